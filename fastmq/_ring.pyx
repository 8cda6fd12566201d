"""The shared-memory ring: its layout, statuses and errors, and the wait
engine that both of its ends use (``RingEnd``).  The ends themselves are
``fastmq._ring_writer.RingWriter`` and ``fastmq._ring_reader.RingReader``;
each keeps its half of the flag protocol.

Why it is built this way (memory ordering, the futex protocol, the
delivery contract per path): docs/design.md.

Segment layout (all offsets from the mapping's base)::

    +---------------------------+ 0
    | header (_ring_layout.pxd) |   magic, geometry, wait mode, pids,
    |   futex words, one cache  |   each futex word / counter on its own
    |   line each               |   64-byte line so that polling one does
    |   reader slots (64 B each)|   not false-share with another
    +---------------------------+ meta_off  (64-byte aligned)
    | meta[0] | meta[1] | ...   |   meta_stride bytes per chunk (64 B lines):
    +---------------------------+   [written u8][read u8 x n_reader]
    | chunk 0 | chunk 1 | ...   |   data_off (page aligned),
    +---------------------------+   max_chunk_bytes each

Chunk framing (written by ``RingWriter``, validated by ``RingReader``)::

    [u8 overflow][3 pad][u32 nbuf][u64 len x nbuf][buf0][buf1]...

buffer 0 is the pickle stream, the others out-of-band buffers; each buffer
starts 8-byte aligned.  ``overflow == 1`` means the payload travels on the
ZMQ socket and the chunk only orders it::

    [u8 1][3 pad][u32 0][u64 message id]

The id names the socket message that carries the payload, so that a reader
can never pair a mark with another message's payload.

With node-local readers only, a message too big for a chunk goes through
the ring itself instead, cut into parts, one per chunk, and so does one of
4 MiB or more with large buffers that fits a chunk (readers copy a part out while the writer
copies the next in; fastmq._parts)::

    [u8 2][3 pad][u32 part index][u64 stream length][u64 offset]
    [u64 part length][part bytes ...]

The parts carry one stream, ``[u64 nbuf][u64 len x nbuf][buf0][buf1]...``
(unaligned): each reader copies it out chunk by chunk, releasing each chunk
at once, so a message of any size needs no more ring than one part and the
payload never leaves shared memory.  ``[u8 3]`` (an abort) ends a message
whose sending stopped between parts; readers drop what they had of it.

Flag protocol (single writer, n readers; same states as vLLM's ring)::

    writer:  wait until written == 0 or every read flag == 1
             written = 0 ; copy payload ; read flags = 0 (release)
             written = 1 (release) ; full fence ; wake parked readers
    reader:  wait until read flag == 0 (acquire) and then written == 1
             (acquire) ; copy out ; read flag = 1 (release) ; full fence ;
             wake a parked writer

The writer's half is ``RingWriter.writable`` / ``publish``, the reader's
``RingReader.readable`` / ``release_chunk`` (each with its ordering
argument).  Between the flag checks an end waits here, in ``RingEnd``.

Parking (futex mode) is level-triggered: a waiter increments the parked
counter, issues a full fence, snapshots the futex word, re-checks the flags
and only then sleeps on the snapshot.  The waker publishes, fences, and
bumps the word + wakes only if the counter is non-zero.  With both fences,
either the waker sees the waiter counted or the waiter's re-check sees the
publish, so no wakeup is lost; a busy pipeline (nobody parked) pays no
syscall.  Parked waiters also wake every PARK_SLICE as a safety net.
"""
from cpython.exc cimport PyErr_CheckSignals
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport INT64_MAX, uint8_t, uint32_t, uint64_t, int64_t

from fastmq._native.atomic cimport (
    fmq_add_u32_seq, fmq_fence_seq, fmq_futex_wait, fmq_futex_wake_all, fmq_have_futex,
    fmq_load_u32_acq, fmq_now_ns, fmq_store_u32_rel, fmq_sub_u32_seq)
from fastmq._native.layout cimport align_up as _align, word32 as _u32, word64 as _u64
from fastmq._native.proc cimport fmq_pid_init, fmq_self_pid
from fastmq._recv_buffers cimport heap_keep
from fastmq._segment cimport Segment
from pickle import load as _load, loads as _loads

from fastmq._proc import START_TAG_MASK, is_alive as _process_alive

MAGIC = 0x3152514d54534146   # b"FASTMQR1" little-endian
# 2: reader slots hold one 64-bit claim word (pid, start tag, LEFT).
# 3: the chunk flags follow the reader slots (64-byte aligned, not a page).
LAYOUT_VERSION = 3

fmq_pid_init()

# Header offsets: fastmq/_ring_layout.pxd.
from fastmq._ring_layout cimport *

cdef uint64_t CLAIM_LEFT = 1ULL << CLAIM_LEFT_BIT


# What a writer's reader_state() says of a rank's slot.
SLOT_FREE = 0      # never claimed
SLOT_ALIVE = 1     # claimed by a running process
SLOT_LEFT = 2      # its holder closed its end (exited, or dropped the queue)
SLOT_DEAD = 3      # its holder died without closing (SIGKILL, os._exit, crash)


cdef bint claim_alive(uint64_t word) except -1:
    # The pid and its start tag come from one load of one word: they are
    # always the same process's.
    if word == 0 or (word & CLAIM_LEFT):
        return False
    return _process_alive(<uint32_t>(word & CLAIM_PID_MASK),
                          (word >> 32) & CLAIM_TAG_MASK, START_TAG_MASK)


# Wait modes; the Python layer maps names to these.
WAIT_SPIN = W_SPIN
WAIT_FUTEX = W_FUTEX
WAIT_ZMQ = W_ZMQ

# What a wait returns: the caller logs (LONG_WAIT, then continue_wait()) or
# raises (a gone peer).  See RingEnd.wait_next.
READY = ST_READY
LONG_WAIT = ST_LONG_WAIT
WRITER_CLOSED = ST_WRITER_CLOSED
WRITER_DIED = ST_WRITER_DIED
READER_DIED = ST_READER_DIED
# Not waits: read_object() found an overflow mark; send_object() was handed
# a pickler that must be rebuilt first.
OVERFLOW = ST_OVERFLOW
PICKLER_STALE = ST_PICKLER_STALE
PARTS = ST_PARTS
PART_HEAD_BYTES = PART_HEAD  # a part chunk's header (fastmq._parts)


class _Pending:
    """What ``read_object`` returns instead of a message (see ``pending``)."""

    __slots__ = ()

    def __repr__(self):
        return "fastmq._ring.PENDING"


PENDING = _Pending()

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
    # The flags follow the reader slots in the header's page where they
    # fit: a small ring's bookkeeping is one page, as vLLM's is.
    meta_off = _align(H_READER_SLOTS + READER_SLOT * n_reader, 64)
    data_off = _align(meta_off + stride * max_chunks, 4096)
    # In Python's integers: a C product of huge sizes wraps, and a ring
    # whose size wrapped small could never take a message.
    total = data_off + (<object>max_chunk_bytes) * max_chunks
    if total > PY_SSIZE_T_MAX:
        raise ValueError("a ring of %d chunks of %d bytes (%d bytes) is larger than a "
                         "process can map" % (max_chunks, max_chunk_bytes, total))
    return stride, meta_off, data_off, total


cdef class RingEnd:
    """One process's end of a ring in a mapped Segment: what the writer's
    end (``RingWriter``) and a reader's (``RingReader``) share -- the
    geometry, the futex words, and the wait for this end's turn on its
    next chunk.  Only the roles are created (``RingWriter.create``,
    ``RingReader.attach``).

    The end never calls up into the queue layer.  A wait returns a status
    (``READY``, ``LONG_WAIT``, ``WRITER_CLOSED``, ``WRITER_DIED``,
    ``READER_DIED``) that the caller acts on: it logs a long wait and calls
    ``continue_wait()``, or raises for a gone peer.  Timeouts raise
    ``TimeoutError`` and ``cancel()`` raises ``RuntimeError("cancelled")``
    in the waiting thread.  In the ZMQ wait mode the end also holds the
    wakeup sockets (``use_zmq_wakeup``); it only polls and sends on them.
    """

    def __cinit__(self):
        self.park_slice_ns = PARK_SLICE_NS
        self.current_idx = 0
        self.warn_interval = 60.0
        self.owner_pid = fmq_self_pid()

    cdef int bind(self, Segment seg, tuple geometry, int wait_mode, int64_t spin_ns) except -1:
        # ``geometry`` is ``layout()``'s for the handle's sizes (n_reader,
        # max_chunk_bytes, max_chunks, stride, meta_off, data_off, total),
        # which the role wrote (create) or found in the header (attach).
        # Never read back from the header: any process that can write the
        # segment could change a word between a reader's check and a
        # second read, and these bound every later access.
        cdef char *b = <char *>seg.addr
        self.segment = seg
        self.base = b
        (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.meta_stride,
         self.meta_off, self.data_off, _) = geometry
        self.wait_mode = wait_mode
        self.spin_ns = spin_ns
        self.read_seq = _u32(b, H_READ_SEQ)
        self.readers_parked = _u32(b, H_READERS_PARKED)
        self.write_seq = _u32(b, H_WRITE_SEQ)
        self.writer_parked = _u32(b, H_WRITER_PARKED)
        self.data_view = memoryview(seg)
        return 0

    # -- what the roles define -------------------------------------------
    # RingEnd is never made on its own, only as a RingWriter or RingReader:
    # these say "not my turn" and "give up" so that a missing override
    # shows up as a wait that never succeeds, never as a read of a chunk
    # that is not ready.  Each role's spin_until is a loop over its own
    # inline flag check, so a poll is no virtual call.
    cdef bint turn(self, int idx) noexcept nogil:
        return False

    cdef int spin_until(self, int idx, int64_t until_ns) noexcept nogil:
        """1: ready, 0: ``until_ns`` passed, -1: cancelled."""
        return 0

    cdef int check_peers(self, int idx) except -1:
        return ST_READY

    cdef void mark_waiting(self, bint on) noexcept:
        pass

    # -- waiting ---------------------------------------------------------
    cdef int park_futex(self, int idx, int64_t timeout_ns) noexcept nogil:
        cdef uint32_t seq
        cdef bint ready
        fmq_add_u32_seq(self.park_counter, 1)
        fmq_fence_seq()
        seq = fmq_load_u32_acq(self.park_word)
        ready = self.turn(idx)
        if not ready and not fmq_load_u32_acq(&self.cancelled):
            fmq_futex_wait(self.park_word, seq, timeout_ns)
            ready = self.turn(idx)
        fmq_sub_u32_seq(self.park_counter, 1)
        return 1 if ready else 0

    cdef int park_zmq(self, int idx, int64_t timeout_ns) except -1:
        # A reader's park in ZMQ mode: the same registration handshake as
        # park_futex; the sleep is a poll on the notify socket (and the
        # cancel socket that shutdown() sends on).
        cdef bint ready
        fmq_add_u32_seq(self.park_counter, 1)
        fmq_fence_seq()
        try:
            ready = self.turn(idx)
            if not ready and not fmq_load_u32_acq(&self.cancelled):
                events = self.zmq_poller.poll(timeout=max(1, timeout_ns // 1000000))
                for sock, _ in events:
                    if sock is self.zmq_notify:
                        self.zmq_notify.recv(_ZMQ_NOBLOCK, copy=False)
                ready = self.turn(idx)
        finally:
            fmq_sub_u32_seq(self.park_counter, 1)
        return 1 if ready else 0

    cdef int set_zmq_wakeup(self, object notify, object poller) except -1:
        if self.wait_mode != W_ZMQ:
            raise ValueError("this ring does not use the ZMQ wait mode")
        self.zmq_notify = notify
        self.zmq_poller = poller
        return 0

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
        self.mark_waiting(True)
        try:
            status = self.spin_then_park()
        except BaseException:
            self.w_active = False
            raise
        finally:
            self.mark_waiting(False)
        if status != ST_LONG_WAIT:
            self.w_active = False
        return status

    cdef int spin_then_park(self) except -1:
        cdef int idx = self.current_idx
        cdef int mode = self.wait_mode
        cdef int64_t spin_end = (INT64_MAX if mode == W_SPIN or self.spin_only
                                 or self.spin_ns > 10**15
                                 else self.w_start + self.spin_ns)
        cdef int64_t now, until
        cdef int r, status
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
            if mode == W_FUTEX:
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

    cdef bint peer_check_due(self) noexcept:
        # Process liveness reads /proc: at most every PEER_CHECK_NS.
        cdef int64_t now = fmq_now_ns()
        if now < self.next_peer_check:
            return False
        self.next_peer_check = now + PEER_CHECK_NS
        return True

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

    # -- checks --------------------------------------------------------------
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

    cdef inline int _check_idx(self, int idx) except -1:
        if not (0 <= idx < self.max_chunks):
            raise IndexError("chunk index %d out of range 0..%d" % (idx, self.max_chunks - 1))
        return 0

    # -- views and observers ---------------------------------------------------
    def chunk_view(self, int idx):
        """A writable memoryview of chunk ``idx`` (valid while it is held)."""
        if not (0 <= idx < self.max_chunks):
            raise IndexError("chunk index %d out of range" % idx)
        cdef Py_ssize_t s = self.data_off + idx * self.max_chunk_bytes
        return self.data_view[s:s + self.max_chunk_bytes]

    def meta_view(self, int idx):
        """A memoryview of chunk ``idx``'s flags: [written, read x n_reader]."""
        if not (0 <= idx < self.max_chunks):
            raise IndexError("chunk index %d out of range" % idx)
        cdef Py_ssize_t s = self.meta_off + idx * self.meta_stride
        return self.data_view[s:s + 1 + self.n_reader]

    @property
    def parked_readers(self):
        return fmq_load_u32_acq(self.readers_parked)

    @property
    def parked_writer(self):
        return fmq_load_u32_acq(self.writer_parked)

    def close(self):
        """Drop this end's view of the mapping (the Segment unmaps when unused)."""
        if self.data_view is not None:
            self.data_view.release()
            self.data_view = None
        self.base = NULL


def decode_frames(stream, list oob=None, arena=None):
    """The object a message's frames carry: ``stream`` is the pickle stream
    (a view into a ring chunk, or a socket frame) and ``oob`` its
    out-of-band buffers, some of which may be descriptors of ``arena``
    slots (a reader's end, whose ``map_oob`` maps them to views of the
    slots).  Every message is decoded here or by ``decode_stream``,
    whichever way it came."""
    return decode(stream, oob, arena)


def decode_stream(file, Py_ssize_t nbytes):
    """The object of a message whose ``nbytes``-byte pickle stream is read
    from ``file`` as it arrives (``fastmq._piecewise``: the ring's parts, or
    a remote message's checked segments, of a message with no out-of-band
    buffer)."""
    heap_keep(nbytes if nbytes > 0 else 0)
    return _load(file)


cdef object decode(object stream, list oob, object arena):
    # Every way in (a chunk, a socket frame, a pooled buffer, piece by
    # piece) unpickles with no malloc'd buffer of the stream's size coming
    # and going: see heap_keep.
    heap_keep(len(stream))
    if oob:
        if arena is not None:
            oob = arena.map_oob(oob)
        return _loads(stream, buffers=oob)
    return _loads(stream)
