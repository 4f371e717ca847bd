"""Sandbox handles: a small string that lets another process (or host) reach a sandbox.

A handle is ``"orchard1:"`` followed by the URL-safe base64 (unpadded) of a
msgpack map with short keys: the backend, the sandbox id, where its executor
answers, its bearer token and what the client pins or holds to reach it
safely (the TLS certificate's SHA-256 on docker and kubernetes; on isolated
local and docker sandboxes on a unix socket its path and the identity of
its inode, which the creating client keeps open so no other file can take
it). The version in the prefix changes when the encoding does; a newer
field an older client does not know is ignored.

The token is in it, so a handle is a secret: whoever holds it can run
commands in the sandbox. ``repr`` of a ``Handle`` hides it (a handle in a
log line of reprs, a traceback or a list shows only backend and id); its
``str`` is the whole handle, to pass to the other process and nowhere else.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import msgspec

from .errors import InvalidHandle

PREFIX = "orchard1:"
#: Longest handle accepted (a real one is a few hundred characters).
MAX_LENGTH = 4096
_BACKENDS = ("local", "docker", "kubernetes")
#: A sandbox id: a pod or container name (backends put it in API paths).
_ID = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class HandleFields(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a handle carries (private: callers see ``Handle``)."""

    backend: str = msgspec.field(name="b")
    sandbox_id: str = msgspec.field(name="i")
    #: The executor's base URL ("" for a unix socket).
    url: str = msgspec.field(name="u")
    token: str = msgspec.field(name="t")
    image: str = msgspec.field(default="", name="m")
    #: SHA-256 of the executor's TLS certificate (docker, kubernetes).
    fingerprint: bytes | None = msgspec.field(default=None, name="f")
    #: The executor's unix socket (isolated local, docker's transport unix), and its (st_dev, st_ino).
    socket: str | None = msgspec.field(default=None, name="s")
    inode: tuple[int, int] | None = msgspec.field(default=None, name="n")
    #: Kubernetes: the pod's namespace and the executor's port in it.
    namespace: str | None = msgspec.field(default=None, name="ns")
    port: int | None = msgspec.field(default=None, name="p")

    def __repr__(self) -> str:  # never print the token
        return f"HandleFields(backend={self.backend!r}, sandbox_id={self.sandbox_id!r}, token=<hidden>)"


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(HandleFields)


class Handle(str):
    """A sandbox's handle, from ``Sandbox.handle()``: a ``str``, to give to ``Client.attach``.

    It is a plain string to every API (send it through a queue, an
    environment variable, JSON, Ray), but its ``repr`` hides the token it
    carries. Treat ``str(handle)`` like a password: whoever has it can use
    the sandbox until it is deleted.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        try:
            fields = parse(self)
        except InvalidHandle:
            return "Handle(<malformed>)"
        return f"Handle(backend={fields.backend!r}, sandbox_id={fields.sandbox_id!r}, token=<hidden>)"

    @property
    def backend(self) -> str:
        """The backend the sandbox runs on."""
        return parse(self).backend

    @property
    def sandbox_id(self) -> str:
        """The sandbox's id."""
        return parse(self).sandbox_id


def encode(fields: HandleFields) -> Handle:
    """The handle string for ``fields``."""
    raw = base64.urlsafe_b64encode(_ENCODER.encode(fields)).rstrip(b"=").decode()
    return Handle(PREFIX + raw)


def _bad(why: str) -> InvalidHandle:
    # Never the handle itself in the message: it carries the token.
    return InvalidHandle(f"not a valid sandbox handle: {why} (pass the str of Sandbox.handle() as it is)")


def parse(handle: Any) -> HandleFields:
    """The fields of a handle, or ``InvalidHandle`` saying what is wrong with it."""
    if not isinstance(handle, str):
        raise _bad(f"a {type(handle).__name__}, not a str")
    if len(handle) > MAX_LENGTH:
        raise _bad(f"{len(handle)} characters, more than {MAX_LENGTH}")
    version, sep, body = handle.strip().partition(":")
    if not sep or not version.startswith("orchard"):
        raise _bad("it does not start with 'orchard1:'")
    if version + ":" != PREFIX:
        raise _bad(f"version {version!r}, while this Orchard reads {PREFIX[:-1]!r} (a newer Orchard made it?)")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        if base64.urlsafe_b64encode(raw).rstrip(b"=").decode() != body.rstrip("="):
            raise ValueError("not canonical base64")
        fields = _DECODER.decode(raw)
    except (ValueError, binascii.Error, msgspec.MsgspecError) as exc:
        raise _bad(type(exc).__name__ if isinstance(exc, msgspec.MsgspecError) else "its body is not base64") from None
    _check(fields)
    return fields


def _check(f: HandleFields) -> None:
    if f.backend not in _BACKENDS:
        raise _bad(f"unknown backend {f.backend[:40]!r}")
    if not _ID.fullmatch(f.sandbox_id) or not f.token:
        raise _bad("no sandbox id (a pod or container name) or no token")
    if f.socket is not None:
        if f.backend == "kubernetes" or f.inode is None or not f.socket.startswith("/"):
            raise _bad("a socket without its inode, or not absolute")
    elif not f.url.startswith(("http://", "https://")):
        raise _bad("no executor address")
    if f.url.startswith("https://") and (f.fingerprint is None or len(f.fingerprint) != 32):
        raise _bad("an https executor without the SHA-256 of its certificate")
    if f.backend in ("docker", "kubernetes") and f.fingerprint is None and f.socket is None:
        raise _bad(f"a {f.backend} executor on a network without the SHA-256 of its certificate")
    if f.backend == "kubernetes" and (not f.namespace or f.port is None or not 0 < f.port < 65536):
        raise _bad("a kubernetes sandbox without its namespace or port")
