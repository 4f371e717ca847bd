"""What keeping the token off the wire costs: TLS (chosen) against plain HTTP, and HMAC signing.

    python benchmarks/bench_tls.py [--reps 300] [--mib 64] [--json PATH]

Issue 11 asked for one of two designs, measured: TLS to the executor (a key
pair per sandbox, the certificate pinned; what Orchard does) or requests
signed with the token (HMAC over method, path, body hash, time and nonce,
replay refused). On the docker backend with its executors on the network
(``transport="tcp"``; the default unix transport needs neither), same run,
same machine:

- ``plain``: the executor without TLS (the docker backend told not to use
  it; the bearer token in clear): the baseline.
- ``tls``: tcp's default; keep-alive connections, as the client pools them.
- HMAC adds no round trip: its cost is the client signing and the executor
  verifying each request (SHA-256 of the body, HMAC, a nonce lookup), CPU
  measured here with the stdlib and added to the plain figures.

Also: a new connection's setup (TCP vs TCP + TLS 1.3 handshake), the
executor's resident memory (private, and shared file pages) with and without libssl loaded, and the
client's key pair per sandbox. Figures are ratios to ``plain``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import secrets
import ssl
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yarl
from _stats import pct

import orchard
from orchard import _tls

IMAGE = "orchard-test/swe:latest"


def ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(values, 50) * 1e3, "p90_ms": pct(values, 90) * 1e3}


async def timed(n: int, call: Any) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def connect_times(sb: orchard.Sandbox, n: int) -> list[float]:
    url = yarl.URL(sb._rpc._base)
    tls = None
    if url.scheme == "https":
        tls = ssl.create_default_context()
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        _, writer = await asyncio.open_connection(url.host, url.port, ssl=tls, server_hostname="" if tls else None)
        out.append(time.perf_counter() - t0)
        writer.close()
        await writer.wait_closed()
    return out


async def measure(tls: bool, reps: int, mib: int) -> dict[str, Any]:
    payload = os.urandom(mib << 20)
    # Executors on the network (transport tcp), where TLS is the default.
    async with orchard.Client(orchard.DockerConfig(transport="tcp")) as client:
        backend, _ = await client._ensure_open()
        backend.tls = tls  # the baseline: this benchmark alone turns TLS off
        async with client.sandbox(IMAGE) as sb:
            return await _measured(sb, reps, payload)


async def _measured(sb: orchard.Sandbox, reps: int, payload: bytes) -> dict[str, Any]:
    for _ in range(20):
        await sb.exec(["true"])
    exec_t = await timed(reps, lambda: sb.exec(["true"]))
    small = os.urandom(1024)
    write_t = await timed(reps, lambda: sb.write_file("/tmp/small", small))
    read_t = await timed(reps, lambda: sb.read_file("/tmp/small"))
    up, down = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        await sb.write_file("/tmp/big", payload)
        up.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = await sb.read_file("/tmp/big")
        down.append(time.perf_counter() - t0)
        assert got == payload
    status = (await sb.exec(["cat", "/proc/1/status"])).stdout
    kib = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith("Rss")}
    return {
        "exec_true": ms(exec_t),
        "write_1k": ms(write_t),
        "read_1k": ms(read_t),
        "connect": ms(await connect_times(sb, reps // 3)),
        "upload_mib_s": len(payload) / (1 << 20) / statistics.median(up),
        "download_mib_s": len(payload) / (1 << 20) / statistics.median(down),
        # Private memory: the bundle's files (libssl included) are page cache shared by every sandbox.
        "executor_rss_anon_mib": kib["RssAnon"] / 1024,
        "executor_rss_file_mib": kib["RssFile"] / 1024,
    }


def hmac_cost(reps: int, body: bytes) -> float:
    """Seconds to sign a request on the client and verify it on the executor (replay set included)."""
    key = secrets.token_bytes(32)
    seen: set[bytes] = set()
    t0 = time.perf_counter()
    for _ in range(reps):
        nonce, stamp = secrets.token_bytes(16), str(time.time()).encode()
        digest = hashlib.sha256(body).digest()
        msg = b"\n".join([b"POST", b"/v1/exec", digest, stamp, nonce])
        sig = hmac.new(key, msg, "sha256").digest()
        # The executor: hash the body it received, check the signature, refuse a nonce seen before.
        check = hmac.new(key, b"\n".join([b"POST", b"/v1/exec", hashlib.sha256(body).digest(), stamp, nonce]), "sha256")
        if not hmac.compare_digest(sig, check.digest()) or nonce in seen:
            raise AssertionError("the reference verifier refused a sound request")
        seen.add(nonce)
    return (time.perf_counter() - t0) / reps


def keygen_cost(reps: int) -> float:
    t0 = time.perf_counter()
    for i in range(reps):
        _tls.make_identity(f"sb-bench-{i}")
    return (time.perf_counter() - t0) / reps


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    plain = await measure(False, args.reps, args.mib)
    tls = await measure(True, args.reps, args.mib)
    small = hmac_cost(2000, b"\x82\xa3cmd\x91\xa4true")  # an exec request's msgpack body
    big = hmac_cost(3, os.urandom(args.mib << 20))
    hmac_est = {
        "exec_true": {"p50_ms": plain["exec_true"]["p50_ms"] + small * 1e3},
        "upload_mib_s": args.mib / (args.mib / plain["upload_mib_s"] + big),
    }
    result = {
        "plain": plain,
        "tls": tls,
        "hmac_estimate": hmac_est,
        "hmac_sign_verify_us": {"small": small * 1e6, f"{args.mib}MiB": big * 1e6},
        "keygen_per_sandbox_ms": keygen_cost(50) * 1e3,
    }
    print(f"{'':22} {'plain':>10} {'tls':>10} {'tls/plain':>10} {'hmac(est)':>10}")
    for key in ("exec_true", "write_1k", "read_1k", "connect"):
        a, b = plain[key]["p50_ms"], tls[key]["p50_ms"]
        h = hmac_est.get(key, {}).get("p50_ms")
        print(f"{key + ' p50 ms':22} {a:10.3f} {b:10.3f} {b / a:10.2f} {h if h is None else f'{h:10.3f}'}")
    for key in ("upload_mib_s", "download_mib_s"):
        a, b = plain[key], tls[key]
        print(f"{key:22} {a:10.1f} {b:10.1f} {b / a:10.2f} {hmac_est.get(key, '')!s:>10.6}")
    for key in ("executor_rss_anon_mib", "executor_rss_file_mib"):
        print(f"{key:22} {plain[key]:10.1f} {tls[key]:10.1f} {tls[key] / plain[key]:10.2f}")
    print(f"HMAC sign+verify: {small * 1e6:.1f} us per small request, {big * 1e3:.1f} ms per {args.mib} MiB body")
    print(f"key pair + certificate per sandbox (client): {result['keygen_per_sandbox_ms']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
