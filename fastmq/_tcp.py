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
      writer -> reader   CHALLENGE  "FMQr", version, mode, this connection's challenge (16)
      reader -> writer   HELLO      "FMQr", rank (i64), pid (i64), reader nonce (16), proof (32)
      writer -> reader   READY      "FMQr", proof (32)
    a small message (WHOLE_BYTES of frames at most), sealed at once:
      "FMQw", sequence number (u64), frame count (u32), frame lengths (u64 each),
      the frames, one tag over all of it
    a larger one:
      "FMQs", sequence number, frame count, frame lengths, the header's tag,
      then its frames cut into segments of SEGMENT_BYTES, each followed by its tag

The tags (none in security mode ``"none"``; in ``"encrypt"`` the frames are
ciphertext, the tag after them) are ``fastmq._seal``'s.  Segment indices
run across the whole message, so a reader checks each segment as it
arrives, while the next one is still on its way.

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
import threading
import time
from collections import deque

from fastmq import _seal
from fastmq._pool import BufferPool
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
WHOLE = b"FMQw"       # a message sealed whole (small)
SEGMENTED = b"FMQs"   # a message sealed segment by segment
WHOLE_BYTES = 64 * 1024
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
        self.nonce = os.urandom(_seal.NONCE_BYTES)   # this connection's challenge
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

    CLOSE_GRACE_S = 2.0

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
        self._joining: list[_Joining] = []
        self.readers: list[_Reader] = []
        self.broken: str | None = None   # why the readers can no longer be served
        self.written_any = False   # some byte of the current message was written
        self._batches = None       # the current message's batches not sealed yet
        self._sealed: list = []    # its batches sealed so far
        self._drainer = None       # sends the rest of a message past its deadline
        self._zmtp_since = None    # when a ZMQ peer first knocked
        self._closing = False
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
            proof = self.seal.prove(b"writer", j.nonce, nonce, self._mode_byte())
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
                                            j.nonce))
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
            # vLLM's own reader reconnects (ZMQ does) and comes back: that
            # is a deployment error to name; a one-off is only refused.
            now = time.monotonic()
            if self._zmtp_since is None:
                self._zmtp_since = now
            if now - self._zmtp_since < 1.0:
                return self._reject(j, "speaks ZMQ (vLLM's own MessageQueue?)")
            from fastmq.handle import HandleMismatchError

            raise HandleMismatchError(
                f"a remote reader of this fastmq queue ({j.peer[0]}) attached with vLLM's "
                "own MessageQueue (it speaks ZMQ): fastmq is not active in its process. "
                "Activate fastmq in every process of the deployment or in none.")
        if len(j.got) < HELLO.size:
            # (a ZMQ greeting, 0xFF first, is told apart once 10 bytes are here)
            if j.got[0] != 0xFF and j.got[:len(MAGIC)] != MAGIC[:len(j.got)]:
                self._reject(j, "is not a fastmq reader")
            return
        if len(j.got) > HELLO.size:
            return self._reject(j, "sent more than a hello")
        magic, rank, pid, nonce, proof = HELLO.unpack(j.got)
        if magic != MAGIC:
            return self._reject(j, "is not a fastmq reader")
        if not self.seal.proven(proof, b"reader", j.nonce, HELLO.pack(
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

    @property
    def shutting_down(self) -> bool:
        """For the drain thread's waits (see ``_wait``): the queue closed."""
        return self._closing

    def wait_drained(self, until: float | None, end) -> None:
        """Wait (as ``_wait`` does: deadline, shutdown) until the rest of an
        earlier message, which the drain thread sends, is out."""
        t = self._drainer
        while t is not None and t.is_alive():
            if end.shutting_down:
                raise RuntimeError("cancelled")
            wait = SLICE_S
            if until is not None:
                wait = min(wait, until - time.monotonic())
                if wait <= 0:
                    raise TimeoutError("fastmq: a remote reader did not take the previous "
                                       "message in time")
            t.join(wait)
        self._drainer = None

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
        returns False (the caller then has what is left copied and sent in
        the background, ``keep_rest``).  A reader whose
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
        caller owns is referenced once ``enqueue()`` returns; a thread sends
        it, and the next message waits for that thread first."""
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
            r.next_batch = 0
        self._batches, self._sealed = None, []
        # Sent in the background: the caller may wait for the readers'
        # answers before it enqueues again (vLLM's engine does).
        self._drainer = threading.Thread(target=self._drain, name="fastmq-remote-drain",
                                         daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        try:
            self.push(None, self, committing=False)
        except RuntimeError:   # closed first (see close)
            pass
        except BaseException as e:
            logger.warning("fastmq: sending the rest of a remote message failed: %r", e)

    def close(self, linger=None) -> None:
        """Close every socket.  What ``sendmsg`` took is the kernel's: it is
        still delivered (and then the connection closed) after this.  The
        rest of a message that the drain thread is still sending gets a
        short grace first."""
        t = self._drainer
        if t is not None and t.is_alive():
            t.join(self.CLOSE_GRACE_S)
            self._closing = True
            t.join(1.0)
            if t.is_alive() or any(r.parts for r in self.readers):
                logger.warning("fastmq: a remote queue was closed while a slow reader had "
                               "not taken the rest of a message whose enqueue() returned "
                               "at its deadline; that reader misses it")
        self._closing = True
        for s in ([self.listener] if self.listener is not None else []) + \
                [j.sock for j in self._joining] + [r.sock for r in self.readers]:
            try:
                s.close()
            except OSError:
                pass
        self.listener = None
        self._joining = []


class Outgoing:
    """One message as the batches of wire parts that go out in turn.

    A small message (``WHOLE_BYTES`` at most) is one batch sealed at once:
    one tag, one ``sendmsg``.  A larger one is the header, then its frames
    cut into segments, each with its tag, about a segment per batch; the
    batches are sealed lazily, as the fastest reader needs them, so a tag
    is computed while the previous segment is still being taken."""

    def __init__(self, seal: _seal.Seal, seq: int, buffers: list):
        views = [memoryview(b).cast("B") for b in buffers]
        lengths = [len(v) for v in views]
        self.nbytes = total = sum(lengths)
        whole = total <= WHOLE_BYTES
        header = HEAD.pack(WHOLE if whole else SEGMENTED, seq, len(views)) + \
            struct.pack(f"<{len(views)}Q", *lengths)
        self._seal = seal
        self._seq = seq
        if whole:
            self._first = seal.seal_whole(seq, header, views)
            self._segments = ()
        else:
            self._first = [header, seal.tag_header(seq, header)] if seal.tag_bytes else [header]
            self._segments = (v[off:off + SEGMENT_BYTES]
                              for v in views for off in range(0, len(v), SEGMENT_BYTES))

    def batches(self):
        """Lists of wire parts; the first holds the header.

        Under ``"mac"`` the tag of a batch's last segment is computed when
        the next batch is asked for, that is once the segment was handed
        to the fastest reader's socket: the reader receives (and checks)
        the segment while the writer tags it, instead of waiting for the
        tag before the first byte leaves (for a message of one segment,
        one of the two passes over it comes off the critical path), and
        the writer tags bytes the copy into the socket just read."""
        seal, seq = self._seal, self._seq
        late = seal.tag_bytes and not seal.encrypting
        batch, size, index = self._first, 0, 0
        last = None     # ("mac") the last segment sent, its tag not yet
        for seg in self._segments:
            if last is not None:
                batch.append(seal.tag(seq, index - 1, last))
                last = None
            if late and size + len(seg) >= SEGMENT_BYTES:
                batch.append(seg)
                last = seg
            else:
                batch += seal.seal(seq, index, seg)
            index += 1
            size += len(seg)
            if size >= SEGMENT_BYTES:
                yield batch
                batch, size = [], 0
        if last is not None:
            batch.append(seal.tag(seq, index - 1, last))
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

    def __init__(self, address: str, ipv6: bool, seal: _seal.Seal, rank: int,
                 keep_bytes: int = 0):
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
        self._step = None    # the message being received (a generator)
        # Large frames' memory, reused once the caller dropped it (see
        # fastmq._pool: fresh pages cost as much as receiving into them).
        self.buffers = BufferPool(keep_bytes)
        self.spin_s = 0.0    # how long a receive spins before it waits in the kernel
        self._received = 0   # bytes received so far (how _drive sees progress)
        self._seq = 0

    # -- waiting ---------------------------------------------------------------------
    def _drive(self, gen, until, end):
        """Run ``gen`` (which yields when it needs more bytes) to its end.

        Spins for ``spin_s`` first (non-blocking receives), then waits in
        the kernel: a message that follows closely is taken without the
        wakeup of a sleeping process, which on loopback costs more than
        the message itself."""
        spin_until = None
        seen = -1
        while True:
            try:
                next(gen)
            except StopIteration as s:
                return s.value
            now = time.perf_counter()
            if self._received != seen:
                # Bytes keep coming (a large message): the next ones are a
                # socket buffer's drain away, not a step away, so the
                # window restarts rather than each refill costing a wakeup.
                seen = self._received
                spin_until = now + self.spin_s
            if now < spin_until:
                # Give the core back to a writer or reader sharing it (more
                # busy processes than cores: the writer may be waiting for
                # this one to get off its core).
                os.sched_yield()
                continue
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
        self._received += k
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
    # The reader's half runs in two steps: a short-lived thread, started
    # with the reader, connects and answers the writer's challenge, so the
    # writer's wait_until_ready() can complete even before this reader's is
    # called (as it can with local readers, in one thread); then
    # wait_until_ready() waits for the writer's READY and checks its proof.
    def start_hello(self, end) -> None:
        self._hello_error = None
        self._hello_nonce = self._challenge = self._mode = None
        self._hello_thread = threading.Thread(target=self._hello, args=(end,), daemon=True,
                                              name="fastmq-remote-hello")
        self._hello_thread.start()

    def _hello(self, end) -> None:
        try:
            if self._connect_error not in (0, errno.EINPROGRESS):
                self._refused(self._connect_error)
            while not _wait([(self.fd, select.POLLOUT)], None, end):
                pass   # the connect completes (or fails) first
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._refused(err)
            self._drive(self._answer_challenge(), None, end)
        except BaseException as e:
            self._hello_error = e

    def handshake(self, end) -> None:
        t = self._hello_thread
        while t.is_alive():
            if end.shutting_down:
                raise RuntimeError("cancelled")
            t.join(SLICE_S)
        try:
            if self._hello_error is not None:
                raise self._hello_error
            self._drive(self._await_ready(), None, end)
        except PeerGone:
            raise RuntimeError(
                f"fastmq: the writer at {self.address} closed the connection during the "
                "handshake: it is gone, it did not accept this reader's key, or its "
                "handshake completed without this reader (a reader cannot join, or after "
                "a disconnect rejoin, a queue once the writer's wait_until_ready() has "
                "returned; create a new queue)") from None
        finally:
            self._hello_error = None

    def _refused(self, err: int) -> None:
        raise RuntimeError(
            f"fastmq: cannot connect to the writer at {self.address} "
            f"({os.strerror(err)}): the writer is gone, or its handshake completed "
            "without this reader (a reader cannot join, or after a disconnect rejoin, a "
            "queue once the writer's wait_until_ready() has returned; create a new queue)")

    def _answer_challenge(self):
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
        self._challenge, self._hello_nonce, self._mode = challenge, nonce, mode

    def _await_ready(self):
        yield from self._ensure(READY.size)
        magic, proof = READY.unpack(self._take(READY.size))
        if magic != MAGIC or not self.seal.proven(proof, b"writer", self._challenge,
                                                  self._hello_nonce, bytes([self._mode])):
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
        kind, seq, n = HEAD.unpack_from(self._mv, self._lo)
        if kind not in (WHOLE, SEGMENTED) or not 1 <= n <= MAX_FRAMES:
            raise CorruptChunkError(f"fastmq: remote reader: the stream from "
                                    f"{self.address} is not a fastmq message header "
                                    f"({bytes(kind)!r}, {n} frames)")
        size = HEAD.size + 8 * n
        yield from self._ensure(size)
        lengths = struct.unpack_from(f"<{n}Q", self._mv, self._lo + HEAD.size)
        total = sum(lengths)
        if kind == WHOLE:
            if total > WHOLE_BYTES:
                raise CorruptChunkError(f"fastmq: remote reader: message {seq} claims "
                                        f"{total} bytes in a small message's form")
            yield from self._ensure(size + total + t)
            wire = self._take(size + total + t)
            body = seal.open_whole(seq, wire, size, total)
            if body is None:
                raise self._unauthentic(seq)
            self._check_seq(seq)
            frames, off = [], 0
            for length in lengths:
                frames.append(bytearray(body[off:off + length]))
                off += length
            return frames
        yield from self._ensure(size + t)
        header = self._take(size)
        if t and not seal.check_header(seq, header, self._take(t)):
            raise self._unauthentic(seq)
        self._check_seq(seq)
        if total > MAX_MESSAGE_BYTES:
            raise CorruptChunkError(f"fastmq: remote reader: message {seq} claims "
                                    f"{total} bytes")
        frames = []
        index = 0
        tag_buf = bytearray(t)
        wire = None
        for length in lengths:
            frame = self._frame_buffer(length)
            out = memoryview(frame)
            for off in range(0, length, SEGMENT_BYTES):
                seg = out[off:off + SEGMENT_BYTES]
                if seal.encrypting:
                    if wire is None:
                        wire = memoryview(bytearray(SEGMENT_BYTES + t))
                    w = wire[:len(seg) + t]
                    yield from self._read_into(w)
                    ok = seal.decrypt_into(seq, index, w, seg)
                else:
                    yield from self._read_into(seg)
                    ok = True
                    if t:
                        # Tagged before the writer's tag is read: the writer
                        # sends it after the segment, once it has computed it
                        # too (Outgoing.batches), and both run at once.
                        expected = seal.tag(seq, index, seg)
                        yield from self._read_into(memoryview(tag_buf))
                        ok = seal.matches(expected, tag_buf)
                if not ok:
                    raise self._unauthentic(seq)
                index += 1
            frames.append(frame)
        return frames

    def _frame_buffer(self, length: int):
        """Writable memory for a received frame.  A large one comes from
        the pool, not zeroed first (``bytearray(n)`` writes every page
        once before the socket writes it again)."""
        if length < self.DIRECT_BYTES:
            return bytearray(length)
        return self.buffers.take(length)

    def _unauthentic(self, seq: int) -> CorruptChunkError:
        return CorruptChunkError(f"fastmq: remote reader: message {seq} from {self.address} "
                                 "failed authentication (not sealed with this queue's key)")

    def _check_seq(self, seq: int) -> None:
        if seq != self._seq + 1:
            raise RuntimeError(
                f"fastmq: this remote reader expected message {self._seq + 1} but "
                f"received {seq}: a remote reader cannot rejoin a running queue")
        self._seq = seq

    def close(self, linger=None) -> None:
        self.buffers.close()
        try:
            self.sock.close()
        except OSError:
            pass
