"""A remote reader's handshake and liveness (``fastmq._wire``,
``fastmq._keys``, ``fastmq._liveness``): a mixin of ``fastmq._stream.Stream``,
whose state it uses.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time

from fastmq import _keys, _liveness, _seal, _wire
from fastmq._wire import (ALIVE, CHALLENGE, HELLO, MAGIC, PREAMBLE, READY, PeerGone, PeerSilent,
                          WriterSpeaksZMTP)


class StreamHello:
    """(State: ``Stream``'s.)"""

    # -- handshake -------------------------------------------------------------------
    # The reader's half runs on a thread, started with the reader: it
    # connects and answers the writer's challenge, so the writer's
    # wait_until_ready() can complete even before this reader's is called
    # (as it can with local readers, in one thread), then takes the
    # writer's READY as soon as it comes and starts this reader's
    # heartbeats: the writer counts the silence of a reader from its own
    # READY, whenever this reader's wait_until_ready() comes (it waits for
    # the thread).
    def start_hello(self) -> None:
        self._hello_error = None
        self._hs = self._transcript = self._writer_public = None
        self._hello_thread = threading.Thread(target=self._hello, daemon=True,
                                              name="fastmq-remote-hello")
        self._hello_thread.start()

    def _hello(self) -> None:
        try:
            if self._connect_error not in (0, errno.EINPROGRESS):
                self._refused(self._connect_error)
            # The connect completes (or fails) first.  A writer's kernel
            # answers at once, even before the writer accepts (its backlog);
            # no answer for the bound is a silent node (SYN retries take
            # minutes, and no user timeout bounds them).
            until = time.monotonic() + self.peer_timeout
            try:
                while not _wire.wait([(self.fd, select.POLLOUT)], until, self.cancelled):
                    pass
            except TimeoutError:
                raise PeerSilent(f"its node did not answer the connection for "
                                 f"{self.peer_timeout:g} s (FASTMQ_PEER_TIMEOUT_S)",
                                 self.handshake_heard()) from None
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._refused(err)
            self._connected_at = time.perf_counter()
            self._drive(self._answer_challenge(), None)
            self._drive(self._await_ready(), None)
        except BaseException as e:
            self._hello_error = e
            return
        # From here a writer that is alive sends something at least every
        # interval (a message or a heartbeat), and so does this reader.
        self._heard_n, self._heard_at = self._received, time.perf_counter()
        self._live = True
        _liveness.PULSE.add(self)

    def handshake(self) -> None:
        t = self._hello_thread
        while t.is_alive():
            if self.cancelled.is_set():
                raise RuntimeError("cancelled")
            t.join(_wire.SLICE_S)
        if self._silent is not None:
            # (The handshake found the writer's node silent earlier: for good.)
            raise PeerSilent(self._silent.what, self._silent.last)
        # A failed handshake stays failed: a second wait raises again
        # (the error is kept), never returns as if the reader were ready.
        try:
            if self._hello_error is not None:
                raise self._hello_error
        except PeerSilent as e:
            self._silent = e
            raise
        except PeerGone:
            raise RuntimeError(
                f"fastmq: the writer at {self.address} closed the connection during the "
                "handshake: it is gone, it did not accept this reader's key, or its "
                "handshake completed without this reader (a reader cannot join, or after "
                "a disconnect rejoin, a queue once the writer's wait_until_ready() has "
                "returned; create a new queue)") from None

    def pulse(self, now: float) -> float | None:
        """(The process's heartbeat thread.)  Tell the writer this reader
        is there, once per interval: the writer's thread reads it; this
        one sends nothing else after the handshake, so the two never meet
        on the socket.  None once the stream is over."""
        # (Also after shutdown(): the process is there, and a writer that
        # still sends must not take it for a dead node.)
        if not self._live or self._failed is not None or self.ended is not None:
            return None
        beat = _liveness.interval(self.peer_timeout)
        if now < self._alive_due:
            return self._alive_due
        # Before this heartbeat: the ones before it should be acknowledged
        # by now (a node that is alive does so within a round trip).
        unanswered = _liveness.unacknowledged_s(self.sock)
        if unanswered > self.peer_timeout:
            self._silent_in_background(
                f"its node acknowledged nothing this reader sent for {unanswered:.1f} s "
                f"(the bound, FASTMQ_PEER_TIMEOUT_S, is {self.peer_timeout:g} s)")
            return None
        self._alive_due = now + beat
        self._alive_counter += 1
        try:
            self.sock.send(_wire.heartbeat(self._alive_seal, self._alive_counter,
                                           self.last_seq, self.peer_timeout, ALIVE),
                           socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass    # its writer reads them: a full buffer is a writer that is gone
        except OSError as e:
            if e.errno not in _liveness.UNREACHED:
                return None   # (the receive says what happened)
            # The kernel gave up on the writer's node.  Said here, not left
            # to the next receive: a reader busy elsewhere (a vLLM worker in
            # a collective with the dead node's ranks) may never come back
            # to receive.
            self._silent_in_background(self.kernel_gave_up(e))
            return None
        return self._alive_due

    def kernel_gave_up(self, e: OSError) -> str:
        """What the kernel's error on the connection says: it gave up on
        the writer's node (the error is its timeout, or the soft error it
        saw last in the timeout's place)."""
        return (f"the kernel gave up on the connection ({e.strerror}: keepalive or heartbeats "
                f"unacknowledged for the bound, FASTMQ_PEER_TIMEOUT_S, of "
                f"{self.peer_timeout:g} s)")

    def _silent_in_background(self, what: str) -> None:
        silent = PeerSilent(what, self.last_heard())
        # Before the shutdown: a receive that then finds the connection
        # closed reports this silence, not a close (the kernel tells its
        # error once, and this thread took it).
        self._silent = silent
        self._live = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        told = self.on_silent
        if told is not None:
            told(silent)

    def _refused(self, err: int) -> None:
        if err in _liveness.UNREACHED:
            # Its node (or the router before it) found nothing at the
            # address: a node that died or whose link went down, not a
            # writer that closed (that node's kernel would refuse).  Before
            # the bound, where the neighbour's address no longer resolves.
            raise PeerSilent(
                f"its node did not answer the connection ({os.strerror(err)}, after "
                f"{time.perf_counter() - self._connect_at:.1f} s; the bound, "
                f"FASTMQ_PEER_TIMEOUT_S, is {self.peer_timeout:g} s)", self.handshake_heard())
        raise RuntimeError(
            f"fastmq: cannot connect to the writer at {self.address} "
            f"({os.strerror(err)}): the writer is gone, or its handshake completed "
            "without this reader (a reader cannot join, or after a disconnect rejoin, a "
            "queue once the writer's wait_until_ready() has returned; create a new queue)")

    def _answer_challenge(self):
        yield from self._ensure(_wire.ZMTP_SIGNATURE_LEN)
        if _wire.is_zmtp(bytes(self._mv[self._lo:self._hi])):
            raise WriterSpeaksZMTP()
        magic, version, mode = PREAMBLE.unpack_from(self._mv, self._lo)
        if magic != MAGIC or version != _wire.VERSION:
            raise RuntimeError(f"fastmq: the peer at {self.address} is not a fastmq writer "
                               f"of this version (protocol {bytes(magic)!r} version "
                               f"{version}, this reader speaks {_wire.VERSION}): use the "
                               "same fastmq on every node")
        if mode != _wire.MODE_CODES[self.security]:
            raise RuntimeError(f"fastmq: the writer at {self.address} uses remote security "
                               f"mode {_seal.MODES[mode] if mode < len(_seal.MODES) else mode!r}"
                               f" but the handle says {self.security!r}")
        yield from self._ensure(CHALLENGE.size)
        challenge = bytes(self._take(CHALLENGE.size))
        self._challenge_at = time.perf_counter()
        _, _, _, _, writer_public = CHALLENGE.unpack(challenge)
        hs = _keys.Handshake(self.psk)
        blank = HELLO.pack(MAGIC, self.rank, os.getpid(), hs.nonce, hs.public,
                           bytes(_keys.PROOF_BYTES))
        self._alive_nonce = hs.nonce
        transcript = challenge + blank[:HELLO.size - _keys.PROOF_BYTES]
        try:
            self.sock.sendall(blank[:HELLO.size - _keys.PROOF_BYTES] +
                              hs.prove(b"reader", transcript))
        except OSError as e:    # as a receive's: the writer reset the connection
            raise PeerGone(str(e)) from e
        self._hs, self._transcript, self._writer_public = hs, transcript, writer_public

    def _await_ready(self):
        yield from self._ensure(READY.size)
        magic, wrapped = READY.unpack(self._take(READY.size))
        key = None
        if magic == MAGIC and self.security != "none":
            key = self._hs.unwrap(wrapped, self._writer_public, self._transcript)
        self._hs = self._transcript = None
        if magic != MAGIC or (self.security != "none" and key is None):
            raise RuntimeError(f"fastmq: the peer at {self.address} did not prove it is "
                               "this queue's writer (it does not hold the queue's key)")
        if key is not None:
            self.seal = _seal.Seal(self.security, key)
        self._alive_seal = self.seal.for_reader(self._alive_nonce)

    # -- liveness ----------------------------------------------------------------------
    def _went_silent(self, now: float) -> None:
        """Nothing for the bound while this reader waited with nothing to
        read: a writer that is alive sends a heartbeat several times in
        that time, so its node died or is unreachable.  For good; the
        connection is shut, so that a writer that was only cut off learns
        it if the link comes back."""
        self._fail_silent(PeerSilent(
            f"nothing came from it for {now - self._heard_at:.1f} s (the bound, "
            f"FASTMQ_PEER_TIMEOUT_S, is {self.peer_timeout:g} s)", self.last_heard()))

    def _fail_silent(self, e: PeerSilent) -> None:
        self._silent = e
        self._live = False
        _liveness.PULSE.discard(self)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise e

    def handshake_heard(self) -> str:
        """What came from the writer last during the handshake, and when
        (a silence in it has no heartbeat to name)."""
        now = time.perf_counter()
        if self._challenge_at is not None:
            return (f"its challenge (the handshake's first step), "
                    f"{now - self._challenge_at:.1f} s ago; this reader's hello, sent then, "
                    "was never answered")
        if self._connected_at is not None:
            return (f"its node accepted the connection {now - self._connected_at:.1f} s ago, "
                    "nothing heard since (no challenge came)")
        return (f"nothing (this reader's connection, made {now - self._connect_at:.1f} s "
                "ago, was never answered)")

    def last_heard(self) -> str:
        """What came from the writer last, and when."""
        if self._heartbeat_after == self.last_seq and self._heartbeats:
            what = f"a heartbeat (after message {self.last_seq})"
        elif self.last_seq:
            what = f"message {self.last_seq}"
        else:
            what = "the handshake's answer"
        return f"{what}, {time.perf_counter() - self._heard_at:.1f} s ago"
