"""The remote path's wire: one TCP connection from each remote reader to the
writer (``fastmq._fanout`` is the writer's end, ``fastmq._stream`` a
reader's), carrying messages sealed by ``fastmq._seal``.

Why plain TCP and not a ZMQ socket: a message has left the writer's
process once ``sendmsg`` has put its bytes in the kernel's socket buffer,
which outlives a killed writer, so ``enqueue()`` can return right then;
through ZMQ it would first have to learn from libzmq's I/O thread that the
message was written.  A reader blocks in the kernel for the bytes, with no
I/O thread between it and the socket either.

Wire format (integers little-endian)::

    handshake (fastmq._keys), after the reader connected:
      writer -> reader   CHALLENGE  "FMQr", version, mode, writer nonce (16), public key (32)
      reader -> writer   HELLO      "FMQr", rank (i64), pid (i64), reader nonce (16),
                                    public key (32), proof (32)
      writer -> reader   READY      "FMQr", the message key wrapped (48)
    a small message (WHOLE_BYTES of frames at most), sealed at once:
      "FMQw", seal counter (u64), sequence number (u64), frame count (u32),
      frame lengths (u64 each), the frames, one tag over all of it
    a larger one:
      "FMQs", seal counter, sequence number, frame count, frame lengths, the
      header's tag, then its frames cut into segments of SEGMENT_BYTES, each
      followed by its tag
    the end of the stream (the writer closed the queue):
      "FMQe", seal counter, the last sequence number sent, 0, the header's tag
    a heartbeat, between messages, on a stream idle for a while (fastmq._liveness):
      "FMQh", seal counter, the last sequence number sent, 0, the header's tag
    and from reader to writer, the one thing a reader sends after the handshake:
      "FMQa", the reader's own counter, the last sequence number it took, the
      reader's bound (ms), a tag under the reader's heartbeat key (Seal.for_reader)

The tags (none in security mode ``"none"``; in ``"encrypt"`` the frames are
ciphertext, the tag after them) are ``fastmq._seal``'s, under the nonce
(seal counter, index).  Segment indices run across the whole message, so a
reader checks each segment as it arrives, while the next one is still on
its way.  Both ends hold to the same limits (``MAX_FRAMES``,
``MAX_MESSAGE_BYTES``): the writer refuses to send what a reader would
refuse to take.
"""
from __future__ import annotations

import select
import socket
import struct
import time

from fastmq import _keys, _seal

MAGIC = b"FMQr"
VERSION = 3    # 3: heartbeats (an earlier peer is refused in the handshake)
SLICE_S = 0.1
SEGMENT_BYTES = 1 << 20
WHOLE_BYTES = 64 * 1024
# "encrypt": a segment this large is encrypted into pooled memory
# (Outgoing); a smaller one, a frame's short tail, into a fresh bytes.
POOLED_CIPHER_MIN = 256 * 1024
# How far (in batches, about a segment each) the fastest reader may run
# ahead of the slowest under "encrypt": every batch in between is
# ciphertext the writer keeps.  Unbounded, two readers on two cores drift
# a whole message apart and each message's ciphertext is fresh memory.
CIPHER_LEAD_BATCHES = 8
# What the writer keeps of those blocks for the next segments: the lead,
# plus the batch each reader's socket has still to take (a block is a
# segment and its tag, in whole pages).
CIPHER_POOL_BYTES = 2 * CIPHER_LEAD_BATCHES * (SEGMENT_BYTES + 4096)

PREAMBLE = struct.Struct("<4sBB")    # CHALLENGE's first fields: told apart before the rest
CHALLENGE = struct.Struct(f"<4sBB{_keys.NONCE_BYTES}s{_keys.PUBLIC_BYTES}s")
HELLO = struct.Struct(f"<4sqq{_keys.NONCE_BYTES}s{_keys.PUBLIC_BYTES}s{_keys.PROOF_BYTES}s")
READY = struct.Struct(f"<4s{_keys.WRAPPED_BYTES}s")
HEAD = struct.Struct("<4sQQI")
WHOLE = b"FMQw"       # a message sealed whole (small)
SEGMENTED = b"FMQs"   # a message sealed segment by segment
END = b"FMQe"         # the writer closed the queue
HEARTBEAT = b"FMQh"   # the writer is there (an idle stream)
ALIVE = b"FMQa"       # the reader is there (reader to writer)
MODE_CODES = {m: i for i, m in enumerate(_seal.MODES)}

# A reader takes a header whole into its inbox: the frame count is bounded
# so that the largest header, with its tag, fits.
INBOX_BYTES = 256 * 1024
MAX_FRAMES = (INBOX_BYTES - HEAD.size - _seal.TAG_BYTES) // 8
# A small message (WHOLE_BYTES at most) is taken whole into the inbox: with
# at most this many frames, header, frames and tag fit; one with more goes
# in segments.
WHOLE_MAX_FRAMES = (INBOX_BYTES - HEAD.size - WHOLE_BYTES - _seal.TAG_BYTES) // 8
MAX_MESSAGE_BYTES = 1 << 42    # a length beyond this is a forgery, not a message

HUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

# The first bytes a ZMQ peer sends (ZMTP greeting): the mark of a reader
# that attached with vLLM's own MessageQueue.
ZMTP_SIGNATURE_LEN = 10


def is_zmtp(data: bytes) -> bool:
    return len(data) >= ZMTP_SIGNATURE_LEN and data[0] == 0xFF and data[9] == 0x7F


def parse_address(addr: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` (``[v6]`` brackets removed)."""
    if not addr.startswith("tcp://"):
        raise ValueError(f"fastmq: remote address {addr!r} is not tcp://host:port")
    host, _, port = addr[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class PeerGone(ConnectionError):
    """The other end closed the connection (or it broke)."""


class PeerSilent(PeerGone):
    """Nothing came from the other end for the bound (``fastmq._liveness``),
    or the kernel gave up on it (no acknowledgement, keepalive unanswered):
    its node died or became unreachable; nothing closed the connection.
    ``what`` says how it was noticed, ``last`` what was heard last."""

    def __init__(self, what: str, last: str = ""):
        super().__init__(what)
        self.what, self.last = what, last


class WriterSpeaksZMTP(RuntimeError):
    """The writer's port answered in ZMQ: a vLLM queue, not a fastmq one."""


def wait(fds_events, until: float | None, stop=None) -> bool:
    """Wait one slice for any of ``fds_events``; raise ``RuntimeError
    ("cancelled")`` when ``stop`` (a ``threading.Event``, or None) is set,
    ``TimeoutError`` once ``until`` has passed.  True if an event came.

    ``stop`` is the waiting object's own flag, set by whoever shuts it
    down (another thread, or a signal handler): a slice is short, so a
    stop is seen within one."""
    if stop is not None and stop.is_set():
        raise RuntimeError("cancelled")
    slice_s = SLICE_S
    if until is not None:
        slice_s = min(slice_s, until - time.monotonic())
        if slice_s <= 0:
            raise TimeoutError
    p = select.poll()
    for fd, ev in fds_events:
        p.register(fd, ev)
    return bool(p.poll(slice_s * 1000))


def told_bound(own: float, told_ms: int) -> float:
    """The bound to allow a peer that said its own is ``told_ms``."""
    return max(own, min(told_ms / 1000, 1e9))


def check_limits(buffers: list) -> None:
    """``ValueError`` for a message a remote reader would refuse to take."""
    if len(buffers) > MAX_FRAMES:
        raise ValueError(f"fastmq: a message of {len(buffers)} frames (its pickle stream and "
                         f"out-of-band buffers) is more than a remote reader takes "
                         f"({MAX_FRAMES})")


def end_of_stream(seal: _seal.Seal, counter: int, last_seq: int) -> list:
    """The wire form of the end of the stream after message ``last_seq``."""
    header = HEAD.pack(END, counter, last_seq, 0)
    return [header, seal.tag_header(counter, header)] if seal.tag_bytes else [header]


def heartbeat(seal: _seal.Seal, counter: int, last_seq: int, bound_s: float = 0.0,
              kind: bytes = HEARTBEAT) -> bytes:
    """A heartbeat's wire form (``kind`` ALIVE: a reader's, ``seal`` its
    heartbeat seal): sealed as an end of the stream is, so that it cannot
    be forged, and its counter rises, so that it cannot be replayed.  A
    reader's carries its bound (``bound_s``): its writer allows the larger
    of its own and the reader's, since a reader with a longer bound beats
    less often.  (The writer's has the form of an end of the stream, 0 in
    the frame count's place, as every reader's parser expects of a header
    without frames.)"""
    header = HEAD.pack(kind, counter, last_seq, min(int(bound_s * 1000), 0xFFFFFFFF))
    return header + seal.tag_header(counter, header) if seal.tag_bytes else header


class Outgoing:
    """One message as the batches of wire parts that go out in turn.

    A small message (``WHOLE_BYTES`` at most) is one batch sealed at once:
    one tag, one ``sendmsg``.  A larger one is the header, then its frames
    cut into segments, each with its tag, about a segment per batch.

    ``batch(k)`` is a function of ``k`` alone, computed when the fastest
    reader needs it (so a tag is computed while the previous segment is
    still being taken): an exception in the middle of computing one leaves
    nothing half-done, and asking again gives the same bytes under the same
    nonces.

    ``"encrypt"``: each segment's ciphertext goes into a block taken from
    ``pool`` (a ``BufferPool``), which returns to the pool once every
    reader's socket has taken it (and the fanout dropped the batch): the
    next segments encrypt into the few pages that go round, already
    mapped, instead of a fresh ``bytes`` each (fresh pages cost more than
    the cipher), and the first message is no slower than the next."""

    def __init__(self, seal: _seal.Seal, counter: int, seq: int, buffers: list,
                 pool=None):
        views = [memoryview(b).cast("B") for b in buffers]
        lengths = [len(v) for v in views]
        self.nbytes = total = sum(lengths)
        if total > MAX_MESSAGE_BYTES:
            raise ValueError(f"fastmq: a message of {total} bytes is more than a remote "
                             f"reader takes ({MAX_MESSAGE_BYTES})")
        whole = total <= WHOLE_BYTES and len(views) <= WHOLE_MAX_FRAMES
        header = HEAD.pack(WHOLE if whole else SEGMENTED, counter, seq, len(views)) + \
            struct.pack(f"<{len(views)}Q", *lengths)
        self._seal = seal
        self._counter = counter
        if whole:
            self._first = seal.seal_whole(counter, header, views)
            self._pool = None
            self._segments: list = []
            self._groups: list = []
            self.n_batches = 1
            self._late = False
            return
        self._first = [header, seal.tag_header(counter, header)] if seal.tag_bytes else [header]
        self._segments = [v[off:off + SEGMENT_BYTES]
                          for v in views for off in range(0, len(v), SEGMENT_BYTES)]
        self._pool = pool if seal.encrypting and seal.encrypts_into else None
        # Batches of about a segment: each group of segments ends once it
        # holds SEGMENT_BYTES (the last group may hold less).
        groups, start, size = [], 0, 0
        for i, seg in enumerate(self._segments):
            size += len(seg)
            if size >= SEGMENT_BYTES:
                groups.append((start, i + 1, True))
                start, size = i + 1, 0
        if start < len(self._segments):
            groups.append((start, len(self._segments), False))
        self._groups = groups
        # "mac": the tag of a full group's last segment goes at the head of
        # the next batch (a trailing batch of its own after the last group).
        self._late = bool(seal.tag_bytes) and not seal.encrypting
        # No segment at all (frames all empty): the header is the one batch.
        trailing = self._late and bool(groups) and groups[-1][2]
        self.n_batches = max(1, len(groups) + trailing)

    def batch(self, k: int) -> list:
        """Batch ``k`` (0 <= k < n_batches): lists of wire parts; the first
        holds the header.

        Under ``"mac"`` the tag of a full batch's last segment is computed
        with the next batch, that is once the segment was handed to the
        fastest reader's socket: the reader receives (and checks) the
        segment while the writer tags it, instead of waiting for the tag
        before the first byte leaves, and the writer tags bytes the copy
        into the socket just read."""
        seal, counter, segs = self._seal, self._counter, self._segments
        if not self._groups:
            return self._first
        out = list(self._first) if k == 0 else []
        if self._late and k > 0 and self._groups[k - 1][2]:
            last = self._groups[k - 1][1] - 1
            out.append(seal.tag(counter, last, segs[last]))
        if k == len(self._groups):
            return out
        start, stop, full = self._groups[k]
        for i in range(start, stop):
            if self._late and full and i == stop - 1:
                out.append(segs[i])
            else:
                cipher = None
                if self._pool is not None and len(segs[i]) >= POOLED_CIPHER_MIN:
                    cipher = memoryview(self._pool.take(len(segs[i]) + seal.tag_bytes))
                out += seal.seal(counter, i, segs[i], cipher)
        return out
