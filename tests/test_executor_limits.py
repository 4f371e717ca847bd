"""Executor limits seen from the host: a background process's capped output files on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

import orchard
from support import WAIT

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
