"""The executor's TLS identity from its environment: a bad one is refused at start, clearly; a good one serves TLS 1.3 only."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import ssl
import subprocess
import sys

import pytest

from orchard import _tls

pytestmark = pytest.mark.executor

TOKEN_SHA256 = hashlib.sha256(b"t").hexdigest()


def executor(tls: str, *extra: str) -> subprocess.Popen[bytes]:
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchard_executor", "--host=127.0.0.1", "--port=0", f"--ready-fd={w}", *extra],
        env={**os.environ, "ORCHARD_EXECUTOR_TOKEN_SHA256": TOKEN_SHA256, _tls.ENV: tls},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(w,),
    )
    os.close(w)
    proc.ready = os.fdopen(r, "rb")  # type: ignore[attr-defined]
    return proc


@pytest.mark.parametrize(
    "pem",
    ["junk", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", _tls.make_identity("x").pem[:300]],
)
def test_a_tls_identity_that_is_not_a_certificate_and_key_stops_the_executor_with_the_reason(pem: str) -> None:
    proc = executor(pem)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert b"ORCHARD_EXECUTOR_TLS" in err
    assert b"PEM certificate and key" in err
    assert proc.ready.read() == b""  # type: ignore[attr-defined]  # it never said it was serving


async def test_a_good_identity_serves_tls_1_3_only_with_that_certificate() -> None:
    identity = _tls.make_identity("sb-test")
    proc = executor(identity.pem)
    try:
        port = json.loads(await asyncio.to_thread(proc.ready.readline))["port"]  # type: ignore[attr-defined]
        client = ssl.create_default_context()
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="")
        tls = writer.get_extra_info("ssl_object")
        assert tls.version() == "TLSv1.3"
        assert hashlib.sha256(tls.getpeercert(binary_form=True)).digest() == identity.fingerprint
        writer.close()
        # A client that offers at most TLS 1.2 is refused.
        old = ssl.create_default_context()
        old.check_hostname, old.verify_mode = False, ssl.CERT_NONE
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await asyncio.open_connection("127.0.0.1", port, ssl=old, server_hostname="")
    finally:
        proc.kill()
        proc.communicate()


async def test_pins_of_one_certificate_share_one_tls_connection() -> None:
    """The readiness poll and the sandbox's calls each pin the certificate: one handshake between them, not two."""
    import aiohttp

    identity = _tls.make_identity("sb-test")
    proc = executor(identity.pem)
    created = 0

    async def count(*_: object) -> None:
        nonlocal created
        created += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(count)
    try:
        port = json.loads(await asyncio.to_thread(proc.ready.readline))["port"]  # type: ignore[attr-defined]
        async with aiohttp.ClientSession(trace_configs=[trace]) as http:
            for _ in range(3):  # as the backend's poll, then the executor client, each pinning anew
                async with http.get(f"https://127.0.0.1:{port}/healthz", ssl=_tls.pin(identity.fingerprint)) as r:
                    assert r.status == 200
        assert created == 1
    finally:
        proc.kill()
        proc.communicate()
