"""Attaching to a sandbox from a real subprocess, for the handle tests of every backend."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from typing import Any

import pytest

import orchard
from orchard import _handle
from orchard.errors import ProtocolError
from support import eventually

#: Attaches to the handle on stdin with ``Client(argv[1], **json(argv[2]))`` and runs a
#: command there (``attach(owner=json(argv[3]))``); prints what happened as JSON.
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys, warnings
    import orchard
    from orchard.errors import OrchardError

    async def main():
        handle = sys.stdin.read()
        warnings.simplefilter("ignore")
        async with orchard.Client(sys.argv[1], **json.loads(sys.argv[2])) as client:
            try:
                sb = await client.attach(handle, owner=json.loads(sys.argv[3]))
            except OrchardError as exc:
                return {"error": type(exc).__name__, "message": str(exc), "reason": getattr(exc, "reason", None)}
            r = await sb.exec("cat note.txt && echo from-child > child.txt")
            return {"stdout": r.stdout, "exit_code": r.exit_code, "id": sb.id, "repr": repr(sb.handle())}

    print(json.dumps(asyncio.run(main())))
    """
)


async def attach_in_child(handle: str, backend: str, options: dict[str, Any], *, owner: bool = False) -> dict[str, Any]:
    """Run ``CHILD`` in a fresh interpreter, the handle on its stdin (never argv, which ``ps`` shows)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        backend,
        json.dumps(options),
        json.dumps(owner),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(str(handle).encode()), 90)
    assert proc.returncode == 0, err.decode()
    # Nothing the attaching side printed (its errors, reprs, warnings) shows the token.
    assert token_of(handle) not in (out + err).decode()
    result: dict[str, Any] = json.loads(out)
    return result


def token_of(handle: str) -> str:
    """The secret a handle carries."""
    return _handle.parse(handle).token


#: Replaces the executor's socket at argv[1] with its own, and keeps what it is sent in /tmp/captured.
SWAP = textwrap.dedent(
    """
    import os, socket, sys
    path = sys.argv[1]
    os.unlink(path)
    fake = socket.socket(socket.AF_UNIX)
    fake.bind(path)
    os.chmod(path, 0o777)
    fake.listen(8)
    open("/tmp/listening", "w").close()
    while True:
        conn, _ = fake.accept()
        data = conn.recv(65536)
        with open("/tmp/captured", "ab") as f:
            f.write(data)
        conn.close()
    """
)


async def a_swapped_socket_never_gets_the_token(sb: orchard.Sandbox, attacher: orchard.Client, socket: str) -> None:
    """The sandbox swaps a socket of its own in for its executor's: an attach is refused before sending the token."""
    handle = sb.handle()
    await sb.write_file("/tmp/swap.py", SWAP)
    await sb.start_process(["python3", "/tmp/swap.py", socket])
    await eventually(lambda: sb.exists("/tmp/listening"), what="the fake socket listens")
    with pytest.raises(ProtocolError, match="not its executor's socket"):
        await attacher.attach(handle, timeout=5)
    captured = await sb.read_file("/tmp/captured") if await sb.exists("/tmp/captured") else b""
    assert token_of(handle).encode() not in captured
    assert b"Bearer" not in captured
    # The creator still reaches its executor through the inode it holds.
    assert (await sb.exec("echo mine")).stdout == "mine\n"
