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
import operator
import os
import struct
import threading
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
from fastmq import cleanup
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
_FLUSH_SLICE_S = 0.05  # flush waits re-check shutdown and peers at this period

# Socket messages (local overflow payloads and every remote message) are
#   [header][pickle stream][out-of-band buffer ...][flush pad, if needed]
# header = (message id, number of payload frames).  Local overflow ids
# count send attempts, so a payload the writer abandoned (its mark never
# published) is recognised and skipped; remote ids count committed
# messages, so a remote reader sees any gap.
_HEADER = struct.Struct("<QI")

# enqueue() returns only once the message has left this process: in the
# kernel's socket buffers or the reader's process, both of which outlive a
# killed writer.  libzmq says so through a MessageTracker on the last frame,
# read with its engine's order in mind: the engine encodes frames into
# batches of out_batch_size (8 KiB) and takes the next frame from the pipe
# only while the batch it is filling has room.  So every message ends with
#   [fill: more than one batch][mark: tracked]
# The fill completes the batch that holds the message's last bytes; the
# mark is taken from the pipe, and released (tracker done), only after that
# batch was written -- also with CURVE, where a frame is released as soon as
# it is encrypted.  Frames below _FLUSH_MARK are copied by pyzmq (cheap, and
# immune to later mutation); larger ones are sent zero-copy, and released in
# order before the mark, so no caller buffer is referenced once enqueue()
# returns either.
_FLUSH_FILL = bytes(9 * 1024)
_FLUSH_MARK_BYTES = 1024
_FLUSH_MARK = bytes(_FLUSH_MARK_BYTES)

# Queues alive in this process, so that a forked child can disown them.
_live_queues: "weakref.WeakSet[MessageQueue]" = weakref.WeakSet()


def _disown_after_fork() -> None:
    parent = os.getppid()
    for q in list(_live_queues):
        q._forked_from = parent


os.register_at_fork(after_in_child=_disown_after_fork)


def _tune_data_socket(sock, *, xpub: bool) -> None:
    """Options every socket that carries messages gets.

    No high-water mark: the ring bounds what a local reader can have
    outstanding, and the flush wait in enqueue() bounds the remote path to
    one message in flight, so a limit could only ever drop (XPUB) a message
    whose enqueue() had returned.  NODROP makes any limit block instead."""
    if xpub:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.copy_threshold = _FLUSH_MARK_BYTES
    else:
        sock.setsockopt(zmq.RCVHWM, 0)


def _send_frames(sock, msg_id: int, buffers: list):
    """Queue one socket message; return the tracker of its last frame."""
    frames = [_HEADER.pack(msg_id, len(buffers)), *buffers, _FLUSH_FILL, _FLUSH_MARK]
    return sock.send_multipart(frames, copy=False, track=True)


def _split_frames(frames: list, where: str) -> tuple[int, list]:
    """(message id, payload frames) of a received socket message."""
    head = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
    if len(head) != _HEADER.size:
        raise CorruptChunkError(f"fastmq: {where}: a socket message has a "
                                f"{len(head)}-byte header, expected {_HEADER.size}")
    msg_id, n = _HEADER.unpack(head)
    if not 1 <= n <= len(frames) - 1:
        raise CorruptChunkError(f"fastmq: {where}: message {msg_id} names {n} payload "
                                f"frames but carries {len(frames) - 1}")
    return msg_id, frames[1:1 + n]

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
    # fastmq only: how many readers in all, so that a bad rank is refused.
    n_reader: int | None = None


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
        self._notify_failed = False

    @property
    def _ring(self):
        return self._ring_ref()

    def park_zmq(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout=timeout_ms))
        if self._notify in events:
            self._notify.recv(zmq.NOBLOCK, copy=False)

    def notify_zmq(self) -> None:
        try:
            self._notify.send(b"\x00")
        except Exception as e:
            # The ring counts it (stats()["notify_errors"]); a reader parked
            # meanwhile re-checks within its park slice.  Logged once: it
            # would otherwise repeat on every message.
            if not self._notify_failed:
                self._notify_failed = True
                logger.warning("fastmq: a ZMQ wakeup notify failed (%s); parked readers "
                               "now wake only on their %.0f ms re-check", repr(e),
                               self._ring.park_slice_ns / 1e6)
            raise

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
                    + segments.dead_peers_note())
        if not self.writer_alive():
            cleanup.remove_dead_writer(ring)   # its files go with it
            return (f"fastmq: the writer (pid {ring.writer_pid}) died; no more "
                    "messages will come")
        return None

    def writer_alive(self) -> bool:
        return _proc.is_alive(self._ring.writer_pid, self._ring.writer_start)


def _deadline(timeout: float | None) -> float | None:
    if timeout is None or not math.isfinite(timeout):
        return None
    return time.monotonic() + max(timeout, 0.0)


def _nbytes(buffers: list) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


def _check_rank(handle: Handle, rank) -> int:
    """``rank`` as an int if ``handle`` has a reader of that rank, else
    ``ValueError`` naming the valid ranks."""
    local = list(handle.local_reader_ranks)
    remote = handle.remote_subscribe_addr is not None
    if remote:
        n = handle.n_reader
        # Remote readers are the ranks not listed as local; with the writer
        # in the same group, ranks run up to n_reader.
        valid = (f"local reader ranks {local}, or a remote reader rank in 0..{n} "
                 "not listed there" if n is not None else
                 f"local reader ranks {local}, or a remote reader rank >= 0")
    else:
        valid = f"the local reader ranks {local}"
    if isinstance(rank, bool) or not hasattr(type(rank), "__index__"):
        raise ValueError(f"fastmq: reader rank {rank!r} is not an integer; this queue "
                         f"has {valid}")
    rank = operator.index(rank)
    ok = rank in local or (remote and rank >= 0 and
                           (handle.n_reader is None or rank <= handle.n_reader))
    if not ok:
        raise ValueError(f"fastmq: reader rank {rank} is not a reader of this queue: "
                         f"it has {valid}")
    return rank


def _close_zmq(context, sockets, paths) -> None:
    # Not run at interpreter exit (pyzmq's term() can hang there when the
    # context and its sockets are collected together); segments.remove_at_exit
    # still removes the ipc files then.
    # linger=0 loses nothing: enqueue() returned only after its message
    # left the process (see _FLUSH_FILL).  Teardown errors cannot be acted
    # on, but are logged rather than silently dropped.
    for s in sockets:
        try:
            s.close(linger=0)
        except Exception as e:
            logger.debug("fastmq: closing a queue socket failed: %r", e)
    try:
        context.term()
    except Exception as e:
        logger.debug("fastmq: terminating a queue's ZMQ context failed: %r", e)
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
    ``FASTMQ_CURVE`` or on) encrypts and authenticates the remote TCP path
    with ZMQ CURVE; the keys travel in the handle (see ``fastmq._curve``).
    ``enable_shm_tensor_arena`` defaults to ``None``: the tensor arena is on
    for local-only queues unless ``FASTMQ_ARENA=0``; ``arena_slots``,
    ``arena_slot_mb``, ``arena_min_mb``, ``arena_prefault`` and
    ``arena_copy_threads`` size it, and ``arena_readers`` (``"isolated"``,
    the default, or ``"shared"``) says whether readers get copy-on-write
    views of a slot or share its writable memory (see ``fastmq.arena``).
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
        self._init_ends()
        # Held by enqueue() and by shutdown() around closing the ring, so a
        # shutdown on another thread cannot close the queue between an
        # enqueue's last check and its publish (readers would then see
        # "closed" and stop before a message whose enqueue() returned).
        # Re-entrant: a signal handler may call shutdown() mid-enqueue.
        self._send_lock = threading.RLock()
        self._overflow_id = 0       # last local overflow send attempt
        self._remote_seq = 0        # last message committed to remote readers
        self._remote_pending = None  # tracker of a remote message not yet flushed
        self._remote_broken = None  # why remote readers can no longer be served
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
                _tune_data_socket(self.local_socket, xpub=True)
                local_subscribe_addr, path = _net.bind_ipc(self.local_socket)
                paths.append(path)
                segments.remove_at_exit([path])
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
                    segments.remove_at_exit([path])
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
                # VERBOSER: every (un)subscription reaches us, so enqueue()
                # sees a remote reader that disconnected (and would miss
                # messages) instead of sending into the void.
                self.remote_socket.setsockopt(zmq.XPUB_VERBOSER, True)
                _tune_data_socket(self.remote_socket, xpub=True)
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
            n_reader=n_reader,
        )
        self._finalizer = weakref.finalize(self, _close_zmq, context, sockets, paths)
        self._finalizer.atexit = False
        _live_queues.add(self)
        logger.debug("fastmq message queue handle: %s", self.handle)
        if on_queue_created is not None:
            on_queue_created()

    def _make_arena(self, enable: bool | None, options: dict):
        """The writer's tensor arena (see fastmq.arena), or None: off, or
        some reader is remote.  ``options`` are the ``arena_*`` keywords."""
        from fastmq import arena

        return arena.create_for_queue(enable, options, self.n_local_reader,
                                      self.n_remote_reader)

    def _init_ends(self) -> None:
        # Set by the fork hook in a child that inherited this queue: its
        # ring position and sockets are the parent's, so any use would lose
        # or duplicate messages.
        self._forked_from = None
        self._pid = os.getpid()

    def _forked(self) -> RuntimeError:
        return RuntimeError(
            f"fastmq: this MessageQueue was created in process {self._forked_from} and "
            f"inherited by fork into process {os.getpid()}; a queue end cannot be used "
            "from a forked child (parent and child would each consume or publish part "
            "of the stream). Create or attach the queue in the child instead.")

    # -- attach ------------------------------------------------------------
    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> "MessageQueue":
        """Attach as reader ``rank`` (a local reader when ``rank`` is in
        ``handle.local_reader_ranks``, otherwise a remote one)."""
        rank = _check_rank(handle, rank)
        self = MessageQueue.__new__(MessageQueue)
        self._init_ends()
        self.handle = handle
        self._is_writer = False
        self._remote_seq = 0
        self._overflow_seen = 0      # id of the last overflow payload received
        self._overflow_ahead = None  # a payload received before its mark
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
                holder = ring.claim_reader(*_proc.me(), _proc.is_alive)
                if holder:
                    raise RuntimeError(
                        f"fastmq: local reader rank {rank} of this queue is already "
                        f"attached by process {holder}, which is alive; each rank is "
                        "attached by one process")
                self.local_socket = context.socket(zmq.SUB)
                sockets.append(self.local_socket)
                _tune_data_socket(self.local_socket, xpub=False)
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
        _live_queues.add(self)
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
            frames = sock.recv_multipart()
            if frames != [b"READY"]:
                what = f"{len(frames)} frames"
                if len(frames) >= 2 and len(frames[0]) == _HEADER.size:
                    what = f"message {_HEADER.unpack(frames[0])[0]}"
                raise RuntimeError(
                    f"fastmq: this reader connected after the writer's handshake: it "
                    f"received {what} of a running queue instead of READY. A reader "
                    "cannot join (or, after a disconnect, rejoin) a queue once the "
                    "writer's wait_until_ready() has returned; create a new queue.")

    def shutdown(self) -> None:
        """Wake a reader (or writer) blocked in this queue: it raises
        ``RuntimeError("cancelled")``.  Safe from another thread.

        On the writer, an ``enqueue()`` running on another thread either
        completes (and its message is delivered before readers see the
        queue closed) or raises; it never returns for a message that
        readers then miss."""
        self.shutting_down = True
        ring = self._ring
        if ring is not None:
            # Wake first: an enqueue() blocked on a full ring or a flush
            # raises "cancelled" and lets go of the send lock.
            ring.cancel()
            if self._is_writer:
                with self._send_lock:
                    ring.mark_closed()
                # Wake parked readers again, now that they can see "closed".
                ring.cancel()
                return
            # A reader whose writer was killed removes the files that the
            # writer could not (vLLM's queue gets this from the resource
            # tracker).
            cleanup.remove_dead_writer(ring)
            if ring.wait_mode == WAIT_ZMQ:
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
        """Broadcast ``obj`` to every reader.

        When it returns, every reader will receive ``obj``, in order, once,
        even if this process then exits, is killed or calls ``shutdown()``.
        When it raises (``TimeoutError`` after ``timeout`` seconds waiting
        for slow readers, ``RuntimeError`` on shutdown or a dead peer, an
        unpicklable object, ``ShmFullError``), no reader receives ``obj``
        (one exception: see the README on remote readers and timeouts)."""
        if not self._is_writer:
            raise RuntimeError("Only writers can enqueue")
        if self._forked_from is not None:
            raise self._forked()
        with self._send_lock:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            arena = self.tensor_arena
            ring = self._ring
            published = ring.n_published if ring is not None else 0
            stats = self._stats
            remote = None
            try:
                buffers = self._encoder.encode(obj)
                if self.n_remote_reader == 0:
                    framed = ring.send(buffers, timeout)
                    if framed:
                        stats.ring_messages += 1
                        stats.ring_bytes += framed
                    else:
                        self._send_overflow(buffers, _deadline(timeout), timeout)
                else:
                    remote = self._send_with_remote(buffers, _deadline(timeout), timeout)
            except BaseException:
                if arena is not None:
                    if ring is not None and ring.n_published != published:
                        # The chunk naming these slots is out: readers own
                        # the slots now and release them.
                        arena.commit()
                    else:
                        # Never published to a reader: the slots are free again.
                        arena.abort()
                raise
            if arena is not None:
                arena.commit()
            if remote is not None:
                self._flush_remote(remote, _deadline(timeout))

    def _send_overflow(self, buffers: list, deadline: float | None,
                       timeout: float | None) -> None:
        """A message too big for a chunk: payload on the socket, then a mark
        in the ring.  The mark is published only once the payload has left
        this process, so a reader that sees it always gets the payload, and
        a send abandoned before (timeout, shutdown, dead reader) is skipped
        by readers by its id."""
        ring = self._ring
        ring.wait_writable(timeout)
        self._overflow_id += 1
        tracker = _send_frames(self.local_socket, self._overflow_id, buffers)
        self._wait_flushed(tracker, deadline, "a local reader's socket")
        ring.send_overflow_mark(self._overflow_id, 0)
        self._stats.overflow_messages += 1
        self._stats.overflow_bytes += _nbytes(buffers)

    def _send_with_remote(self, buffers: list, deadline: float | None,
                          timeout: float | None):
        """Everything that can fail or time out happens before the remote
        send; the remote send is the commit point, and the ring publish
        after it cannot fail.  Returns the remote message's tracker."""
        ring = self._ring
        if ring is not None:
            ring.wait_writable(timeout)
        self._check_remote_readers()
        if self._remote_pending is not None:
            # Backpressure: the previous remote message must have left.
            self._wait_flushed(self._remote_pending, deadline, "the remote readers' socket")
            self._remote_pending = None
        overflow = False
        if ring is not None:
            framed = ring.framed_size(buffers)
            overflow = framed > ring.max_chunk_bytes
            # /dev/shm too must fail here, not after the commit point.
            ring.reserve_next(framed)
        if overflow:
            self._overflow_id += 1
            tracker = _send_frames(self.local_socket, self._overflow_id, buffers)
            self._wait_flushed(tracker, deadline, "a local reader's socket")
        self._remote_seq += 1
        tracker = _send_frames(self.remote_socket, self._remote_seq, buffers)
        stats = self._stats
        nbytes = _nbytes(buffers)
        stats.remote_messages += 1
        stats.remote_bytes += nbytes
        if ring is not None:
            if overflow:
                ring.send_overflow_mark(self._overflow_id, 0)
                stats.overflow_messages += 1
                stats.overflow_bytes += nbytes
            else:
                stats.ring_bytes += ring.send(buffers, 0)
                stats.ring_messages += 1
        return tracker

    def _flush_remote(self, tracker, deadline: float | None) -> None:
        """Wait until the committed remote message has left this process.
        Past the deadline (or on shutdown) it stays queued and the next
        enqueue() waits for it first."""
        self._remote_pending = tracker
        try:
            self._wait_flushed(tracker, deadline, "the remote readers' socket")
        except (TimeoutError, RuntimeError):
            return
        self._remote_pending = None

    def _wait_flushed(self, tracker, deadline: float | None, where: str) -> None:
        if tracker.done:
            return
        next_check = time.monotonic() + 0.2
        while True:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            wait = _FLUSH_SLICE_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"fastmq: a reader did not take the message from "
                                       f"{where} in time")
                wait = min(wait, left)
            try:
                tracker.wait(wait)
                return
            except zmq.NotDone:
                pass
            if self._ring is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.2
                self._check_local_readers_alive()

    def _check_local_readers_alive(self) -> None:
        ring = self._ring
        for r in range(ring.n_reader):
            pid, started = ring.reader_identity(r)
            if pid and not _proc.is_alive(pid, started):
                raise RuntimeError(f"fastmq: reader rank {r} (pid {pid}) died; the "
                                   "writer cannot deliver to it")

    def _check_remote_readers(self) -> None:
        """Raise if a remote reader disconnected since the handshake: the
        messages it missed cannot be replayed, so sending on would drop
        them for it silently."""
        sock = self.remote_socket
        while self._remote_broken is None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = sock.recv(zmq.NOBLOCK)
            if event[:1] == b"\x00":
                self._remote_broken = (
                    "a remote reader disconnected from the writer after the handshake; "
                    "messages sent since would not reach it, and a remote reader "
                    "cannot rejoin a running queue")
            elif event[:1] == b"\x01":
                logger.warning("fastmq: a remote client subscribed to the queue after the "
                               "handshake; it is not one of the queue's readers")
        if self._remote_broken is not None:
            raise RuntimeError(f"fastmq: {self._remote_broken}")

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Receive the next object.  ``TimeoutError`` after ``timeout``
        seconds (nothing was consumed: the next call returns that same
        message); ``RuntimeError("cancelled")`` after ``shutdown()``."""
        if self._forked_from is not None:
            raise self._forked()
        if self._is_local_reader:
            arena = self.tensor_arena
            if arena is not None:
                # Hand back arena slots whose last view died (CUDA-event
                # gated where this process pinned the arena).
                arena.flush_releases()
            obj = self._ring.recv(timeout, indefinite)
            if obj is OVERFLOW:
                # The payload left the writer before the mark was published:
                # it is here or nearly, so it gets its own (full) timeout
                # rather than a clock read on every dequeue().
                obj = self._recv_overflow(_deadline(timeout))
            return obj
        if self._is_remote_reader:
            frames = self._recv_frames(self.remote_socket, _deadline(timeout))
            msg_id, payload = _split_frames(frames, "remote reader")
            want = self._remote_seq + 1
            if msg_id != want:
                raise RuntimeError(
                    f"fastmq: this remote reader expected message {want} but received "
                    f"{msg_id}: it lost messages while disconnected from the writer, and "
                    "a remote reader cannot rejoin a running queue")
            self._remote_seq = msg_id
            return self._decode_frames(payload)
        raise RuntimeError("Only readers can dequeue")

    def _recv_overflow(self, deadline: float | None) -> Any:
        """The payload of the overflow mark the ring just returned.  The
        mark's chunk is released only once its payload is here, so a
        timeout leaves both where they were."""
        ring = self._ring
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
                frames = self._recv_frames(self.local_socket, deadline)
                msg_id, payload = _split_frames(frames, "local reader")
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
        return self._decode_frames(payload)

    def _decode_frames(self, payload: list) -> Any:
        main, *oob = payload
        if oob and self.tensor_arena is not None:
            oob = self.tensor_arena.map_oob(oob)
        return decode(main, oob)

    def _recv_frames(self, sock, deadline: float | None) -> list:
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
                # A local reader saw an overflow mark, whose payload left the
                # writer before the mark was published; if the writer is
                # gone, frames still in flight get one more slice.
                if writer_dead:
                    raise RuntimeError(self._ring.hooks.writer_gone() or "fastmq: writer died")
                writer_dead = not self._ring.hooks.writer_alive()
        return sock.recv_multipart(copy=False)

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
        # ZMQ wakeup notifies that failed (logged once; see _RingHooks).
        out["notify_errors"] = self._ring.notify_errors if self._ring is not None else 0
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
