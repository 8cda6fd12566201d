"""The remote path's wire: one TCP connection from each remote reader to the
writer, carrying sealed messages (``fastmq._seal``).

Why plain TCP and not a ZMQ socket: a message has left the writer's
process once ``sendmsg`` has put its bytes in the kernel's socket buffer,
which outlives a killed writer, so ``enqueue()`` can return right then;
through ZMQ it would first have to learn from libzmq's I/O thread that the
message was written.  A reader blocks in the kernel for the bytes, with no
I/O thread between it and the socket either.

Wire format (integers little-endian)::

    handshake, after the reader connected:
      writer -> reader   CHALLENGE  magic "FMQr", version, mode, writer nonce (16)
      reader -> writer   HELLO      magic, rank (i64), pid (i64), reader nonce (16), proof (32)
      writer -> reader   READY      magic, proof (32)
    each message:
      header   magic, sequence number (u64), frame count (u32), frame lengths (u64 each), tag
      frames   each cut into segments of SEGMENT_BYTES, every segment followed by its tag

The tags (none in security mode ``"none"``; ciphertext in place of the
segment in ``"encrypt"``) are ``fastmq._seal``'s.  Segment indices run
across the whole message, so a reader checks each segment as it arrives,
while the next one is still on its way.

Every wait is sliced (``SLICE_S``): shutdown, deadlines and dead peers are
noticed between slices.  Sends are non-blocking: a writer pushes to every
reader in turn, so one slow reader's full socket buffer does not stall the
others'.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import socket
import struct
import time
from collections import deque

from fastmq import _seal
from fastmq._ring import CorruptChunkError

logger = logging.getLogger("fastmq")

MAGIC = b"FMQr"
VERSION = 1
SLICE_S = 0.1
SEGMENT_BYTES = 1 << 20
MAX_FRAMES = 1 << 16
MAX_MESSAGE_BYTES = 1 << 42    # a length beyond this is corruption, not a message

CHALLENGE = struct.Struct(f"<4sBB{_seal.NONCE_BYTES}s")
HELLO = struct.Struct(f"<4sqq{_seal.NONCE_BYTES}s{_seal.PROOF_BYTES}s")
READY = struct.Struct(f"<4s{_seal.PROOF_BYTES}s")
HEAD = struct.Struct("<4sQI")
_MODE_CODES = {m: i for i, m in enumerate(_seal.MODES)}
_IOV_MAX = 512
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_HUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

# The first bytes a ZMQ peer sends (ZMTP greeting): the mark of a reader
# that attached with vLLM's own MessageQueue.
_ZMTP_SIGNATURE_LEN = 10


def _is_zmtp(data: bytes) -> bool:
    return len(data) >= _ZMTP_SIGNATURE_LEN and data[0] == 0xFF and data[9] == 0x7F


def parse_address(addr: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` (``[v6]`` brackets removed)."""
    if not addr.startswith("tcp://"):
        raise ValueError(f"fastmq: remote address {addr!r} is not tcp://host:port")
    host, _, port = addr[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class PeerGone(ConnectionError):
    """The other end closed the connection (or it broke)."""


class WriterSpeaksZMTP(RuntimeError):
    """The writer's port answered in ZMQ: a vLLM queue, not a fastmq one."""


def _wait(fds_events, until: float | None, end) -> bool:
    """Wait one slice for any of ``fds_events``; raise ``RuntimeError
    ("cancelled")`` when ``end.shutting_down`` (``end`` may be None),
    ``TimeoutError`` once ``until`` has passed.  True if an event came."""
    if end is not None and end.shutting_down:
        raise RuntimeError("cancelled")
    wait = SLICE_S
    if until is not None:
        wait = min(wait, until - time.monotonic())
        if wait <= 0:
            raise TimeoutError
    p = select.poll()
    for fd, ev in fds_events:
        p.register(fd, ev)
    return bool(p.poll(wait * 1000))


# -- the writer's side ------------------------------------------------------------
class _Joining:
    """A connection that has not proven it is a reader yet."""

    __slots__ = ("sock", "peer", "nonce", "got", "identity")

    def __init__(self, sock, peer):
        self.sock, self.peer = sock, peer
        self.nonce = os.urandom(_seal.NONCE_BYTES)
        self.got = b""
        self.identity = None   # (rank, pid, reader nonce) once proven


class _Reader:
    """A remote reader's connection after the handshake, with the parts of
    messages still to be written to it."""

    __slots__ = ("sock", "fd", "rank", "pid", "parts", "next_batch", "error")

    def __init__(self, sock, rank, pid):
        self.sock, self.fd, self.rank, self.pid = sock, sock.fileno(), rank, pid
        self.parts: deque = deque()
        self.next_batch = 0
        self.error: str | None = None

    def write(self) -> int:
        """Write what the socket takes now (how many bytes); raise
        ``PeerGone`` if the connection broke."""
        parts = self.parts
        total = 0
        while parts:
            try:
                n = self.sock.sendmsg(list(itertools.islice(parts, _IOV_MAX)), (),
                                      _SEND_FLAGS)
            except BlockingIOError:
                return total
            except (BrokenPipeError, ConnectionResetError) as e:
                raise PeerGone(str(e)) from e
            total += n
            while n:
                head = parts[0]
                size = len(head)
                if n >= size:
                    parts.popleft()
                    n -= size
                else:
                    parts[0] = memoryview(head)[n:]
                    n = 0
        return total

    def describe(self) -> str:
        return f"remote reader rank {self.rank} (pid {self.pid} on its node)"


class Fanout:
    """The writer's end: a listening socket for the handshake, then one
    connection per remote reader."""

    def __init__(self, connect_ip: str, ipv6: bool, seal: _seal.Seal):
        self.seal = seal
        family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.bind((connect_ip.strip("[]"), 0))
            self.listener.listen(64)
            self.listener.setblocking(False)
        except BaseException:
            self.listener.close()
            raise
        port = self.listener.getsockname()[1]
        self.address = f"tcp://{connect_ip}:{port}"
        self.challenge = os.urandom(_seal.NONCE_BYTES)
        self._joining: list[_Joining] = []
        self.readers: list[_Reader] = []
        self.broken: str | None = None   # why the readers can no longer be served
        self.written_any = False   # some byte of the current message was written
        self._batches = None       # the current message's batches not sealed yet
        self._sealed: list = []    # its batches sealed so far
        self._poll = None

    # -- handshake ------------------------------------------------------------------
    def fds(self) -> list:
        """What the handshake waits on (the listener and joining sockets)."""
        if self.listener is None:
            return []
        return [self.listener] + [j.sock for j in self._joining]

    def handshake_step(self, n_readers: int) -> bool:
        """Accept connections, check the hellos that arrived, and once
        exactly ``n_readers`` readers have proven themselves, send each
        READY and stop listening.  Never waits; True once done."""
        if self.listener is None:
            return True
        self._accept()
        for j in list(self._joining):
            self._read_hello(j)
        proven = [j for j in self._joining if j.identity is not None]
        # Exactly: a surplus means one of them already left (its close has
        # not been read yet) and will drop out.
        if len(proven) != n_readers:
            return False
        for j in proven:
            rank, pid, nonce = j.identity
            proof = self.seal.prove(b"writer", self.challenge, nonce, self._mode_byte())
            try:
                j.sock.sendall(READY.pack(MAGIC, proof))
            except OSError as e:
                raise RuntimeError(f"fastmq: remote reader rank {rank} (pid {pid} on its "
                                   f"node) dropped its connection during the handshake "
                                   f"({e})") from e
            self.readers.append(_Reader(j.sock, rank, pid))
        for j in self._joining:
            if j.identity is None:
                j.sock.close()
        self._joining = []
        self.listener.close()
        self.listener = None
        self._poll = select.poll()
        for r in self.readers:
            self._poll.register(r.fd, select.POLLIN | _HUP)
        return True

    def _mode_byte(self) -> bytes:
        return bytes([_MODE_CODES[self.seal.mode]])

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:   # e.g. ECONNABORTED: that peer is gone already
                logger.debug("fastmq: accepting a remote reader failed: %r", e)
                continue
            _tune(sock)
            j = _Joining(sock, peer)
            try:
                sock.sendall(CHALLENGE.pack(MAGIC, VERSION, _MODE_CODES[self.seal.mode],
                                            self.challenge))
            except OSError:
                sock.close()
                continue
            self._joining.append(j)

    def _read_hello(self, j: _Joining) -> None:
        try:
            data = j.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            # Gone before READY: a reader that died, or a stranger.
            self._joining.remove(j)
            j.sock.close()
            return
        if j.identity is not None:
            return self._reject(j, "sent bytes after its hello")
        j.got += data
        if _is_zmtp(j.got):
            from fastmq.handle import HandleMismatchError

            raise HandleMismatchError(
                f"a remote reader of this fastmq queue ({j.peer[0]}) attached with vLLM's "
                "own MessageQueue (it speaks ZMQ): fastmq is not active in its process. "
                "Activate fastmq in every process of the deployment or in none.")
        if len(j.got) < HELLO.size:
            if j.got[:len(MAGIC)] != MAGIC[:len(j.got)]:
                self._reject(j, "is not a fastmq reader")
            return
        if len(j.got) > HELLO.size:
            return self._reject(j, "sent more than a hello")
        magic, rank, pid, nonce, proof = HELLO.unpack(j.got)
        if magic != MAGIC:
            return self._reject(j, "is not a fastmq reader")
        if not self.seal.proven(proof, b"reader", self.challenge, HELLO.pack(
                magic, rank, pid, nonce, bytes(_seal.PROOF_BYTES))):
            return self._reject(j, "did not prove it holds this queue's key")
        j.identity = (rank, pid, nonce)

    def _reject(self, j: _Joining, why: str) -> None:
        logger.warning("fastmq: refused a connection from %s to this queue's remote port: "
                       "it %s", j.peer[0], why)
        self._joining.remove(j)
        j.sock.close()

    def missing(self, n_readers: int) -> str:
        proven = sum(j.identity is not None for j in self._joining)
        return f"remote readers ({proven} connected and proven, {n_readers} expected)"

    # -- messages -------------------------------------------------------------------
    def check_readers(self) -> None:
        """Raise if a reader's connection closed or broke since the
        handshake (it can never take another message), or if the queue's
        remote side is broken for an earlier reason."""
        events = self._poll.poll(0) if self.broken is None and self._poll is not None else ()
        if events:
            for fd, _ in events:
                r = next(r for r in self.readers if r.fd == fd)
                try:
                    data = r.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                why = "sent bytes after the handshake" if data else "disconnected"
                self._break(r, why)
                break
        if self.broken is not None:
            raise RuntimeError(f"fastmq: {self.broken}")

    def _break(self, r: _Reader, why: str) -> None:
        r.error = why
        self.broken = (
            f"{r.describe()} {why} from the writer after the handshake: it died or its "
            "node is unreachable; messages sent since would not reach it, and a remote "
            "reader cannot rejoin a running queue")

    def has_pending(self) -> bool:
        return any(r.parts for r in self.readers)

    # A message goes out as a list of sealed batches that grows as the
    # fastest reader needs the next one (sealing runs one batch ahead of the
    # sockets); each reader has its own position in it, so a reader that
    # is ahead is not held to a slower one's pace, only the message as a
    # whole is (enqueue() returns once every reader has all of it).
    def begin(self, batches) -> None:
        """Start sending a message (an iterator of batches of wire parts)."""
        self.written_any = False
        self._batches = batches
        self._sealed = []
        for r in self.readers:
            r.next_batch = 0

    def _refill(self, r: _Reader) -> bool:
        """Queue ``r``'s next batch; False when it has the whole message."""
        if r.next_batch == len(self._sealed):
            batch = next(self._batches, None) if self._batches is not None else None
            if batch is None:
                self._batches = None
                return False
            self._sealed.append(batch)
        r.parts.extend(self._sealed[r.next_batch])
        r.next_batch += 1
        return True

    def discard(self) -> None:
        """Drop a message of which nothing was written."""
        self._batches, self._sealed = None, []
        for r in self.readers:
            r.parts.clear()

    def push(self, until: float | None, end=None, committing: bool = True,
             until_commit: bool = False) -> bool:
        """Write the message to every reader; True once all of it is in the
        kernel (or, ``until_commit``, once its first byte is).

        Before the first byte of the message is written (``written_any``),
        ``until`` raises ``TimeoutError`` and ``end.shutting_down`` raises
        ``RuntimeError("cancelled")``: nothing was sent.  After it, the
        message is committed: shutdown no longer stops it, and ``until``
        returns False (the caller then copies what is left, ``keep_rest``,
        and the next message pushes it out first).  A reader whose
        connection breaks is dropped (``broken`` says which).
        ``committing=False``: only the rest of an earlier message is left;
        the deadline and ``end`` apply throughout."""
        active = [r for r in self.readers if r.error is None]
        while active:
            waiting = []
            for r in active:
                try:
                    while True:
                        if r.parts and r.write() and committing:
                            self.written_any = True
                        if r.parts or not self._refill(r):
                            break
                except PeerGone as e:
                    r.parts.clear()
                    self._break(r, f"disconnected ({e})")
                    continue
                if r.parts:
                    waiting.append(r)
            if not waiting or (until_commit and self.written_any):
                return True
            active = waiting
            committed = committing and self.written_any
            try:
                _wait([(r.fd, select.POLLOUT) for r in active], until,
                      None if committed else end)
            except TimeoutError:
                if committed:
                    return False
                raise TimeoutError(f"fastmq: {', '.join(r.describe() for r in active)} "
                                   "did not take the message in time") from None
        return True

    def keep_rest(self) -> None:
        """Past a deadline (or an exception) after the commit: what each
        reader has still to get becomes its own copy, so that nothing the
        caller owns is referenced once ``enqueue()`` returns; the next
        message pushes it out first."""
        copies: dict = {}   # a part queued for several readers is copied once

        def own(p):
            if isinstance(p, bytes):
                return p
            if id(p) not in copies:
                copies[id(p)] = (p, bytes(p))
            return copies[id(p)][1]

        rest = [own(p) for batch in (self._batches or ()) for p in batch]
        for r in self.readers:
            if r.error is None:
                r.parts = deque([own(p) for p in r.parts] +
                                [own(p) for b in self._sealed[r.next_batch:] for p in b] + rest)
        self._batches, self._sealed = None, []

    def close(self, linger=None) -> None:
        """Close every socket.  What ``sendmsg`` took is the kernel's: it is
        still delivered (and then the connection closed) after this."""
        for s in ([self.listener] if self.listener is not None else []) + \
                [j.sock for j in self._joining] + [r.sock for r in self.readers]:
            try:
                s.close()
            except OSError:
                pass
        self.listener = None
        self._joining = []


class Outgoing:
    """One message cut into the batches that go out in turn: the header and
    the first segments, then about a segment at a time.  Sealing is lazy,
    one batch ahead of the socket, so a tag is computed while the previous
    segment is still being taken by the readers."""

    def __init__(self, seal: _seal.Seal, seq: int, buffers: list):
        views = [memoryview(b).cast("B") for b in buffers]
        lengths = [len(v) for v in views]
        header = HEAD.pack(MAGIC, seq, len(views)) + struct.pack(f"<{len(views)}Q", *lengths)
        self.nbytes = sum(lengths)
        self._seal = seal
        self._seq = seq
        self._first = [header, seal.tag_header(seq, header)] if seal.tag_bytes else [header]
        self._segments = ((v[off:off + SEGMENT_BYTES])
                          for v in views for off in range(0, max(len(v), 1), SEGMENT_BYTES))
        self._index = 0

    def batches(self):
        """Lists of wire parts; the first holds the header."""
        seal, seq = self._seal, self._seq
        batch, size = self._first, 0
        for seg in self._segments:
            if not len(seg):
                continue
            batch += seal.seal(seq, self._index, seg)
            self._index += 1
            size += len(seg)
            if size >= SEGMENT_BYTES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


# -- the reader's side ------------------------------------------------------------
class Stream:
    """A remote reader's end: the connection to the writer and a small
    receive buffer.  ``recv`` is resumable: a deadline that passes in the
    middle of a message leaves it half-read, and the next call goes on
    from there (a ``dequeue()`` that timed out consumed nothing)."""

    INBOX_BYTES = 256 * 1024
    DIRECT_BYTES = 64 * 1024    # reads this large go straight into the frame

    def __init__(self, address: str, ipv6: bool, seal: _seal.Seal, rank: int):
        self.seal = seal
        self.address = address
        self.rank = rank
        host, port = parse_address(address)
        self.sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET,
                                  socket.SOCK_STREAM)
        _tune(self.sock)
        self.fd = self.sock.fileno()
        self._connect_error = self.sock.connect_ex((host, port))
        self._inbox = bytearray(self.INBOX_BYTES)
        self._mv = memoryview(self._inbox)
        self._lo = self._hi = 0
        self._eof = False
        self._step = None    # the message being received (a generator)
        self._seq = 0

    # -- waiting ---------------------------------------------------------------------
    def _drive(self, gen, until, end):
        """Run ``gen`` (which yields when it needs more bytes) to its end."""
        while True:
            try:
                next(gen)
            except StopIteration as s:
                return s.value
            _wait([(self.fd, select.POLLIN)], until, end)

    def _ensure(self, n: int):
        """Generator: make ``n`` bytes contiguous in the inbox (n <= its size)."""
        while self._hi - self._lo < n:
            if self._lo and self._lo + n > self.INBOX_BYTES:
                have = self._hi - self._lo
                self._mv[:have] = self._mv[self._lo:self._hi]
                self._lo, self._hi = 0, have
            k = self._recv_into(self._mv[self._hi:])
            if k is None:
                yield
            else:
                self._hi += k

    def _recv_into(self, view) -> int | None:
        try:
            k = self.sock.recv_into(view)
        except BlockingIOError:
            return None
        except (ConnectionResetError, OSError) as e:
            raise PeerGone(str(e)) from e
        if k == 0:
            raise PeerGone("closed")
        return k

    def _take(self, n: int) -> memoryview:
        v = self._mv[self._lo:self._lo + n]
        self._lo += n
        return v

    def _read_into(self, out: memoryview):
        """Generator: fill ``out`` from the stream."""
        have = min(self._hi - self._lo, len(out))
        if have:
            out[:have] = self._take(have)
        while have < len(out):
            rest = out[have:]
            if len(rest) >= self.DIRECT_BYTES:
                k = self._recv_into(rest)
                if k is None:
                    yield
                else:
                    have += k
            else:
                yield from self._ensure(len(rest))
                out[have:] = self._take(len(rest))
                have = len(out)

    # -- handshake -------------------------------------------------------------------
    def handshake(self, end) -> None:
        if self._connect_error not in (0, errno.EINPROGRESS):
            self._refused(self._connect_error)
        while not _wait([(self.fd, select.POLLOUT)], None, end):
            pass   # the connect completes (or fails) first
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._refused(err)
        try:
            self._drive(self._handshake(), None, end)
        except PeerGone:
            raise RuntimeError(
                f"fastmq: the writer at {self.address} closed the connection during the "
                "handshake: it is gone, or its handshake completed without this reader "
                "(a reader cannot join, or after a disconnect rejoin, a queue once the "
                "writer's wait_until_ready() has returned; create a new queue)") from None

    def _refused(self, err: int) -> None:
        raise RuntimeError(
            f"fastmq: cannot connect to the writer at {self.address} "
            f"({os.strerror(err)}): the writer is gone, or its handshake completed "
            "without this reader (a reader cannot join, or after a disconnect rejoin, a "
            "queue once the writer's wait_until_ready() has returned; create a new queue)")

    def _handshake(self):
        yield from self._ensure(_ZMTP_SIGNATURE_LEN)
        if _is_zmtp(bytes(self._mv[self._lo:self._hi])):
            raise WriterSpeaksZMTP()
        yield from self._ensure(CHALLENGE.size)
        magic, version, mode, challenge = CHALLENGE.unpack(self._take(CHALLENGE.size))
        if magic != MAGIC or version != VERSION:
            raise RuntimeError(f"fastmq: the peer at {self.address} is not a fastmq writer "
                               f"(protocol {bytes(magic)!r} version {version})")
        if mode != _MODE_CODES[self.seal.mode]:
            raise RuntimeError(f"fastmq: the writer at {self.address} uses remote security "
                               f"mode {_seal.MODES[mode] if mode < len(_seal.MODES) else mode!r}"
                               f" but the handle says {self.seal.mode!r}")
        nonce = os.urandom(_seal.NONCE_BYTES)
        rank, pid = self.rank, os.getpid()
        blank = HELLO.pack(MAGIC, rank, pid, nonce, bytes(_seal.PROOF_BYTES))
        hello = HELLO.pack(MAGIC, rank, pid, nonce,
                           self.seal.prove(b"reader", challenge, blank))
        self.sock.sendall(hello)
        yield from self._ensure(READY.size)
        magic, proof = READY.unpack(self._take(READY.size))
        if magic != MAGIC or not self.seal.proven(proof, b"writer", challenge, nonce,
                                                  bytes([mode])):
            raise RuntimeError(f"fastmq: the peer at {self.address} did not prove it is "
                               "this queue's writer (it does not hold the queue's key)")

    # -- messages --------------------------------------------------------------------
    def recv(self, until: float | None, end) -> list:
        """The frames of the next message (bytearrays, checked); raises
        ``TimeoutError`` (resumable), ``RuntimeError("cancelled")``,
        ``PeerGone`` (the writer's connection closed) or
        ``CorruptChunkError`` (a tag or a header that does not check)."""
        if self._step is None:
            self._step = self._message()
        try:
            frames = self._drive(self._step, until, end)
        except (TimeoutError, RuntimeError) as e:
            if isinstance(e, TimeoutError) or str(e) == "cancelled":
                raise   # the half-read message stays, to be resumed
            self._step = None
            raise
        except BaseException:
            self._step = None
            raise
        self._step = None
        return frames

    def _message(self):
        seal = self.seal
        t = seal.tag_bytes
        yield from self._ensure(HEAD.size)
        magic, seq, n = HEAD.unpack_from(self._mv, self._lo)
        if magic != MAGIC or not 1 <= n <= MAX_FRAMES:
            raise CorruptChunkError(f"fastmq: remote reader: the stream from "
                                    f"{self.address} is not a fastmq message header "
                                    f"({bytes(magic)!r}, {n} frames)")
        size = HEAD.size + 8 * n
        yield from self._ensure(size + t)
        header = self._take(size)
        if t:
            tag = self._take(t)
            if not seal.check_header(seq, header, tag):
                raise CorruptChunkError(f"fastmq: remote reader: message header from "
                                        f"{self.address} failed authentication")
        if seq != self._seq + 1:
            raise RuntimeError(
                f"fastmq: this remote reader expected message {self._seq + 1} but "
                f"received {seq}: a remote reader cannot rejoin a running queue")
        lengths = struct.unpack_from(f"<{n}Q", header, HEAD.size)
        if sum(lengths) > MAX_MESSAGE_BYTES:
            raise CorruptChunkError(f"fastmq: remote reader: message {seq} claims "
                                    f"{sum(lengths)} bytes")
        frames = []
        index = 0
        tag_buf = bytearray(t)
        wire = None
        for length in lengths:
            frame = bytearray(length)
            out = memoryview(frame)
            for off in range(0, length, SEGMENT_BYTES):
                seg = out[off:off + SEGMENT_BYTES]
                if seal.encrypting:
                    if wire is None or len(wire) < len(seg) + t:
                        wire = bytearray(min(length, SEGMENT_BYTES) + t)
                    w = memoryview(wire)[:len(seg) + t]
                    yield from self._read_into(w)
                    ok = seal.decrypt_into(seq, index, w, seg)
                else:
                    yield from self._read_into(seg)
                    ok = True
                    if t:
                        yield from self._read_into(memoryview(tag_buf))
                        ok = seal.check(seq, index, seg, tag_buf)
                if not ok:
                    raise CorruptChunkError(f"fastmq: remote reader: message {seq} from "
                                            f"{self.address} failed authentication")
                index += 1
            frames.append(frame)
        self._seq = seq
        return frames

    def close(self, linger=None) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
