"""Who is subscribed: the readers' identities on a writer's XPUB sockets.

The handshake (``wait_until_ready``) must count readers, not
subscription events: a reader killed before the handshake and replaced by
a new one of the same rank produces a subscribe, an unsubscribe and a
subscribe, and a process that subscribes without being a reader (a late
joiner, a monitor, vLLM's own queue on a fastmq handle) is not a reader.
So each fastmq reader subscribes, before its catch-all subscription, to a
topic of its own that names it::

    IDENTITY_PREFIX | i32 rank | u32 pid | u64 nonce | tag

The topic is longer than the first frame of any message a queue sends (a
12-byte socket-message header, ``READY``, a 1-byte wakeup), so it never
matches a message: it only says who is there.  With ``XPUB_VERBOSER`` the
writer sees every subscribe and unsubscribe, and ``Subscribers`` keeps the
set of identities present.  A catch-all subscription that stays without an
identity is foreign (see ``Subscribers.foreign``).  Each event carries
libzmq's "Peer-Address" of its connection, which for a unix socket ends
with the kernel's ``SO_PEERCRED`` (``:uid:gid:pid``): the writer's
long-wait line and its errors name such a subscriber by pid and uid.

The socket is an abstract unix name, which any process of the writer's
network namespace can connect to (a pod's sidecar too).  So the data
socket is an ``XPUB_MANUAL`` one: a subscription takes effect only when
the writer applies it, which it does for a connection whose identity
carries the right tag, an HMAC of the identity under the handle's local
key (``fastmq._door``: it travels only inside the handle).  A process
without the handle can connect and subscribe, and receives nothing.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time

import zmq

from fastmq._gone import ReaderGoneError
from fastmq._ring import SLOT_ALIVE, SLOT_DEAD, SLOT_FREE, SLOT_LEFT
from fastmq.handle import HandleMismatchError

IDENTITY_PREFIX = b"\xfffastmq-reader\x00"
_ID = struct.Struct("<iIQ")
TAG_BYTES = 16
IDENTITY_BYTES = len(IDENTITY_PREFIX) + _ID.size + TAG_BYTES


def _tag(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()[:TAG_BYTES]


def identity(rank: int, pid: int, key: bytes) -> bytes:
    """A new identity topic for the reader of ``rank`` in process ``pid``
    (as the writer's pid namespace numbers it), tagged with the queue's
    local ``key``."""
    body = IDENTITY_PREFIX + _ID.pack(rank, pid, secrets.randbits(64))
    return body + _tag(key, body)


# How long more catch-all subscriptions than identities may last before a
# subscriber counts as foreign.  A reader's two subscriptions arrive
# together, in either order (libzmq sends those made before connect in its
# trie's order), and a closed connection's unsubscriptions all at once:
# real surpluses last microseconds.
FOREIGN_AFTER_S = 1.0
# How long before the long-wait line names such a subscriber.
NAMED_AFTER_S = 0.1


def subscribe(sock, topic: bytes) -> None:
    """Subscribe a reader's SUB socket: its identity, and everything."""
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.setsockopt(zmq.SUBSCRIBE, b"")


class Subscribers:
    """The identities subscribed to one XPUB (``XPUB_VERBOSER``), fed with
    the socket's subscription events."""

    def __init__(self, key: bytes | None = None):
        self.present: dict[bytes, tuple[int, int]] = {}   # topic -> (rank, pid)
        self.catch_all = 0                                # "" subscriptions alive
        self._surplus_since = None
        # The local key: set on an XPUB_MANUAL socket, whose readers'
        # subscriptions ``drain`` applies once their identity's tag checks.
        self._key = key
        self.refused = 0    # identities whose tag did not check
        # Per peer (libzmq's "Peer-Address" of a unix socket names the
        # kernel's SO_PEERCRED: "...:uid:gid:pid"): catch-all subscriptions
        # alive, valid identities alive, identities whose tag did not check.
        self._peer_catch_all: dict[str, int] = {}
        self._peer_ids: dict[str, int] = {}
        self._peer_bad_tag: dict[str, int] = {}

    def feed(self, event: bytes, peer: str = "") -> tuple[bool, bytes] | None:
        """Account for one event (from ``peer``, its "Peer-Address", ""
        when not known); returns ``(subscribed, topic)`` for a reader's
        identity, None for anything else."""
        if not event or event[0] not in (0, 1):
            return None
        subscribed, topic = event[0] == 1, bytes(event[1:])
        if not topic:
            self.catch_all += 1 if subscribed else -1
            _count(self._peer_catch_all, peer, 1 if subscribed else -1)
            return None
        if len(topic) != IDENTITY_BYTES or not topic.startswith(IDENTITY_PREFIX):
            return None
        if self._key is not None and not hmac.compare_digest(
                topic[-TAG_BYTES:], _tag(self._key, topic[:-TAG_BYTES])):
            self.refused += subscribed
            if subscribed:
                _count(self._peer_bad_tag, peer, 1)
            return None
        if subscribed:
            rank, pid, _ = _ID.unpack_from(topic, len(IDENTITY_PREFIX))
            self.present[topic] = (rank, pid)
        else:
            self.present.pop(topic, None)
        _count(self._peer_ids, peer, 1 if subscribed else -1)
        return subscribed, topic

    def unidentified(self) -> list[str]:
        """The peers (named as ``describe_peer`` does) with more catch-all
        subscriptions alive than valid identities: processes that
        subscribed without a reader's identity (a sidecar, a reader of
        vLLM's own queue)."""
        return [describe_peer(p) for p, n in self._peer_catch_all.items()
                if n > self._peer_ids.get(p, 0)]

    def describe_refused(self) -> str:
        """The subscribers refused so far, for the writer's long-wait
        line: identities whose tag did not check, and catch-all
        subscriptions without an identity that have lasted ``NAMED_AFTER_S``
        (after ``FOREIGN_AFTER_S`` the handshake raises, naming them)."""
        out = [f"{describe_peer(p)} (subscribed to the local socket with an identity "
               "that does not carry this queue's key)" for p in self._peer_bad_tag]
        if self._surplus_since is not None and \
                time.monotonic() - self._surplus_since >= NAMED_AFTER_S:
            out += [f"{p} (subscribed to the local socket without a reader's identity)"
                    for p in self.unidentified()]
        return ", ".join(out)

    def drain(self, sock) -> list[tuple[bool, bytes]]:
        """Feed every event waiting on ``sock``; the identity events."""
        out = []
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            try:
                peer = frame.get("Peer-Address")
            except (zmq.ZMQError, AttributeError, TypeError):
                peer = ""
            got = self.feed(frame.bytes, peer)
            if got is not None:
                out.append(got)
                if self._key is not None and got[0]:
                    # XPUB_MANUAL: applies to the connection whose event
                    # was received last, this reader's.
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
        return out

    def has(self, rank: int, pid: int) -> bool:
        return (rank, pid) in self.present.values()

    @property
    def foreign(self) -> bool:
        """Whether a catch-all subscriber that could be one of this queue's
        readers has had no identity for ``FOREIGN_AFTER_S`` (asked after
        each ``drain``).  A subscriber whose pid this process cannot see
        (the kernel gives 0: another container's pid namespace, as a
        Kubernetes pod's sidecar) is no reader of this writer's processes:
        it is named in the long-wait line, never fails the handshake."""
        if self.catch_all <= len(self.present):
            self._surplus_since = None
            return False
        now = time.monotonic()
        if self._surplus_since is None:
            self._surplus_since = now
        if self._peer_catch_all and not any(
                _pid_of(p) != 0 for p, n in self._peer_catch_all.items()
                if n > self._peer_ids.get(p, 0)):
            return False
        return now - self._surplus_since >= FOREIGN_AFTER_S


def _count(counts: dict, key: str, by: int) -> None:
    n = counts.get(key, 0) + by
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def _pid_of(peer: str) -> int | None:
    # libzmq's "Peer-Address" of a unix-socket peer: "host:uid:gid:pid".
    parts = peer.rsplit(":", 3)
    if len(parts) == 4 and all(x.isdigit() for x in parts[1:]):
        return int(parts[3])
    return None


def describe_peer(peer: str) -> str:
    """A subscriber as libzmq names a unix-socket peer
    (``host:uid:gid:pid``, the kernel's ``SO_PEERCRED``, its pid as this
    process's pid namespace numbers it): "pid P uid U"."""
    pid = _pid_of(peer)
    if pid is None:
        return "a process the socket does not name"
    uid = peer.rsplit(":", 3)[1]
    if pid == 0:
        return f"a process outside this pid namespace (uid {uid})"
    return f"pid {pid} uid {uid}"


__all__ = ["IDENTITY_BYTES", "Subscribers", "describe_peer", "identity", "subscribe"]


# -- the writer's view of its local readers during the handshake ----------------------
def local_readers_ready(ring, local: list, ring_name: str) -> bool:
    """Whether every local rank's ring slot is held by a live process that
    has subscribed: by identity on the data socket, ``local[0]``; on the
    ZMQ-mode notify socket, which carries no identities, one catch-all
    subscription per reader.  ``local`` is ``[(socket, Subscribers), ...]``.
    Raises for a reader that died or left, and for a subscriber that is
    not a fastmq reader."""
    (_, data), *notify = local
    ready = all(subs.catch_all >= ring.n_reader for _, subs in notify)
    for rank in range(ring.n_reader):
        pid, state = ring.reader_state(rank)
        if state in (SLOT_DEAD, SLOT_LEFT):
            raise ReaderGoneError(
                f"fastmq: local reader rank {rank} (pid {pid}) "
                f"{'died' if state == SLOT_DEAD else 'closed its end of the queue'} "
                "before the handshake completed; the writer cannot make progress",
                rank, pid, "died" if state == SLOT_DEAD else "left")
        if state != SLOT_ALIVE or not data.has(rank, pid):
            ready = False
    if data.foreign:
        # A fastmq reader claims its slot, then subscribes with its
        # identity; a subscriber without one attached with vLLM's own
        # MessageQueue, which would read this ring as vLLM's.
        unclaimed = [r for r in range(ring.n_reader)
                     if ring.reader_state(r)[1] == SLOT_FREE]
        who = ", ".join(data.unidentified()) or "a process the socket does not name"
        raise HandleMismatchError(
            f"this MessageQueue handle was created by fastmq (ring segment "
            f"{ring_name!r}) but local reader(s) {unclaimed or '?'} attached "
            "with vLLM's own MessageQueue: fastmq is not active in their process. "
            "Install fastmq in every vLLM process's environment, unset "
            "FASTMQ_VLLM=0, or call fastmq.vllm.patch() before vLLM creates "
            f"its queues. (Subscribed to the queue's local socket without a reader's "
            f"identity: {who}; a process that does not hold this queue's handle, such "
            "as a sidecar in the writer's network namespace, is refused the same way "
            "and receives nothing.)")
    return ready


def missing_readers(ring, local: list, remote: str | None) -> str:
    """The readers the handshake still waits for, for its periodic log
    line: the local ranks of ``ring`` not yet present (``ring`` None: none
    missing) and ``remote``, what the remote side says is missing."""
    missing = []
    if ring is not None:
        for rank in range(ring.n_reader):
            pid, state = ring.reader_state(rank)
            if state != SLOT_ALIVE or not local[0][1].has(rank, pid):
                missing.append(f"local rank {rank}" + (f" (pid {pid})" if pid else ""))
    if remote:
        missing.append(remote)
    return ", ".join(missing) or "none"
