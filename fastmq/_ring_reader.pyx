"""A reader's end of a ring (``RingReader``): it attaches to a ring the
writer created, claims its reader slot, reads and validates chunks, and
wakes a parked writer.  The layout, the framing and the wait it shares with
the writer: fastmq/_ring.pyx.

The reader's half of the flag protocol::

    wait until read flag == 0 (acquire) and then written == 1 (acquire) ;
    copy out ; read flag = 1 (release) ; full fence ; wake a parked writer

A reader loads its read flag before ``written``: a reset flag is a release
store made after ``written = 0``, so observing it orders the following load
of ``written`` after that reset (it sees 0, or the new 1 whose release makes
the payload visible).  Loading ``written`` first could pair a stale
``written == 1`` with a fresh reset flag and read a half-copied chunk.

A reader leaves an overflow mark's chunk unread until the payload it names
has arrived on the socket: a reader that times out in between finds the
same mark again on its next call.
"""
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.buffer cimport (PyBUF_READ, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release,
                            PyObject_GetBuffer)
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcpy
from posix.unistd cimport close as c_close

cdef extern from "poll.h" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum:
        POLLIN

from fastmq._native.atomic cimport (
    fmq_add_u32_seq, fmq_cas_u64, fmq_fence_seq, fmq_futex_wake_all, fmq_load_u8_acq,
    fmq_load_u32_acq, fmq_load_u32_seq, fmq_load_u64_acq, fmq_store_u8_rel,
    fmq_store_u64_rel)
from fastmq._native.layout cimport (HEADER_NO_MAGIC, HEADER_OK, header_status,
                                    word32 as _u32, word64 as _u64)
from fastmq._native.proc cimport fmq_self_pid

cdef extern from "fmq_populate.h" nogil:
    int fmq_map_for_reading(char *p, size_t n)
from fastmq._ring cimport (CHUNK_PART, CHUNK_PART_ABORT, FRAME_HEAD, NOGIL_COPY_MIN,
                           PART_HEAD, RESERVE_STEP, ST_OVERFLOW, ST_PARTS, ST_READY,
                           ST_WRITER_CLOSED, ST_WRITER_DIED, W_ZMQ, RingEnd, claim_alive,
                           decode, spin_tick)
from fastmq._recv_buffers cimport POOLED_MIN
from fastmq._ring_layout cimport *
from fastmq._segment cimport Segment

from fastmq._proc import is_alive as _process_alive, pid_namespace as _pid_namespace
from fastmq._ring import (LAYOUT_VERSION, MAGIC, PENDING, CorruptChunkError,
                          SegmentMismatchError, layout)

cdef uint64_t CLAIM_LEFT = 1ULL << CLAIM_LEFT_BIT
cdef object _PENDING = PENDING


cdef class RingReader(RingEnd):
    """Reader ``reader_rank``'s end of a ring (``RingReader.attach``).  Its
    wait (``wait_next``) is for the next chunk to be published; it returns
    ``WRITER_CLOSED`` / ``WRITER_DIED`` when the writer is gone and that
    chunk is still unpublished."""

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
        # Each word read once: what is checked is what is used.
        mode = _u32(b, H_WAIT_MODE)[0]
        if mode > W_ZMQ:
            raise SegmentMismatchError("fastmq ring %r has unknown wait mode %d" % (seg.name, mode))
        spin_ns = <int64_t>_u64(b, H_SPIN_NS)[0]
        cdef RingReader self = RingReader.__new__(RingReader)
        self.bind(seg, want, mode, spin_ns)
        self.reader_rank = reader_rank
        self.writer_pidfd = -1
        # A pid means something only in its pid namespace: a reader in
        # another one (a child namespace that sees the host's /proc, a
        # sidecar) must not judge the writer by it.
        ns = _u64(b, H_WRITER_PIDNS)[0]
        mine = _pid_namespace()
        self.writer_pid_visible = ns == 0 or mine == 0 or ns == mine
        # The readers park together: one counter, one futex word.
        self.park_counter = self.readers_parked
        self.park_word = self.read_seq
        # Each chunk's first page, populated by the writer at creation,
        # mapped here too: a fresh queue's first messages take no fault.
        cdef int idx
        for idx in range(max_chunks):
            fmq_map_for_reading(self.chunk(idx), min(RESERVE_STEP, max_chunk_bytes))
        return self

    # -- the reader's turn -------------------------------------------------
    cdef inline bint readable(self, int idx) noexcept nogil:
        cdef uint8_t *m = self.meta(idx)
        # Read flag first, then written: see the module docstring.
        if fmq_load_u8_acq(m + 1 + self.reader_rank) != 0:
            return False
        return fmq_load_u8_acq(m) == 1

    cdef bint turn(self, int idx) noexcept nogil:
        return self.readable(idx)

    cdef int spin_until(self, int idx, int64_t until_ns) noexcept nogil:
        """1: ready, 0: ``until_ns`` passed, -1: cancelled."""
        cdef unsigned int i = 0
        cdef int r
        while not self.readable(idx):
            i += 1
            r = spin_tick(&self.cancelled, i, until_ns)
            if r != 1:
                return r
        return 1

    cdef int check_peers(self, int idx) except -1:
        # The writer's closed flag is one acquire load: checked every slice.
        # Its process's liveness reads /proc: throttled.
        if self.closed_by_writer() and not self.readable(idx):
            return ST_WRITER_CLOSED
        if not self.peer_check_due():
            return ST_READY
        cdef int state = self.writer_state()
        # The chunk is re-checked after the writer's state was loaded: a
        # message published just before it closed or died is still read.
        if state != ST_READY and not self.readable(idx):
            return state
        return ST_READY

    cdef inline bint closed_by_writer(self) noexcept:
        return fmq_load_u32_acq(_u32(self.base, H_WRITER_STATE)) == 2

    cdef int writer_state(self) except -1:
        if self.closed_by_writer():
            return ST_WRITER_CLOSED
        if not self.writer_alive():
            return ST_WRITER_DIED
        return ST_READY

    def writer_alive(self):
        """Whether the writer's process runs: its pidfd (from the writer,
        ``fastmq._door``) turns readable when it exits, in any pid
        namespace and without /proc; without one, its pid and start time,
        where this process's pid namespace is the writer's (elsewhere it
        cannot be judged, and counts as alive)."""
        cdef pollfd p
        if self.writer_pidfd >= 0:
            p.fd = self.writer_pidfd
            p.events = POLLIN
            p.revents = 0
            return not (poll(&p, 1, 0) > 0 and (p.revents & POLLIN))
        if not self.writer_pid_visible:
            return True
        return _process_alive(self.writer_pid, self.writer_start)

    def watch_writer(self, int pidfd):
        """Judge the writer by ``pidfd`` (a pidfd of its process; this end
        owns it from here on and closes it with itself)."""
        if self.writer_pidfd >= 0:
            c_close(self.writer_pidfd)
        self.writer_pidfd = pidfd

    def use_zmq_wakeup(self, notify, poller=None):
        """ZMQ wait mode: park by polling ``poller`` (its ``notify`` SUB,
        on which the writer's wakeups arrive, and a cancel socket)."""
        if poller is None and self.wait_mode == W_ZMQ:
            raise ValueError("a reader's end parks on a poller")
        self.set_zmq_wakeup(notify, poller)

    def peer_status(self):
        """For waits outside the ring (a socket, a flush): ``WRITER_CLOSED``
        or ``WRITER_DIED`` when the writer is gone, else ``READY``."""
        self._check_open()
        return self.writer_state()

    # -- reading -----------------------------------------------------------
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
        self._check_open()
        if idx != self.current_idx:
            raise RuntimeError("fastmq ring: chunk %d is not the one being read (%d)"
                               % (idx, self.current_idx))
        self.release_chunk(idx)

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
        cdef Py_buffer view
        off = start0[0] + len0[0]
        for i in range(1, <Py_ssize_t>n):
            ln = (<uint64_t *>(c + FRAME_HEAD + 8 * i))[0]
            off = (off + 7) & ~(<uint64_t>7)
            # Re-checked at the point of use: a length rewritten since the
            # first pass must not read past the chunk.
            if off > cap or ln > cap - off:
                raise CorruptChunkError("fastmq ring chunk %d: buffer %d changed while "
                                        "being read" % (idx, i))
            if ln >= POOLED_MIN and self.buffers is not None:
                # Memory an earlier message's buffer gave back once dropped:
                # no page fault per 4 KiB, as fresh memory would take.
                ba = self.buffers.take(ln)
                PyObject_GetBuffer(ba, &view, PyBUF_WRITABLE)
                try:
                    if <uint64_t>view.len != ln:
                        raise BufferError("fastmq: a pooled buffer of the wrong size")
                    with nogil:
                        memcpy(view.buf, c + off, ln)
                finally:
                    PyBuffer_Release(&view)
            else:
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
        self._check_open()
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
        if (<uint8_t *>c)[0] == CHUNK_PART or (<uint8_t *>c)[0] == CHUNK_PART_ABORT:
            self.pending = ST_PARTS
            return _PENDING
        cdef uint64_t start0, len0
        cdef object stream = None
        try:
            try:
                oob = self.take_oob(idx, c, &start0, &len0)
            except CorruptChunkError:
                if arena is not None:
                    # The slots the chunk names would stay taken for good:
                    # its descriptors never reach the arena's map_oob.
                    stream = PyMemoryView_FromMemory(c, self.max_chunk_bytes, PyBUF_READ)
                    arena.release_named_in(stream)
                raise
            # Unpickled in place: the chunk stays this reader's until the
            # object is built (its bytes are copies), then it is marked read.
            stream = PyMemoryView_FromMemory(c + start0, len0, PyBUF_READ)
            return decode(stream, oob, arena)
        finally:
            try:
                if stream is not None:
                    stream.release()
            finally:
                self.release_chunk(idx)

    def part_header(self, int idx):
        """``(aborted, index, stream length, offset, length)`` of the part
        in chunk ``idx`` (this end's current one, ready), validated against
        the chunk; ``aborted``: the writer stopped the stream (the other
        fields are 0)."""
        self._check_open()
        if idx != self.current_idx:
            raise RuntimeError("fastmq ring: chunk %d is not the one being read (%d)"
                               % (idx, self.current_idx))
        cdef char *c = self.chunk(idx)
        cdef uint8_t kind = (<uint8_t *>c)[0]
        if kind == CHUNK_PART_ABORT:
            return True, 0, 0, 0, 0
        if kind != CHUNK_PART:
            raise CorruptChunkError("fastmq ring chunk %d: expected the next part of a "
                                    "message, found chunk kind %d" % (idx, kind))
        cdef uint32_t index = (<uint32_t *>(c + 4))[0]
        cdef uint64_t total = (<uint64_t *>(c + 8))[0]
        cdef uint64_t offset = (<uint64_t *>(c + 16))[0]
        cdef uint64_t ln = (<uint64_t *>(c + 24))[0]
        if ln > <uint64_t>(self.max_chunk_bytes - PART_HEAD) or offset > total \
                or ln > total - offset:
            raise CorruptChunkError("fastmq ring chunk %d: part %d of %d bytes at offset %d "
                                    "does not fit the chunk or its %d-byte stream"
                                    % (idx, index, ln, offset, total))
        return False, index, total, offset, ln

    def copy_part(self, int idx, uint64_t src, object dst, uint64_t dst_off, uint64_t n):
        """Copy ``n`` bytes from offset ``src`` of the part in chunk ``idx``
        into the writable buffer ``dst`` at ``dst_off``.  Both ends are
        checked here, the part's length re-read at the point of use."""
        self._check_open()
        if idx != self.current_idx:
            raise RuntimeError("fastmq ring: chunk %d is not the one being read (%d)"
                               % (idx, self.current_idx))
        cdef char *c = self.chunk(idx)
        cdef uint64_t ln = (<uint64_t *>(c + 24))[0]
        if (<uint8_t *>c)[0] != CHUNK_PART or ln > <uint64_t>(self.max_chunk_bytes - PART_HEAD) \
                or src > ln or n > ln - src:
            raise CorruptChunkError("fastmq ring chunk %d: a part changed while being read"
                                    % idx)
        cdef Py_buffer view
        PyObject_GetBuffer(dst, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if dst_off > <uint64_t>view.len or n > <uint64_t>view.len - dst_off:
                raise ValueError("fastmq ring: a part copy runs past its destination")
            if n >= NOGIL_COPY_MIN:
                with nogil:
                    memcpy(<char *>view.buf + dst_off, c + PART_HEAD + src, n)
            else:
                memcpy(<char *>view.buf + dst_off, c + PART_HEAD + src, n)
        finally:
            PyBuffer_Release(&view)

    @property
    def overflow_latest(self):
        """Id of the newest overflow mark the writer published (0: none)."""
        self._check_open()
        return fmq_load_u64_acq(_u64(self.base, H_OVERFLOW_ID))

    # -- the writer (header fields other modules read) ---------------------
    @property
    def writer_pid(self):
        return _u32(self.base, H_WRITER_PID)[0]

    @property
    def writer_start(self):
        return _u64(self.base, H_WRITER_START)[0]

    @property
    def writer_closed(self):
        return fmq_load_u32_acq(_u32(self.base, H_WRITER_STATE)) == 2

    # -- this reader's slot ------------------------------------------------
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
        cdef char *slot = self.base + H_READER_SLOTS + READER_SLOT * self.reader_rank
        cdef uint64_t *word = self.claim_word(self.reader_rank)
        cdef uint64_t mine = pid | ((start & CLAIM_TAG_MASK) << 32)
        cdef uint64_t held
        while True:
            held = fmq_load_u64_acq(word)
            if (held != 0 and (held & CLAIM_PID_MASK) != pid and claim_alive(held)):
                return <uint32_t>(held & CLAIM_PID_MASK)
            if fmq_cas_u64(word, held, mine):
                break
        fmq_store_u64_rel(<uint64_t *>(slot + SLOT_START), start)
        fmq_store_u64_rel(<uint64_t *>(slot + SLOT_READ), 0)
        fmq_store_u64_rel(<uint64_t *>(slot + SLOT_WAITING), 0)
        fmq_fence_seq()
        self.claim = mine
        self.claimed = True
        return 0

    cdef void mark_waiting(self, bint on) noexcept:
        # Read by the writer, as a hint only (RingWriter.readers_waiting):
        # a reader in a wait takes the next chunks as they come.
        if self.claimed and self.base != NULL:
            fmq_store_u64_rel(_u64(self.base, H_READER_SLOTS + READER_SLOT * self.reader_rank
                                   + SLOT_WAITING), on)

    cdef int release_claim(self) noexcept:
        # A clean close marks the slot LEFT and keeps the pid: a writer
        # waiting on this reader then names it at once, as it names a
        # reader that died.  Only the claiming process does this (a forked
        # child that drops the inherited end must not), and only while the
        # claim is still its own.
        if self.claimed and self.base != NULL and self.owner_pid == fmq_self_pid():
            fmq_cas_u64(self.claim_word(self.reader_rank), self.claim,
                        self.claim | CLAIM_LEFT)
            self.claimed = False
        return 0

    def close(self):
        """Give the reader slot up (LEFT) and drop this end's view of the
        mapping (the Segment unmaps when unused)."""
        self.release_claim()
        RingEnd.close(self)
        if self.writer_pidfd >= 0:
            c_close(self.writer_pidfd)
            self.writer_pidfd = -1

    def __dealloc__(self):
        if self.writer_pidfd >= 0:
            c_close(self.writer_pidfd)
