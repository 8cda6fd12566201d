"""``MessageQueue``: vLLM's broadcast-queue surface (same names, same
signatures, same errors) over one of three ends:

* ``fastmq._writer.QueueWriter`` -- the queue's creator;
* ``fastmq._reader.LocalReader`` -- a reader on the writer's node (ring);
* ``fastmq._reader.RemoteReader`` -- a reader on another node (TCP).

The façade owns what every end shares: its lifetime (the ZMQ context and
sockets are closed when the queue is collected) and the fork guard.  The
layers below never call up into it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

from fastmq import _config, _overflow
from fastmq._config import LONG_WAIT_TIME_LOG_MSG
from fastmq._gone import ReaderGoneError, WriterGoneError
from fastmq._reader import LocalReader, RemoteReader
from fastmq._ring import CorruptChunkError, SegmentMismatchError
from fastmq._writer import QueueWriter
from fastmq.handle import BufferHandle, Handle, HandleMismatchError, check_rank

logger = logging.getLogger("fastmq")

# Queues alive in this process, so that a forked child can disown them.
_live_queues: "weakref.WeakSet[MessageQueue]" = weakref.WeakSet()


def _nan_timeout(timeout) -> ValueError:
    # NaN: no deadline comparison is ever true of it, so the call would
    # never time out.  (Checked inline by the callers: a message's calls
    # stay the facade's and the role's.)
    return ValueError(f"fastmq: timeout={timeout!r} is not a number of seconds")


def _disown_after_fork() -> None:
    parent = os.getppid()
    for q in list(_live_queues):
        q._forked_from = parent
        end = getattr(q, "_end", None)
        if end is not None:
            try:
                end.disown()
            except Exception as e:    # at fork: never raise into the child's start
                logger.debug("fastmq: a forked child could not let go of a queue's "
                             "descriptors: %r", e)


os.register_at_fork(after_in_child=_disown_after_fork)

# Called (no arguments) after each queue end is created or attached in this
# process; see add_creation_hook.
_creation_hooks: list = []


def add_creation_hook(hook) -> None:
    """Call ``hook()`` after each queue is created or attached in this
    process, until ``remove_creation_hook(hook)``; once per hook however
    often it is added.  ``fastmq.vllm`` registers one while it is active,
    so that a vLLM worker started with fork (which inherits the swapped
    classes but runs no plugin and no import) still logs that fastmq is
    active."""
    if hook not in _creation_hooks:
        _creation_hooks.append(hook)


def remove_creation_hook(hook) -> None:
    """Stop calling ``hook`` (see ``add_creation_hook``); no error if it
    was not registered."""
    if hook in _creation_hooks:
        _creation_hooks.remove(hook)


# Asked for arena option defaults before a writer with local readers builds
# its arena; see add_arena_defaults_hook.
_arena_defaults_hooks: list = []


def add_arena_defaults_hook(hook) -> None:
    """Call ``hook(enable_shm_tensor_arena)`` when a queue with local
    readers is created in this process, until ``remove_arena_defaults_hook``;
    the dict it returns gives defaults for the arena keywords
    (``arena_readers=`` ...) that the constructor was not given.
    ``fastmq.vllm`` registers one while it is active: vLLM's arena
    semantics for the queue vLLM asks an arena of, on a CUDA platform."""
    if hook not in _arena_defaults_hooks:
        _arena_defaults_hooks.append(hook)


def remove_arena_defaults_hook(hook) -> None:
    """Stop calling ``hook`` (see ``add_arena_defaults_hook``)."""
    if hook in _arena_defaults_hooks:
        _arena_defaults_hooks.remove(hook)


# Told when a remote reader's writer is gone; see add_writer_gone_hook.
_writer_gone_hooks: list = []


def add_writer_gone_hook(hook) -> None:
    """Call ``hook(error, queue)`` when the writer of ``queue``, a remote
    reader, is gone (it shut the queue down, or its connection was cut),
    once per queue, before ``dequeue`` raises ``error``; until
    ``remove_writer_gone_hook``.  When the writer's node went silent the
    call may come first from fastmq's heartbeat thread, while no
    ``dequeue`` waits (the process may be busy elsewhere, never to come
    back to it).  A hook that returns a number of seconds makes a
    ``dequeue`` that finds the writer gone first wait for ``shutdown()``
    until so long after the call (at most its own timeout); ``shutdown()``
    then raises ``RuntimeError("cancelled")`` as any shutdown does.
    ``fastmq.vllm`` registers one: a vLLM node whose engine is elsewhere
    ends through vLLM's own shutdown."""
    if hook not in _writer_gone_hooks:
        _writer_gone_hooks.append(hook)


def remove_writer_gone_hook(hook) -> None:
    """Stop calling ``hook`` (see ``add_writer_gone_hook``)."""
    if hook in _writer_gone_hooks:
        _writer_gone_hooks.remove(hook)


def _tell_in_background(queue_ref, error: WriterGoneError) -> None:
    # (The heartbeat thread: nothing may escape into it.)
    queue = queue_ref()
    if queue is None:
        return
    try:
        queue._tell_writer_gone(error)
    except Exception:
        logger.exception("fastmq: a writer-gone hook failed")


def _arena_options(enable: Any, n_local_reader: Any, options: dict) -> dict:
    if not _arena_defaults_hooks or not isinstance(n_local_reader, int) or n_local_reader <= 0:
        return options
    out: dict = {}
    for hook in list(_arena_defaults_hooks):
        out.update(hook(enable))
    for key, value in options.items():
        # A keyword given wins; None means not given, as in fastmq.arena.
        if value is not None or key not in out:
            out[key] = value
    return out


class MessageQueue:
    """One writer to ``n_reader`` readers, ``n_local_reader`` of them on this
    node (shared memory), the rest remote (TCP).  Same constructor, methods
    and errors as vLLM's ``MessageQueue``; the keyword-only arguments are
    fastmq's own.

    Parameters:
        n_reader: how many readers, local and remote.
        n_local_reader: how many of them are on this node (they read the
            shared-memory ring; the others connect over TCP).
        local_reader_ranks: the local readers' ranks (default
            ``range(n_local_reader)``).
        max_chunk_bytes: the size of a ring chunk (default 24 MiB; a
            larger message goes over a socket).  ``FASTMQ_MAX_CHUNK_MB``
            overrides it.
        max_chunks: how many chunks the ring has (default 10).
            ``FASTMQ_MAX_CHUNKS`` overrides it.
        connect_ip: the address remote readers connect to (default: this
            node's).
        enable_shm_tensor_arena: the tensor arena, which copies a large
            buffer once for every local reader.  ``None`` (the default):
            on unless ``FASTMQ_ARENA=0``.
        wait_mode: how readers wait, ``"futex"``, ``"zmq"`` or ``"spin"``
            (default ``FASTMQ_WAIT``, else futex).  Readers adopt the
            writer's.
        spin_us: how long a reader spins before it parks (default
            ``FASTMQ_SPIN_US``, else 2000).  Readers adopt the writer's.
        remote_security: the remote path's protection (default
            ``FASTMQ_REMOTE_SECURITY``, else ``"mac"``): ``"mac"``
            authenticates the writer, the readers and every message,
            ``"encrypt"`` encrypts them too, ``"none"`` is plain TCP.  The
            readers' key comes from ``FASTMQ_SECRET`` /
            ``FASTMQ_SECRET_FILE`` when set, else it travels in the handle.
        **arena_options: the arena's sizing, ``arena_slots``,
            ``arena_slot_mb``, ``arena_min_mb``, ``arena_prefault``,
            ``arena_copy_threads``; and ``arena_readers``: ``"isolated"``
            (the default: readers get copy-on-write views of a slot) or
            ``"shared"`` (they share its writable memory).  See
            ``fastmq.arena``.

    Raises:
        ValueError: a count or an option out of range.
        ShmFullError: not enough memory for the ring (it is reserved
            when the queue is created).
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
        remote_security: str | None = None,
        **arena_options: Any,
    ):
        self._start(QueueWriter(
            n_reader, n_local_reader, local_reader_ranks, max_chunk_bytes, max_chunks,
            connect_ip, enable_shm_tensor_arena, wait_mode=wait_mode, spin_us=spin_us,
            remote_security=remote_security,
            arena_options=_arena_options(enable_shm_tensor_arena, n_local_reader,
                                         arena_options)))
        logger.debug("fastmq message queue handle: %s", self.handle)

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> "MessageQueue":
        """Attach as reader ``rank``: a local reader when ``rank`` is in
        ``handle.local_reader_ranks``, otherwise a remote one (any other
        integer, -1 included, as vLLM's executor attaches to its peers'
        response queues).  ``ValueError`` for a rank that is not an integer,
        or that is not local on a queue with no remote readers."""
        rank = check_rank(handle, rank)
        self = MessageQueue.__new__(MessageQueue)
        if rank in handle.local_reader_ranks:
            self._start(LocalReader(handle, rank))
        else:
            self._start(RemoteReader(handle, rank))
        return self

    def _start(self, end) -> None:
        self._end = end
        # Set by the fork hook in a child that inherited this queue: its
        # ring position and sockets are the parent's, so any use would lose
        # or duplicate messages.
        self._forked_from = None
        # The writer-gone hooks are told once, by a dequeue or by the
        # heartbeat thread, whichever finds it first; a dequeue waits for a
        # shutdown until _gone_grace_until (time.monotonic) as they asked.
        self._told_writer_gone = False
        self._gone_lock = threading.Lock()
        self._gone_grace_until = 0.0
        if isinstance(end, RemoteReader):
            this = weakref.ref(self)
            end.on_writer_silent(lambda e: _tell_in_background(this, e))
        self._finalizer = weakref.finalize(self, _overflow.close_all, *end.zmq)
        self._finalizer.atexit = False
        _live_queues.add(self)
        for hook in _creation_hooks:
            hook()

    def _forked(self) -> RuntimeError:
        return RuntimeError(
            f"fastmq: this MessageQueue was created in process {self._forked_from} and "
            f"inherited by fork into process {os.getpid()}; a queue end cannot be used "
            "from a forked child (parent and child would each consume or publish part "
            "of the stream). Create or attach the queue in the child instead.")

    # -- handshake and shutdown ------------------------------------------------
    def export_handle(self) -> Handle:
        return self._end.handle

    def wait_until_ready(self) -> None:
        """Collective: the writer and every reader call it (any order).

        The writer waits for every reader's subscription, then sends READY
        on each channel so that no later message can be missed."""
        if self._forked_from is not None:
            raise self._forked()
        self._end.wait_until_ready()

    def shutdown(self) -> None:
        """Wake a reader (or writer) blocked in this queue: it raises
        ``RuntimeError("cancelled")``.  Safe from another thread.

        On the writer, an ``enqueue()`` running on another thread either
        completes (and its message is delivered before readers see the
        queue closed) or raises; it never returns for a message that
        readers then miss."""
        if self._forked_from is not None:
            raise self._forked()
        self._end.shutdown()

    # -- messages ----------------------------------------------------------------
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to every reader.

        When it returns, every reader will receive ``obj``, in order, once,
        even if this process then exits, is killed or calls ``shutdown()``.
        When it raises (``TimeoutError`` after ``timeout`` seconds waiting
        for slow readers, ``RuntimeError`` on shutdown or a dead peer, an
        unpicklable object, ``ShmFullError``), no reader receives ``obj``
        (one exception: see the README on remote readers and timeouts)."""
        if self._forked_from is not None:
            raise self._forked()
        end = self._end
        if not end.is_writer:
            raise RuntimeError("Only writers can enqueue")
        if timeout is not None and timeout != timeout:
            raise _nan_timeout(timeout)
        end.enqueue(obj, timeout)

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Receive the next object.  ``TimeoutError`` after ``timeout``
        seconds (nothing was consumed: the next call returns that same
        message); ``RuntimeError("cancelled")`` after ``shutdown()``."""
        if self._forked_from is not None:
            raise self._forked()
        end = self._end
        if end.is_writer:
            raise RuntimeError("Only readers can dequeue")
        if timeout is not None and timeout != timeout:
            raise _nan_timeout(timeout)
        try:
            return end.dequeue(timeout, indefinite)
        except WriterGoneError as e:
            self._writer_gone(e, timeout)

    def _tell_writer_gone(self, error: WriterGoneError) -> None:
        with self._gone_lock:
            if self._told_writer_gone:
                return
            self._told_writer_gone = True
        grace = 0.0
        for hook in list(_writer_gone_hooks):
            grace = max(grace, hook(error, self) or 0.0)
        self._gone_grace_until = time.monotonic() + grace

    def _writer_gone(self, error: WriterGoneError, timeout: float | None):
        self._tell_writer_gone(error)
        grace = self._gone_grace_until - time.monotonic()
        if timeout is not None:
            grace = min(grace, max(timeout, 0.0))
        if grace > 0 and self._end.wait_shutdown(grace):
            raise RuntimeError("cancelled") from None
        raise error

    def broadcast_object(self, obj: Any = None) -> Any:
        if self._end.is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def empty_tensor(self, shape, dtype=None):
        """An uninitialised CPU tensor for the writer to fill and enqueue.

        With a tensor arena and a free slot that fits, it lies inside that
        slot, so enqueueing it copies nothing (the readers view the same
        memory: do not modify it after enqueueing until they are done with
        it); otherwise it is an ordinary ``torch.empty`` tensor."""
        if self._forked_from is not None:
            raise self._forked()
        if self._end.is_writer:
            return self._end.empty_tensor(shape, dtype)
        import torch

        return torch.empty(shape, dtype=dtype)

    def stats(self) -> dict:
        """Counters of this end: messages and bytes sent per path (ring,
        overflow socket, remote socket), wake syscalls issued, ZMQ wakeup
        notifies that failed, and the tensor arena's hits and fallbacks."""
        return self._end.stats()

    # -- raw chunk access ----------------------------------------------------------
    @contextmanager
    def acquire_write(self, timeout: float | None = None) -> Iterator[memoryview]:
        """Yield the next chunk's bytes; publish it when the block exits
        normally (an exception leaves the chunk unpublished and reusable)."""
        if self._forked_from is not None:
            raise self._forked()
        if not self._end.is_writer or self._end.ring is None:
            raise RuntimeError("Only writers can acquire write")
        with self._end.acquire_write(timeout) as buf:
            yield buf

    @contextmanager
    def acquire_read(self, timeout: float | None = None,
                     indefinite: bool = False) -> Iterator[memoryview]:
        """Yield this reader's next chunk; it is marked read on exit, even
        when the block raises."""
        if self._forked_from is not None:
            raise self._forked()
        if not isinstance(self._end, LocalReader):
            raise RuntimeError("Only readers can acquire read")
        with self._end.acquire_read(timeout, indefinite) as buf:
            yield buf

    # -- vLLM's attributes -----------------------------------------------------------
    @property
    def handle(self) -> Handle:
        return self._end.handle

    @property
    def buffer(self):
        """The ring (``ShmRingBuffer``), or None (remote reader, no local readers)."""
        return self._end.buffer

    @property
    def tensor_arena(self):
        return self._end.tensor_arena

    @property
    def local_socket(self):
        return self._end.local_socket

    @property
    def remote_socket(self):
        return self._end.remote_socket

    @property
    def n_local_reader(self) -> int:
        return self._end.n_local_reader

    @property
    def n_remote_reader(self) -> int:
        return getattr(self._end, "n_remote_reader", 0)

    @property
    def local_reader_rank(self) -> int:
        return self._end.local_reader_rank

    @property
    def shutting_down(self) -> bool:
        return self._end.shutting_down

    @property
    def _is_writer(self) -> bool:
        return self._end.is_writer

    @property
    def _is_local_reader(self) -> bool:
        return isinstance(self._end, LocalReader)

    @property
    def _is_remote_reader(self) -> bool:
        return isinstance(self._end, RemoteReader)

    @property
    def _ring(self):
        """This end of the ring (``fastmq._ring_writer.RingWriter`` or
        ``fastmq._ring_reader.RingReader``), or None."""
        return self._end.ring

    @property
    def current_idx(self) -> int:
        ring = self._end.ring
        return ring.current_idx if ring is not None else -1

    @property
    def wait_mode(self) -> str | None:
        ring = self._end.ring
        if ring is None:
            return None
        return {v: k for k, v in _config.WAIT_MODES.items()}[ring.wait_mode]

    # -- process groups ------------------------------------------------------------
    @staticmethod
    def create_from_process_group(pg, max_chunk_bytes, max_chunks, writer_rank: int = 0,
                                  external_writer_handle=None, blocking: bool = True
                                  ) -> "MessageQueue":
        """One writer (``writer_rank``) to every other rank of ``pg``: a torch
        ``ProcessGroup`` or an object with vLLM's ``StatelessProcessGroup``
        methods (``rank``, ``world_size``, ``broadcast_obj``, ``all_gather_obj``)."""
        from fastmq import groups

        group = groups.Group(pg)
        on_node = groups.same_node_as(group, writer_rank)
        if group.rank == writer_rank:
            if external_writer_handle is not None:
                mq = MessageQueue.create_from_handle(external_writer_handle, group.rank)
            else:
                local = [r for r, same in enumerate(on_node) if same and r != writer_rank]
                mq = MessageQueue(n_reader=group.world_size - 1, n_local_reader=len(local),
                                  local_reader_ranks=local, max_chunk_bytes=max_chunk_bytes,
                                  max_chunks=max_chunks)
            group.broadcast(mq.export_handle(), writer_rank)
        else:
            handle = group.broadcast(None, writer_rank)
            mq = MessageQueue.create_from_handle(handle, group.rank)
        if blocking:
            mq.wait_until_ready()
        return mq

    @staticmethod
    def create_from_process_group_single_reader(pg, max_chunk_bytes, max_chunks,
                                                reader_rank: int = 0, blocking: bool = False
                                                ) -> tuple["MessageQueue", list[Handle]]:
        """Every rank writes its own queue read by ``reader_rank``; returns this
        rank's queue and, on the reader, every rank's handle."""
        from fastmq import groups

        group = groups.Group(pg)
        reader = groups.group_rank_of(group, reader_rank)
        on_node = groups.same_node_as(group, reader)
        mq = MessageQueue(n_reader=1, n_local_reader=1 if on_node[group.rank] else 0,
                          max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)
        handles = group.all_gather(mq.export_handle())
        if blocking:
            mq.wait_until_ready()
        return mq, (handles if group.rank == reader else [])


__all__ = ["MessageQueue", "Handle", "BufferHandle", "HandleMismatchError",
           "CorruptChunkError", "SegmentMismatchError", "LONG_WAIT_TIME_LOG_MSG"]
