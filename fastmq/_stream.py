"""A remote reader's end of the remote path (``fastmq._wire``): the
connection to the writer and the receive of sealed messages into a small
inbox (the handshake's reader half and the heartbeats are
``fastmq._stream_hello``'s).

A reader trusts nothing it has not checked: a header is refused before its
frames are taken if its form is wrong or it claims more than the limits,
every tag is checked before what it covers is used, seal counters must
rise and sequence numbers follow each other, and the end of the stream is
a sealed message of its own, so that a clean close, a cut connection and
a tail of messages dropped on the way are three different errors.  Once a
check fails the stream cannot be trusted again: every later call says so.
A writer that sends nothing, not even a heartbeat, for the bound
(``FASTMQ_PEER_TIMEOUT_S``) while the reader waits went silent
(``fastmq._liveness``): a fourth error, for good too.
"""
from __future__ import annotations

import inspect
import os
import select
import socket
import struct
import threading
import time

from fastmq import _config, _liveness, _seal, _wire
from fastmq._recv_buffers import BufferPool, copy_streaming
from fastmq._piecewise import PiecewiseFile
from fastmq._stream_hello import StreamHello
from fastmq._ring import CorruptChunkError
from fastmq._wire import (END, HEAD, HEARTBEAT, SEGMENT_BYTES, SEGMENTED, WHOLE, WHOLE_BYTES,
                          PeerGone, PeerSilent)


class StreamEnded(Exception):
    """The writer closed the queue: a sealed end of the stream came after
    the last message (``last_seq``) and this reader had them all."""

    def __init__(self, last_seq: int):
        super().__init__(last_seq)
        self.last_seq = last_seq


class StreamBroken(RuntimeError):
    """The stream cannot be trusted from here on (a failed check, or a tail
    of messages dropped on the way)."""


# After this many messages in a row whose first byte came later than the
# spin window, a reader waits for the next one in the kernel at once (and
# spins again after one that came within the window): one late message,
# a busy core's hiccup, does not cost the next one the spin.
LONG_WAITS = 4

# A sealed frame this large does not stay in the last-level cache: its
# segments are checked where they land (in cache) and copied in with
# streaming stores (see Stream._segment).  Smaller frames are received (or
# decrypted) straight into place.  Measured on 2 vCPUs (one reader, 64
# MiB): 20.6 ms against 21.6-23.1 with the default MAC.  At 16 MiB the
# frame stays in cache and the extra copy costs more than it saves (one
# reader: 5.7-6.1 ms against 4.5-5.0), and four readers on one core gained
# nothing beyond the spread of the runs (docs/design.md).
STREAMING_STORE_BYTES = 32 << 20


class Stream(StreamHello):
    """A remote reader's end.  ``recv`` is resumable: a deadline that passes
    in the middle of a message leaves it half-read, and the next call goes
    on from there (a ``dequeue()`` that timed out consumed nothing)."""

    INBOX_BYTES = _wire.INBOX_BYTES
    DIRECT_BYTES = 64 * 1024    # reads this large go straight into the frame

    def __init__(self, address: str, ipv6: bool, security: str, psk: bytes | None,
                 rank: int, keep_bytes: int = 0, fill_threads: int = 1,
                 peer_timeout: float | None = None):
        self.security = security
        # Silence longer than this is the writer gone (fastmq._liveness).
        # (Its writer's must not be more than four times longer: the writer
        # beats once per quarter of its own.)
        self.peer_timeout = (_config.peer_timeout_s() if peer_timeout is None
                             else peer_timeout)
        self.psk = psk
        self.seal: _seal.Seal | None = _seal.Seal("none", None) if security == "none" else None
        self.address = address
        self.rank = rank
        host, port = _wire.parse_address(address)
        self.sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET,
                                  socket.SOCK_STREAM)
        _wire.tune(self.sock)
        # A reader sends only heartbeats after the handshake, which its
        # writer reads at once: a user timeout never cuts a live writer.
        _liveness.tune(self.sock, self.peer_timeout, user_timeout=True)
        self.fd = self.sock.fileno()
        # The handshake's steps as heard (time.perf_counter), for what a
        # silence in it says was heard last (StreamHello.handshake_heard).
        self._connect_at = time.perf_counter()
        self._connected_at = self._challenge_at = None
        self._connect_error = self.sock.connect_ex((host, port))
        self._inbox = bytearray(self.INBOX_BYTES)
        self._mv = memoryview(self._inbox)
        self._lo = self._hi = 0
        self._step = None    # the message being received (a generator)
        # Large frames' memory, reused once the caller dropped it (see
        # fastmq._recv_buffers: fresh pages cost as much as receiving into them).
        self.buffers = BufferPool(keep_bytes, fill_threads)
        # Where a sealed segment lands to be checked (and, "encrypt",
        # decrypted into the second) before it goes into its frame; each
        # one for the stream's life, so they stay mapped and in cache,
        # segment after segment.
        self._landing: memoryview | None = None
        self._opened: memoryview | None = None
        # A streamed message's segment lands here (SegmentStream).
        self._segment_memory: memoryview | None = None
        self._tag = memoryview(bytearray(_seal.TAG_BYTES))   # a segment's tag as received
        self.spin_s = 0.0    # how long a receive spins before it waits in the kernel
        self._long_waits = 0   # waits in a row for a message's first byte longer than spin_s
        self._received = 0   # bytes received so far (how _drive sees progress)
        self.last_seq = 0    # the last message taken
        self._counter = 0    # its seal counter
        self._failed: BaseException | None = None   # the check that failed, for good
        self.ended: StreamEnded | None = None
        # Liveness, once the handshake is over: when bytes were last seen
        # (time.perf_counter) and the count then; heartbeats taken; the
        # silence that ended the stream, for good.
        self._live = False
        self._heard_at = 0.0
        self._heard_n = 0
        self._heartbeats = 0
        self._heartbeat_after = -1    # last_seq when the last heartbeat came
        self._silent: PeerSilent | None = None
        # Called (on the heartbeat thread) with the PeerSilent once the
        # heartbeats found the writer's node silent, whether or not a
        # receive is waiting; None: nobody is told until the next receive.
        self.on_silent = None
        self._alive_seal = None       # this reader's heartbeats (Seal.for_reader)
        self._alive_counter = 0
        self._alive_due = 0.0         # when the next one is due (time.monotonic)
        # Set by the reader's shutdown() (see cancel).
        self.cancelled = threading.Event()

    # -- waiting ---------------------------------------------------------------------
    def cancel(self) -> None:
        """The reader is shutting down: a wait in ``recv`` or in the
        handshake raises ``RuntimeError("cancelled")`` within a slice (a
        half-read message stays, as after a timeout)."""
        self.cancelled.set()

    def _drive(self, gen, until, message: bool = False):
        """Run ``gen`` (which yields when it needs more bytes) to its end.

        Spins for ``spin_s`` first (non-blocking receives), then waits in
        the kernel: a message that follows closely is taken without the
        wakeup of a sleeping process, which on loopback costs more than
        the message itself.  Before a message's first byte it does not
        spin once ``LONG_WAITS`` messages in a row came later than the
        window: a reader whose messages come further apart than ``spin_s``
        (an engine waiting for a step's answers from remote workers, a
        reader of large tensors) would otherwise spend the whole window at
        every message, on a core another process may need, for nothing.
        (``message``: ``gen`` takes a message; the handshake's waits do
        not count.)"""
        start = time.perf_counter()
        if self._received != self._heard_n:
            # Bytes were taken since the last look: heard at the latest now.
            self._heard_n, self._heard_at = self._received, start
        first = self._received if message else -1
        spin_until = start + (self.spin_s if self._long_waits < LONG_WAITS or not message
                              else 0.0)
        seen = self._received
        beats = self._heartbeats
        while True:
            try:
                next(gen)
            except StopIteration as s:
                if seen == first:
                    self._waited(time.perf_counter() - start)
                return s.value
            now = time.perf_counter()
            if self._received != seen and self._heartbeats != beats:
                # A heartbeat came (an idle writer): no message is near, so
                # back to the kernel's wait without a spin; the message's
                # first byte is still to come.
                beats = self._heartbeats
                if seen == first:
                    first = self._received
                seen = self._received
                spin_until = now
            elif self._received != seen:
                if seen == first:
                    self._waited(now - start)
                # Bytes keep coming (a large message): the next ones are a
                # socket buffer's drain away, not a step away, so the
                # window restarts rather than each refill costing a wakeup.
                seen = self._received
                spin_until = now + self.spin_s
            if now < spin_until:
                # Give the core back to a writer or reader sharing it (more
                # busy processes than cores: the writer may be waiting for
                # this one to get off its core).
                os.sched_yield()
                continue
            if self._live:
                if self._received != self._heard_n:
                    self._heard_n, self._heard_at = self._received, now
                elif now - self._heard_at > self.peer_timeout:
                    self._went_silent(now)
            try:
                _wire.wait([(self.fd, select.POLLIN)], until, self.cancelled)
            except TimeoutError:
                if seen == first:
                    self._waited(time.perf_counter() - start)
                raise

    def _waited(self, wait_s: float) -> None:
        self._long_waits = 0 if wait_s <= self.spin_s else self._long_waits + 1

    def _ensure(self, n: int):
        """Generator: make ``n`` bytes contiguous in the inbox."""
        if n > self.INBOX_BYTES:   # the callers' limits keep n below; never trust it
            raise CorruptChunkError(f"fastmq: remote reader: a header of {n} bytes from "
                                    f"{self.address} does not fit the inbox")
        while self._hi - self._lo < n:
            if self._lo and self._lo + n > self.INBOX_BYTES:
                have = self._hi - self._lo
                self._mv[:have] = self._mv[self._lo:self._hi]
                self._lo, self._hi = 0, have
            k = self._recv_into(self._mv[self._hi:])
            if k is None:
                yield
            else:
                self._hi += k

    def _recv_into(self, view) -> int | None:
        try:
            k = self.sock.recv_into(view)
        except BlockingIOError:
            return None
        except OSError as e:
            if self._silent is not None:    # the heartbeat thread took the error first
                raise PeerSilent(self._silent.what, self._silent.last) from None
            if e.errno in _liveness.UNREACHED:    # the kernel gave up on the writer's node
                self._fail_silent(PeerSilent(self.kernel_gave_up(e),
                                             self.last_heard() if self._live
                                             else self.handshake_heard()))
            raise PeerGone(str(e)) from e
        if k == 0:
            if self._silent is not None:
                raise PeerSilent(self._silent.what, self._silent.last)
            raise PeerGone("closed")
        self._received += k
        return k

    def _take(self, n: int) -> memoryview:
        v = self._mv[self._lo:self._lo + n]
        self._lo += n
        return v

    def _read_into(self, out: memoryview, exact: bool = False):
        """Generator: fill ``out`` from the stream.  ``exact``: every read
        goes straight into ``out`` and asks for no byte past it.  A large
        frame's segments and tags are read so: a read through the inbox
        would also take up to INBOX_BYTES of the next segment, which is then
        copied again into its frame (a quarter of every segment, at 1 MiB)."""
        have = min(self._hi - self._lo, len(out))
        if have:
            out[:have] = self._take(have)
        while have < len(out):
            rest = out[have:]
            if exact or len(rest) >= self.DIRECT_BYTES:
                k = self._recv_into(rest)
                if k is None:
                    yield
                else:
                    have += k
            else:
                yield from self._ensure(len(rest))
                out[have:] = self._take(len(rest))
                have = len(out)

    # -- messages --------------------------------------------------------------------
    def recv(self, until: float | None, stream: bool = False) -> list | SegmentStream:
        """The frames of the next message (bytearrays, checked), or, with
        ``stream``, for a message of one frame of more than a segment, a
        ``SegmentStream`` that the caller unpickles (``fastmq._piecewise``;
        its frame is received as it is read).  Raises
        ``TimeoutError`` (resumable), ``RuntimeError("cancelled")``,
        ``StreamEnded`` (the writer closed the queue), ``PeerGone`` (the
        connection closed without the end of the stream),
        ``CorruptChunkError`` (a header or a tag that does not check) or
        ``StreamBroken`` (an earlier check failed, or messages were dropped)."""
        if self.ended is not None:
            raise self.ended
        if self._silent is not None:
            raise PeerSilent(self._silent.what, self._silent.last)
        if self._failed is not None:
            raise StreamBroken(f"fastmq: remote reader: the stream from {self.address} "
                               f"failed a check earlier ({self._failed}); nothing after it "
                               "can be trusted") from None
        if self._step is None:
            self._step = self._message(stream)
        return self._run(until)

    def _run(self, until: float | None):
        """``_drive`` the step in progress; what a failure leaves is the
        same for a message and for a segment of a streamed one."""
        step = self._step
        try:
            frames = self._drive(step, until, message=True)
        except StreamEnded as e:
            self._step = None
            self.ended = e
            raise
        except BaseException as e:
            if inspect.getgeneratorstate(step) in (inspect.GEN_CREATED, inspect.GEN_SUSPENDED):
                # Raised between receives (a deadline, cancel(), a signal
                # handler's exception): the step stopped where it yields, and
                # the half-read message stays, to be resumed.
                raise
            self._step = None
            if isinstance(e, PeerGone):
                raise     # the connection closed: not a failed check
            if not isinstance(e, (CorruptChunkError, StreamBroken)):
                # Raised while bytes were being taken (a signal handler's
                # exception, an error of memory): how much of the message
                # the socket gave up is not known, so nothing after it can
                # be told apart from what follows.
                self._fail(StreamBroken(
                    f"fastmq: remote reader: taking message {self.last_seq + 1} from "
                    f"{self.address} was interrupted ({e!r}); the stream cannot be followed "
                    "past it"))
                raise
            self._fail(e)
            raise
        self._step = None
        return frames

    def _fail(self, error: BaseException) -> None:
        """The stream cannot be trusted from here on: every later call
        says so, and the connection is shut, so that the writer learns it
        at once (it names this reader as gone) rather than waiting for
        reads that will never come."""
        self._failed = error
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _message(self, stream: bool = False):
        seal = self.seal
        t = seal.tag_bytes
        yield from self._ensure(HEAD.size)
        kind, counter, seq, n = HEAD.unpack_from(self._mv, self._lo)
        while kind == HEARTBEAT and n == 0:
            yield from self._heartbeat(counter, seq)
            yield from self._ensure(HEAD.size)
            kind, counter, seq, n = HEAD.unpack_from(self._mv, self._lo)
        if kind not in (WHOLE, SEGMENTED, END) or \
                not (n == 0 if kind == END else 1 <= n <= _wire.MAX_FRAMES):
            raise CorruptChunkError(f"fastmq: remote reader: a malformed message header from "
                                    f"{self.address} ({bytes(kind)!r}, {n} frames; at most "
                                    f"{_wire.MAX_FRAMES})")
        size = HEAD.size + 8 * n
        if kind == END:
            yield from self._ensure(size + t)
            header = self._take(size)
            if t and not seal.check_header(counter, header, self._take(t)):
                raise self._unauthentic()
            if t and counter <= self._counter:
                raise StreamBroken(f"fastmq: remote reader: an end of the stream from "
                                   f"{self.address} repeats seal counter {counter} (a replay)")
            if seq != self.last_seq:
                raise StreamBroken(
                    f"fastmq: remote reader: the writer closed the queue after message {seq}, "
                    f"but this reader received only up to message {self.last_seq}: "
                    f"messages were dropped on the way from {self.address}")
            raise StreamEnded(seq)
        yield from self._ensure(size)
        lengths = struct.unpack_from(f"<{n}Q", self._mv, self._lo + HEAD.size)
        total = sum(lengths)
        if kind == WHOLE:
            if total > WHOLE_BYTES:
                raise CorruptChunkError(f"fastmq: remote reader: a malformed message header: "
                                        f"message {seq} claims {total} bytes in a small "
                                        "message's form")
            yield from self._ensure(size + total + t)
            wire = self._take(size + total + t)
            body = seal.open_whole(counter, wire, size, total)
            if body is None:
                raise self._unauthentic()
            self._check_counter(counter, seq)
            frames, off = [], 0
            for length in lengths:
                frames.append(bytearray(body[off:off + length]))
                off += length
            return frames
        yield from self._ensure(size + t)
        header = self._take(size)
        if t and not seal.check_header(counter, header, self._take(t)):
            raise self._unauthentic()
        if total > _wire.MAX_MESSAGE_BYTES:
            raise CorruptChunkError(f"fastmq: remote reader: a malformed message header: "
                                    f"message {seq} claims {total} bytes")
        self._check_counter(counter, seq)
        if stream and n == 1 and total > SEGMENT_BYTES:
            # The caller unpickles it segment by segment (SegmentStream).
            return SegmentStream(self, counter, seq, total)
        frames = []
        index = 0
        for length in lengths:
            frame = self._frame_buffer(length)
            out = memoryview(frame)
            streaming = length >= STREAMING_STORE_BYTES
            for off in range(0, length, SEGMENT_BYTES):
                yield from self._segment(counter, seq, index, out[off:off + SEGMENT_BYTES],
                                         streaming)
                index += 1
            frames.append(frame)
        return frames

    def _segment(self, counter: int, seq: int, index: int, seg: memoryview,
                 streaming: bool = False):
        """Generator: segment ``index`` of message ``seq`` into ``seg``,
        checked (a tag that does not check raises).  ``streaming``: ``seg``
        is part of a frame larger than the caches; a sealed segment is then
        checked where it landed and copied in with streaming stores
        (``copy_streaming``), which do not read the frame's old lines first.
        Until the check passed, whatever ``seg`` holds is never handed out:
        a failed check raises and the frame is dropped."""
        seal = self.seal
        t = seal.tag_bytes
        if self._landing is None and (seal.encrypting or t and streaming):
            self._landing = memoryview(bytearray(SEGMENT_BYTES + t))
        if seal.encrypting:
            w = self._landing[:len(seg) + t]
            yield from self._read_into(w, exact=True)
            if streaming:
                if self._opened is None:
                    self._opened = memoryview(bytearray(SEGMENT_BYTES))
                opened = self._opened[:len(seg)]
                ok = seal.decrypt_into(counter, index, w, opened)
                if ok:
                    copy_streaming(seg, opened)
            else:
                ok = seal.decrypt_into(counter, index, w, seg)
        else:
            got = self._landing[:len(seg)] if t and streaming else seg
            yield from self._read_into(got, exact=True)
            ok = True
            if t:
                # Tagged before the writer's tag is read: the writer sends it
                # after the segment, once it has computed it too
                # (Outgoing.batch), and both run at once.
                expected = seal.tag(counter, index, got)
                if streaming:
                    copy_streaming(seg, got)
                tag = self._tag[:t]
                yield from self._read_into(tag, exact=True)
                ok = seal.matches(expected, tag)
        if not ok:
            raise self._unauthentic(seq)

    def _heartbeat(self, counter: int, seq: int):
        """Generator: take the writer's heartbeat whose header is next
        (sealed like an end of the stream: a forged one fails its check, a
        replayed one repeats a counter, and one naming a later message
        than the last received says messages were dropped)."""
        t = self.seal.tag_bytes
        yield from self._ensure(HEAD.size + t)
        header = self._take(HEAD.size)
        if t and not self.seal.check_header(counter, header, self._take(t)):
            raise self._unauthentic()
        if t and counter <= self._counter:
            raise StreamBroken(f"fastmq: remote reader: a heartbeat from {self.address} "
                               f"repeats seal counter {counter} (a replay)")
        if seq != self.last_seq:
            raise StreamBroken(
                f"fastmq: remote reader: the writer's heartbeat says it sent up to message "
                f"{seq}, but this reader received only up to message {self.last_seq}: "
                f"messages were dropped on the way from {self.address}")
        self._counter = counter
        self._heartbeats += 1
        self._heartbeat_after = seq

    def _frame_buffer(self, length: int):
        """Writable memory for a received frame.  A large one comes from
        the pool, not zeroed first (``bytearray(n)`` writes every page
        once before the socket writes it again)."""
        if length < self.DIRECT_BYTES:
            return bytearray(length)
        return self.buffers.take(length)

    def _unauthentic(self, seq: int | None = None) -> CorruptChunkError:
        # ``seq`` once the message's header checked (a segment's tag); a
        # header that did not check names whatever number its forger wrote,
        # so the message after the last one taken is named instead.
        which = (f"message {seq}" if seq is not None
                 else f"the message after message {self.last_seq}")
        return CorruptChunkError(f"fastmq: remote reader: {which} from {self.address} failed "
                                 "authentication (not sealed with this queue's key)")

    def _check_counter(self, counter: int, seq: int) -> None:
        """A checked header's seal counter must rise (no replay) and its
        sequence number follow the last one (no gap, no repeat); the
        message is taken once both hold."""
        if self.seal.tag_bytes and counter <= self._counter:
            raise StreamBroken(f"fastmq: remote reader: message {seq} from {self.address} "
                               f"repeats seal counter {counter} (a replay)")
        if seq != self.last_seq + 1:
            raise StreamBroken(
                f"fastmq: remote reader: expected message {self.last_seq + 1} from "
                f"{self.address} but received message {seq}: messages were dropped on the way")
        self._counter, self.last_seq = counter, seq

    def close(self, linger=None) -> None:
        self._live = False
        _liveness.PULSE.discard(self)
        self.buffers.close()
        try:
            self.sock.close()
        except OSError:
            pass


class SegmentStream(PiecewiseFile):
    """The one frame (a pickle stream) of a large message, received and
    checked a segment at a time as the unpickler reads it
    (``fastmq._piecewise``), into one segment's memory kept by the stream:
    no buffer of the message's size.  Every segment's tag is checked before
    a byte of it is read, as for a message received whole.

    ``finish()`` receives (and checks) the rest of the frame; ``abandon()``
    leaves it to the stream's next ``recv``, which passes over it first.
    After a failed check the stream is broken for good, as ever."""

    def __init__(self, stream: Stream, counter: int, seq: int, length: int):
        self._stream = stream
        self._counter, self._seq = counter, seq
        self._length = self._left = length
        self._index = 0                 # the next segment
        self._pending = None            # the receive of the last one asked for
        if stream._segment_memory is None:
            stream._segment_memory = memoryview(bytearray(SEGMENT_BYTES))
        self._seg = stream._segment_memory

    def _next_segment(self):
        """Generator: the next segment into the stream's segment memory."""
        # Called only while bytes of the frame remain (its length was
        # checked against the header's limits).
        n = min(SEGMENT_BYTES, self._length - self._index * SEGMENT_BYTES)
        yield from self._stream._segment(self._counter, self._seq, self._index,
                                         self._seg[:n])
        self._index += 1
        self._pos, self._end = 0, n

    def _advance(self) -> None:
        stream = self._stream
        stream._step = self._pending = self._next_segment()
        stream._run(None)

    def _copy(self, target, at: int, k: int) -> None:
        with memoryview(target) as out:
            out[at:at + k] = self._seg[self._pos:self._pos + k]

    def finish(self) -> None:
        while self._index * SEGMENT_BYTES < self._length:
            self._advance()

    def abandon(self, error: BaseException) -> None:
        # A segment half-received (a wait cancelled) is finished first; a
        # failed check or a closed connection leaves nothing to resume.
        stream = self._stream
        if stream._failed is not None or isinstance(error, PeerGone):
            stream._step = None
            return
        stream._step = self._pass_over(self._pending)

    def _pass_over(self, pending):
        """Generator: the rest of this message received, checked and
        dropped; then the next message."""
        if pending is not None:
            yield from pending
        while self._index * SEGMENT_BYTES < self._length:
            yield from self._next_segment()
        return (yield from self._stream._message())
