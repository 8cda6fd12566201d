"""The shared-memory ring: layout, flags, waiting and framing.

Why it is built this way (memory ordering, the futex protocol, the
delivery contract per path): docs/design.md.

Segment layout (all offsets from the mapping's base)::

    +---------------------------+ 0
    | header (_ring_layout.pxd) |   magic, geometry, wait mode, pids,
    |   futex words, one cache  |   each futex word / counter on its own
    |   line each               |   64-byte line so that polling one does
    |   reader slots (64 B each)|   not false-share with another
    +---------------------------+ meta_off  (page aligned)
    | meta[0] | meta[1] | ...   |   meta_stride bytes per chunk (64 B lines):
    +---------------------------+   [written u8][read u8 x n_reader]
    | chunk 0 | chunk 1 | ...   |   data_off (page aligned),
    +---------------------------+   max_chunk_bytes each

Chunk framing::

    [u8 overflow][3 pad][u32 nbuf][u64 len x nbuf][buf0][buf1]...

buffer 0 is the pickle stream, the others out-of-band buffers; each buffer
starts 8-byte aligned.  ``overflow == 1`` means the payload travels on the
ZMQ socket and the chunk only orders it::

    [u8 1][3 pad][u32 0][u64 message id]

The id names the socket message that carries the payload, so that a reader
can never pair a mark with another message's payload.  A reader leaves the
mark's chunk unread until that payload has arrived: a reader that times out
in between finds the same mark again on its next call.

The writer reserves a chunk's pages in /dev/shm (``Segment.reserve``) before
it first writes that far into the chunk: a full tmpfs then fails the send
with ``ShmFullError`` instead of killing the writer with SIGBUS.

Flag protocol (single writer, n readers; same states as vLLM's ring)::

    writer:  wait until written == 0 or every read flag == 1
             written = 0 ; copy payload ; read flags = 0 (release)
             written = 1 (release) ; full fence ; wake parked readers
    reader:  wait until read flag == 0 (acquire) and then written == 1
             (acquire) ; copy out ; read flag = 1 (release) ; full fence ;
             wake a parked writer

A reader loads its read flag before ``written``: a reset flag is a release
store made after ``written = 0``, so observing it orders the following load
of ``written`` after that reset (it sees 0, or the new 1 whose release makes
the payload visible).  Loading ``written`` first could pair a stale
``written == 1`` with a fresh reset flag and read a half-copied chunk.

Parking (futex mode) is level-triggered: a waiter increments the parked
counter, issues a full fence, snapshots the futex word, re-checks the flags
and only then sleeps on the snapshot.  The waker publishes, fences, and
bumps the word + wakes only if the counter is non-zero.  With both fences,
either the waker sees the waiter counted or the waiter's re-check sees the
publish, so no wakeup is lost; a busy pipeline (nobody parked) pays no
syscall.  Parked waiters also wake every PARK_SLICE as a safety net.
"""
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.buffer cimport PyBUF_READ, PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.exc cimport PyErr_CheckSignals
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.stdint cimport INT64_MAX, uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from fastmq._native.atomic cimport (
    fmq_cas_u64, fmq_add_u32_seq, fmq_cpu_relax, fmq_fence_seq, fmq_futex_wait,
    fmq_futex_wake_all, fmq_have_futex, fmq_load_u8_acq, fmq_load_u32_acq,
    fmq_load_u32_seq, fmq_now_ns, fmq_sched_yield, fmq_store_u8_rel,
    fmq_store_u32_rel, fmq_sub_u32_seq, fmq_load_u64_acq, fmq_store_u64_rel)
from fastmq._native.layout cimport (HEADER_NO_MAGIC, HEADER_OK, align_up as _align,
                                    header_status, word32 as _u32, word64 as _u64)
from fastmq._native.proc cimport fmq_pid_init, fmq_self_pid
from fastmq._segment cimport Segment
from fastmq._segment import ShmFullError
from fastmq._sink cimport PickleSink
from pickle import loads as _loads

from fastmq._proc import START_TAG_MASK, is_alive as _process_alive

MAGIC = 0x3152514d54534146   # b"FASTMQR1" little-endian
# 2: reader slots hold one 64-bit claim word (pid, start tag, LEFT).
LAYOUT_VERSION = 2

fmq_pid_init()

# Header offsets: fastmq/_ring_layout.pxd.
from fastmq._ring_layout cimport *

cdef uint64_t CLAIM_LEFT = 1ULL << CLAIM_LEFT_BIT


# What reader_state() says of a rank's slot.
SLOT_FREE = 0      # never claimed
SLOT_ALIVE = 1     # claimed by a running process
SLOT_LEFT = 2      # its holder closed its end (exited, or dropped the queue)
SLOT_DEAD = 3      # its holder died without closing (SIGKILL, os._exit, crash)


cdef inline bint _claim_alive(uint64_t word) except -1:
    # The pid and its start tag come from one load of one word: they are
    # always the same process's.
    if word == 0 or (word & CLAIM_LEFT):
        return False
    return _process_alive(<uint32_t>(word & CLAIM_PID_MASK),
                          (word >> 32) & CLAIM_TAG_MASK, START_TAG_MASK)


cdef enum:
    FRAME_HEAD = 8
    MARK_BYTES = 16
    RESERVE_STEP = 65536   # pages are reserved in steps of this many bytes
    NOGIL_COPY_MIN = 65536   # copies this large release the GIL

# Wait modes; the Python layer maps names to these.
WAIT_SPIN = 0
WAIT_FUTEX = 1
WAIT_ZMQ = 2

# What a wait returns: the caller logs (LONG_WAIT, then continue_wait()) or
# raises (a gone peer).  See RingEnd.wait_next.
cdef enum:
    ST_READY = 0
    ST_LONG_WAIT = 1
    ST_WRITER_CLOSED = 2
    ST_WRITER_DIED = 3
    ST_READER_DIED = 4
    ST_OVERFLOW = 5
    ST_PICKLER_STALE = 6
READY = ST_READY
LONG_WAIT = ST_LONG_WAIT
WRITER_CLOSED = ST_WRITER_CLOSED
WRITER_DIED = ST_WRITER_DIED
READER_DIED = ST_READER_DIED
# Not waits: read_object() found an overflow mark; send_object() was handed
# a pickler that must be rebuilt first.
OVERFLOW = ST_OVERFLOW
PICKLER_STALE = ST_PICKLER_STALE


class _Pending:
    """What ``read_object`` returns instead of a message (see ``pending``)."""

    __slots__ = ()

    def __repr__(self):
        return "fastmq._ring.PENDING"


PENDING = _Pending()
cdef object _PENDING = PENDING

cdef int64_t PARK_SLICE_NS = 100_000_000     # safety-net re-check while parked
cdef int64_t SPIN_SLICE_NS = 20_000_000      # GIL/signal check while spinning
cdef int64_t PEER_CHECK_NS = 200_000_000     # how often a wait reads /proc for peers

cdef int _ZMQ_NOBLOCK = 1                    # zmq.NOBLOCK (the ring never imports zmq)


class CorruptChunkError(RuntimeError):
    """A ring chunk's framing does not describe a valid message."""


class SegmentMismatchError(RuntimeError):
    """A segment is not a fastmq ring matching the handle."""


def have_futex():
    return bool(fmq_have_futex())


def layout(int n_reader, Py_ssize_t max_chunk_bytes, int max_chunks):
    """(meta_stride, meta_off, data_off, total) for a ring's geometry."""
    if n_reader < 1 or n_reader > 4096:
        raise ValueError("n_reader must be in 1..4096, got %d" % n_reader)
    if max_chunk_bytes < 64:
        raise ValueError("max_chunk_bytes must be at least 64, got %d" % max_chunk_bytes)
    if max_chunks < 1:
        raise ValueError("max_chunks must be at least 1, got %d" % max_chunks)
    stride = _align(1 + n_reader, 64)
    meta_off = _align(H_READER_SLOTS + READER_SLOT * n_reader, 4096)
    data_off = _align(meta_off + stride * max_chunks, 4096)
    total = data_off + max_chunk_bytes * max_chunks
    return stride, meta_off, data_off, total


cdef inline void _frame(char *c, Py_ssize_t n, const char **ptrs,
                        Py_ssize_t *lens) noexcept nogil:
    # Chunk framing (see the module docstring): head, lengths, buffers.
    cdef Py_ssize_t i, off = FRAME_HEAD + 8 * n
    c[0] = 0
    (<uint32_t *>(c + 4))[0] = <uint32_t>n
    for i in range(n):
        (<uint64_t *>(c + FRAME_HEAD + 8 * i))[0] = lens[i]
        off = _align(off, 8)
        memcpy(c + off, ptrs[i], lens[i])
        off += lens[i]


cdef class RingEnd:
    """One process's end of a ring in a mapped Segment: the writer's end
    (``reader_rank == -1``) or one reader's.

    The end never calls up into the queue layer.  A wait returns a status
    (``READY``, ``LONG_WAIT``, ``WRITER_CLOSED``, ``WRITER_DIED``,
    ``READER_DIED``) that the caller acts on: it logs a long wait and calls
    ``continue_wait()``, or raises for a gone peer.  Timeouts raise
    ``TimeoutError`` and ``cancel()`` raises ``RuntimeError("cancelled")``
    in the waiting thread.  In the ZMQ wait mode the end also holds the
    wakeup sockets (``use_zmq_wakeup``); it only polls and sends on them.
    """

    def __cinit__(self):
        self.reserved = NULL
        self.park_slice_ns = PARK_SLICE_NS
        self.reader_rank = -1
        self.current_idx = 0
        self.warn_interval = 60.0
        self.dead_rank = -1
        self.owner_pid = fmq_self_pid()

    def __dealloc__(self):
        free(self.reserved)
        self.reserved = NULL

    @staticmethod
    def create(Segment seg, int n_reader, Py_ssize_t max_chunk_bytes,
               int max_chunks, int wait_mode, int64_t spin_ns,
               uint32_t writer_pid, uint64_t writer_start, uint64_t writer_pidns=0):
        stride, meta_off, data_off, total = layout(n_reader, max_chunk_bytes, max_chunks)
        if seg.size < total:
            raise ValueError("segment of %d bytes is smaller than the ring (%d)" % (seg.size, total))
        cdef char *b = <char *>seg.addr
        seg.reserve(0, data_off, "the ring's header")
        memset(b, 0, data_off)
        _u32(b, H_VERSION)[0] = LAYOUT_VERSION
        _u32(b, H_NREADER)[0] = n_reader
        _u64(b, H_CHUNK_BYTES)[0] = max_chunk_bytes
        _u32(b, H_NCHUNKS)[0] = max_chunks
        _u32(b, H_META_STRIDE)[0] = stride
        _u64(b, H_META_OFF)[0] = meta_off
        _u64(b, H_DATA_OFF)[0] = data_off
        _u64(b, H_TOTAL)[0] = total
        _u32(b, H_WAIT_MODE)[0] = wait_mode
        _u64(b, H_SPIN_NS)[0] = spin_ns
        _u32(b, H_WRITER_PID)[0] = writer_pid
        _u64(b, H_WRITER_START)[0] = writer_start
        _u64(b, H_WRITER_PIDNS)[0] = writer_pidns
        _u32(b, H_WRITER_STATE)[0] = 1
        # The magic goes last, released: an attacher that sees it sees the rest.
        fmq_store_u64_rel(_u64(b, H_MAGIC), MAGIC)
        cdef RingEnd self = RingEnd.__new__(RingEnd)
        self._bind(seg, -1)
        return self

    @staticmethod
    def attach(Segment seg, int n_reader, Py_ssize_t max_chunk_bytes,
               int max_chunks, int reader_rank):
        """Map a reader end; every header field is checked against the handle."""
        stride, meta_off, data_off, total = layout(n_reader, max_chunk_bytes, max_chunks)
        if seg.size < H_READER_SLOTS + READER_SLOT:
            raise SegmentMismatchError(
                "shared memory segment %r (%d bytes) is too small to be a fastmq ring"
                % (seg.name, seg.size))
        cdef char *b = <char *>seg.addr
        status = header_status(b, MAGIC, LAYOUT_VERSION)
        if status == HEADER_NO_MAGIC:
            raise SegmentMismatchError(
                "shared memory segment %r is not a fastmq ring (no fastmq header); "
                "was the handle made by vLLM's own MessageQueue while this process "
                "uses fastmq's?" % seg.name)
        if status != HEADER_OK:
            raise SegmentMismatchError("fastmq ring %r has layout version %d, this "
                                       "fastmq reads version %d"
                                       % (seg.name, _u32(b, H_VERSION)[0], LAYOUT_VERSION))
        got = (_u32(b, H_NREADER)[0], _u64(b, H_CHUNK_BYTES)[0], _u32(b, H_NCHUNKS)[0],
               _u32(b, H_META_STRIDE)[0], _u64(b, H_META_OFF)[0], _u64(b, H_DATA_OFF)[0],
               _u64(b, H_TOTAL)[0])
        want = (n_reader, max_chunk_bytes, max_chunks, stride, meta_off, data_off, total)
        if got != want or seg.size < total:
            raise SegmentMismatchError(
                "fastmq ring %r header %r does not match its handle %r (segment %d bytes)"
                % (seg.name, got, want, seg.size))
        if not (0 <= reader_rank < n_reader):
            raise ValueError("reader rank %d out of range for %d readers" % (reader_rank, n_reader))
        mode = _u32(b, H_WAIT_MODE)[0]
        if mode > WAIT_ZMQ:
            raise SegmentMismatchError("fastmq ring %r has unknown wait mode %d" % (seg.name, mode))
        cdef RingEnd self = RingEnd.__new__(RingEnd)
        self._bind(seg, reader_rank)
        return self

    def _bind(self, Segment seg, int reader_rank):
        cdef char *b = <char *>seg.addr
        self.segment = seg
        self.base = b
        self.n_reader = _u32(b, H_NREADER)[0]
        self.max_chunk_bytes = _u64(b, H_CHUNK_BYTES)[0]
        self.max_chunks = _u32(b, H_NCHUNKS)[0]
        self.meta_stride = _u32(b, H_META_STRIDE)[0]
        self.meta_off = _u64(b, H_META_OFF)[0]
        self.data_off = _u64(b, H_DATA_OFF)[0]
        self.wait_mode = _u32(b, H_WAIT_MODE)[0]
        self.spin_ns = _u64(b, H_SPIN_NS)[0]
        self.read_seq = _u32(b, H_READ_SEQ)
        self.readers_parked = _u32(b, H_READERS_PARKED)
        self.write_seq = _u32(b, H_WRITE_SEQ)
        self.writer_parked = _u32(b, H_WRITER_PARKED)
        self.reader_rank = reader_rank
        self.is_writer = reader_rank < 0
        if self.is_writer:
            # Bytes of each chunk already reserved in /dev/shm (writer only).
            self.reserved = <Py_ssize_t *>calloc(self.max_chunks, sizeof(Py_ssize_t))
            if self.reserved == NULL:
                raise MemoryError()
        self.data_view = memoryview(seg)

    # -- small accessors -------------------------------------------------
    cdef inline uint8_t *meta(self, int idx) nogil:
        return <uint8_t *>(self.base + self.meta_off + idx * self.meta_stride)

    cdef inline char *chunk(self, int idx) nogil:
        return self.base + self.data_off + idx * self.max_chunk_bytes

    cdef inline bint readable(self, int idx) nogil:
        cdef uint8_t *m = self.meta(idx)
        # Read flag first, then written: see the module docstring.
        if fmq_load_u8_acq(m + 1 + self.reader_rank) != 0:
            return False
        return fmq_load_u8_acq(m) == 1

    cdef inline bint writable(self, int idx) nogil:
        cdef uint8_t *m = self.meta(idx)
        cdef int r
        if fmq_load_u8_acq(m) == 0:
            return True
        for r in range(self.n_reader):
            if fmq_load_u8_acq(m + 1 + r) == 0:
                return False
        return True

    cdef inline bint turn(self, int idx) nogil:
        # This end's turn on chunk idx: free to write (the writer's end) or
        # published and unread (a reader's end).
        return self.writable(idx) if self.is_writer else self.readable(idx)

    # -- waiting ---------------------------------------------------------
    cdef int spin_until(self, int idx, int64_t until_ns) nogil:
        """1: ready, 0: ``until_ns`` passed, -1: cancelled."""
        cdef unsigned int i = 0
        while True:
            if self.turn(idx):
                return 1
            i += 1
            if (i & 63) == 0:
                if fmq_load_u32_acq(&self.cancelled):
                    return -1
                if fmq_now_ns() >= until_ns:
                    return 0
                # Give a core back to a writer/reader sharing it (with two
                # cores and several readers the machine is oversubscribed).
                fmq_sched_yield()
            else:
                fmq_cpu_relax()

    cdef int park_futex(self, int idx, int64_t timeout_ns) nogil:
        cdef uint32_t *counter = self.writer_parked if self.is_writer else self.readers_parked
        cdef uint32_t *word = self.write_seq if self.is_writer else self.read_seq
        cdef uint32_t seq
        cdef bint ready
        fmq_add_u32_seq(counter, 1)
        fmq_fence_seq()
        seq = fmq_load_u32_acq(word)
        ready = self.turn(idx)
        if not ready and not fmq_load_u32_acq(&self.cancelled):
            fmq_futex_wait(word, seq, timeout_ns)
            ready = self.turn(idx)
        fmq_sub_u32_seq(counter, 1)
        return 1 if ready else 0

    cdef int park_zmq(self, int idx, int64_t timeout_ns) except -1:
        # A reader's park in ZMQ mode: the same registration handshake as
        # park_futex; the sleep is a poll on the notify socket (and the
        # cancel socket that shutdown() sends on).
        cdef bint ready
        fmq_add_u32_seq(self.readers_parked, 1)
        fmq_fence_seq()
        try:
            ready = self.readable(idx)
            if not ready and not fmq_load_u32_acq(&self.cancelled):
                events = self.zmq_poller.poll(timeout=max(1, timeout_ns // 1000000))
                for sock, _ in events:
                    if sock is self.zmq_notify:
                        self.zmq_notify.recv(_ZMQ_NOBLOCK, copy=False)
                ready = self.readable(idx)
        finally:
            fmq_sub_u32_seq(self.readers_parked, 1)
        return 1 if ready else 0

    def use_zmq_wakeup(self, notify, poller=None):
        """ZMQ wait mode: the writer's end sends a wakeup on ``notify`` (an
        XPUB) while a reader is parked; a reader's end parks by polling
        ``poller`` (its ``notify`` SUB and a cancel socket)."""
        if self.wait_mode != WAIT_ZMQ:
            raise ValueError("this ring does not use the ZMQ wait mode")
        if not self.is_writer and poller is None:
            raise ValueError("a reader's end parks on a poller")
        self.zmq_notify = notify
        self.zmq_poller = poller

    def wait_next(self, timeout=None):
        """Wait for this end's turn on its next chunk: free (the writer's
        end) or published (a reader's end).

        Returns ``READY``, or a status the caller acts on: ``LONG_WAIT``
        (another ``warn_interval`` passed; call ``continue_wait()`` to go
        on with the same deadline), ``WRITER_CLOSED`` / ``WRITER_DIED``
        (a reader's end: nothing more will come) or ``READER_DIED`` (the
        writer's end: ``dead_rank`` / ``dead_pid`` name a reader that died
        without reading the chunk).  Raises ``TimeoutError`` after
        ``timeout`` seconds and ``RuntimeError("cancelled")`` once this end
        is cancelled -- at once, even when the chunk is ready: shutdown()
        stops a busy end too, not only an idle one."""
        self._check_open()
        return self.begin_wait(timeout)

    cdef int begin_wait(self, object timeout) except -1:
        if fmq_load_u32_acq(&self.cancelled):
            raise RuntimeError("cancelled")
        cdef int idx = self.current_idx
        if self.turn(idx):
            return ST_READY
        cdef int64_t start = fmq_now_ns()
        cdef int64_t deadline = INT64_MAX
        cdef double t_s
        if timeout is not None:
            t_s = timeout
            # inf, nan or beyond ~285 years: no deadline (the cast would
            # overflow into the past).
            if t_s < 9.0e9:
                deadline = start + <int64_t>(max(t_s, 0.0) * 1e9)
        self.w_start = start
        self.w_deadline = deadline
        self.w_warn_ns = (<int64_t>(self.warn_interval * 1e9)
                          if 0 < self.warn_interval < 9.0e9 else 0)
        self.w_next_warn = start + self.w_warn_ns if self.w_warn_ns > 0 else INT64_MAX
        self.w_active = True
        return self.wait_loop()

    def continue_wait(self):
        """Go on with the wait that returned ``LONG_WAIT``."""
        self._check_open()
        if not self.w_active:
            raise RuntimeError("fastmq ring: continue_wait() without a wait in progress")
        return self.wait_loop()

    @property
    def waited(self):
        """Seconds the current (or last) slow wait has lasted."""
        return (fmq_now_ns() - self.w_start) / 1e9

    cdef int wait_loop(self) except -1:
        # A wait in progress ends (w_active = False) with anything but
        # LONG_WAIT: ready, a gone peer, a timeout or a cancel.
        cdef int status
        try:
            status = self.spin_then_park()
        except BaseException:
            self.w_active = False
            raise
        if status != ST_LONG_WAIT:
            self.w_active = False
        return status

    cdef int spin_then_park(self) except -1:
        cdef int idx = self.current_idx
        cdef int mode = self.wait_mode
        cdef int64_t spin_end = (INT64_MAX if mode == WAIT_SPIN or self.spin_ns > 10**15
                                 else self.w_start + self.spin_ns)
        cdef int64_t now, until
        cdef int r, status
        # A ZMQ-mode writer has no socket to park on: it spins with yields.
        if self.is_writer and mode == WAIT_ZMQ:
            spin_end = INT64_MAX
        while True:
            now = fmq_now_ns()
            if now >= spin_end:
                break
            until = min(spin_end, self.w_deadline, self.w_next_warn, now + SPIN_SLICE_NS)
            with nogil:
                r = self.spin_until(idx, until)
            if r == 1:
                return ST_READY
            if r < 0:
                raise RuntimeError("cancelled")
            status = self.between_slices(idx)
            if status != ST_READY:
                return status
        while True:
            now = fmq_now_ns()
            until = min(self.w_deadline, self.w_next_warn, now + self.park_slice_ns)
            if mode == WAIT_FUTEX:
                with nogil:
                    r = self.park_futex(idx, until - now)
            else:
                r = self.park_zmq(idx, until - now)
            if r == 1:
                return ST_READY
            if fmq_load_u32_acq(&self.cancelled):
                raise RuntimeError("cancelled")
            status = self.between_slices(idx)
            if status != ST_READY:
                return status

    cdef int between_slices(self, int idx) except -1:
        """Between spin slices and park slices: signals, peers, timeout, the
        long-wait clock.  ``ST_READY`` means: keep waiting.

        Peers come before the timeout: a caller that polls with short
        timeouts must still learn that the writer closed the queue or died
        (the peer check is throttled, so this costs a clock read)."""
        PyErr_CheckSignals()
        cdef int status = self.check_peers(idx)
        if status != ST_READY:
            return status
        cdef int64_t now = fmq_now_ns()
        if now >= self.w_deadline:
            raise TimeoutError
        if now >= self.w_next_warn:
            self.w_next_warn += self.w_warn_ns
            return ST_LONG_WAIT
        return ST_READY

    cdef int check_peers(self, int idx) except -1:
        # The writer's closed flag is one acquire load: checked every slice.
        # Process liveness reads /proc: at most every PEER_CHECK_NS.
        if not self.is_writer and self.closed_by_writer() and not self.readable(idx):
            return ST_WRITER_CLOSED
        cdef int64_t now = fmq_now_ns()
        if now < self.next_peer_check:
            return ST_READY
        self.next_peer_check = now + PEER_CHECK_NS
        if self.is_writer:
            return ST_READER_DIED if self.find_dead_reader(idx) else ST_READY
        cdef int state = self.writer_state()
        # The chunk is re-checked after the writer's state was loaded: a
        # message published just before it closed or died is still read.
        if state != ST_READY and not self.readable(idx):
            return state
        return ST_READY

    cdef bint find_dead_reader(self, int idx) except -1:
        # Sets dead_rank / dead_pid / dead_left to the first gone reader
        # (died, or closed its end) among those that have not read chunk
        # idx, or among all attached readers (idx < 0).
        cdef uint8_t *m = NULL
        cdef uint64_t word
        cdef int r
        if idx >= 0:
            m = self.meta(idx)
            if fmq_load_u8_acq(m) == 0:
                return False
        for r in range(self.n_reader):
            if m != NULL and fmq_load_u8_acq(m + 1 + r) != 0:
                continue
            word = fmq_load_u64_acq(self.claim_word(r))
            if word != 0 and not _claim_alive(word):
                self.dead_rank = r
                self.dead_pid = <uint32_t>(word & CLAIM_PID_MASK)
                self.dead_left = (word & CLAIM_LEFT) != 0
                return True
        return False

    cdef inline uint64_t *claim_word(self, int rank) noexcept nogil:
        return <uint64_t *>(self.base + H_READER_SLOTS + READER_SLOT * rank)

    cdef inline bint closed_by_writer(self) noexcept:
        return fmq_load_u32_acq(_u32(self.base, H_WRITER_STATE)) == 2

    cdef int writer_state(self) except -1:
        if self.closed_by_writer():
            return ST_WRITER_CLOSED
        if not _process_alive(self.writer_pid, self.writer_start):
            return ST_WRITER_DIED
        return ST_READY

    def peer_status(self):
        """For waits outside the ring (a socket, a flush): a reader's end
        returns ``WRITER_CLOSED`` or ``WRITER_DIED`` when the writer is
        gone; the writer's end returns ``READER_DIED`` when an attached
        reader is dead (``dead_rank`` / ``dead_pid``).  Else ``READY``."""
        self._check_open()
        if self.is_writer:
            return ST_READER_DIED if self.find_dead_reader(-1) else ST_READY
        return self.writer_state()

    def cancel(self):
        """Wake this end's waits with RuntimeError('cancelled'). Thread-safe."""
        fmq_store_u32_rel(&self.cancelled, 1)
        if self.base == NULL:
            return
        fmq_fence_seq()
        # Bumping the words makes a waiter that snapshotted them just before
        # sleeping return at once; other processes' waiters re-check and
        # park again.
        fmq_add_u32_seq(self.read_seq, 1)
        fmq_futex_wake_all(self.read_seq)
        fmq_add_u32_seq(self.write_seq, 1)
        fmq_futex_wake_all(self.write_seq)

    # -- writer ------------------------------------------------------------
    cdef int publish(self, int idx) except -1:
        cdef uint8_t *m = self.meta(idx)
        cdef int r
        for r in range(self.n_reader):
            fmq_store_u8_rel(m + 1 + r, 0)
        fmq_store_u8_rel(m, 1)
        # Counted here, in C, right after the release: the caller tells
        # "published" from "not" by this counter, and no Python exception
        # can land between the two.
        self.n_published += 1
        # For observers only (fastmq ls): where the writer is, exactly.
        fmq_store_u64_rel(_u64(self.base, H_PUBLISHED), self.n_published)
        self.current_idx = (idx + 1) % self.max_chunks
        fmq_fence_seq()
        if fmq_load_u32_seq(self.readers_parked) != 0:
            self.wakeups += 1
            if self.wait_mode == WAIT_ZMQ:
                try:
                    self.zmq_notify.send(b"\x00")
                except Exception as e:
                    # Already published: a failed notify must not fail the
                    # send (a parked reader re-checks within a park slice).
                    # Counted, and kept as text for the caller to log: the
                    # exception's traceback would keep frames alive.
                    self.notify_errors += 1
                    self.last_notify_error = repr(e)
            else:
                fmq_add_u32_seq(self.read_seq, 1)
                fmq_futex_wake_all(self.read_seq)
        return 0

    cdef inline int _check_open(self) except -1:
        if self.base == NULL:
            raise RuntimeError("fastmq ring is closed")
        if self.owner_pid != fmq_self_pid():
            # Inherited through fork(): the ring's flags and this end's
            # position are the parent's; touching them would lose or
            # duplicate the parent's messages.
            raise RuntimeError(
                "fastmq ring end of process %d used in its forked child %d; a ring end "
                "belongs to the process that created or attached it"
                % (self.owner_pid, fmq_self_pid()))
        return 0

    cdef inline int _check_turn(self, int idx) except -1:
        # Every write and read is preceded by wait_next(); this guards the
        # shared memory against a caller that skipped it.
        if not self.turn(idx):
            raise RuntimeError("fastmq ring: chunk %d is not this end's to %s; wait_next() "
                               "first" % (idx, "write" if self.is_writer else "read"))
        return 0

    cdef inline int _check_writer(self) except -1:
        self._check_open()
        if not self.is_writer:
            raise RuntimeError("only the writer's end of a ring writes")
        return 0

    cdef inline int _check_reader(self) except -1:
        self._check_open()
        if self.is_writer:
            raise RuntimeError("only a reader's end of a ring reads")
        return 0

    def begin_write(self):
        """Take the next chunk for writing in place and return its index
        (its written flag cleared).  All of it is reserved, so the caller may
        write anywhere in it; ``publish_chunk(idx)`` publishes it."""
        self._check_writer()
        cdef int idx = self.current_idx
        self._check_turn(idx)
        self.reserve_chunk(idx, self.max_chunk_bytes)
        fmq_store_u8_rel(self.meta(idx), 0)
        return idx

    cdef int reserve_chunk(self, int idx, Py_ssize_t nbytes) except -1:
        # Steady state: one comparison.  A chunk's reservation only grows,
        # in RESERVE_STEP steps, so a stream of similar sizes pays one
        # posix_fallocate per chunk in the ring's lifetime.
        if nbytes <= self.reserved[idx]:
            return 0
        cdef Py_ssize_t want = min(_align(nbytes, RESERVE_STEP), self.max_chunk_bytes)
        self.segment.reserve(self.data_off + idx * self.max_chunk_bytes, want,
                             "writing a %d-byte message into ring chunk %d" % (nbytes, idx))
        self.reserved[idx] = want
        return 0

    cdef inline int _check_idx(self, int idx) except -1:
        if not (0 <= idx < self.max_chunks):
            raise IndexError("chunk index %d out of range 0..%d" % (idx, self.max_chunks - 1))
        return 0

    def publish_chunk(self, int idx):
        self._check_writer()
        if idx != self.current_idx:
            raise RuntimeError("fastmq ring: chunk %d is not the one being written (%d)"
                               % (idx, self.current_idx))
        self.publish(idx)

    def reserve_next(self, Py_ssize_t nbytes):
        """Reserve the next chunk's first ``nbytes`` (capped at the chunk)
        now, so that a later ``send``/``send_overflow_mark`` into it cannot
        fail for lack of /dev/shm (``ShmFullError`` here instead)."""
        self._check_writer()
        self.reserve_chunk(self.current_idx, min(max(nbytes, MARK_BYTES), self.max_chunk_bytes))

    def framed_size(self, list buffers):
        """The bytes ``send(buffers)`` would fill in a chunk."""
        cdef Py_ssize_t total = FRAME_HEAD + 8 * len(buffers)
        for b in buffers:
            total = _align(total, 8) + memoryview(b).nbytes
        return total

    def send(self, list buffers, timeout=None, bint committed=False):
        """Wait for the next chunk (as ``wait_next``), frame ``buffers`` into
        it and publish it.

        Returns the framed size; 0, without waiting or touching anything,
        when the framed message does not fit a chunk (the caller then takes
        the overflow path); or, with nothing sent, a wait status negated
        (``-LONG_WAIT``, ``-READER_DIED``): the caller acts on it, goes on
        with ``continue_wait()`` until ``READY``, and sends again.
        ``ShmFullError`` when /dev/shm cannot back the chunk's pages:
        nothing is published and the ring stays usable.

        ``committed``: the message already reached other readers (the
        remote ones), so the chunk -- already free, and reserved by
        ``reserve_next`` -- must take it too: no wait, and no
        ``cancel()`` refuses it.
        """
        self._check_writer()
        cdef Py_ssize_t n = len(buffers)
        cdef Py_ssize_t i
        cdef Py_buffer *views = <Py_buffer *>malloc(sizeof(Py_buffer) * (n if n > 0 else 1))
        cdef const char **ptrs = <const char **>malloc(sizeof(char *) * (n if n > 0 else 1))
        cdef Py_ssize_t *lens = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * (n if n > 0 else 1))
        cdef Py_ssize_t got = 0
        try:
            if views == NULL or ptrs == NULL or lens == NULL:
                raise MemoryError()
            for i in range(n):
                PyObject_GetBuffer(buffers[i], &views[i], PyBUF_SIMPLE)
                got += 1
                ptrs[i] = <const char *>views[i].buf
                lens[i] = views[i].len
            return self.frame_and_publish(n, ptrs, lens, timeout, committed)
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            free(views)
            free(ptrs)
            free(lens)

    cdef Py_ssize_t frame_and_publish(self, Py_ssize_t n, const char **ptrs,
                                      Py_ssize_t *lens, object timeout,
                                      bint committed) except -1000:
        # send()'s work once the buffers are pinned: see its docstring for
        # what the result means.
        cdef Py_ssize_t i, total = FRAME_HEAD + 8 * n, off
        cdef int idx, status
        cdef char *c
        for i in range(n):
            total = _align(total, 8) + lens[i]
        if total > self.max_chunk_bytes:
            return 0
        if committed:
            self._check_turn(self.current_idx)
        else:
            status = self.begin_wait(timeout)
            if status != ST_READY:
                return -status
        idx = self.current_idx
        self.reserve_chunk(idx, total)
        c = self.chunk(idx)
        fmq_store_u8_rel(self.meta(idx), 0)
        if total >= NOGIL_COPY_MIN:
            with nogil:
                _frame(c, n, ptrs, lens)
        else:
            # Releasing the GIL costs more than copying a small message.
            _frame(c, n, ptrs, lens)
        self.publish(idx)
        return total

    def send_object(self, obj, pickler, PickleSink sink, timeout=None):
        """Pickle ``obj`` with ``pickler`` (whose file and buffer callback
        are ``sink``) and send it: the writer's whole ``enqueue()`` of a
        message that fits a chunk, in one call.

        The object is pickled before the ring is touched, so one that
        cannot be pickled raises with nothing sent.  Returns as
        ``send_pickled``, or ``-PICKLER_STALE`` with nothing pickled when
        the sink says the pickler must be rebuilt first."""
        self._check_writer()
        if sink.needs_new_pickler():
            return -ST_PICKLER_STALE
        try:
            sink.pickle(pickler, obj)
            return self.send_sink(sink, timeout)
        except BaseException:
            # Nothing was published (the publish is the last step and
            # cannot fail): the message's arena slots are free again.
            sink.aborted()
            raise

    def send_pickled(self, PickleSink sink, timeout=None):
        """Frame the message pickled into ``sink`` into the next chunk and
        publish it (as ``send``); then ``sink``'s arena commit runs and the
        sink lets go of the message's out-of-band buffers.  Returns the
        framed size; 0 when the message does not fit a chunk (nothing sent,
        ``sink.frames()`` gives it for the overflow path); or a wait status
        negated, with nothing sent: act on it, ``continue_wait()`` until
        ``READY``, then call this again."""
        self._check_writer()
        try:
            return self.send_sink(sink, timeout)
        except BaseException:
            sink.aborted()
            raise

    cdef Py_ssize_t send_sink(self, PickleSink sink, object timeout) except -1000:
        if not sink.holding:
            raise RuntimeError("fastmq: no pickled message in the sink")
        cdef list oob = sink.oob
        cdef Py_ssize_t n = 1 + len(oob), i, got = 1, sent
        cdef Py_buffer fixed_views[4]
        cdef const char *fixed_ptrs[5]
        cdef Py_ssize_t fixed_lens[5]
        cdef Py_buffer *views = fixed_views
        cdef const char **ptrs = fixed_ptrs
        cdef Py_ssize_t *lens = fixed_lens
        if n > 5:
            views = <Py_buffer *>malloc(sizeof(Py_buffer) * (n - 1))
            ptrs = <const char **>malloc(sizeof(char *) * n)
            lens = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * n)
        try:
            if views == NULL or ptrs == NULL or lens == NULL:
                raise MemoryError()
            ptrs[0] = sink.buf
            lens[0] = sink.size
            for i in range(1, n):
                PyObject_GetBuffer(oob[i - 1], &views[i - 1], PyBUF_SIMPLE)
                got += 1
                ptrs[i] = <const char *>views[i - 1].buf
                lens[i] = views[i - 1].len
            sent = self.frame_and_publish(n, ptrs, lens, timeout, False)
        finally:
            for i in range(1, got):
                PyBuffer_Release(&views[i - 1])
            if views != fixed_views:
                free(views)
                free(ptrs)
                free(lens)
        if sent > 0:
            self.sent_messages += 1
            self.sent_bytes += sent
            sink.committed()
        return sent

    def send_overflow_mark(self, uint64_t msg_id):
        """Publish, in the next chunk (``wait_next()`` returned ``READY``
        for it), a mark that says: message ``msg_id`` is on the socket."""
        self._check_writer()
        cdef int idx = self.current_idx
        self._check_turn(idx)
        self.reserve_chunk(idx, MARK_BYTES)
        fmq_store_u8_rel(self.meta(idx), 0)
        cdef char *c = self.chunk(idx)
        c[0] = 1
        (<uint32_t *>(c + 4))[0] = 0
        (<uint64_t *>(c + 8))[0] = msg_id
        # Released by the publish below: a reader that sees this mark also
        # sees the id, and can tell a corrupt mark (an id that was never
        # published) from a payload still in flight.
        _u64(self.base, H_OVERFLOW_ID)[0] = msg_id
        self.publish(idx)

    def mark_closed(self):
        if self.base != NULL:
            self._check_writer()
            fmq_store_u32_rel(_u32(self.base, H_WRITER_STATE), 2)

    # -- reader ------------------------------------------------------------
    cdef int release_chunk(self, int idx) except -1:
        fmq_store_u8_rel(self.meta(idx) + 1 + self.reader_rank, 1)
        self.n_read += 1
        fmq_store_u64_rel(_u64(self.base, H_READER_SLOTS + READER_SLOT * self.reader_rank
                               + SLOT_READ), self.n_read)
        self.current_idx = (idx + 1) % self.max_chunks
        fmq_fence_seq()
        if fmq_load_u32_seq(self.writer_parked) != 0:
            self.wakeups += 1
            fmq_add_u32_seq(self.write_seq, 1)
            fmq_futex_wake_all(self.write_seq)
        return 0

    def release_read(self, int idx):
        """Mark chunk ``idx`` (this end's current one) read by this reader."""
        self._check_reader()
        if idx != self.current_idx:
            raise RuntimeError("fastmq ring: chunk %d is not the one being read (%d)"
                               % (idx, self.current_idx))
        self.release_chunk(idx)

    def chunk_view(self, int idx):
        """A writable memoryview of chunk ``idx`` (valid while it is held)."""
        if not (0 <= idx < self.max_chunks):
            raise IndexError("chunk index %d out of range" % idx)
        cdef Py_ssize_t s = self.data_off + idx * self.max_chunk_bytes
        return self.data_view[s:s + self.max_chunk_bytes]

    cdef list take_oob(self, int idx, char *c, uint64_t *start0, uint64_t *len0):
        # Validates the chunk's framing, copies the out-of-band buffers out
        # and says where the pickle stream lies in the chunk.
        cdef uint8_t overflow = (<uint8_t *>c)[0]
        if overflow != 0:
            raise CorruptChunkError("fastmq ring chunk %d: bad overflow mark %d" % (idx, overflow))
        cdef uint64_t cap = self.max_chunk_bytes
        cdef uint64_t n = (<uint32_t *>(c + 4))[0]
        if n < 1 or FRAME_HEAD + 8 * n > cap:
            raise CorruptChunkError("fastmq ring chunk %d: bad buffer count %d" % (idx, n))
        cdef uint64_t off = FRAME_HEAD + 8 * n
        cdef uint64_t ln
        cdef Py_ssize_t i
        start0[0] = 0
        len0[0] = 0
        # Validate all lengths before touching any payload byte.
        for i in range(<Py_ssize_t>n):
            ln = (<uint64_t *>(c + FRAME_HEAD + 8 * i))[0]
            off = (off + 7) & ~(<uint64_t>7)
            if off > cap or ln > cap - off:
                raise CorruptChunkError(
                    "fastmq ring chunk %d: buffer %d of %d bytes at offset %d overruns "
                    "the %d-byte chunk" % (idx, i, ln, off, cap))
            if i == 0:
                start0[0] = off
                len0[0] = ln
            off += ln
        if n == 1:
            return None     # the common case: no list to build
        cdef list oob = []
        cdef object ba
        cdef char *dst
        off = start0[0] + len0[0]
        for i in range(1, <Py_ssize_t>n):
            ln = (<uint64_t *>(c + FRAME_HEAD + 8 * i))[0]
            off = (off + 7) & ~(<uint64_t>7)
            # Re-checked at the point of use: a length rewritten since the
            # first pass must not read past the chunk.
            if off > cap or ln > cap - off:
                raise CorruptChunkError("fastmq ring chunk %d: buffer %d changed while "
                                        "being read" % (idx, i))
            ba = PyByteArray_FromStringAndSize(NULL, ln)
            dst = PyByteArray_AS_STRING(ba)
            if ln >= NOGIL_COPY_MIN:
                with nogil:
                    memcpy(dst, c + off, ln)
            else:
                memcpy(dst, c + off, ln)
            oob.append(ba)
            off += ln
        return oob

    def read_object(self, timeout=None, arena=None):
        """A reader's whole ``dequeue()`` of a message in the ring, in one
        call: hand back ``arena``'s released slots (``flush_releases()``),
        wait for this reader's next chunk (as ``wait_next``), validate its
        framing, copy the out-of-band buffers out, unpickle the stream in
        place (``decode_frames``) and mark the chunk read -- also when the
        framing is invalid (``CorruptChunkError``) or unpickling fails.

        Returns the message, or ``PENDING`` with ``pending`` set to why
        nothing was read: a wait status (``LONG_WAIT``, ``WRITER_CLOSED``,
        ``WRITER_DIED``; act on it, ``continue_wait()`` until ``READY``,
        call again) or ``OVERFLOW`` (an overflow mark: ``overflow_id``
        names the socket message that carries the payload, and the chunk
        stays unread until ``release_read(current_idx)``)."""
        self._check_reader()
        if arena is not None:
            arena.flush_releases()
        cdef int status = self.begin_wait(timeout)
        if status != ST_READY:
            self.pending = status
            return _PENDING
        cdef int idx = self.current_idx
        cdef char *c = self.chunk(idx)
        if (<uint8_t *>c)[0] == 1:
            self.overflow_id = (<uint64_t *>(c + 8))[0]
            self.pending = ST_OVERFLOW
            return _PENDING
        cdef uint64_t start0, len0
        cdef object stream = None
        try:
            oob = self.take_oob(idx, c, &start0, &len0)
            # Unpickled in place: the chunk stays this reader's until the
            # object is built (its bytes are copies), then it is marked read.
            stream = PyMemoryView_FromMemory(c + start0, len0, PyBUF_READ)
            return _decode(stream, oob, arena)
        finally:
            try:
                if stream is not None:
                    stream.release()
            finally:
                self.release_chunk(idx)

    # -- peers (header fields other modules read) --------------------------
    @property
    def writer_pid(self):
        return _u32(self.base, H_WRITER_PID)[0]

    @property
    def writer_start(self):
        return _u64(self.base, H_WRITER_START)[0]

    @property
    def writer_closed(self):
        return fmq_load_u32_acq(_u32(self.base, H_WRITER_STATE)) == 2

    def claim_reader(self, uint32_t pid, uint64_t start):
        """Take this end's reader slot for process ``pid`` (started at
        ``start``).

        Returns 0, or the pid of another live process that holds the slot
        (then nothing changed); a slot whose holder died or left is taken
        over.  The claim word (pid and start tag) is swapped whole, against
        exactly the value judged gone, so two processes claiming one rank
        at the same time cannot both win, and none can judge a new holder
        by its predecessor's start time."""
        self._check_open()
        if self.reader_rank < 0:
            raise RuntimeError("the writer's end has no reader slot")
        cdef char *slot = self.base + H_READER_SLOTS + READER_SLOT * self.reader_rank
        cdef uint64_t *word = self.claim_word(self.reader_rank)
        cdef uint64_t mine = pid | ((start & CLAIM_TAG_MASK) << 32)
        cdef uint64_t held
        while True:
            held = fmq_load_u64_acq(word)
            if (held != 0 and (held & CLAIM_PID_MASK) != pid and _claim_alive(held)):
                return <uint32_t>(held & CLAIM_PID_MASK)
            if fmq_cas_u64(word, held, mine):
                break
        fmq_store_u64_rel(<uint64_t *>(slot + SLOT_START), start)
        fmq_store_u64_rel(<uint64_t *>(slot + SLOT_READ), 0)
        fmq_fence_seq()
        self.claim = mine
        self.claimed = True
        return 0

    cdef int release_claim(self) noexcept:
        # A clean close marks the slot LEFT and keeps the pid: a writer
        # waiting on this reader then names it at once, as it names a
        # reader that died.  Only the claiming process does this (a forked
        # child that drops the inherited end must not), and only while the
        # claim is still its own.
        if (self.claimed and self.base != NULL and self.reader_rank >= 0
                and self.owner_pid == fmq_self_pid()):
            fmq_cas_u64(self.claim_word(self.reader_rank), self.claim,
                        self.claim | CLAIM_LEFT)
            self.claimed = False
        return 0

    def reader_identity(self, int rank):
        """``(pid, start time)`` of the process that claimed reader slot
        ``rank`` (pid 0: never claimed)."""
        self._check_open()
        if not (0 <= rank < self.n_reader):
            raise IndexError(rank)
        cdef char *slot = self.base + H_READER_SLOTS + READER_SLOT * rank
        return (<uint32_t>(fmq_load_u64_acq(self.claim_word(rank)) & CLAIM_PID_MASK),
                fmq_load_u64_acq(<uint64_t *>(slot + SLOT_START)))

    def reader_state(self, int rank):
        """``(pid, state)`` of reader slot ``rank``: ``SLOT_FREE``,
        ``SLOT_ALIVE``, ``SLOT_LEFT`` or ``SLOT_DEAD``."""
        self._check_open()
        if not (0 <= rank < self.n_reader):
            raise IndexError(rank)
        cdef uint64_t word = fmq_load_u64_acq(self.claim_word(rank))
        cdef uint32_t pid = <uint32_t>(word & CLAIM_PID_MASK)
        if word == 0:
            return 0, SLOT_FREE
        if word & CLAIM_LEFT:
            return pid, SLOT_LEFT
        return pid, (SLOT_ALIVE if _claim_alive(word) else SLOT_DEAD)

    def unread_readers(self, int idx):
        """Ranks that have not read chunk ``idx`` (for the long-wait log)."""
        self._check_open()
        self._check_idx(idx)
        cdef uint8_t *m = self.meta(idx)
        if fmq_load_u8_acq(m) == 0:
            return []
        return [r for r in range(self.n_reader) if fmq_load_u8_acq(m + 1 + r) == 0]

    @property
    def overflow_latest(self):
        """Id of the newest overflow mark the writer published (0: none)."""
        self._check_open()
        return fmq_load_u64_acq(_u64(self.base, H_OVERFLOW_ID))

    @property
    def parked_readers(self):
        return fmq_load_u32_acq(self.readers_parked)

    @property
    def parked_writer(self):
        return fmq_load_u32_acq(self.writer_parked)

    def meta_view(self, int idx):
        """A memoryview of chunk ``idx``'s flags: [written, read x n_reader]."""
        if not (0 <= idx < self.max_chunks):
            raise IndexError("chunk index %d out of range" % idx)
        cdef Py_ssize_t s = self.meta_off + idx * self.meta_stride
        return self.data_view[s:s + 1 + self.n_reader]

    def close(self):
        """Drop this end's view of the mapping (the Segment unmaps when unused)."""
        self.release_claim()
        if self.data_view is not None:
            self.data_view.release()
            self.data_view = None
        self.base = NULL


def decode_frames(stream, list oob=None, arena=None):
    """The object a message's frames carry: ``stream`` is the pickle stream
    (a view into a ring chunk, or a socket frame) and ``oob`` its
    out-of-band buffers, some of which may be descriptors of ``arena``
    slots (a reader's end, whose ``map_oob`` maps them to views of the
    slots).  Every message is decoded here, whichever way it came."""
    return _decode(stream, oob, arena)


cdef object _decode(object stream, list oob, object arena):
    if oob:
        if arena is not None:
            oob = arena.map_oob(oob)
        return _loads(stream, buffers=oob)
    return _loads(stream)
