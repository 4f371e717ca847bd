"""The injected runtime as built (images/executor/build_bundle.py), run inside a sandbox container."""

from __future__ import annotations

import json
import textwrap

import pytest
from docker_support import BUSYBOX, SandboxFactory

from orchard._backends.bundle import MOUNT, _python

pytestmark = pytest.mark.docker

PROBE = textwrap.dedent(
    """
    import json, sys
    import orchard_executor.__main__, orchard_executor.app
    imported_client = "aiohttp.client" in sys.modules
    import aiohttp, importlib
    # Every name the package exports is still there, and is its submodule's own object.
    wrong = [n for n, (m, a) in aiohttp._LAZY.items()
             if getattr(aiohttp, n) is not getattr(importlib.import_module("aiohttp." + m), a)]
    missing = [n for n in aiohttp.__all__ if not hasattr(aiohttp, n) and not n.startswith("Gunicorn")]
    try:
        aiohttp.no_such_name
        unknown = "found"
    except AttributeError:
        unknown = "AttributeError"
    print(json.dumps({"imported_client": imported_client, "wrong": wrong, "missing": missing,
                      "unknown": unknown, "submodule": aiohttp.client.ClientSession is aiohttp.ClientSession}))
    """
)


async def test_the_executor_never_imports_aiohttps_client_and_aiohttp_keeps_its_names(sandbox: SandboxFactory) -> None:
    # build_bundle makes aiohttp's __init__ import each submodule on first use: the executor, a server,
    # then starts without the HTTP client's import (about 30 ms of every start).
    sb = await sandbox(BUSYBOX)
    r = await sb.exec([*_python(f"{MOUNT}/runtime"), "-c", PROBE])
    assert r.exit_code == 0, r.stderr
    found = json.loads(r.stdout)
    assert found == {
        "imported_client": False,
        "wrong": [],
        "missing": [],
        "unknown": "AttributeError",
        "submodule": True,
    }
