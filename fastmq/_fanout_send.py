"""How a message goes out to the remote readers (``fastmq._wire``): a
mixin of ``fastmq._fanout.Fanout``, whose state it uses.

A message goes out as batches of sealed parts (``Outgoing.batch``), each
computed once, when the fastest reader needs it; each reader's outbox
counts the batches it was given, so a reader that is ahead is not held to
a slower one's pace, only the message as a whole is (``enqueue()``
returns once every reader has all of it).  Writes are non-blocking and go
to every reader in turn, so one slow reader's full socket buffer does not
stall the others'.  While it waits for a reader's socket, the sender
keeps the others told that the writer is there, and breaks a reader that
the heartbeat thread found gone (``fastmq._fanout_live``).
"""
from __future__ import annotations

import logging
import select
import threading
import time

from fastmq import _liveness, _wire
from fastmq._wire import PeerGone, PeerSilent

logger = logging.getLogger("fastmq")


class FanoutSending:
    """(State: ``Fanout``'s.)"""

    def _owed(self) -> bool:
        return self._message is not None or \
            any(r.out.owed for r in self.readers if r.error is None)

    def wait_drained(self, until: float | None) -> None:
        """Wait (as ``_wire.wait`` does: deadline, ``cancel()``) until the
        rest of an earlier message is out: what the drain thread sends, or
        what an exception left unsent."""
        t = self._drainer
        while t is not None and t.is_alive():
            if self.cancelled.is_set():
                raise RuntimeError("cancelled")
            slice_s = _wire.SLICE_S
            if until is not None:
                slice_s = min(slice_s, until - time.monotonic())
                if slice_s <= 0:
                    raise TimeoutError("fastmq: a remote reader did not take the previous "
                                       "message in time")
            t.join(slice_s)
        self._drainer = None
        if self._owed():
            self._push(until, self.cancelled, committing=False)

    # A message goes out as batches of sealed parts (Outgoing.batch), each
    # computed once, when the fastest reader needs it; each reader's outbox
    # counts the batches it was given, so a reader that is ahead is not
    # held to a slower one's pace, only the message as a whole is
    # (enqueue() returns once every reader has all of it).  Under
    # "encrypt" the batches between the slowest reader and the fastest are
    # ciphertext the writer keeps: the fastest is held within
    # CIPHER_LEAD_BATCHES of the slowest, so that they fit the pool.
    @property
    def next_seq(self) -> int:
        return self._last_seq + 1

    def begin(self, buffers: list) -> _wire.Outgoing:
        """Start sending the next message: it takes the next seal counter
        (gone for good, whatever happens next) and the next sequence
        number.  The outboxes count its bytes from here (``committed``)."""
        seq = self._last_seq + 1
        with self._lock:    # (no heartbeat is half-way on a socket)
            for r in self.readers:
                r.out.mark()
            self._marked = seq
            message = _wire.Outgoing(self.seal, next(self._counters), seq, buffers,
                                     self._ciphertexts)
            self._message, self._sealed, self._dropped = message, [], 0
        return message

    def committed(self, seq: int) -> bool:
        """Whether some byte of message ``seq`` reached a reader's socket
        (counted by the outboxes with the write itself)."""
        return self._marked == seq and self.written_any

    @property
    def written_any(self) -> bool:
        """Whether some byte of the message begun last reached a socket."""
        return any(r.out.sent for r in self.readers)

    def commit(self) -> None:
        """The current message is the readers' now: its sequence number is used."""
        self._last_seq = self._marked

    def _refill(self, r: _Reader, bounded: bool = True) -> bool | None:
        """Queue ``r``'s next batch; False when it has the whole message,
        None when it is held back (``bounded``, "encrypt": the lead)."""
        m = self._message
        k = r.out.batches
        if m is None or k >= m.n_batches:
            return False
        if self._ciphertexts is not None and m.n_batches > 1:
            # A batch every reader has been given is theirs alone now: its
            # blocks go back to the pool once the sockets took them.  (A
            # one-batch message, a step's, has nothing to drop or hold.)
            low = min([x.out.batches for x in self.readers if x.error is None], default=0)
            while self._dropped < low:
                self._sealed[self._dropped] = None
                self._dropped += 1
            if bounded and k - low >= _wire.CIPHER_LEAD_BATCHES:
                return None
        if k == len(self._sealed):
            self._sealed.append(m.batch(k))
        r.out.add(self._sealed[k])
        return True

    def discard(self, seq: int) -> None:
        """Drop message ``seq``, of which nothing was written (the rest of
        an earlier one, not begun over, stays)."""
        if self._marked != seq:
            return
        self._message, self._sealed, self._dropped = None, [], 0
        for r in self.readers:
            r.out.clear()

    def push(self, until: float | None, cancellable: bool = False,
             until_commit: bool = False) -> bool:
        """Write the message to every reader; True once all of it is in the
        kernel (or, ``until_commit``, once its first byte is).

        Before the first byte of the message is written (``written_any``),
        ``until`` raises ``TimeoutError`` and, if ``cancellable``,
        ``cancel()`` raises ``RuntimeError("cancelled")``: nothing was sent.
        After it, the message is committed: ``cancel()`` no longer stops
        it, and ``until`` returns False (the caller then has what is left
        copied and sent in the background, ``keep_rest``).  A reader whose
        connection breaks is dropped (``broken`` says which); if every
        reader's broke before the first byte, nothing is committed, and
        ``until_commit`` raises ``broken_error()``."""
        done = self._push(until, self.cancelled if cancellable else None, True, until_commit)
        if until_commit and not self.written_any:
            raise self.broken_error()
        return done

    def _push(self, until: float | None, stop, committing: bool,
              until_commit: bool = False) -> bool:
        """``push``; ``committing=False``: only the rest of an earlier
        message is left, and ``until`` and ``stop`` apply throughout."""
        active = [r for r in self.readers if r.error is None]
        # Liveness while the readers' sockets are waited for: readers that
        # have the whole message get heartbeats, a held one ("encrypt")
        # gets the rest once a wait lasts an interval (so that it is
        # between messages too), a reader found gone is broken.
        bounded, next_beat, moved_then = True, None, None
        while active:
            waiting, held = [], []
            for r in active:
                try:
                    while True:
                        if r.out.owed:
                            r.write()
                        if r.out.owed:
                            break
                        more = self._refill(r, bounded)
                        if not more:
                            if more is None:
                                held.append(r)
                            break
                except PeerSilent as e:
                    self._break(r, self._silent_text(
                        r, f"the kernel gave up on the connection ({e})", time.monotonic()),
                        "silent")
                    continue
                except PeerGone as e:
                    self._break(r, f"disconnected ({e})")
                    continue
                if r.out.owed:
                    waiting.append(r)
            # A held reader waits for the slowest, which is never held: it
            # was given another batch or waits for its socket (``waiting``).
            if not waiting:
                if held:
                    active = held
                    continue
                break
            if until_commit and self.written_any:
                return True
            active = waiting + held
            committed = committing and self.written_any
            try:
                _wire.wait([(r.fd, select.POLLOUT) for r in waiting], until,
                           None if committed else stop)
            except TimeoutError:
                if committed:
                    return False
                raise TimeoutError(f"fastmq: {', '.join(r.describe() for r in waiting)} "
                                   "did not take the message in time") from None
            if self._gone_pending:
                self.apply_gone()
                active = [r for r in active if r.error is None]
            if not committing or self.written_any:
                now = time.monotonic()
                moved = sum(r.out.sent for r in held)
                beat = _liveness.interval(self.peer_timeout)
                if next_beat is None:
                    next_beat, moved_then = now + beat, moved
                elif now >= next_beat:
                    # The readers held ahead got nothing for an interval (the
                    # slowest is stalled, or very slow): they get the rest now
                    # (that ciphertext is kept for them) rather than hear
                    # nothing in the middle of a message.  A slow link that
                    # keeps them fed keeps the lead, and its memory bound.
                    if held and moved == moved_then:
                        bounded = False
                    next_beat, moved_then = now + beat, moved
                    self.heartbeat_finished(active)
        # Every reader has it all: nothing of the caller's is referenced now.
        self._message, self._sealed, self._dropped = None, [], 0
        return True

    def keep_rest(self) -> None:
        """Past a deadline (or an exception) after the commit: what each
        reader has still to get is sealed now and becomes its own copy, so
        that nothing the caller owns is referenced once ``enqueue()``
        returns; a thread sends it, and the next message waits for that
        thread first."""
        if (self._drainer is not None and self._drainer.is_alive()) or not self._owed():
            return   # (called again by an exception's path, or nothing is left)
        copies: dict = {}   # a part queued for several readers is copied once
        for r in self.readers:
            if r.error is None:
                while self._refill(r, bounded=False):
                    pass
                r.out.own_rest(copies)
        self._message, self._sealed, self._dropped = None, [], 0
        # Sent in the background: the caller may wait for the readers'
        # answers before it enqueues again (vLLM's engine does).
        self._drainer = threading.Thread(target=self._drain, name="fastmq-remote-drain",
                                         daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        try:
            self._push(None, self._closing, committing=False)
        except RuntimeError:   # closed first (see close)
            pass
        except BaseException as e:
            logger.warning("fastmq: sending the rest of a remote message failed: %r", e)

    def end_stream(self, grace_s: float) -> None:
        """Send every reader the sealed end of the stream, after the last
        message: a reader then tells this clean close from a cut connection
        or a tail of messages dropped on the way.  At most ``grace_s`` for
        it to be taken; once."""
        with self._lock:     # (after any heartbeat half-way; none after it)
            if self._ended or self.listener is not None or self._owed():
                return
            self._ended = True
            parts = _wire.end_of_stream(self.seal, next(self._counters), self._last_seq)
        waiting = [r for r in self.readers if r.error is None]
        for r in waiting:
            r.out.mark()
            r.out.add(parts)
        until = time.monotonic() + grace_s
        while waiting:
            for r in list(waiting):
                try:
                    r.write()
                except PeerGone:
                    r.out.clear()
                if not r.out.owed:
                    waiting.remove(r)
            try:
                if waiting:
                    _wire.wait([(r.fd, select.POLLOUT) for r in waiting], until, None)
            except TimeoutError:
                return
