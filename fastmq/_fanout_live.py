"""The writer's side of liveness (``fastmq._liveness``), a mixin of
``fastmq._fanout.Fanout``: the heartbeats to readers whose stream is idle,
and the reading of each reader's heartbeats, which is how the writer tells
a reader that is only slow (its heartbeats keep coming while the writer
waits for its socket) from one whose node went silent.

Everything here runs on the process's heartbeat thread, except
``apply_gone`` and ``heartbeat_finished``, which the thread that sends
messages calls: the heartbeat thread never changes what a message's send
uses, it only marks a reader (``gone``) for the sender to break.
"""
from __future__ import annotations

import os
import socket
import time

from fastmq import _liveness, _wire
from fastmq._wire import ALIVE, HEAD


class FanoutLiveness:
    """(State: ``peer_timeout``, ``_lock``, ``_gone_pending`` and each
    ``_Reader``'s liveness fields, set up by ``Fanout``.)"""

    def start_liveness(self) -> None:
        """The handshake completed: heartbeats from here on."""
        now = time.monotonic()
        for r in self.readers:
            r.heard = now
        _liveness.PULSE.add(self)

    # -- the heartbeat thread --------------------------------------------------------
    def pulse(self, now: float) -> float | None:
        if self._closing.is_set() or self._ended or os.getpid() != self._pid:
            return None
        for r in self.readers:
            if r.error is None and r.gone is None:
                self._take_alive(r, now)
                bound = max(self.peer_timeout, r.bound)
                if r.gone is None and now - r.heard > bound:
                    r.gone = (self._silent_text(
                        r, f"nothing came from it for {now - r.heard:.1f} s (the bound, "
                        f"FASTMQ_PEER_TIMEOUT_S, is {bound:g} s)", now), "silent")
                if r.gone is not None:
                    self._gone_pending = True
        # Heartbeats only where no message is on its way (the sender's
        # thread sends them itself meanwhile, see heartbeat_finished), and
        # only to a reader to which nothing went since the last pulse.
        if self._lock.acquire(blocking=False):
            try:
                drainer = self._drainer
                if self._message is None and not self._ended and \
                        (drainer is None or not drainer.is_alive()):
                    beat = _liveness.interval(self.peer_timeout)
                    for r in self.readers:
                        if r.error is None and not r.out.owed:
                            token = (self._marked, r.out.sent)
                            if r.token is None or token != r.token[0]:
                                r.token = (token, now)     # bytes went since
                            elif now - r.token[1] >= 0.9 * beat:   # (a wait ends early)
                                self._send_heartbeat(r)
                                r.token = (token, now)
            finally:
                self._lock.release()
        return now + _liveness.interval(self.peer_timeout)

    def _take_alive(self, r, now: float) -> None:
        """Read what reader ``r`` sent: its heartbeats, nothing else."""
        size = HEAD.size + r.alive_seal.tag_bytes
        while True:
            try:
                data = r.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _liveness.UNREACHED:
                    r.gone = (self._silent_text(
                        r, f"the kernel gave up on the connection ({e.strerror}: keepalive "
                        "unanswered)", now), "silent")
                    return
                r.gone = (f"{r.describe()} disconnected ({e}) from the writer after the "
                          "handshake", "disconnected")
                return
            if not data:
                return    # (closed: the writer's poll sees the hangup)
            r.inbox += data
            while len(r.inbox) >= size:
                frame = bytes(r.inbox[:size])
                del r.inbox[:size]
                kind, counter, seq, n = HEAD.unpack_from(frame)
                seal = r.alive_seal
                ok = kind == ALIVE and \
                    (not seal.tag_bytes or (counter > r.alive_counter and
                                            seal.check_header(counter, frame[:HEAD.size],
                                                              frame[HEAD.size:])))
                if not ok:
                    r.gone = (f"{r.describe()} sent bytes after the handshake that are not "
                              "its sealed heartbeat", "misbehaved")
                    return
                r.alive_counter, r.heard, r.heard_seq = counter, now, seq
                r.bound = _wire.told_bound(self.peer_timeout, n)
            if len(data) < 4096:
                return

    def _silent_text(self, r, what: str, now: float) -> str:
        last = (f"its heartbeat after message {r.heard_seq}" if r.alive_counter
                else "its hello in the handshake, then nothing")
        return (f"{r.describe()} at {r.addr} went silent: {what}; last heard from it: {last}, "
                f"{_liveness.ago(r.heard, now)}. Its "
                "node died or became unreachable, or the link drops everything: silence, not "
                "a close; messages sent since would not reach it, and a remote reader cannot "
                "rejoin a running queue")

    def _send_heartbeat(self, r) -> None:
        """One sealed heartbeat to ``r``, whose outbox is empty (so it goes
        between two messages); a socket that takes none of it is full, and
        its reader has bytes to read anyway."""
        wire = _wire.heartbeat(self.seal, next(self._counters), self._last_seq)
        try:
            k = r.sock.send(wire, socket.MSG_DONTWAIT)
        except OSError:
            return    # (full, or broken: the sends and the poll say which)
        if k < len(wire):
            r.out.add([wire[k:]])

    # -- the sender's thread ---------------------------------------------------------
    def apply_gone(self) -> None:
        """Break every reader the heartbeat thread found gone."""
        self._gone_pending = False
        for r in self.readers:
            if r.error is None and r.gone is not None:
                text, how = r.gone
                self._break(r, text, how)

    def heartbeat_finished(self, busy: list) -> None:
        """While a message still goes to the readers in ``busy``: a
        heartbeat to each other reader, which has all of it (its stream
        is between two messages)."""
        with self._lock:
            for r in self.readers:
                if r.error is None and r not in busy and not r.out.owed:
                    self._send_heartbeat(r)
