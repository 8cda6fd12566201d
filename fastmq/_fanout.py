"""The writer's end of the remote path (``fastmq._wire``): a listening
socket for the handshake, then one connection per remote reader, each with
the bytes it is still owed (``fastmq._outbox``).

The port is reachable by anyone on the network, so nothing an
unauthenticated peer sends may stall or abort the handshake: each
connection that has not proven the queue's key has a deadline
(``UNPROVEN_DEADLINE_S``), at most ``MAX_UNPROVEN`` are held (the oldest
is dropped for a newcomer), an accept that fails for want of descriptors
drops the oldest and backs off instead of spinning, refusals are logged at
most once per ``REFUSAL_LOG_S``, and a ZMQ peer (vLLM's own queue, fastmq
not active in the reader's process) is named in the log and in the error
if the handshake is cancelled, but never ends it.

Every wait is sliced (``_wire.SLICE_S``): shutdown, deadlines and dead
peers are noticed between slices.  How a message goes out is
``fastmq._fanout_send``'s; the heartbeats, and a reader whose node went
silent, ``fastmq._fanout_live``'s.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import socket
import sys
import threading
import time

from fastmq import _config, _keys, _liveness, _pools, _seal, _wire
from fastmq._fanout_live import FanoutLiveness
from fastmq._fanout_send import FanoutSending
from fastmq._gone import ReaderGoneError
from fastmq._outbox import Outbox
from fastmq._wire import CHALLENGE, HELLO, MAGIC, READY, PeerGone, PeerSilent

logger = logging.getLogger("fastmq")

UNPROVEN_DEADLINE_S = 10.0
MAX_UNPROVEN = 64
ACCEPT_BACKOFF_S = 0.05
REFUSAL_LOG_S = 10.0
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _Joining:
    """A connection that has not proven it is a reader yet."""

    __slots__ = ("sock", "peer", "since", "hs", "challenge", "got", "identity", "ready",
                 "nonce")

    def __init__(self, sock, peer, hs: _keys.Handshake, mode_code: int):
        self.sock, self.peer, self.hs = sock, peer, hs
        self.since = time.monotonic()
        self.challenge = CHALLENGE.pack(MAGIC, _wire.VERSION, mode_code, hs.nonce, hs.public)
        self.got = b""
        self.identity = None   # (rank, pid) once proven
        self.ready = b""       # its READY's wrapped key, once proven
        self.nonce = b""       # its handshake nonce (its heartbeats' key)

class _Reader:
    """A remote reader's connection after the handshake."""

    __slots__ = ("sock", "fd", "rank", "pid", "out", "error", "addr", "alive_seal",
                 "alive_counter", "heard", "heard_seq", "inbox", "gone", "token", "bound")

    def __init__(self, sock, rank, pid, addr="?", alive_seal=None):
        self.sock, self.fd, self.rank, self.pid = sock, sock.fileno(), rank, pid
        self.out = Outbox()
        self.error: str | None = None
        # Liveness (fastmq._fanout_live): its heartbeats' seal, the last
        # counter and when it came, what is left of a partial one, why it is
        # gone (set by the heartbeat thread), what the last pulse saw sent.
        self.addr, self.alive_seal = addr, alive_seal
        self.alive_counter, self.heard, self.heard_seq = 0, 0.0, 0
        self.inbox = bytearray()
        self.gone: tuple | None = None
        self.token = None
        self.bound = 0.0    # the reader's own bound, once it said it

    def write(self) -> int:
        try:
            return self.out.write(self.fd)
        except OSError as e:
            if e.errno in _liveness.UNREACHED:    # the kernel gave up on its node
                raise PeerSilent(e.strerror or str(e)) from e
            raise PeerGone(str(e)) from e

    def describe(self) -> str:
        return f"remote reader rank {self.rank} (pid {self.pid} on its node)"


class Fanout(FanoutSending, FanoutLiveness):
    """The writer's end: the handshake, then the messages, to every remote
    reader; ``psk`` is the queue's pre-shared key (None: ``"none"``)."""

    CLOSE_GRACE_S = 2.0

    def __init__(self, connect_ip: str, ipv6: bool, security: str, psk: bytes | None):
        # The connections are this process's: a forked child that inherits
        # them only lets its copies go (see close).
        self._pid = os.getpid()
        self.psk = psk
        # Silence longer than this is a reader gone (fastmq._liveness).
        self.peer_timeout = _config.peer_timeout_s()
        # Held by whatever puts bytes on the readers' sockets outside a
        # message's send: the heartbeat thread, and begin() (a message
        # starts only once no heartbeat is half-way).
        self._lock = threading.RLock()
        self._gone_pending = False   # the heartbeat thread marked a reader gone
        self.mode_code = _wire.MODE_CODES[security]
        # The message key: random per queue, handed to each reader under
        # its connection's own key, never derived from what crosses the wire.
        self.seal = _seal.Seal(security, _keys.new_message_key() if psk else None)
        # Seal counters: next() is one call, so a value once taken is never
        # handed out again, whatever exception follows.
        self._counters = itertools.count(1)
        # "encrypt": memory for a message's ciphertext, reused message
        # after message (fastmq._wire.Outgoing), the process's (fastmq._pools).
        self._ciphertexts = _pools.ciphertexts() if security == "encrypt" else None
        family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.bind((connect_ip.strip("[]"), 0))
            self.listener.listen(64)
            self.listener.setblocking(False)
        except OSError as e:
            self.listener.close()
            raise OSError(f"fastmq: cannot listen for remote readers at "
                          f"connect_ip={connect_ip.strip('[]')!r} ({e.strerror or e}): give an "
                          "address of this node (or set FASTMQ_HOST_IP)") from e
        except BaseException:
            self.listener.close()
            raise
        port = self.listener.getsockname()[1]
        self.address = f"tcp://{connect_ip}:{port}"
        self.ipv6 = ipv6
        self._joining: list[_Joining] = []
        self.readers: list[_Reader] = []
        # Why the readers can no longer be served: (text, rank, pid, how) of
        # the reader whose connection broke (see broken_error).
        self.broken: tuple | None = None
        self.failed: str | None = None   # why the handshake did not complete
        self.zmq_peer: str | None = None  # the last ZMQ peer that knocked
        self._message: _wire.Outgoing | None = None   # the one going out
        self._sealed: list = []     # its batches computed so far
        self._dropped = 0           # how many of them every reader was given (now None)
        self._last_seq = 0          # the last message committed
        self._marked = 0            # the message the outboxes count the bytes of
        self._drainer = None        # sends the rest of a message past its deadline
        self._accept_after = 0.0    # accepting paused until (out of descriptors)
        self._refusals = 0          # refusals not logged yet
        self._refusal_logged = -REFUSAL_LOG_S
        self._ended = False
        # Set by the queue's shutdown(): waits for a message not yet
        # committed raise "cancelled" (see push).
        self.cancelled = threading.Event()
        # Set by close(): the drain thread stops sending the rest of a
        # committed message.
        self._closing = threading.Event()
        self._poll = None

    # -- handshake ------------------------------------------------------------------
    def fds(self) -> list:
        """What the handshake waits on (the listener, unless accepting is
        paused, and the joining sockets)."""
        if self.listener is None:
            return []
        lst = [self.listener] if time.monotonic() >= self._accept_after else []
        return lst + [j.sock for j in self._joining]

    def handshake_step(self, n_readers: int) -> bool:
        """Accept connections, check the hellos that arrived, and once
        exactly ``n_readers`` readers have proven themselves, send each
        READY and stop listening.  Never waits, never raises for what an
        unauthenticated peer does; True once done."""
        if self.listener is None:
            return True
        now = time.monotonic()
        if now >= self._accept_after:
            self._accept(now)
        for j in list(self._joining):
            if j.identity is None and now - j.since > UNPROVEN_DEADLINE_S:
                self._reject(j, f"did not complete the handshake in {UNPROVEN_DEADLINE_S:.0f} s")
            else:
                self._read_hello(j)
        self._log_refusals(now)
        proven = [j for j in self._joining if j.identity is not None]
        # Exactly: a surplus means one of them already left (its close has
        # not been read yet) and will drop out.
        if len(proven) != n_readers:
            return False
        for j in proven:
            rank, pid = j.identity
            try:
                j.sock.sendall(READY.pack(MAGIC, j.ready))
            except OSError as e:
                self.failed = (f"remote reader rank {rank} (pid {pid} on its node) dropped "
                               f"its connection during the handshake ({e})")
                raise RuntimeError(f"fastmq: {self.failed}") from e
            self.readers.append(_Reader(j.sock, rank, pid, j.peer[0],
                                        self.seal.for_reader(j.nonce)))
        for j in self._joining:
            if j.identity is None:
                j.sock.close()
        self._joining = []
        self.listener.close()
        self.listener = None
        # A hangup or an error; what readers send (heartbeats) is read by
        # the heartbeat thread.
        self._poll = select.poll()
        for r in self.readers:
            self._poll.register(r.fd, _wire.HUP)
        self.start_liveness()
        return True

    def _accept(self, now: float) -> None:
        for _ in range(MAX_UNPROVEN):
            try:
                sock, peer = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _OUT_OF_FDS:
                    # The connection stays queued, so the listener stays
                    # readable: free a descriptor and wait a little
                    # rather than fail the same accept again and again.
                    oldest = self._oldest_unproven()
                    if oldest is not None:
                        self._reject(oldest, "this process ran out of file descriptors",
                                     "dropped")
                    self._accept_after = now + ACCEPT_BACKOFF_S
                    self._refused(f"could not accept a connection ({e.strerror})")
                    return
                continue   # e.g. ECONNABORTED: that peer is gone already
            if sum(j.identity is None for j in self._joining) >= MAX_UNPROVEN:
                self._reject(self._oldest_unproven(), f"a newer one came and at most "
                             f"{MAX_UNPROVEN} unproven ones are held", "dropped")
            try:
                _wire.tune(sock)
                # The kernel gives up on a silent node (keepalive); no user
                # timeout: a live reader may let data wait (see _liveness).
                _liveness.tune(sock, self.peer_timeout, user_timeout=False)
                j = _Joining(sock, peer, _keys.Handshake(self.psk), self.mode_code)
                sock.sendall(j.challenge)
            except OSError:
                sock.close()
                continue
            self._joining.append(j)

    def _oldest_unproven(self) -> _Joining | None:
        """(``_joining`` is in the order of arrival; a proven reader is
        never dropped for a stranger.)"""
        return next((j for j in self._joining if j.identity is None), None)

    def _read_hello(self, j: _Joining) -> None:
        try:
            data = j.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in _liveness.UNREACHED and j.identity is not None:
                # Its node went silent before the handshake completed: the
                # rank may connect again (a new process).
                rank, pid = j.identity
                logger.warning("fastmq: remote reader rank %d (pid %d on its node) at %s went "
                               "silent during the handshake (the kernel gave up on the "
                               "connection: %s, keepalive unanswered for about %g s): dropped; "
                               "the writer waits for that rank to connect again", rank, pid,
                               j.peer[0], e.strerror, self.peer_timeout)
            data = b""
        if not data:
            # Gone before READY: a reader that died, or a stranger.
            self._drop(j)
            return
        if j.identity is not None:
            return self._reject(j, "sent bytes after its hello")
        j.got += data
        if _wire.is_zmtp(j.got):
            # vLLM's own reader reconnects (ZMQ does) and comes back: named
            # while the handshake waits, and if it ends without the reader.
            self.zmq_peer = j.peer[0]
            return self._reject(j, "speaks ZMQ (a reader attached with vLLM's own "
                                "MessageQueue, fastmq not active in its process?)")
        if len(j.got) < HELLO.size:
            # (a ZMQ greeting, 0xFF first, is told apart once 10 bytes are here)
            if j.got[0] != 0xFF and j.got[:len(MAGIC)] != MAGIC[:len(j.got)]:
                self._reject(j, "is not a fastmq reader")
            return
        if len(j.got) > HELLO.size:
            return self._reject(j, "sent more than a hello")
        magic, rank, pid, nonce, public, proof = HELLO.unpack(j.got)
        if magic != MAGIC:
            return self._reject(j, "is not a fastmq reader")
        transcript = j.challenge + j.got[:HELLO.size - _keys.PROOF_BYTES]
        if not j.hs.proven(proof, b"reader", transcript):
            return self._reject(j, "did not prove it holds this queue's key")
        try:
            wrapped = j.hs.wrap(self.seal.key, public, transcript)
        except ValueError:
            return self._reject(j, "sent an unusable public key")
        j.ready = wrapped
        j.nonce = nonce
        j.identity = (rank, pid)

    def _drop(self, j: _Joining) -> None:
        if j in self._joining:
            self._joining.remove(j)
        j.sock.close()

    def _reject(self, j: _Joining, why: str, verb: str = "refused") -> None:
        """Close ``j`` and say so: "refused ...: it <why>", or for a
        connection let go of for want of room, "dropped ...: <why>"."""
        self._drop(j)
        self._refused(f"{verb} a connection from {j.peer[0]}: "
                      f"{'it ' if verb == 'refused' else ''}{why}")

    def _refused(self, what: str) -> None:
        now = time.monotonic()
        if now - self._refusal_logged >= REFUSAL_LOG_S:
            more = f" ({self._refusals} more refused or dropped since the last such line)" \
                if self._refusals else ""
            logger.warning("fastmq: this queue's remote port %s%s", what, more)
            self._refusal_logged, self._refusals = now, 0
        else:
            self._refusals += 1

    def _log_refusals(self, now: float) -> None:
        if self._refusals and now - self._refusal_logged >= REFUSAL_LOG_S:
            logger.warning("fastmq: this queue's remote port refused or dropped %d more "
                           "connections", self._refusals)
            self._refusal_logged, self._refusals = now, 0

    def missing(self, n_readers: int) -> str:
        proven = sum(j.identity is not None for j in self._joining)
        out = f"remote readers ({proven} connected and proven, {n_readers} expected)"
        if self.zmq_peer is not None:
            out += (f"; a peer at {self.zmq_peer} speaks ZMQ: a reader attached with vLLM's "
                    "own MessageQueue (fastmq not active in its process?)")
        return out

    # -- messages -------------------------------------------------------------------
    def check_ready(self) -> None:
        """Raise unless the handshake completed: before it, or after it
        failed, no remote reader would get a message."""
        if self.listener is not None:
            why = self.failed or "wait_until_ready() has not returned"
            raise RuntimeError(f"fastmq: this queue's remote readers are not connected "
                               f"({why}); no remote reader would receive the message")

    def check_readers(self) -> None:
        """Raise if a reader's connection closed or broke since the
        handshake (it can never take another message), or if the queue's
        remote side is broken for an earlier reason."""
        if self._gone_pending:
            self.apply_gone()
        events = self._poll.poll(0) if self.broken is None and self._poll is not None else ()
        if events:
            for fd, _ in events:
                r = next(r for r in self.readers if r.fd == fd)
                self._hung_up(r)
                break
        if self.broken is not None:
            raise self.broken_error()

    def broken_error(self) -> ReaderGoneError:
        """What ``check_readers`` raises once the remote side is broken: a
        ``ReaderGoneError`` naming the reader whose connection broke (a new
        one each time: a raised exception collects its traceback)."""
        text, rank, pid, how = self.broken
        return ReaderGoneError(f"fastmq: {text}", rank, pid, how)

    def _hung_up(self, r: _Reader) -> None:
        """``r``'s connection reported a hangup or an error: closed, or
        timed out by the kernel (its node went silent)."""
        err = r.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err in _liveness.UNREACHED:   # (a timeout, or the soft error seen last in its place)
            self._break(r, self._silent_text(
                r, f"the kernel gave up on the connection ({os.strerror(err)}: keepalive "
                "unanswered)", time.monotonic()), "silent")
        else:
            self._break(r, f"disconnected{f' ({os.strerror(err)})' if err else ''}")

    def _break(self, r: _Reader, why: str, how: str | None = None) -> None:
        """``r`` can take no more messages: ``why`` is how it went (a
        sentence of its own where ``how`` is given)."""
        r.error = why
        r.out.clear()
        if how is None:
            how = "disconnected"
            why = (f"{r.describe()} {why} from the writer after the handshake: it died or "
                   "its node is unreachable; messages sent since would not reach it, and a "
                   "remote reader cannot rejoin a running queue")
        if how == "silent":
            try:    # a reader only cut off learns it, if the link comes back
                r.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.broken = (why, r.rank, r.pid, how)

    def cancel(self) -> None:
        """The queue is shutting down: a wait for a message that is not
        committed yet raises ``RuntimeError("cancelled")``; a committed one
        is still sent."""
        self.cancelled.set()

    def close(self, linger=None) -> None:
        """Close every socket, after the end of the stream.  What
        ``sendmsg`` took is the kernel's: it is still delivered (and then
        the connection closed) after this.  The rest of a message that the
        drain thread is still sending gets a short grace first.

        In a forked child (its queue dropped, or the child exiting) only the
        child's copies of the descriptors are closed: the end of the stream,
        or any byte, sent from here would land in the parent's stream."""
        if os.getpid() != self._pid:
            self._close_sockets()
            return
        _liveness.PULSE.discard(self)
        t = self._drainer
        if t is not None and t.is_alive():
            t.join(self.CLOSE_GRACE_S)
            self._closing.set()
            t.join(1.0)
        if (t is not None and t.is_alive()) or self._owed():
            logger.warning("fastmq: a remote queue was closed while a slow reader had "
                           "not taken the rest of a message whose enqueue() returned "
                           "at its deadline; that reader misses it")
        elif self.listener is None and not sys.is_finalizing():
            self.end_stream(0.5)
        self._closing.set()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in ([self.listener] if self.listener is not None else []) + \
                [j.sock for j in self._joining] + [r.sock for r in self.readers]:
            try:
                s.close()
            except OSError:
                pass
        self.listener = None
        self._joining = []
