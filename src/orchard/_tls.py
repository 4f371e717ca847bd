"""TLS to executors reached over a network: a key pair per sandbox, its certificate pinned.

The bearer token must never cross a network in clear, and neither should
what a sandbox's commands read and write. For each sandbox the client makes
an ECDSA P-256 key and a self-signed certificate, hands both to the executor
with the sandbox's spec (beside the token's hash) and accepts, from that
sandbox's address, only the certificate whose SHA-256 it kept: no CA, no
hostname, nothing to configure. The executor speaks TLS 1.3 only, whose
ephemeral key exchange means that someone who later reads the spec (and the
key in it) still cannot decrypt traffic they recorded; only an active
man in the middle who has read the spec could intercept.

``cryptography`` is imported here only, when a networked backend starts a
sandbox: ``import orchard`` stays light.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass

import aiohttp

#: The environment variable the executor reads its PEM certificate and key from.
ENV = "ORCHARD_EXECUTOR_TLS"


@dataclass(frozen=True, repr=False)
class Identity:
    """One sandbox's TLS identity.

    Attributes:
        pem: the certificate and its private key, PEM, for the executor.
        fingerprint: SHA-256 of the certificate (DER), which the client pins.
    """

    pem: str
    fingerprint: bytes

    def __repr__(self) -> str:  # never print the key
        return f"Identity(fingerprint={self.fingerprint.hex()})"


def make_identity(name: str) -> Identity:
    """A fresh key pair and self-signed certificate for the sandbox ``name``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Pinned by hash, so validity dates guard nothing; wide, so clock skew cannot break it.
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Identity(pem=pem.decode(), fingerprint=cert.fingerprint(hashes.SHA256()))


def pin(fingerprint: bytes | None) -> aiohttp.Fingerprint | bool:
    """The ``ssl=`` argument for a request to an executor: its pinned certificate, if it has one.

    The same object for the same certificate: aiohttp pools connections by it, so the backend's
    readiness poll (or a pool claim's re-key) and the sandbox's first call share one TLS connection
    instead of paying a second handshake.
    """
    return _fingerprint(fingerprint) if fingerprint is not None else True


@functools.lru_cache(maxsize=4096)
def _fingerprint(fingerprint: bytes) -> aiohttp.Fingerprint:
    return aiohttp.Fingerprint(fingerprint)
