"""The writer's end of a queue: encodes each message once and publishes it
to the ring (node-local readers), to the local XPUB socket when it does not
fit a chunk (with a mark in the ring), and to the remote XPUB socket.

Nothing lost: when ``enqueue()`` returns, the message is in shared memory
or has left this process (see ``fastmq._overflow.FLUSH_FILL``); everything
that can fail or time out happens before that point.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import zmq

from fastmq import (_config, _door, _fanout, _keys, _net, _overflow, _parts, _seal,
                    _subscribers, segments)
from fastmq._ring import (LONG_WAIT, PICKLER_STALE, READER_DIED, READY,
                          WAIT_ZMQ)
from fastmq._gone import ReaderGoneError
from fastmq._segment import parse_locator
from fastmq._serde import Encoder
from fastmq._writer_remote import RemoteSending, nbytes as _nbytes
from fastmq.handle import BufferHandle, Handle
from fastmq.ring import ShmRingBuffer

logger = logging.getLogger("fastmq")

# How often a wait for a flush checks that the local readers are alive.
PEER_CHECK_S = 0.2


class _Stats:
    __slots__ = ("ring_messages", "ring_bytes", "parts_messages", "parts_bytes",
                 "overflow_messages", "overflow_bytes", "remote_messages", "remote_bytes")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class QueueWriter(RemoteSending):
    """Creates the ring, the sockets and the arena of a new queue, and
    sends on them.  ``MessageQueue.__init__`` documents the arguments."""

    is_writer = True
    local_reader_rank = -1

    def __init__(self, n_reader: int, n_local_reader: int,
                 local_reader_ranks: list[int] | None, max_chunk_bytes: int, max_chunks: int,
                 connect_ip: str | None, enable_shm_tensor_arena: bool | None, *,
                 wait_mode: str | None, spin_us: float | None, remote_security: str | None,
                 arena_options: dict):
        if n_local_reader > n_reader or n_local_reader < 0:
            raise ValueError(f"n_local_reader={n_local_reader} must be in 0..n_reader={n_reader}")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        elif len(local_reader_ranks) != n_local_reader:
            raise ValueError(f"local_reader_ranks {local_reader_ranks} does not have "
                             f"n_local_reader={n_local_reader} entries")
        elif len(set(local_reader_ranks)) != len(local_reader_ranks):
            # Each rank claims a ring slot of its own: a rank listed twice
            # leaves a slot no reader can take, and the handshake waits for
            # it for ever.
            raise ValueError(f"local_reader_ranks {local_reader_ranks} lists a rank twice")
        max_chunk_bytes, max_chunks = _config.ring_geometry(max_chunk_bytes, max_chunks)
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_remote_reader = n_reader - n_local_reader
        self.shutting_down = False
        self.stats_ = _Stats()
        # Held by enqueue() and by shutdown() around closing the ring, so a
        # shutdown on another thread cannot close the queue between an
        # enqueue's last check and its publish (readers would then see
        # "closed" and stop before a message whose enqueue() returned).
        # Re-entrant: a signal handler may call shutdown() mid-enqueue;
        # then the close waits for that enqueue() (``_close_pending``).
        self._send_lock = threading.RLock()
        self._close_pending = False
        self._overflow_id = 0       # last local overflow send attempt
        # A message's parts went out, but not its last one (an exception
        # between parts): the next message is preceded by an abort.
        self._parts_open = False
        # FASTMQ_PARTS=0: every message larger than a chunk takes the
        # overflow socket, as in vLLM.
        self._parts_on = _config.env_bool("FASTMQ_PARTS", True)
        self._notify_failure_logged = False
        self._ready = False          # wait_until_ready() returned
        self._zmq_wakeup = False     # the ring notifies parked readers on a ZMQ socket
        self.buffer = self.ring = self.tensor_arena = None
        self.local_socket = self.notify_socket = self.fanout = self.door = None
        self._local_key = _door.new_key()
        self.zmq = (zmq.Context(), [])
        local_addrs = (None, None)
        security = None
        trust = _keys.new_writer_trust("none")
        try:
            if n_local_reader > 0:
                local_addrs = self._open_local(n_local_reader, max_chunk_bytes, max_chunks,
                                               wait_mode, spin_us)
                from fastmq import arena

                self.tensor_arena = arena.create_for_queue(
                    enable_shm_tensor_arena, arena_options, n_local_reader, n_remote_reader)
                self._open_door()
            elif arena_options:
                raise TypeError(f"unexpected arguments {sorted(arena_options)}")
            if n_remote_reader > 0:
                security = _seal.mode(remote_security)
                trust = _keys.new_writer_trust(security)
                self._open_remote(connect_ip, security, trust["psk"])
            self.encoder = Encoder(self.tensor_arena)
        except BaseException:
            # Nothing of a queue that failed to start stays open: the
            # door's thread and its copies of the descriptors included.
            _overflow.close_all(*self.zmq)
            if self.buffer is not None:
                self.buffer.close()
            raise
        # The arena core's bound method, taken once: it runs per message.
        self._commit_arena = (self.tensor_arena.commit
                              if self.tensor_arena is not None else None)
        fanout = self.fanout
        self.handle = Handle(
            local_reader_ranks=list(local_reader_ranks),
            buffer_handle=BufferHandle(*self.buffer.handle()) if self.buffer else None,
            local_subscribe_addr=local_addrs[0],
            local_notify_addr=local_addrs[1],
            remote_subscribe_addr=fanout.address if fanout is not None else None,
            remote_addr_ipv6=fanout.ipv6 if fanout is not None else False,
            tensor_arena_handle=(self.tensor_arena.handle()
                                 if self.tensor_arena is not None else None),
            remote_key=trust["remote_key"],
            remote_salt=trust["remote_salt"],
            remote_key_id=trust["remote_key_id"],
            remote_security=security,
            n_reader=n_reader,
            writer_pid=os.getpid(),
            spin_us=_config.spin_us(spin_us) if n_remote_reader else None,
            local_door_addr=self.door.address if self.door is not None else None,
            local_key=self._local_key if n_local_reader else None,
            peer_timeout_s=fanout.peer_timeout if fanout is not None else None,
        )

    def _open_door(self) -> None:
        """The socket the local readers get the segments' descriptors from
        (``fastmq._door``), open while the queue is."""
        locators = [self.buffer.handle()[3]]
        if self.tensor_arena is not None:
            locators.append(self.tensor_arena.handle()[3])
        given = []
        for locator in locators:
            name, _, fd, _ = parse_locator(locator)
            given.append((name, fd))
        self.door = _door.Door(given, self._local_key)
        self.zmq[1].append(self.door)

    def _open_local(self, n_local_reader: int, max_chunk_bytes: int, max_chunks: int,
                    wait_mode: str | None, spin_us: float | None) -> tuple[str, str | None]:
        """The ring and the ipc sockets of the local readers; their
        addresses (overflow, and notify in the ZMQ wait mode)."""
        context, sockets = self.zmq
        self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks,
                                    wait_mode=wait_mode, spin_us=spin_us)
        self.ring = ring = self.buffer.ring
        ring.warn_interval = _config.warning_interval()
        if self._parts_on:
            # A message this large goes in parts even when it fits a chunk:
            # readers copy one part out while the writer copies the next in.
            ring.parts_min = _parts.PARTS_MIN
        self.local_socket = context.socket(zmq.XPUB)
        sockets.append(self.local_socket)
        # Every (un)subscription, so that the handshake counts the readers
        # present (fastmq._subscribers), not events; applied by the writer
        # only for a reader that holds the handle (XPUB_MANUAL).
        self.local_socket.setsockopt(zmq.XPUB_VERBOSER, True)
        self.local_socket.setsockopt(zmq.XPUB_MANUAL, True)
        _overflow.tune_publisher(self.local_socket)
        subscribe_addr = _net.bind_ipc(self.local_socket)
        notify_addr = None
        if ring.wait_mode == WAIT_ZMQ:
            # XPUB, not PUB: wait_until_ready() waits for every reader's
            # subscription here too, since a notify sent before it arrives
            # would be dropped (a lost wakeup).  Default high-water mark on
            # purpose: with SNDHWM=1 a notify sent before the socket has
            # processed the previous one's delivery is dropped silently.
            # The ring notifies only while a reader is parked, so the pipe
            # stays short anyway.
            notify = self.notify_socket = context.socket(zmq.XPUB)
            notify.setsockopt(zmq.XPUB_VERBOSER, True)
            sockets.append(notify)
            notify_addr = _net.bind_ipc(notify)
            ring.use_zmq_wakeup(notify)
            self._zmq_wakeup = True
        return subscribe_addr, notify_addr

    def _open_remote(self, connect_ip: str | None, security: str, psk: bytes | None) -> None:
        """The listener remote readers connect to (``self.fanout``)."""
        if not connect_ip:
            connect_ip = _net.local_ip()
        ipv6 = _net.is_ipv6(connect_ip)
        if ipv6:
            connect_ip = f"[{connect_ip.strip('[]')}]"
        self.fanout = _fanout.Fanout(connect_ip, ipv6, security, psk)
        self.zmq[1].append(self.fanout)

    # -- handshake and shutdown ----------------------------------------------
    def wait_until_ready(self) -> None:
        """Wait until every reader is subscribed, then send READY on each
        channel so that no later message can be missed.

        Readers are counted by identity (``fastmq._subscribers``): a local
        rank is ready when the live process that holds its ring slot has
        subscribed; ``n_remote_reader`` remote identities must be present.
        Waits in slices: ``shutdown()`` raises ``RuntimeError("cancelled")``,
        and a local reader that died or left before the handshake raises
        a ``RuntimeError`` naming it.  Nothing a peer on the remote port
        does makes it raise; a ZMQ peer there (a reader of vLLM's own
        queue) is named in the log and in the exception if it is cancelled.
        After it raised, ``enqueue()`` raises too.  Once it returned, a
        second call returns at once (the readers are still subscribed)."""
        if self._ready:
            return
        try:
            self._wait_for_readers()
            self._ready = True
        except BaseException as e:
            fanout = self.fanout
            if fanout is not None and fanout.listener is not None:
                fanout.failed = f"wait_until_ready() raised {e!r}"
                if fanout.zmq_peer is not None:
                    e.add_note(f"fastmq: while this queue waited for its remote readers, a "
                               f"peer at {fanout.zmq_peer} spoke ZMQ to its port: a reader "
                               "attached with vLLM's own MessageQueue (fastmq not active in "
                               "its process?)")
            raise

    def _wait_for_readers(self) -> None:
        local = ([(self.local_socket, _subscribers.Subscribers(self._local_key))]
                 if self.n_local_reader else [])
        if self.notify_socket is not None:
            local.append((self.notify_socket, _subscribers.Subscribers()))
        remote = self.fanout if self.n_remote_reader else None
        remote_done = remote is None
        local_done = not local
        flushes = []
        start = time.monotonic()
        next_log = start + _config.warning_interval()
        while True:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            if not local_done:
                for sock, subs in local:
                    subs.drain(sock)
                if _subscribers.local_readers_ready(self.ring, local, self.buffer.name):
                    self.local_socket.send(b"READY")
                    flushes.append(_overflow.send_flush(self.local_socket))
                    local_done = True
            if not remote_done:
                # READY is in the kernel once this says done: it has left
                # this process, like any remote message.
                remote_done = remote.handshake_step(self.n_remote_reader)
            if local_done and remote_done:
                # Like a message: READY has left this process before the
                # first enqueue() can, so a writer killed right after one
                # still leaves readers that finished the handshake.
                for tracker in flushes:
                    self._wait_flushed(tracker, None, "the readers' sockets")
                return
            if time.monotonic() >= next_log:
                next_log += _config.warning_interval()
                far = (remote.missing(self.n_remote_reader)
                       if remote is not None and not remote.readers else None)
                logger.info("fastmq: the writer has waited %.0f s in wait_until_ready() "
                            "for its readers: %s%s", time.monotonic() - start,
                            _subscribers.missing_readers(None if local_done else self.ring,
                                                         local, far),
                            self._refused_note(local))
            poller = zmq.Poller()
            for sock, _ in local:
                poller.register(sock, zmq.POLLIN)
            for sock in remote.fds() if remote is not None else ():
                poller.register(sock, zmq.POLLIN)
            poller.poll(_overflow.RECV_SLICE_MS)

    def _refused_note(self, local: list) -> str:
        """The local peers refused so far, for the long-wait line."""
        refused = self.door.describe_refused() if self.door is not None else ""
        subs = local[0][1].describe_refused() if local else ""
        if subs:
            refused += (", " if refused else "") + subs
        return f"; refused: {refused}" if refused else ""

    def disown(self) -> None:
        """In a forked child that inherited this end (see
        ``fastmq.queue``): let go of the child's copies of its descriptors,
        the remote listener and connections and the segments', so that
        they live as long as this end's own process: a remote reader learns
        at once that its writer died, and a closed listener accepts no
        more.  Nothing is sent and nothing shared is changed."""
        if self.fanout is not None:
            self.fanout.close()       # in another process: the descriptors only
        if self.door is not None:
            self.door.close()         # the child's copies only
        segments.drop_inherited(self.buffer, self.tensor_arena)

    def shutdown(self) -> None:
        """An enqueue() on another thread either completes (its message is
        delivered before readers see the queue closed) or raises.  Called
        by a signal handler in the middle of this thread's enqueue(), it
        closes the ring when that enqueue() is done."""
        self.shutting_down = True
        if self.fanout is not None:
            self.fanout.cancel()
        ring = self.ring
        if ring is None:
            return
        # Wake first: an enqueue() blocked on a full ring or a flush raises
        # "cancelled" and lets go of the send lock.
        ring.cancel()
        if self._send_lock._is_owned():
            # This thread is inside enqueue() (we run in a signal handler):
            # closing now could let readers stop before a message that
            # enqueue() is about to publish.
            self._close_pending = True
            return
        with self._send_lock:
            self._close_ring()

    def _close_ring(self) -> None:
        self._close_pending = False
        self.ring.mark_closed()
        # Wake parked readers again, now that they can see "closed".
        self.ring.cancel()

    # -- waiting for the ring ---------------------------------------------------
    def _wait_turn(self, timeout: float | None) -> None:
        status = self.ring.wait_next(timeout)
        if status != READY:
            self._keep_waiting(status)

    def _keep_waiting(self, status: int) -> None:
        """Act on what ``ring.wait_next()`` returned until the chunk is
        free: log a long wait, raise for a reader that died."""
        ring = self.ring
        while status != READY:
            if status == LONG_WAIT:
                behind = ", ".join(
                    f"rank {r} (pid {ring.reader_identity(r)[0] or 'not attached'})"
                    for r in ring.unread_readers(ring.current_idx))
                logger.info(_config.LONG_WAIT_TIME_LOG_MSG + " Readers that have not read "
                            "chunk %d for %.0f s: %s.", ring.warn_interval, ring.current_idx,
                            ring.waited, behind or "none")
            elif status == READER_DIED:
                raise _reader_gone(
                    ring, f"without reading chunk {ring.current_idx}; the writer cannot "
                    "make progress")
            status = ring.continue_wait()

    def _wait_flushed(self, tracker, until: float | None, where: str) -> None:
        """Wait until the message of ``tracker`` (sent on ``where``, not yet
        published in the ring) has left this process; between slices,
        ``shutdown()`` raises ``RuntimeError("cancelled")`` and a local
        reader that died raises (it could never take the message)."""
        if tracker.done:
            return
        next_check = time.monotonic() + PEER_CHECK_S
        while True:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            if _overflow.flush_slice(tracker, until, where):
                return
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + PEER_CHECK_S
            ring = self.ring
            if ring.peer_status() == READER_DIED:
                raise _reader_gone(ring, "; the writer cannot deliver to it", sep="")

    # -- raw chunk access ---------------------------------------------------------
    @contextmanager
    def acquire_write(self, timeout: float | None) -> Iterator[memoryview]:
        if self._parts_open:
            self._abort_parts(timeout)
        self._wait_turn(timeout)
        ring = self.ring
        idx = ring.begin_write()
        with ring.chunk_view(idx) as buf:
            yield buf
        ring.publish_chunk(idx)

    # -- messages -----------------------------------------------------------------
    def enqueue(self, obj: Any, timeout: float | None) -> None:
        if self.n_remote_reader:
            return self._enqueue_remote(obj, timeout)
        if self.ring is None:
            return    # no reader at all (a group of one): delivered to every one, as vLLM's
        with self._send_lock:
            try:
                if self.shutting_down:
                    raise RuntimeError("cancelled")
                # Node-local readers only: one call into the ring pickles
                # the message into the encoder's buffer, frames it into the
                # next chunk, publishes it and commits its arena slots (or,
                # raising, has published nothing and freed them); it counts
                # what it sent (see stats()).
                encoder = self.encoder
                if self._parts_open:
                    self._abort_parts(timeout)
                framed = self.ring.send_object(obj, encoder.pickler, encoder.sink, timeout)
                if framed <= 0:
                    self._send_local_slow(obj, framed, timeout)
                if self._zmq_wakeup and not self._notify_failure_logged and \
                        self.ring.notify_errors:
                    self._log_notify_failure()
            finally:
                if self._close_pending:
                    # shutdown() ran in a signal handler during this call.
                    self._close_ring()

    def _send_local_slow(self, obj: Any, framed: int, timeout: float | None) -> None:
        """What ``ring.send_object`` left to do, with nothing published yet:
        rebuild a stale pickler, act on a wait status, or send a message of
        ``PARTS_MIN`` or more in parts, in one chunk or over the overflow
        socket."""
        ring = self.ring
        encoder = self.encoder
        published = ring.n_published
        try:
            while framed == -PICKLER_STALE:
                encoder.refresh()
                framed = ring.send_object(obj, encoder.pickler, encoder.sink, timeout)
            if framed < 0:
                # A wait status (pickled, nothing sent): act on it, then the
                # chunk is free and the send does not wait again.
                self._keep_waiting(-framed)
                framed = ring.send_pickled(encoder.sink, timeout)
            if framed == 0:
                # Too big for a chunk, or large enough for parts (send
                # waited for nothing): one deadline covers the wait for
                # each chunk and the flush.
                until = _overflow.deadline(timeout)
                self._wait_turn(timeout)
                sink = encoder.sink
                # Parts only to readers waiting for them (each takes the
                # parts as they come): in chunks merely free they would stay
                # while a reader is busy elsewhere, and the writer could no
                # longer run max_chunks messages ahead as vLLM's does.  Else
                # one chunk if it fits, else the socket: one chunk, as vLLM.
                cut = (_parts.cut_to_fit(*sink.stream(), ring.max_chunk_bytes)
                       if self._parts_on else None)
                if cut is not None and not _parts.readers_take_parts(ring, cut[1], until):
                    cut = None
                if cut is not None:
                    self._send_parts(*cut, until)
                elif not self._send_whole(sink, until):
                    self._send_overflow(sink.frames(encoder.pool), until)
                if self._commit_arena is not None:
                    self._commit_arena()
        except BaseException:
            # A message whose last part is not out was never delivered:
            # its arena slots are free again, as if nothing was published.
            self._settle_arena(ring.n_published if self._parts_open else published)
            raise
        finally:
            # The message's out-of-band buffers are the caller's memory.
            encoder.sink.clear()

    def _send_whole(self, sink, until: float | None) -> bool:
        """A message that fits a chunk but was held back for parts, which
        its readers are not waiting for: in one chunk after all.  False
        when it does not fit one."""
        ring = self.ring
        framed = ring.send_pickled(sink, _overflow.remaining(until), True)
        while framed < 0:
            self._keep_waiting(-framed)
            framed = ring.send_pickled(sink, _overflow.remaining(until), True)
        return framed > 0

    def _settle_arena(self, published: int) -> None:
        """After a failed enqueue(): the slots of a message whose chunk is
        out belong to the readers; those of one never published are free."""
        arena = self.tensor_arena
        if arena is None:
            return
        ring = self.ring
        if ring is not None and ring.n_published != published:
            # The chunk naming these slots is out: readers own
            # the slots now and release them.
            arena.commit()
        else:
            # Never published to a reader: the slots are free again.
            arena.abort()

    def _log_notify_failure(self) -> None:
        # Once: it would otherwise repeat on every message.
        self._notify_failure_logged = True
        logger.warning("fastmq: a ZMQ wakeup notify failed (%s); parked readers now wake "
                       "only on their %.0f ms re-check", self.ring.last_notify_error,
                       self.ring.park_slice_ns / 1e6)

    def _send_overflow(self, buffers: list, until: float | None) -> None:
        """A message too big for a chunk (whose turn has come): payload on
        the socket, then a mark in the ring.  The mark is published only once
        the payload has left this process, so a reader that sees it always
        gets the payload, and a send abandoned before (timeout, shutdown,
        dead reader) is skipped by readers by its id."""
        self._overflow_id += 1
        _overflow.send_message(self.local_socket, self._overflow_id, buffers)
        tracker = _overflow.send_flush(self.local_socket)
        self._wait_flushed(tracker, until, "a local reader's socket")
        self.ring.send_overflow_mark(self._overflow_id)
        stats = self.stats_
        stats.overflow_messages += 1
        stats.overflow_bytes += _nbytes(buffers)

    def _send_parts(self, parts: list, total: int, until: float | None) -> None:
        """A message of ``PARTS_MIN`` or more, node-local readers only, in
        parts (``fastmq._parts``) through consecutive chunks; the first chunk's
        turn has come.  Delivered once the last part is out; an exception
        before that (a timeout, ``shutdown()``, a dead reader, a signal,
        memory running out) leaves ``_parts_open`` set, and the next
        message first tells the readers to drop what they have of it."""
        ring = self.ring
        for index, (pieces, offset) in enumerate(parts):
            if index:
                self._wait_turn(_overflow.remaining(until))
            self._parts_open = True
            ring.send_part(pieces, index, total, offset)
        self._parts_open = False
        stats = self.stats_
        stats.parts_messages += 1
        stats.parts_bytes += total

    def _abort_parts(self, timeout: float | None) -> None:
        self._wait_turn(timeout)
        self.ring.send_part_abort()
        self._parts_open = False

    @property
    def remote_socket(self):
        """The remote path's end (``fastmq._fanout.Fanout``), or None."""
        return self.fanout

    def empty_tensor(self, shape, dtype=None):
        arena = self.tensor_arena
        if arena is not None:
            t = arena.empty_tensor(shape, dtype)
            if t is not None:
                return t
        import torch

        return torch.empty(shape, dtype=dtype)

    def stats(self) -> dict:
        out = self.stats_.as_dict()
        ring = self.ring
        if ring is not None:
            # The one-call path counts in the ring (RingWriter.send_object).
            out["ring_messages"] += ring.sent_messages
            out["ring_bytes"] += ring.sent_bytes
        out["wakeups"] = ring.wakeups if ring is not None else 0
        out["notify_errors"] = ring.notify_errors if ring is not None else 0
        if self.tensor_arena is not None:
            out.update(self.tensor_arena.stats())
        return out


def _reader_gone(ring, what: str, sep: str = " ") -> ReaderGoneError:
    """The error for the reader that ``ring.dead_rank`` names, gone ``what``."""
    how = "closed its end of the queue" if ring.dead_left else "died"
    return ReaderGoneError(
        f"fastmq: reader rank {ring.dead_rank} (pid {ring.dead_pid}) {how}{sep}{what}",
        ring.dead_rank, ring.dead_pid, "left" if ring.dead_left else "died")
