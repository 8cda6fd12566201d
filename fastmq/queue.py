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
import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import zmq

from fastmq import _config, _curve, _net, _proc
from fastmq._ring import OVERFLOW, WAIT_ZMQ, CorruptChunkError, SegmentMismatchError
from fastmq._serde import Encoder, decode
from fastmq import segments
from fastmq import cleanup  # dead peers
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

# Called (no arguments) after each queue end is created or attached in this
# process.  fastmq.vllm sets it while active, so that a vLLM worker started
# with fork -- which inherits the swapped classes but runs no plugin and no
# import -- still logs that fastmq is active.
on_queue_created = None


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
    # fastmq only: (server public, client public, client secret) z85 keys
    # when the remote path uses CURVE (see fastmq._curve); kept out of repr
    # so that logging the handle does not print the secret.
    remote_curve_keys: tuple[bytes, bytes, bytes] | None = field(default=None, repr=False)


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
        # Weak: the ring owns its hooks, and a strong back-reference would
        # make a cycle that keeps the segment mapped until a GC pass.
        self._ring_ref = weakref.ref(ring)
        self._notify = notify_socket
        self._poller = poller
        self._cancel_recv = cancel_recv
        self._next_peer_check = 0.0

    @property
    def _ring(self):
        return self._ring_ref()

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
        ring = self._ring
        if not writer and ring.writer_closed and not ring.ready(idx, False):
            # One acquire load: checked on every slice, not throttled.
            raise RuntimeError(self.writer_gone())
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
            gone = self.writer_gone()
            # Re-check the chunk after seeing the writer gone (the state is
            # loaded first): a message it published just before closing or
            # dying is still delivered.
            if gone is not None and not ring.ready(idx, False):
                raise RuntimeError(gone)

    def writer_gone(self) -> str | None:
        """Why no more messages will come (writer closed or dead), or None."""
        ring = self._ring
        if ring.writer_closed:
            return (f"fastmq: the writer (pid {ring.writer_pid}) shut the queue down"
                    + segments.dead_peers_note())  # dead peers: name the process that died
        if not self.writer_alive():
            cleanup.remove_dead_writer(ring)  # dead peers: its files go with it
            return (f"fastmq: the writer (pid {ring.writer_pid}) died; no more "
                    "messages will come")
        return None

    def writer_alive(self) -> bool:
        return _proc.is_alive(self._ring.writer_pid, self._ring.writer_start)


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
    writer's wait mode and spin budget.  ``remote_curve`` (default
    ``FASTMQ_CURVE`` or off) encrypts and authenticates the remote TCP path
    with ZMQ CURVE; the keys travel in the handle (see ``fastmq._curve``).
    ``enable_shm_tensor_arena`` defaults to ``None``: the tensor arena is on
    for local-only queues unless ``FASTMQ_ARENA=0``; ``arena_slots``,
    ``arena_slot_mb``, ``arena_min_mb``, ``arena_prefault`` and
    ``arena_copy_threads`` size it (see ``fastmq.arena``).
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
        remote_curve: bool | None = None,
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
        self._notify_socket = None
        self.buffer = None
        self.local_socket = None
        self.remote_socket = None
        local_subscribe_addr = local_notify_addr = remote_subscribe_addr = None
        remote_addr_ipv6 = False
        curve = None
        try:
            if n_local_reader > 0:
                self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks,
                                            wait_mode=wait_mode, spin_us=spin_us)
                self._ring = ring = self.buffer.ring
                ring.warn_interval = _config.warning_interval()
                self.local_socket = context.socket(zmq.XPUB)
                sockets.append(self.local_socket)
                self.local_socket.setsockopt(zmq.XPUB_VERBOSE, True)
                local_subscribe_addr, path = _net.bind_ipc(self.local_socket)
                paths.append(path)
                notify = None
                if ring.wait_mode == WAIT_ZMQ:
                    # XPUB, not PUB: wait_until_ready() waits for every
                    # reader's subscription here too, since a notify sent
                    # before it arrives would be dropped (a lost wakeup).
                    notify = context.socket(zmq.XPUB)
                    notify.setsockopt(zmq.XPUB_VERBOSE, True)
                    sockets.append(notify)
                    # Default high-water mark on purpose: with SNDHWM=1 a
                    # notify sent before the socket has processed the previous
                    # one's delivery is dropped silently -- a lost wakeup.  We
                    # only notify while a reader is parked, so the pipe stays
                    # short anyway.
                    local_notify_addr, path = _net.bind_ipc(notify)
                    paths.append(path)
                ring.hooks = _RingHooks(ring, notify_socket=notify)
                self._notify_socket = notify
                self.tensor_arena = self._make_arena(enable_shm_tensor_arena, arena_options)
            elif arena_options:
                raise TypeError(f"unexpected arguments {sorted(arena_options)}")
            if n_remote_reader > 0:
                if not connect_ip:
                    connect_ip = _net.local_ip()
                self.remote_socket = context.socket(zmq.XPUB)
                sockets.append(self.remote_socket)
                self.remote_socket.setsockopt(zmq.XPUB_VERBOSE, True)
                if _curve.wanted(remote_curve):
                    curve = _curve.CurveServer(context)
                    sockets.append(curve)  # stopped with the sockets, before term()
                    curve.secure(self.remote_socket)
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
            remote_curve_keys=tuple(curve.keys) if curve is not None else None,
        )
        self._finalizer = weakref.finalize(self, _close_zmq, context, sockets, paths)
        self._finalizer.atexit = False
        segments.remove_at_exit(paths)
        logger.debug("fastmq message queue handle: %s", self.handle)
        if on_queue_created is not None:
            on_queue_created()

    def _make_arena(self, enable: bool | None, options: dict):
        """The writer's tensor arena (see fastmq.arena), or None: off, or
        some reader is remote.  ``options`` are the ``arena_*`` keywords."""
        from fastmq import arena

        return arena.create_for_queue(enable, options, self.n_local_reader,
                                      self.n_remote_reader)

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
                keys = getattr(handle, "remote_curve_keys", None)
                if keys is not None:
                    _curve.secure_client(self.remote_socket, keys)
                self.remote_socket.connect(handle.remote_subscribe_addr)
        except BaseException:
            _close_zmq(context, sockets, [])
            if self.buffer is not None:
                self.buffer.close()
            raise
        self._finalizer = weakref.finalize(self, _close_zmq, context, sockets, [])
        self._finalizer.atexit = False
        if on_queue_created is not None:
            on_queue_created()
        return self

    def _attach_arena(self, handle: Handle):
        """This local reader's end of the writer's arena.  A failure to
        attach does not fail the queue: only a message that uses the arena
        raises, with the reason (as in vLLM)."""
        from fastmq import arena

        end = arena.attach_for_queue(handle, self.local_reader_rank)
        if end is not None:
            self._ring.oob_hook = end.map_oob
        return end

    def wait_until_ready(self) -> None:
        """Collective: the writer and every reader call it (any order).

        The writer waits for every reader's subscription, then sends READY
        on each channel so that no later message can be missed."""
        if self._is_writer:
            for _ in range(self.n_local_reader):
                self.local_socket.recv()
            if self._notify_socket is not None:
                for _ in range(self.n_local_reader):
                    self._notify_socket.recv()
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
            if self._is_writer:
                # Before the wake, so that woken readers see it.
                ring.mark_closed()
            else:
                cleanup.remove_dead_writer(ring)  # dead peers: a killed writer's files
            ring.cancel()
            if not self._is_writer and ring.wait_mode == WAIT_ZMQ:
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
        arena = self.tensor_arena
        ring = self._ring
        published = ring.n_published if ring is not None else 0
        try:
            buffers = self._encoder.encode(obj)
            stats = self._stats
            if self.n_local_reader > 0:
                framed = self._ring.send(buffers, timeout)
                if framed:
                    stats.ring_messages += 1
                    stats.ring_bytes += framed
                else:
                    # Order the message in the ring, then publish it on the socket.
                    # copy=True: for any buffer that is not a zmq.Frame, pyzmq
                    # memcpys it into a new zmq message inside send() (its
                    # copy_threshold only matters with copy=False, where large
                    # buffers would stay shared until the IO thread sends them),
                    # so mutating a tensor after enqueue returns cannot change
                    # what is read.  Same for the remote socket below.
                    self._ring.send_overflow_mark(timeout)
                    self.local_socket.send_multipart(buffers, copy=True)
                    stats.overflow_messages += 1
                    stats.overflow_bytes += sum(memoryview(b).nbytes for b in buffers)
            if self.n_remote_reader > 0:
                self.remote_socket.send_multipart(buffers, copy=True)
                stats.remote_messages += 1
                stats.remote_bytes += sum(memoryview(b).nbytes for b in buffers)
        except BaseException:
            if arena is not None:
                if ring is not None and ring.n_published != published:
                    # The chunk naming these slots is out (the error came
                    # after it, e.g. on the overflow socket): readers own
                    # the slots now and release them.
                    arena.commit()
                else:
                    # Never published to a reader: the slots are free again.
                    arena.abort()
            raise
        if arena is not None:
            arena.commit()

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Receive the next object.  ``TimeoutError`` after ``timeout``
        seconds; ``RuntimeError("cancelled")`` after ``shutdown()``."""
        if self._is_local_reader:
            arena = self.tensor_arena
            if arena is not None:
                # Hand back arena slots whose last view died (CUDA-event
                # gated where this process pinned the arena).
                arena.flush_releases()
            obj = self._ring.recv(timeout, indefinite)
            if obj is OVERFLOW:
                obj = self._recv_socket(self.local_socket, timeout)
            return obj
        if self._is_remote_reader:
            return self._recv_socket(self.remote_socket, timeout)
        raise RuntimeError("Only readers can dequeue")

    def _recv_socket(self, sock, timeout: float | None) -> Any:
        deadline = (None if timeout is None or not math.isfinite(timeout)
                    else time.monotonic() + max(timeout, 0.0))
        writer_dead = False
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
            if self._ring is not None:
                # A local reader saw an overflow mark; if the writer died
                # before its payload left, it never comes.  Frames already
                # in flight get one more slice.
                if writer_dead:
                    raise RuntimeError(self._ring.hooks.writer_gone() or "fastmq: writer died")
                writer_dead = not self._ring.hooks.writer_alive()
        main, *oob = sock.recv_multipart(copy=False)
        if oob and self.tensor_arena is not None:
            oob = self.tensor_arena.map_oob(oob)
        return decode(main, oob)

    def empty_tensor(self, shape, dtype=None):
        """An uninitialised CPU tensor for the writer to fill and enqueue.

        With a tensor arena and a free slot that fits, it lies inside that
        slot, so enqueueing it copies nothing (the readers view the same
        memory: do not modify it after enqueueing until they are done with
        it); otherwise it is an ordinary ``torch.empty`` tensor."""
        arena = self.tensor_arena
        if self._is_writer and arena is not None:
            t = arena.empty_tensor(shape, dtype)
            if t is not None:
                return t
        import torch

        return torch.empty(shape, dtype=dtype)

    def broadcast_object(self, obj: Any = None) -> Any:
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def stats(self) -> dict:
        """Counters of this end: messages and bytes sent per path (ring,
        overflow socket, remote socket), wake syscalls issued, and the
        tensor arena's hits and fallbacks."""
        out = self._stats.as_dict()
        # Futex/ZMQ wakes this end issued: zero while nobody ever parked.
        out["wakeups"] = self._ring.wakeups if self._ring is not None else 0
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
