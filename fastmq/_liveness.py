"""Telling a quiet remote peer from a gone one (``fastmq._wire``).

A killed process's kernel closes its connections (FIN or reset), but a
node that died, a link that went down or a firewall that drops sends
nothing: a receive waits for ever and a send blocks once the buffer is
full.  So neither end relies on the other's kernel alone:

* each end sends a small sealed heartbeat (``_wire.heartbeat``) when it
  has sent nothing else for ``interval(bound)``: the writer to a reader
  whose stream was idle, a reader to its writer (a reader never sends
  anything else after the handshake).  It is sealed like every frame, with
  a rising seal counter, so it cannot be forged or replayed;
* a reader waiting for bytes, and a writer waiting for a reader's socket
  to take them, declare the peer gone once nothing came from it for the
  bound (``FASTMQ_PEER_TIMEOUT_S``); the error names the peer, what was
  heard from it last and when, and says it was silence, not a close;
* TCP keepalive on every connection, and on a reader's a
  ``TCP_USER_TIMEOUT`` too (its writer always reads the few heartbeat
  bytes, so they never wait long for an acknowledgement): a dead node is
  noticed by the kernel as well.  Not on a writer's connections: there a
  live reader that stops reading for a while leaves the writer's data
  unacknowledged behind a zero window, and this kernel aborts such a
  connection at the user timeout (measured), which would drop a slow
  reader instead of waiting for it;
* a reader that is not receiving (busy elsewhere) cannot judge its writer
  by the bytes it reads, and the kernel's abort is not to be relied on:
  it reports the last soft error instead of a timeout (``No route to
  host`` once the neighbour's address no longer resolves), and while
  local retransmissions fail (a link without carrier) it may never abort
  at all (seen: 21 retransmissions over 66 s, still established, with a
  3 s user timeout).  So the heartbeat thread also asks the kernel when
  the writer's node last acknowledged anything (``unacknowledged_s``): a
  node that is alive acknowledges the reader's heartbeats within a round
  trip, whatever its process does.

The heartbeats come from one daemon thread per process (``Pulse``), for
every queue end in it: it wakes once per interval and sends only on a
connection that was idle through it, so a busy stream costs nothing per
message.  A forked child has no such thread and forgets the parent's
ends: it never sends on the parent's connections.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import termios
import threading
import time
import weakref

# A peer that is alive sends at least once per interval; the bound allows
# for four of them to be late (a busy process's thread waits for the GIL).
HEARTBEATS_PER_BOUND = 4


def interval(bound: float) -> float:
    return bound / HEARTBEATS_PER_BOUND


def tune(sock: socket.socket, bound: float, user_timeout: bool) -> None:
    """TCP keepalive (and, ``user_timeout``, TCP_USER_TIMEOUT) so that the
    kernel too gives up on a peer whose node is silent for about
    ``bound``."""
    idle = max(1, int(bound / 3))
    intvl = max(1, int(bound / 6))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, intvl)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT,
                        max(1, -(-int(bound - idle) // intvl)))
        if user_timeout:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(bound * 1000))
    except (OSError, AttributeError):
        pass   # (not Linux: the heartbeats alone tell)


# The head of Linux's struct tcp_info (linux/tcp.h): eight one-byte fields
# (tcpi_state first), then 32-bit ones, the 13th tcpi_last_ack_recv (ms
# since the peer's last acknowledgement of anything).
_TCP_INFO = struct.Struct("=8B14I")
_TCP_ESTABLISHED = 1
_LAST_ACK_RECV = 8 + 12
_OUTQ = struct.Struct("i")

# Errors a send or receive gets once the kernel gave up on the peer's node
# (a timeout; or the soft error it saw last, reported in the timeout's
# place): silence, not a close.
UNREACHED = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH,
                       errno.EHOSTDOWN, errno.ENETDOWN})


def unacknowledged_s(sock: socket.socket) -> float:
    """For how long the peer's kernel has acknowledged nothing on ``sock``
    while bytes this end sent wait for it (sent and unacknowledged, or not
    yet out: a host whose own link drops them): 0.0 when none wait (or
    where the kernel does not say)."""
    try:
        waiting = _OUTQ.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ,
                                           bytes(_OUTQ.size)))[0]
        if waiting <= 0:
            return 0.0
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except (OSError, AttributeError, ValueError):
        return 0.0
    if len(raw) < _TCP_INFO.size:
        return 0.0
    info = _TCP_INFO.unpack(raw)
    if info[0] != _TCP_ESTABLISHED:
        return 0.0
    return info[_LAST_ACK_RECV] / 1000.0


def ago(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "never"
    return f"{(time.monotonic() if now is None else now) - t:.1f} s ago"


class Pulse:
    """The process's heartbeat thread.  A member has ``pulse(now) ->
    float | None``: it sends what is due and says when it wants to be
    called next (None: drop it).  Members are held weakly: a queue end
    that is dropped leaves by itself."""

    def __init__(self):
        self._lock = threading.Lock()
        self._members: weakref.WeakSet = weakref.WeakSet()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, member) -> None:
        with self._lock:
            self._members.add(member)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fastmq-liveness",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def discard(self, member) -> None:
        with self._lock:
            self._members.discard(member)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            self._wake.clear()
            with self._lock:
                if self._thread is not me:
                    return     # (a forked child's copy of the state)
                members = list(self._members)
            now = time.monotonic()
            # Asleep until the first member is due (a new one wakes it): one
            # wakeup per interval, none without a member.
            wait, m = None, None
            for m in members:
                try:
                    due = m.pulse(now)
                except Exception:   # a member's socket went bad: it says so itself
                    due = now + 1.0
                if due is None:
                    self.discard(m)
                else:
                    wait = due - now if wait is None else min(wait, due - now)
            members = m = None   # (no strong reference while asleep)
            self._wake.wait(None if wait is None else max(wait, 0.01))

    def _after_fork_in_child(self) -> None:
        # The parent's connections are not this process's to send on.
        self._lock = threading.Lock()
        self._members = weakref.WeakSet()
        self._wake = threading.Event()
        self._thread = None


PULSE = Pulse()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PULSE._after_fork_in_child)
