"""ZMQ CURVE for the remote (TCP) path: encryption and client authentication.

The threat model: docs/operations.md, "Security".

On by default (``FASTMQ_CURVE=0`` or ``remote_curve=False`` turns it off,
e.g. to speak plain ZMTP like vLLM's own remote readers).  When on, the
writer's XPUB is a CURVE server with a fresh keypair, and a ZAP handler
admits only one client key, also fresh.  Both travel in the queue's
``Handle`` (``remote_curve_keys``), which is handed to readers over the
already trusted setup channel (the process group).  A peer that can merely
reach the port has neither key: it cannot complete the handshake, so it
can neither read the stream nor pose as the writer (the reader checks the
server key) to feed pickles to readers.

Keys are fresh per queue and live only in memory; the handle field is left
out of ``repr`` so the debug log of the handle does not print the secret.
"""
from __future__ import annotations

import logging
import os
from typing import NamedTuple

import zmq

from fastmq import _config

logger = logging.getLogger("fastmq")


class CurveKeys(NamedTuple):
    """What a remote reader needs (z85-encoded bytes)."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes


_warned_no_curve = False


def wanted(flag: bool | None) -> bool:
    """The constructor's ``remote_curve``, else ``FASTMQ_CURVE`` (default on).

    On by default because the remote path is a TCP port: without CURVE, any
    client that reaches it first is counted as the remote reader and
    receives every message.  Where libzmq lacks CURVE, the default falls
    back to plain TCP with one warning; asking for it explicitly raises."""
    global _warned_no_curve
    explicit = flag is not None or bool(os.environ.get("FASTMQ_CURVE", "").strip())
    if flag is None:
        flag = _config.env_bool("FASTMQ_CURVE", True)
    if flag and not zmq.has("curve"):
        if explicit:
            raise RuntimeError(
                "fastmq: remote_curve / FASTMQ_CURVE=1 asks for CURVE encryption, but "
                f"this libzmq ({zmq.zmq_version()}) was built without CURVE support")
        if not _warned_no_curve:
            _warned_no_curve = True
            logger.warning(
                "fastmq: this libzmq (%s) has no CURVE support: remote readers use "
                "plain, unauthenticated TCP (set FASTMQ_CURVE=0 to silence this)",
                zmq.zmq_version())
        return False
    return bool(flag)


class _AllowOne:
    """ZAP credentials provider: admits exactly one client public key."""

    def __init__(self, client_public: bytes):
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


class CurveServer:
    """The writer's side: a server keypair, the one admitted client keypair,
    and the ZAP handler thread that enforces it (one per queue context)."""

    def __init__(self, context: zmq.Context):
        from zmq.auth.thread import ThreadAuthenticator

        self._server_public, self._server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self.keys = CurveKeys(self._server_public, client_public, client_secret)
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_AllowOne(client_public))

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before bind) a CURVE server that checks clients via ZAP."""
        sock.curve_secretkey = self._server_secret
        sock.curve_publickey = self._server_public
        sock.curve_server = True

    def close(self, linger: int | None = None) -> None:
        """Stop the ZAP thread (before the context is terminated: its
        sockets would otherwise block ``term()``)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def secure_client(sock: zmq.Socket, keys: CurveKeys | tuple) -> None:
    """Make a reader's SUB (before connect) a CURVE client of the writer."""
    server_public, client_public, client_secret = keys
    sock.curve_serverkey = server_public
    sock.curve_publickey = client_public
    sock.curve_secretkey = client_secret
