"""``MessageQueue`` and ``Handle``: vLLM's broadcast-queue surface over the
Cython ring.

One writer broadcasts every message to ``n_reader`` readers.  Node-local
readers read it from a shared-memory ring chunk (or, when the framed message
does not fit a chunk, find an overflow mark there and take the payload from
a ZMQ XPUB socket); remote readers get it over TCP.  The hot state lives in
``fastmq._ring.Ring``; this module owns sockets, lifetimes and the API.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import zmq

from fastmq import _config, _net, _proc
from fastmq._ring import OVERFLOW, WAIT_ZMQ, CorruptChunkError, SegmentMismatchError
from fastmq._serde import Encoder, decode
from fastmq import segments
from fastmq.segments import ShmRingBuffer

logger = logging.getLogger("fastmq")

LONG_WAIT_TIME_LOG_MSG = (
    "No available shared memory broadcast block found "
    "in %d seconds. This typically happens "
    "when some processes are hanging or doing some "
    "time-consuming work (e.g. compilation, "
    "weight/kv cache quantization)."
)

_RECV_SLICE_MS = 100   # socket waits re-check shutdown at this period


class HandleMismatchError(RuntimeError):
    """A handle from one queue implementation was given to the other."""


class BufferHandle(tuple):
    """``(n_reader, max_chunk_bytes, max_chunks, segment name)`` of a fastmq
    ring.  Indexing works as on the plain tuple vLLM uses; unpacking it, which
    is what vLLM's own ``ShmRingBuffer(*handle.buffer_handle)`` does, raises:
    a vLLM reader must not attach to a fastmq ring."""

    def __new__(cls, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str):
        return tuple.__new__(cls, (n_reader, max_chunk_bytes, max_chunks, name))

    def __reduce__(self):
        return (BufferHandle, (self[0], self[1], self[2], self[3]))

    def __iter__(self):
        raise HandleMismatchError(
            f"this MessageQueue handle was created by fastmq (ring segment "
            f"{self[3]!r}) but is being attached by vLLM's own MessageQueue: "
            "fastmq is not active in this process. Install fastmq in this "
            "process's environment, unset FASTMQ_VLLM=0, or call "
            "fastmq.vllm.patch() before vLLM creates its queues."
        )


@dataclass
class Handle:
    """Everything a reader needs to attach; picklable, same fields as vLLM's."""

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None
    local_notify_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: tuple | None = None


class _Stats:
    __slots__ = ("ring_messages", "ring_bytes", "overflow_messages", "overflow_bytes",
                 "remote_messages", "remote_bytes")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class _RingHooks:
    """Slow-path callbacks the Cython wait loop makes (never per message,
    except ``notify_zmq`` in ZMQ mode while some reader is parked)."""

    def __init__(self, ring, notify_socket=None, poller=None, cancel_recv=None):
        self._ring = ring
        self._notify = notify_socket
        self._poller = poller
        self._cancel_recv = cancel_recv
        self._next_peer_check = 0.0

    def park_zmq(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout=timeout_ms))
        if self._notify in events:
            self._notify.recv(zmq.NOBLOCK, copy=False)

    def notify_zmq(self) -> None:
        self._notify.send(b"\x00")

    def long_wait(self, elapsed: float, writer: bool, idx: int) -> None:
        interval = self._ring.warn_interval
        if writer:
            behind = ", ".join(
                f"rank {r} (pid {self._ring.reader_identity(r)[0] or 'not attached'})"
                for r in self._ring.unread_readers(idx))
            logger.info(LONG_WAIT_TIME_LOG_MSG + " Readers that have not read chunk %d "
                        "for %.0f s: %s.", interval, idx, elapsed, behind or "none")
        else:
            logger.info(LONG_WAIT_TIME_LOG_MSG + " This reader (rank %d) has waited "
                        "%.0f s for the writer (pid %d).", interval,
                        self._ring.reader_rank, elapsed, self._ring.writer_pid)

    def check_peers(self, writer: bool, idx: int) -> None:
        now = time.monotonic()
        if now < self._next_peer_check:
            return
        self._next_peer_check = now + 0.2
        ring = self._ring
        if writer:
            for r in ring.unread_readers(idx):
                pid, started = ring.reader_identity(r)
                if pid and not _proc.is_alive(pid, started):
                    raise RuntimeError(
                        f"fastmq: reader rank {r} (pid {pid}) died without reading "
                        f"chunk {idx}; the writer cannot make progress")
        else:
            if ring.writer_closed:
                raise RuntimeError(
                    f"fastmq: the writer (pid {ring.writer_pid}) shut the queue down")
            if not _proc.is_alive(ring.writer_pid, ring.writer_start):
                raise RuntimeError(
                    f"fastmq: the writer (pid {ring.writer_pid}) died; no more "
                    "messages will come")


def _close_zmq(context, sockets, paths) -> None:
    # Not run at interpreter exit (pyzmq's term() can hang there when the
    # context and its sockets are collected together); segments.remove_at_exit
    # still removes the ipc files then.
    for s in sockets:
        try:
            s.close(linger=0)
        except Exception:
            pass
    try:
        context.term()
    except Exception:
        pass
    segments.remove_now(paths)


def _resolve_geometry(max_chunk_bytes: int, max_chunks: int) -> tuple[int, int]:
    mb = _config.env_int("FASTMQ_MAX_CHUNK_MB", None, minimum=1)
    n = _config.env_int("FASTMQ_MAX_CHUNKS", None, minimum=1)
    return (mb << 20 if mb is not None else max_chunk_bytes,
            n if n is not None else max_chunks)


class MessageQueue:
    """One writer to ``n_reader`` readers, ``n_local_reader`` of them on this
    node (shared memory), the rest remote (TCP).

    Same constructor, methods and errors as vLLM's ``MessageQueue``; extra
    keyword arguments: ``wait_mode`` (``"futex"``, ``"zmq"`` or ``"spin"``;
    default ``FASTMQ_WAIT`` or futex) and ``spin_us`` (how long readers spin
    before parking; default ``FASTMQ_SPIN_US`` or 2000).  Readers adopt the
    writer's wait mode and spin budget.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 1024 * 1024 * 24,
        max_chunks: int = 10,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool | None = None,
        *,
        wait_mode: str | None = None,
        spin_us: float | None = None,
        **arena_options: Any,
    ):
        if n_local_reader > n_reader or n_local_reader < 0:
            raise ValueError(f"n_local_reader={n_local_reader} must be in 0..n_reader={n_reader}")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        elif len(local_reader_ranks) != n_local_reader:
            raise ValueError(f"local_reader_ranks {local_reader_ranks} does not have "
                             f"n_local_reader={n_local_reader} entries")
        max_chunk_bytes, max_chunks = _resolve_geometry(max_chunk_bytes, max_chunks)
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_remote_reader = n_reader - n_local_reader
        self.shutting_down = False
        self._is_writer = True
        self._is_local_reader = False
        self._is_remote_reader = False
        self.local_reader_rank = -1
        self.tensor_arena = None
        self._stats = _Stats()
        context = zmq.Context()
        sockets: list = []
        paths: list[str] = []
        self._ring = None
        self.buffer = None
        self.local_socket = None
        self.remote_socket = None
        local_subscribe_addr = local_notify_addr = remote_subscribe_addr = None
        remote_addr_ipv6 = False
        try:
            if n_local_reader > 0:
                self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks,
                                            wait_mode=wait_mode, spin_us=spin_us)
                self._ring = ring = self.buffer.ring
                ring.warn_interval = _config.warning_interval()
                self.local_socket = context.socket(zmq.XPUB)
                sockets.append(self.local_socket)
                self.local_socket.setsockopt(zmq.XPUB_VERBOSE, True)
                local_subscribe_addr, path = _net.new_ipc_path()
                self.local_socket.bind(local_subscribe_addr)
                paths.append(path)
                notify = None
                if ring.wait_mode == WAIT_ZMQ:
                    notify = context.socket(zmq.PUB)
                    sockets.append(notify)
                    notify.setsockopt(zmq.SNDHWM, 1)
                    local_notify_addr, path = _net.new_ipc_path()
                    notify.bind(local_notify_addr)
                    paths.append(path)
                ring.hooks = _RingHooks(ring, notify_socket=notify)
                self.tensor_arena = self._make_arena(enable_shm_tensor_arena, arena_options)
            elif arena_options:
                raise TypeError(f"unexpected arguments {sorted(arena_options)}")
            if n_remote_reader > 0:
                if not connect_ip:
                    connect_ip = _net.local_ip()
                self.remote_socket = context.socket(zmq.XPUB)
                sockets.append(self.remote_socket)
                self.remote_socket.setsockopt(zmq.XPUB_VERBOSE, True)
                if _net.is_ipv6(connect_ip):
                    self.remote_socket.setsockopt(zmq.IPV6, 1)
                    remote_addr_ipv6 = True
                    connect_ip = f"[{connect_ip.strip('[]')}]"
                self.remote_socket.bind(f"tcp://{connect_ip}:0")
                endpoint = self.remote_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
                remote_subscribe_addr = f"tcp://{connect_ip}:{endpoint.rsplit(':', 1)[1]}"
        except BaseException:
            _close_zmq(context, sockets, paths)
            if self.buffer is not None:
                self.buffer.close()
            raise
        self._encoder = Encoder(self.tensor_arena)
        self.handle = Handle(
            local_reader_ranks=list(local_reader_ranks),
            buffer_handle=BufferHandle(*self.buffer.handle()) if self.buffer else None,
            local_subscribe_addr=local_subscribe_addr,
            local_notify_addr=local_notify_addr,
            remote_subscribe_addr=remote_subscribe_addr,
            remote_addr_ipv6=remote_addr_ipv6,
            tensor_arena_handle=(self.tensor_arena.handle()
                                 if self.tensor_arena is not None else None),
        )
        self._finalizer = weakref.finalize(self, _close_zmq, context, sockets, paths)
        self._finalizer.atexit = False
        segments.remove_at_exit(paths)
        logger.debug("fastmq message queue handle: %s", self.handle)

    def _make_arena(self, enable: bool | None, options: dict):
        """Hook for the tensor arena (see fastmq.arena); none by default."""
        if options:
            raise TypeError(f"unexpected arguments {sorted(options)}")
        return None

    # -- attach ------------------------------------------------------------
    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> "MessageQueue":
        """Attach as reader ``rank`` (a local reader when ``rank`` is in
        ``handle.local_reader_ranks``, otherwise a remote one)."""
        self = MessageQueue.__new__(MessageQueue)
        self.handle = handle
        self._is_writer = False
        self.shutting_down = False
        self.tensor_arena = None
        self._stats = _Stats()
        self._encoder = None
        self._ring = None
        self.buffer = None
        self.local_socket = None
        self.remote_socket = None
        self.n_local_reader = len(handle.local_reader_ranks)
        self.n_remote_reader = 0
        context = zmq.Context()
        sockets: list = []
        try:
            if rank in handle.local_reader_ranks:
                bh = handle.buffer_handle
                if bh is None:
                    raise ValueError("handle has local readers but no buffer_handle")
                if not isinstance(bh, BufferHandle):
                    raise HandleMismatchError(
                        f"this MessageQueue handle was created by vLLM's own MessageQueue "
                        f"(ring segment {bh[3]!r}) but is being attached by fastmq: the "
                        "writer's process does not use fastmq. Activate fastmq in every "
                        "vLLM process (install it; do not set FASTMQ_VLLM=0) or in none.")
                self.local_reader_rank = handle.local_reader_ranks.index(rank)
                self._is_local_reader = True
                self._is_remote_reader = False
                self.buffer = ShmRingBuffer(bh[0], bh[1], bh[2], bh[3])
                self._ring = ring = self.buffer.attach_reader(self.local_reader_rank)
                ring.warn_interval = _config.warning_interval()
                ring.set_reader_identity(self.local_reader_rank, *_proc.me())
                self.local_socket = context.socket(zmq.SUB)
                sockets.append(self.local_socket)
                self.local_socket.setsockopt_string(zmq.SUBSCRIBE, "")
                self.local_socket.connect(handle.local_subscribe_addr)
                notify = poller = cancel_recv = None
                if ring.wait_mode == WAIT_ZMQ:
                    notify = context.socket(zmq.SUB)
                    sockets.append(notify)
                    notify.setsockopt(zmq.CONFLATE, 1)
                    notify.setsockopt_string(zmq.SUBSCRIBE, "")
                    notify.connect(handle.local_notify_addr)
                    cancel_addr = _net.new_inproc_path()
                    cancel_send = context.socket(zmq.PAIR)
                    cancel_send.bind(cancel_addr)
                    cancel_recv = context.socket(zmq.PAIR)
                    cancel_recv.connect(cancel_addr)
                    sockets += [cancel_send, cancel_recv]
                    self._cancel_send = cancel_send
                    poller = zmq.Poller()
                    poller.register(notify, zmq.POLLIN)
                    poller.register(cancel_recv, zmq.POLLIN)
                ring.hooks = _RingHooks(ring, notify, poller, cancel_recv)
                self.tensor_arena = self._attach_arena(handle)
            else:
                self.local_reader_rank = -1
                self._is_local_reader = False
                self._is_remote_reader = True
                self.remote_socket = context.socket(zmq.SUB)
                sockets.append(self.remote_socket)
                self.remote_socket.setsockopt_string(zmq.SUBSCRIBE, "")
                if handle.remote_addr_ipv6:
                    self.remote_socket.setsockopt(zmq.IPV6, 1)
                self.remote_socket.connect(handle.remote_subscribe_addr)
        except BaseException:
            _close_zmq(context, sockets, [])
            if self.buffer is not None:
                self.buffer.close()
            raise
        self._finalizer = weakref.finalize(self, _close_zmq, context, sockets, [])
        self._finalizer.atexit = False
        return self

    def _attach_arena(self, handle: Handle):
        """Hook for the tensor arena (see fastmq.arena); none by default."""
        return None

    def wait_until_ready(self) -> None:
        """Collective: the writer and every reader call it (any order).

        The writer waits for every reader's subscription, then sends READY
        on each channel so that no later message can be missed."""
        if self._is_writer:
            for _ in range(self.n_local_reader):
                self.local_socket.recv()
            if self.n_local_reader > 0:
                self.local_socket.send(b"READY")
            for _ in range(self.n_remote_reader):
                self.remote_socket.recv()
            if self.n_remote_reader > 0:
                self.remote_socket.send(b"READY")
        else:
            sock = self.local_socket if self._is_local_reader else self.remote_socket
            got = sock.recv()
            if got != b"READY":
                raise RuntimeError(f"fastmq: unexpected handshake message {got[:32]!r}")

    def shutdown(self) -> None:
        """Wake a reader (or writer) blocked in this queue: it raises
        ``RuntimeError("cancelled")``.  Safe from another thread."""
        self.shutting_down = True
        ring = self._ring
        if ring is not None:
            ring.cancel()
            if self._is_writer:
                ring.mark_closed()
            elif ring.wait_mode == WAIT_ZMQ:
                try:
                    self._cancel_send.send(b"\x00", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    # -- vLLM-visible attributes -------------------------------------------
    @property
    def current_idx(self) -> int:
        return self._ring.current_idx if self._ring is not None else -1

    @property
    def wait_mode(self) -> str | None:
        if self._ring is None:
            return None
        return {v: k for k, v in _config.WAIT_MODES.items()}[self._ring.wait_mode]

    # -- raw chunk access ----------------------------------------------------
    @contextmanager
    def acquire_write(self, timeout: float | None = None) -> Iterator[memoryview]:
        """Yield the next chunk's bytes; publish it when the block exits
        normally (an exception leaves the chunk unpublished and reusable)."""
        if not self._is_writer:
            raise RuntimeError("Only writers can acquire write")
        ring = self._ring
        idx = ring.acquire_write(timeout)
        with ring.chunk_view(idx) as buf:
            yield buf
        ring.publish_chunk(idx)

    @contextmanager
    def acquire_read(self, timeout: float | None = None,
                     indefinite: bool = False) -> Iterator[memoryview]:
        """Yield this reader's next chunk; it is marked read on exit, even
        when the block raises."""
        if not self._is_local_reader:
            raise RuntimeError("Only readers can acquire read")
        ring = self._ring
        idx = ring.acquire_read(timeout, indefinite)
        try:
            with ring.chunk_view(idx) as buf:
                yield buf
        finally:
            ring.release_read(idx)

    # -- messages ------------------------------------------------------------
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to every reader.  Pickling happens first: an
        object that cannot be pickled raises and nothing is sent."""
        if not self._is_writer:
            raise RuntimeError("Only writers can enqueue")
        buffers = self._encoder.encode(obj)
        stats = self._stats
        if self.n_local_reader > 0:
            framed = self._ring.send(buffers, timeout)
            if framed:
                stats.ring_messages += 1
                stats.ring_bytes += framed
            else:
                # Order the message in the ring, then publish it on the socket.
                # copy=True: the socket snapshots the bytes now, so mutating
                # a tensor after enqueue returns cannot change what is read.
                self._ring.send_overflow_mark(timeout)
                self.local_socket.send_multipart(buffers, copy=True)
                stats.overflow_messages += 1
                stats.overflow_bytes += sum(memoryview(b).nbytes for b in buffers)
        if self.n_remote_reader > 0:
            self.remote_socket.send_multipart(buffers, copy=True)
            stats.remote_messages += 1
            stats.remote_bytes += sum(memoryview(b).nbytes for b in buffers)

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Receive the next object.  ``TimeoutError`` after ``timeout``
        seconds; ``RuntimeError("cancelled")`` after ``shutdown()``."""
        if self._is_local_reader:
            obj = self._ring.recv(timeout, indefinite)
            if obj is OVERFLOW:
                obj = self._recv_socket(self.local_socket, timeout)
            return obj
        if self._is_remote_reader:
            return self._recv_socket(self.remote_socket, timeout)
        raise RuntimeError("Only readers can dequeue")

    def _recv_socket(self, sock, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            wait_ms = _RECV_SLICE_MS
            if deadline is not None:
                left = int((deadline - time.monotonic()) * 1000)
                if left <= 0 and not sock.poll(0):
                    raise TimeoutError
                wait_ms = max(0, min(wait_ms, left))
            if sock.poll(timeout=wait_ms):
                break
        main, *oob = sock.recv_multipart(copy=False)
        return decode(main, oob)

    def broadcast_object(self, obj: Any = None) -> Any:
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def stats(self) -> dict:
        """Counters of what this end sent: messages and bytes per path."""
        out = self._stats.as_dict()
        if self.tensor_arena is not None:
            out.update(self.tensor_arena.stats())
        return out

    # -- process groups --------------------------------------------------------
    @staticmethod
    def create_from_process_group(pg, max_chunk_bytes, max_chunks, writer_rank: int = 0,
                                  external_writer_handle=None, blocking: bool = True
                                  ) -> "MessageQueue":
        """One writer (``writer_rank``) to every other rank of ``pg``: a torch
        ``ProcessGroup`` or an object with vLLM's ``StatelessProcessGroup``
        methods (``rank``, ``world_size``, ``broadcast_obj``, ``all_gather_obj``)."""
        from fastmq import groups

        return groups.create_from_process_group(
            MessageQueue, pg, max_chunk_bytes, max_chunks, writer_rank,
            external_writer_handle, blocking)

    @staticmethod
    def create_from_process_group_single_reader(pg, max_chunk_bytes, max_chunks,
                                                reader_rank: int = 0, blocking: bool = False
                                                ) -> tuple["MessageQueue", list[Handle]]:
        """Every rank writes its own queue read by ``reader_rank``; returns this
        rank's queue and, on the reader, every rank's handle."""
        from fastmq import groups

        return groups.create_from_process_group_single_reader(
            MessageQueue, pg, max_chunk_bytes, max_chunks, reader_rank, blocking)


__all__ = ["MessageQueue", "Handle", "BufferHandle", "HandleMismatchError",
           "CorruptChunkError", "SegmentMismatchError", "LONG_WAIT_TIME_LOG_MSG"]
