"""The readers' ends of a queue: ``LocalReader`` (the ring, plus the local
socket for payloads too big for a chunk) and ``RemoteReader`` (TCP,
``fastmq._stream``).

Every message is decoded in one place, ``fastmq._serde.decode``, whichever
way its frames came: the ring hands over a view of the pickle stream in
its chunk and the out-of-band buffers, a socket its frames.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from fastmq import (_config, _door, _keys, _net, _overflow, _parts, _piecewise, _proc, _seal,
                    _stream, _subscribers, _wire, segments)
from fastmq._segment import lend_descriptor, reclaim_descriptor
from fastmq._gone import WriterGoneError
from fastmq._recv_buffers import BufferPool
from fastmq._ring import (LONG_WAIT, OVERFLOW, PARTS, PENDING, READY, WAIT_ZMQ, WRITER_CLOSED,
                          WRITER_DIED, CorruptChunkError)
from fastmq._serde import decode
from fastmq.handle import Handle, HandleMismatchError, is_fastmq_ring, vllm_ring_error
from fastmq.ring import ShmRingBuffer, dead_peers_note

logger = logging.getLogger("fastmq")


# How long a local reader waits for a promised overflow payload once it has
# seen the writer dead with its connection still open (see _writer_gone).
PAYLOAD_GRACE_S = 2.0


class _ReaderEnd:
    """The ZMQ side of a local reader: the handshake and the receive of an
    overflow payload on its ipc socket."""

    is_writer = False
    handle: Handle
    shutting_down: bool

    def _receive_handshake(self, sock) -> None:
        # In slices, like every other wait: shutdown() from another thread
        # and a writer that died (seen by a local reader) end it.
        frames = [f.bytes for f in self._recv_message(sock, None)]
        if frames != [b"READY"]:
            raise RuntimeError(
                f"fastmq: this reader connected after the writer's handshake: it "
                f"received {_overflow.describe_handshake_frames(frames)} of a running "
                "queue instead of READY. A reader cannot join (or, after a disconnect, "
                "rejoin) a queue once the writer's wait_until_ready() has returned; "
                "create a new queue.")

    def _recv_message(self, sock, until: float | None, payload_due: bool = False) -> list:
        """The frames of the next socket message; raises ``TimeoutError``
        past ``until``, ``RuntimeError`` on shutdown or when the writer is
        gone (checked between slices).  ``payload_due``: the writer
        promised this message (an overflow mark), so only a writer whose
        connection has closed -- every byte it sent is here -- is gone."""
        writer_gone = False
        while True:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            wait_ms = _overflow.RECV_SLICE_MS
            if until is not None:
                left = int((until - time.monotonic()) * 1000)
                if left <= 0 and not sock.poll(0):
                    raise TimeoutError
                wait_ms = max(0, min(wait_ms, left))
            if sock.poll(timeout=wait_ms):
                return sock.recv_multipart(copy=False)
            if writer_gone:
                raise self._writer_gone_error()
            # One more slice once gone: what the writer sent before its
            # connection closed is queued ahead of the close.
            writer_gone = self._writer_gone(payload_due)

    def _watch_connection(self, sock, sockets: list) -> None:
        # ZMQ reconnects silently and hides a closed connection; its
        # monitor says when the connection to the writer dropped.  A killed
        # process's sockets are closed by its kernel at once, after the
        # bytes it had sent, which the reader reads first.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sockets.append(self._monitor)
        self._disconnected = False

    def _connection_dropped(self) -> bool:
        while not self._disconnected:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            self._disconnected = event["event"] == zmq.EVENT_DISCONNECTED
        return self._disconnected


class LocalReader(_ReaderEnd):
    """Reader ``rank`` on the writer's node: attaches the ring (claiming its
    reader slot), the local socket, the wakeup sockets in ZMQ mode and the
    tensor arena."""

    remote_socket = None

    def __init__(self, handle: Handle, rank: int):
        bh = handle.buffer_handle
        if bh is None:
            raise ValueError("handle has local readers but no buffer_handle")
        if not is_fastmq_ring(bh):
            raise vllm_ring_error(bh)
        self.handle = handle
        self.shutting_down = False
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_rank = handle.local_reader_ranks.index(rank)
        self.tensor_arena = None
        self._writer_died_at = None  # when a wait first saw the writer dead
        self._overflow_seen = 0      # id of the last overflow payload received
        self._overflow_ahead = None  # a payload received before its mark
        self._parts = None           # a message arriving in parts (fastmq._parts)
        # Memory kept for the next large message (its parts, or its
        # out-of-band buffers copied out of a chunk), once the last is dropped.
        self._part_buffers = BufferPool(_config.remote_buffers_bytes(),
                                        _config.default_copy_threads())
        self._cancel_send = None
        self.buffer = None
        context = zmq.Context()
        sockets: list = []
        lent: list = []
        admission = None
        try:
            admission = self._admit(handle, rank)
            if admission is not None:
                # The segments' own descriptors: attaching them needs no
                # /proc access to the writer (fastmq._door).
                for name, fd in admission.fds.items():
                    lend_descriptor(name, fd)
                lent = list(admission.fds.items())
                admission.fds.clear()
            self.buffer = ShmRingBuffer(bh.n_reader, bh.max_chunk_bytes, bh.max_chunks, bh.name)
            self.ring = ring = self.buffer.attach_reader(self.local_reader_rank)
            if admission is not None and admission.pidfd >= 0:
                ring.watch_writer(admission.take_pidfd())
            ring.warn_interval = _config.warning_interval()
            ring.buffers = self._part_buffers
            pid, started = _proc.me()
            if admission is not None and admission.pid_for_writer:
                # As the writer's pid namespace numbers this process: what
                # the writer judges this slot's holder by.
                pid = admission.pid_for_writer
            holder = ring.claim_reader(pid, started)
            if holder:
                raise RuntimeError(
                    f"fastmq: local reader rank {rank} of this queue is already "
                    f"attached by process {holder}, which is alive; each rank is "
                    "attached by one process")
            me = _subscribers.identity(self.local_reader_rank, pid,
                                       handle.local_key or b"")   # its ring slot
            self.local_socket = sock = context.socket(zmq.SUB)
            sockets.append(sock)
            _overflow.tune_subscriber(sock)
            _subscribers.subscribe(sock, me)
            self._watch_connection(sock, sockets)
            sock.connect(handle.local_subscribe_addr)
            if ring.wait_mode == WAIT_ZMQ:
                notify = context.socket(zmq.SUB)
                sockets.append(notify)
                # No identity here: a CONFLATE socket keeps one message in
                # each direction, so of two subscriptions only the last
                # would reach the writer.  The writer counts these.
                notify.setsockopt(zmq.CONFLATE, 1)
                notify.setsockopt(zmq.SUBSCRIBE, b"")
                notify.connect(handle.local_notify_addr)
                # shutdown() wakes a reader parked on the poller through
                # this pair (another thread may call it).
                cancel_addr = _net.new_inproc_path()
                self._cancel_send = context.socket(zmq.PAIR)
                self._cancel_send.bind(cancel_addr)
                cancel_recv = context.socket(zmq.PAIR)
                cancel_recv.connect(cancel_addr)
                sockets += [self._cancel_send, cancel_recv]
                poller = zmq.Poller()
                poller.register(notify, zmq.POLLIN)
                poller.register(cancel_recv, zmq.POLLIN)
                ring.use_zmq_wakeup(notify, poller)
            from fastmq import arena

            # A failure to attach the arena does not fail the queue: only a
            # message that uses it raises, with the reason (as in vLLM).
            self.tensor_arena = arena.attach_for_queue(handle, self.local_reader_rank)
        except BaseException:
            _overflow.close_all(context, sockets)
            if self.buffer is not None:
                self.buffer.close()
            raise
        finally:
            for name, fd in lent:
                reclaim_descriptor(name, fd)     # not attached (an error, no arena)
            if admission is not None:
                admission.close()
        self.zmq = (context, sockets)
        # What the ring calls per message (flush_releases, map_oob): the
        # arena's core, or the stand-in for an arena that failed to attach.
        self._arena_core = getattr(self.tensor_arena, "core", self.tensor_arena)

    @staticmethod
    def _admit(handle: Handle, rank: int) -> _door.Admission | None:
        """The segments' descriptors and the writer's pidfd, from the
        writer's door; None for a handle without one (its segments are
        opened through /proc)."""
        addr = getattr(handle, "local_door_addr", None)
        if addr is None:
            return None
        key = getattr(handle, "local_key", None)
        if not isinstance(key, bytes) or len(key) != _door.KEY_BYTES:
            raise ValueError(f"fastmq: the handle's local_key is not {_door.KEY_BYTES} bytes")
        return _door.admit(addr, key, rank, getattr(handle, "writer_pid", None) or 0)

    def wait_until_ready(self) -> None:
        self._receive_handshake(self.local_socket)

    def disown(self) -> None:
        """In a forked child: close the child's copies of the segments'
        descriptors (see ``QueueWriter.disown``)."""
        segments.drop_inherited(self.buffer, self.tensor_arena)

    def shutdown(self) -> None:
        self.shutting_down = True
        ring = self.ring
        ring.cancel()
        if self._cancel_send is not None:
            try:
                self._cancel_send.send(b"\x00", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # -- the writer's state ---------------------------------------------------
    def _writer_gone(self, payload_due: bool = False) -> bool:
        status = self.ring.peer_status()
        if status == READY:
            return False
        if not payload_due:
            return True
        # The payload was in the kernel before its mark was published: it
        # is on its way until a dead writer's connection has closed.  That
        # close may never come (a process forked from the writer after the
        # connection was made holds its descriptor too), so a writer dead
        # for PAYLOAD_GRACE_S is gone as well: bytes already in the kernel
        # arrive in far less, even on a loaded host.
        if status != WRITER_DIED:
            return False
        now = time.monotonic()
        if self._writer_died_at is None:
            self._writer_died_at = now
        return self._connection_dropped() or now - self._writer_died_at >= PAYLOAD_GRACE_S

    def _writer_gone_error(self, status: int | None = None) -> RuntimeError:
        ring = self.ring
        if status is None:
            status = ring.peer_status()
        if status == WRITER_CLOSED:
            return RuntimeError(f"fastmq: the writer (pid {ring.writer_pid}) shut the "
                                "queue down" + dead_peers_note())
        return RuntimeError(f"fastmq: the writer (pid {ring.writer_pid}) died; no more "
                            "messages will come")

    def _keep_waiting(self, status: int, indefinite: bool) -> None:
        """Act on what ``ring.wait_next()`` returned until the chunk is
        ready: log a long wait (unless ``indefinite``), raise for a writer
        that is gone."""
        ring = self.ring
        while status != READY:
            if status != LONG_WAIT:
                raise self._writer_gone_error(status)
            if not indefinite:
                logger.info(_config.LONG_WAIT_TIME_LOG_MSG + " This reader (rank %d) has "
                            "waited %.0f s for the writer (pid %d).", ring.warn_interval,
                            ring.reader_rank, ring.waited, ring.writer_pid)
            status = ring.continue_wait()

    # -- raw chunk access -------------------------------------------------------
    @contextmanager
    def acquire_read(self, timeout: float | None, indefinite: bool) -> Iterator[memoryview]:
        ring = self.ring
        status = ring.wait_next(timeout)
        if status != READY:
            self._keep_waiting(status, indefinite)
        idx = ring.current_idx
        try:
            with ring.chunk_view(idx) as buf:
                yield buf
        finally:
            ring.release_read(idx)

    # -- messages ---------------------------------------------------------------
    def dequeue(self, timeout: float | None, indefinite: bool) -> Any:
        if self._parts is not None:
            # The rest of a message arriving in parts comes first, whatever
            # the next chunk holds (anything but its next part is corrupt).
            obj = self._recv_parts(_overflow.deadline(timeout), indefinite, wait=True)
            if obj is not PENDING:
                return obj
        # One call into the ring: the arena's releases, the wait, the
        # copy of the out-of-band buffers and the unpickling.
        obj = self.ring.read_object(timeout, self._arena_core)
        if obj is PENDING:
            return self._dequeue_pending(timeout, indefinite)
        return obj

    def _dequeue_pending(self, timeout: float | None, indefinite: bool) -> Any:
        ring = self.ring
        while True:
            status = ring.pending
            if status == OVERFLOW:
                # Its payload left the writer before the mark was published:
                # it is here or nearly, so it gets its own (full) timeout
                # rather than a clock read on every dequeue().
                return self._recv_overflow(_overflow.deadline(timeout))
            if status == PARTS:
                obj = self._recv_parts(_overflow.deadline(timeout), indefinite)
                if obj is PENDING:
                    # A message dropped (aborted, or refused): read on.
                    obj = ring.read_object(timeout, self._arena_core)
                if obj is not PENDING:
                    return obj
                continue
            # A wait status: act on it; then the chunk is ready and the
            # read does not wait again.
            self._keep_waiting(status, indefinite)
            obj = ring.read_object(timeout, self._arena_core)
            if obj is not PENDING:
                return obj

    def _recv_overflow(self, until: float | None) -> Any:
        """The payload of the overflow mark in the current chunk.  The
        chunk is released only once its payload is here, so a timeout
        leaves both where they were."""
        ring = self.ring
        want = ring.overflow_id
        if not self._overflow_seen < want <= ring.overflow_latest:
            # Ids grow, and a payload leaves the writer before its mark is
            # published: no payload will ever come for this mark.
            idx = ring.current_idx
            ring.release_read(idx)
            raise CorruptChunkError(
                f"fastmq: ring chunk {idx} holds an overflow mark for message {want}, "
                f"which the writer never published (last published "
                f"{ring.overflow_latest}, last received {self._overflow_seen})")
        while True:
            if self._overflow_ahead is not None:
                (msg_id, payload), self._overflow_ahead = self._overflow_ahead, None
            else:
                frames = self._recv_message(self.local_socket, until, payload_due=True)
                got = _overflow.split_message(frames, "local reader")
                if got is None:
                    continue   # a payload whose sending was interrupted
                msg_id, payload = got
            if msg_id == want:
                break
            if msg_id > want:
                # Kept for the mark that names it; this mark is corrupt.
                self._overflow_ahead = (msg_id, payload)
                ring.release_read(ring.current_idx)
                raise CorruptChunkError(
                    f"fastmq: the ring's overflow mark names message {want}, but the "
                    f"socket delivered message {msg_id} first")
            # msg_id < want: the payload of a send the writer abandoned.
        self._overflow_seen = want
        ring.release_read(ring.current_idx)
        main, *oob = payload
        return decode(main, oob, self.tensor_arena)

    def _recv_parts(self, until: float | None, indefinite: bool, wait: bool = False) -> Any:
        """The message whose part is in the current chunk: each part is
        copied out and its chunk released before the next is awaited.  A
        timeout keeps what arrived (``_parts``) for the next call; an abort
        drops it and returns ``PENDING``, as does the end of a message
        whose first part was refused.  Without a deadline, a message with
        no out-of-band buffer is unpickled as its parts come instead
        (``_load_parts``)."""
        ring = self.ring
        while True:
            if wait:
                status = ring.wait_next(_overflow.remaining(until))
                if status != READY:
                    self._keep_waiting(status, indefinite)
            wait = True
            idx = ring.current_idx
            asm = stream = None
            try:
                aborted, index, total, offset, length = ring.part_header(idx)
                if aborted:
                    self._parts = None
                    return PENDING
                asm = self._parts
                head = None
                if index == 0:
                    if asm is not None:
                        raise CorruptChunkError(
                            f"fastmq ring chunk {idx}: a message's parts start again before "
                            f"its part {asm.next_index}")
                    head = _parts.read_head(ring, idx, length, total)
                    if until is None and len(head[1]) == 1 and \
                            _parts.short_of_memory(total) is None:
                        # The stream holds the chunk from here on.  (Short
                        # of memory, the assembly refuses the message with a
                        # MemoryError and passes over its parts.)
                        stream = _parts.PartStream(ring, idx, total, length, head[0],
                                                   head[1][0], self._next_part(indefinite),
                                                   self._keep_parts)
                    else:
                        asm = self._parts = _parts.Assembly(total, self._part_buffers)
                elif asm is None:
                    raise CorruptChunkError(f"fastmq ring chunk {idx}: part {index} of a "
                                            "message whose first part this reader never saw")
                done = stream is None and asm.take(ring, idx, index, total, offset, length, head)
            except BaseException:
                # A refused first part is passed over to the message's end
                # (``skipping``); anything else ends the message here.
                if asm is None or not asm.skipping or asm.next_index != index + 1:
                    self._parts = None
                raise
            finally:
                if stream is None:
                    ring.release_read(idx)
            if stream is not None:
                try:
                    return _piecewise.unpickle(stream)
                except _parts.PartsAborted:
                    return PENDING      # the writer dropped the message: read on
            if done:
                self._parts = None
                if asm.skipping:
                    return PENDING
                return decode(memoryview(asm.frames[0]), asm.frames[1:], self.tensor_arena)

    def _next_part(self, indefinite: bool):
        ring = self.ring

        def wait() -> int:
            status = ring.wait_next(None)
            if status != READY:
                self._keep_waiting(status, indefinite)
            return ring.current_idx
        return wait

    def _keep_parts(self, asm: _parts.Assembly) -> None:
        self._parts = asm

    def stats(self) -> dict:
        # A reader sends no ZMQ notifies: none can fail.
        out = {"wakeups": self.ring.wakeups, "notify_errors": 0}
        if self.tensor_arena is not None:
            out.update(self.tensor_arena.stats())
        return out


def _peer_timeout(handle: Handle) -> float:
    """This remote reader's bound on its writer's silence: its own setting,
    or the writer's (from the handle) where that is longer."""
    mine = _config.peer_timeout_s()
    theirs = getattr(handle, "peer_timeout_s", None)
    if isinstance(theirs, (int, float)) and not isinstance(theirs, bool) and theirs > mine:
        # (A NaN compares false: the reader keeps its own.)
        return min(float(theirs), _config.ENV_FLOAT_MAX)
    return mine


class RemoteReader:
    """A reader on another node: one TCP connection to the writer
    (``fastmq._stream``), authenticated as the handle's security mode says.
    Messages carry sequence numbers, so a gap is an error rather than a
    silent loss.  It cannot see the writer's process: the connection
    closing (the writer died, or its node went away) is how it learns that
    no more messages will come."""

    is_writer = False
    buffer = ring = tensor_arena = local_socket = None
    local_reader_rank = -1

    def __init__(self, handle: Handle, rank: int):
        self.handle = handle
        self.shutting_down = False
        self.n_local_reader = len(handle.local_reader_ranks)
        security = getattr(handle, "remote_security", None)
        if security not in _seal.MODES:
            raise ValueError(f"fastmq: the handle's remote security mode {security!r} is "
                             f"not one of {', '.join(_seal.MODES)}")
        psk = _keys.reader_psk(handle, security)
        self._ready = False    # wait_until_ready() returned
        self.remote_socket = self.stream = _stream.Stream(
            handle.remote_subscribe_addr, handle.remote_addr_ipv6, security, psk, rank,
            keep_bytes=_config.remote_buffers_bytes(),
            fill_threads=_config.default_copy_threads(),
            peer_timeout=_peer_timeout(handle))
        self._warm_bytes = _config.warm_bytes()
        spin_us = getattr(handle, "spin_us", None)
        self.stream.spin_s = (_config.spin_us(None) if spin_us is None else spin_us) / 1e6
        self.stream.start_hello()
        self.zmq = (None, [self.stream])

    def wait_until_ready(self) -> None:
        try:
            self.stream.handshake()
        except _wire.PeerSilent as e:
            raise self._silence(e, "during the handshake") from None
        except _wire.WriterSpeaksZMTP:
            raise HandleMismatchError(
                "this remote reader uses fastmq, but the writer at "
                f"{self.handle.remote_subscribe_addr} is vLLM's own MessageQueue (it speaks "
                "ZMQ): fastmq is not active in the writer's process. Activate fastmq in "
                "every process of the deployment or in none.") from None
        self._ready = True
        # Here, not in the first dequeue: where readers share a core,
        # populating fresh pages is a large share of a first large
        # message's time.
        self.stream.buffers.warm(self._warm_bytes)

    def disown(self) -> None:
        """In a forked child: close the child's copy of the connection
        (never shut it down: that would end the parent's), so that the
        writer learns at once when this reader's process died."""
        try:
            self.stream.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        self.shutting_down = True
        self.stream.cancel()

    def wait_shutdown(self, seconds: float) -> bool:
        """Whether ``shutdown()`` is called within ``seconds``."""
        return self.stream.cancelled.wait(seconds)

    def _writer(self) -> str:
        pid = getattr(self.handle, "writer_pid", None)
        return f"the writer{f' (pid {pid})' if pid else ''} at {self.handle.remote_subscribe_addr}"

    def on_writer_silent(self, told) -> None:
        """Call ``told(WriterGoneError)`` (on the heartbeat thread) when
        this reader's heartbeats find the writer's node silent, even while
        no ``dequeue`` waits; the next ``dequeue`` raises it as well."""
        self.stream.on_silent = lambda e: told(
            self._silence(e, "(this reader's heartbeats went unanswered)"))

    def _silence(self, e: _wire.PeerSilent, when: str) -> WriterGoneError:
        """A writer whose node went silent (fastmq._liveness): gone, as a
        cut connection is (``clean=False``), in words that say it was
        silence, not a close."""
        last = f"; last heard from it: {e.last}" if e.last else ""
        after = (f"; message {self.stream.last_seq} was the last received, and a remote "
                 "reader cannot rejoin a running queue") if self._ready else ""
        return WriterGoneError(
            f"fastmq: remote reader rank {self.stream.rank}: {self._writer()} went silent "
            f"{when}: {e.what}{last}. Its node died or became unreachable, or the link drops "
            "everything: silence, not a close (no end of the stream, no closed connection "
            f"came){after}", clean=False)

    def _before_handshake(self, timeout: float | None):
        """``dequeue()`` before ``wait_until_ready()`` returned: the stream
        holds the writer's challenge, not messages (reading it as one would
        break the stream for good).  As vLLM's queue does, no message comes:
        ``TimeoutError`` once ``timeout`` passed (``shutdown()`` ends the
        wait); without a timeout, which would never end, a RuntimeError."""
        if timeout is None:
            raise RuntimeError("fastmq: a remote reader receives nothing before its "
                               "wait_until_ready() returned; call it first")
        if self.stream.cancelled.wait(max(timeout, 0.0)):
            raise RuntimeError("cancelled")
        raise TimeoutError("fastmq: no message: this remote reader's wait_until_ready() "
                           "has not returned")

    def dequeue(self, timeout: float | None, indefinite: bool) -> Any:
        stream = self.stream
        if not self._ready:
            return self._before_handshake(timeout)
        until = _overflow.deadline(timeout)
        try:
            # Without a deadline a large message of one frame is unpickled
            # as its segments come (fastmq._piecewise).
            got = stream.recv(until, stream=until is None)
            if isinstance(got, _stream.SegmentStream):
                return _piecewise.unpickle(got)
            main, *oob = got
        except _stream.StreamEnded as e:
            raise WriterGoneError(f"fastmq: {self._writer()} shut the queue down after message "
                                  f"{e.last_seq}; every message it sent was received",
                                  clean=True) from None
        except _wire.PeerSilent as e:
            raise self._silence(e, "while this reader waited for a message") from None
        except _wire.PeerGone:
            raise WriterGoneError(
                f"fastmq: the connection to {self._writer()} was cut before the writer "
                "closed the queue (no end of the stream came): the writer died or exited "
                "without closing it, its node became unreachable, or the connection was "
                f"cut on the way; message {stream.last_seq} was the last received, and a "
                "remote reader cannot rejoin a running queue", clean=False) from None
        return decode(main, oob, None)

    def stats(self) -> dict:
        return {"wakeups": 0, "notify_errors": 0}
