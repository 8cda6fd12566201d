"""How a writer with remote readers sends a message (``QueueWriter`` takes
this role's methods): the remote readers' fan-out first, up to its commit
point (some byte of the message reached a reader's socket), then the
ring for the local readers, whatever happens after that point; and the
note an exception raised after it carries, saying the message is
delivered.
"""
from __future__ import annotations

from typing import Any

from fastmq import _overflow, _wire


def nbytes(buffers: list) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


class RemoteSending:
    """The send of a queue with remote readers (a mixin of
    ``fastmq._writer.QueueWriter``, whose state it uses)."""

    def _enqueue_remote(self, obj: Any, timeout: float | None) -> None:
        """A queue with remote readers.  Any exception raised here once the
        message is committed (some byte of it reached a reader's socket)
        says so in a note: the message is delivered to every reader."""
        fanout = self.fanout
        with self._send_lock:
            # Taken under the lock: another thread's enqueue() may have used
            # the one before.  Whether this call's message was committed is
            # asked under it too: once it is released, the next message may
            # take the same number (this one never used it) and commit.
            seq = fanout.next_seq
            try:
                try:
                    if self.shutting_down:
                        raise RuntimeError("cancelled")
                    arena = self.tensor_arena
                    ring = self.ring
                    published = ring.n_published if ring is not None else 0
                    try:
                        buffers = self.encoder.encode(obj)
                        self._send_with_remote(buffers, seq, timeout,
                                               _overflow.deadline(timeout))
                    except BaseException:
                        self._settle_arena(published)
                        raise
                    if arena is not None:
                        self._commit_arena()
                    if self._zmq_wakeup and ring.notify_errors and \
                            not self._notify_failure_logged:
                        self._log_notify_failure()
                finally:
                    if self._close_pending:
                        # shutdown() ran in a signal handler during this call.
                        self._close_ring()
            except BaseException as e:
                if fanout.committed(seq) and not _noted(e):
                    e.add_note(_COMMITTED_NOTE)
                raise

    def _send_with_remote(self, buffers: list, seq: int, timeout: float | None,
                          until: float | None):
        """Send message ``seq``.  Everything that can fail or time out
        happens before the remote send's first byte is written: that is the
        commit point.  The ring publish after it neither waits nor fails,
        nor can a signal handler split the two; the rest of the message
        goes out after the publish, so that local readers need not wait for
        the remote ones."""
        ring = self.ring
        fanout = self.fanout
        overflow = False
        published = ring.n_published if ring is not None else 0
        try:
            if ring is not None:
                self._wait_turn(timeout)
            fanout.check_ready()
            _wire.check_limits(buffers)
            # Backpressure: the rest of a message that was still going out
            # at its deadline leaves first.
            fanout.wait_drained(until)
            fanout.check_readers()
            if ring is not None:
                framed = ring.framed_size(buffers)
                overflow = framed > ring.max_chunk_bytes
                # Memory too must fail here, not after the commit point.
                ring.reserve_next(framed)
            if overflow:
                self._overflow_id += 1
                _overflow.send_message(self.local_socket, self._overflow_id, buffers)
                tracker = _overflow.send_flush(self.local_socket)
                self._wait_flushed(tracker, until, "a local reader's socket")
            message = fanout.begin(buffers)
            fanout.push(until, cancellable=True, until_commit=True)
            # Committed: the remote readers are getting the message.  The
            # ring must take it too, whatever happens now: the publish
            # neither waits nor heeds cancel(), a shutdown() from a signal
            # handler is deferred (see shutdown), and an exception a signal
            # handler raises from here on is raised only once the local
            # readers have it too.
            fanout.commit()
            if ring is not None:
                self._publish_committed(buffers, overflow)
            if not fanout.push(until):
                # Past the deadline: the rest goes out from a copy, in the
                # background (see the README's limits).
                fanout.keep_rest()
            stats = self.stats_
            if ring is not None:
                if overflow:
                    stats.overflow_messages += 1
                    stats.overflow_bytes += nbytes(buffers)
                else:
                    stats.ring_messages += 1
                    stats.ring_bytes += ring.framed_size(buffers)
            stats.remote_messages += 1
            stats.remote_bytes += message.nbytes
            if fanout.broken is not None:
                # A reader's connection broke during this message: every
                # other reader has it, that one cannot.
                raise fanout.broken_error()
        except BaseException as e:
            # Whether any byte went out is counted with the write itself
            # (fastmq._outbox), so it is right whatever line raised.
            if not fanout.committed(seq):
                fanout.discard(seq)
                raise
            fanout.commit()
            if ring is not None and ring.n_published == published:
                self._publish_committed(buffers, overflow)
            fanout.keep_rest()
            if not _noted(e):
                e.add_note(_COMMITTED_NOTE)
            raise

    def _publish_committed(self, buffers: list, overflow: bool) -> None:
        if overflow:
            self.ring.send_overflow_mark(self._overflow_id)
        else:
            self.ring.send(buffers, None, True)


_COMMITTED_NOTE = ("fastmq: the message was committed before this exception and is "
                   "delivered to every reader still connected")


def _noted(e: BaseException) -> bool:
    return _COMMITTED_NOTE in getattr(e, "__notes__", ())
