"""Executor limits seen from the host: capped output files on disk, bounded memory under a streamed stdin."""

from __future__ import annotations

from pathlib import Path

import pytest

import orchard
from support import WAIT
from test_sandbox_stdin import Generated

pytestmark = pytest.mark.executor


async def test_a_process_output_file_on_disk_never_exceeds_its_cap(
    local_client: orchard.Client, local_root: Path
) -> None:
    cap = 100_000
    async with local_client.sandbox() as sb:
        p = await sb.start_process("head -c 20000000 /dev/zero; head -c 3000000 /dev/zero >&2", max_output=cap)
        st = await p.wait(timeout=WAIT)
        assert st.exit_code == 0
        assert (st.stdout_total, st.stderr_total) == (20_000_000, 3_000_000)
        files = sorted(local_root.glob(f"*/state/processes/{p.id}.*"))
        assert [f.name for f in files] == [f"{p.id}.stderr", f"{p.id}.stdout"]
        assert [f.stat().st_size for f in files] == [cap, cap]


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


async def test_a_streamed_stdin_is_not_buffered_by_the_executor(local_client: orchard.Client) -> None:
    total = 300 * 1024 * 1024
    async with local_client.sandbox() as sb:
        executor = (await sb.info()).pid
        # The command reads slowly at first, so that the stream has to wait for it.
        r = await sb.exec("sleep 1; wc -c", stdin=Generated(total), timeout=WAIT * 5)
        assert int(r.stdout) == total
        assert peak_rss(executor) < 150 * 1024 * 1024
