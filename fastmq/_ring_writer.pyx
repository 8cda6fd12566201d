"""The writer's end of a ring (``RingWriter``): it creates the ring, frames
messages into chunks and publishes them, and wakes parked readers.  The
layout, the framing and the wait it shares with the readers:
fastmq/_ring.pyx.

The writer's half of the flag protocol::

    wait until written == 0 or every read flag == 1
    written = 0 ; copy payload ; read flags = 0 (release)
    written = 1 (release) ; full fence ; wake parked readers

The read flags are reset before ``written`` is set, each a release store:
a reader that sees its reset flag and then ``written == 1`` sees the whole
payload (see fastmq/_ring_reader.pyx for the reader's load order).

The writer reserves a chunk's pages (``Segment.reserve``, which first checks
that the host has the memory) before it first writes that far into the
chunk: memory running out then fails the send with ``ShmFullError`` instead
of a fault or the OOM killer.  So a ring holds what its messages reached,
as vLLM's does, not its whole size.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from fastmq._native.atomic cimport (
    fmq_add_u32_seq, fmq_fence_seq, fmq_futex_wake_all, fmq_load_u8_acq, fmq_load_u32_seq,
    fmq_load_u64_acq, fmq_store_u8_rel, fmq_store_u32_rel, fmq_store_u64_rel)
from fastmq._native.layout cimport align_up as _align, word32 as _u32, word64 as _u64
from fastmq._ring cimport (CHUNK_PART, CHUNK_PART_ABORT, FRAME_HEAD, MARK_BYTES,
                           CHECK_STEP, NOGIL_COPY_MIN, PART_HEAD, RESERVE_STEP,
                           ST_PICKLER_STALE, ST_READER_DIED, ST_READY, W_ZMQ, RingEnd,
                           claim_alive, spin_tick)
from fastmq._ring_layout cimport *
from fastmq._segment cimport Segment
from fastmq._sink cimport PickleSink

from fastmq._ring import (LAYOUT_VERSION, MAGIC, SLOT_ALIVE, SLOT_DEAD, SLOT_FREE, SLOT_LEFT,
                          layout)

cdef uint64_t CLAIM_LEFT = 1ULL << CLAIM_LEFT_BIT


cdef inline Py_ssize_t _framed_size(Py_ssize_t n, Py_ssize_t *lens) noexcept nogil:
    # The bytes _frame fills: head, lengths, each buffer 8-aligned.
    cdef Py_ssize_t i, total = FRAME_HEAD + 8 * n
    for i in range(n):
        total = _align(total, 8) + lens[i]
    return total


cdef inline void _frame(char *c, Py_ssize_t n, const char **ptrs,
                        Py_ssize_t *lens) noexcept nogil:
    # Chunk framing (see fastmq/_ring.pyx): head, lengths, buffers.
    cdef Py_ssize_t i, off = FRAME_HEAD + 8 * n
    c[0] = 0
    (<uint32_t *>(c + 4))[0] = <uint32_t>n
    for i in range(n):
        (<uint64_t *>(c + FRAME_HEAD + 8 * i))[0] = lens[i]
        off = _align(off, 8)
        memcpy(c + off, ptrs[i], lens[i])
        off += lens[i]


cdef class RingWriter(RingEnd):
    """The writer's end of a ring (``RingWriter.create``).  Its wait
    (``wait_next``) is for the next chunk to be free; it returns
    ``READER_DIED`` when a reader that has not read that chunk is gone
    (``dead_rank`` / ``dead_pid`` / ``dead_left`` name it)."""

    def __cinit__(self):
        self.reserved = NULL
        self.dead_rank = -1
        self.parts_min = PY_SSIZE_T_MAX

    def __dealloc__(self):
        free(self.reserved)
        self.reserved = NULL

    @staticmethod
    def create(Segment seg, int n_reader, Py_ssize_t max_chunk_bytes,
               int max_chunks, int wait_mode, int64_t spin_ns,
               uint32_t writer_pid, uint64_t writer_start, uint64_t writer_pidns=0,
               bint checked=False):
        """Write a new ring's header into ``seg`` and return its writer's end.
        ``checked``: the caller has just found the memory for the whole ring
        there, so the header, and a message's first write into a chunk up to
        its first memory step (64 KiB), ask no more."""
        stride, meta_off, data_off, total = layout(n_reader, max_chunk_bytes, max_chunks)
        if seg.size < total:
            raise ValueError("segment of %d bytes is smaller than the ring (%d)" % (seg.size, total))
        cdef char *b = <char *>seg.addr
        seg.reserve(0, data_off, "the ring's header", 0 if checked else -1)
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
        cdef RingWriter self = RingWriter.__new__(RingWriter)
        self.bind(seg, (n_reader, max_chunk_bytes, max_chunks, stride, meta_off, data_off, total),
                  wait_mode, spin_ns)
        # The writer parks on its own word, counted alone.  In the ZMQ mode
        # it has no socket to park on: it spins with yields.
        self.park_counter = self.writer_parked
        self.park_word = self.write_seq
        self.spin_only = self.wait_mode == W_ZMQ
        # Bytes of each chunk already reserved.
        self.reserved = <Py_ssize_t *>calloc(self.max_chunks, sizeof(Py_ssize_t))
        if self.reserved == NULL:
            raise MemoryError()
        # Asking reads several /proc and cgroup files (hundreds of us): a
        # ring's small messages never do, its creation asked for them.
        self.asked_first = min(CHECK_STEP, self.max_chunk_bytes) if checked else 0
        # Each chunk's first page now, with the ring (40 KiB for vLLM's 10
        # chunks), and no more: otherwise the first message into each chunk
        # populates it, and each reader takes its first fault on it, on the
        # message's path (a fresh queue's first pass over its chunks was
        # its slowest).  Beyond it a chunk holds only what was written.
        cdef int idx
        for idx in range(self.max_chunks):
            self.reserve_chunk(idx, RESERVE_STEP)
        return self

    # -- the writer's turn -------------------------------------------------
    cdef inline bint writable(self, int idx) noexcept nogil:
        cdef uint8_t *m = self.meta(idx)
        cdef int r
        if fmq_load_u8_acq(m) == 0:
            return True
        for r in range(self.n_reader):
            if fmq_load_u8_acq(m + 1 + r) == 0:
                return False
        return True

    cdef bint turn(self, int idx) noexcept nogil:
        return self.writable(idx)

    def readers_waiting(self):
        """Whether every reader is in a wait for a chunk now: each takes
        the next chunks as they are published.  A hint (a reader may leave
        its wait at once, on a timeout), never a promise."""
        self._check_open()
        cdef int r
        for r in range(self.n_reader):
            if fmq_load_u64_acq(_u64(self.base, H_READER_SLOTS + READER_SLOT * r
                                     + SLOT_WAITING)) != 1:
                return False
        return True

    def free_chunks(self):
        """How many chunks, from this end's next one on, are free to write
        now.  Each stays free until this end writes it: readers only ever
        release a chunk."""
        self._check_open()
        cdef int i, n = 0
        for i in range(self.max_chunks):
            if not self.writable((self.current_idx + i) % self.max_chunks):
                break
            n += 1
        return n

    cdef int spin_until(self, int idx, int64_t until_ns) noexcept nogil:
        """1: ready, 0: ``until_ns`` passed, -1: cancelled."""
        cdef unsigned int i = 0
        cdef int r
        while not self.writable(idx):
            i += 1
            r = spin_tick(&self.cancelled, i, until_ns)
            if r != 1:
                return r
        return 1

    cdef int check_peers(self, int idx) except -1:
        if not self.peer_check_due():
            return ST_READY
        return ST_READER_DIED if self.find_dead_reader(idx) else ST_READY

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
            if word != 0 and not claim_alive(word):
                self.dead_rank = r
                self.dead_pid = <uint32_t>(word & CLAIM_PID_MASK)
                self.dead_left = (word & CLAIM_LEFT) != 0
                return True
        return False

    def use_zmq_wakeup(self, notify):
        """ZMQ wait mode: wake a parked reader by sending on ``notify`` (an
        XPUB)."""
        self.set_zmq_wakeup(notify, None)

    def peer_status(self):
        """For waits outside the ring (a socket, a flush): ``READER_DIED``
        when an attached reader is gone (``dead_rank`` / ``dead_pid``),
        else ``READY``."""
        self._check_open()
        return ST_READER_DIED if self.find_dead_reader(-1) else ST_READY

    # -- publishing --------------------------------------------------------
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
            if self.wait_mode == W_ZMQ:
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

    cdef inline int _check_turn(self, int idx) except -1:
        # Every write is preceded by wait_next(); this guards the shared
        # memory against a caller that skipped it.
        if not self.writable(idx):
            raise RuntimeError("fastmq ring: chunk %d is not this end's to write; wait_next() "
                               "first" % idx)
        return 0

    def begin_write(self):
        """Take the next chunk for writing in place and return its index
        (its written flag cleared).  All of it is reserved, so the caller may
        write anywhere in it; ``publish_chunk(idx)`` publishes it."""
        self._check_open()
        cdef int idx = self.current_idx
        self._check_turn(idx)
        self.reserve_chunk(idx, self.max_chunk_bytes)
        fmq_store_u8_rel(self.meta(idx), 0)
        return idx

    cdef int reserve_chunk(self, int idx, Py_ssize_t nbytes) except -1:
        # Steady state: one comparison.  A chunk's reservation only grows,
        # to the page that the largest message so far ended in: a chunk
        # holds no page that no message wrote (in 64 KiB steps it held up
        # to 60 KiB more than vLLM's ring, which holds the pages it wrote).
        # The host's memory is asked for in CHECK_STEP steps, as before:
        # asking costs tens of microseconds, and a stream whose sizes creep
        # up would otherwise ask at every new page.
        if nbytes <= self.reserved[idx]:
            return 0
        cdef Py_ssize_t want = min(_align(nbytes, RESERVE_STEP), self.max_chunk_bytes)
        cdef Py_ssize_t have = self.reserved[idx]
        cdef Py_ssize_t asked = max(min(_align(have, CHECK_STEP), self.max_chunk_bytes),
                                    self.asked_first)
        cdef Py_ssize_t check = 0
        if want > asked:
            check = min(_align(want, CHECK_STEP), self.max_chunk_bytes) - have
        # Allocated and mapped: the copy into a fresh chunk takes no fault
        # per page.
        self.segment.populate(self.data_off + idx * self.max_chunk_bytes + have, want - have,
                              "writing a %d-byte message into ring chunk %d" % (nbytes, idx),
                              check)
        self.reserved[idx] = want
        return 0

    def publish_chunk(self, int idx):
        self._check_open()
        if idx != self.current_idx:
            raise RuntimeError("fastmq ring: chunk %d is not the one being written (%d)"
                               % (idx, self.current_idx))
        self.publish(idx)

    def reserve_next(self, Py_ssize_t nbytes):
        """Reserve the next chunk's first ``nbytes`` (capped at the chunk)
        now, so that a later ``send``/``send_overflow_mark`` into it cannot
        fail for lack of memory (``ShmFullError`` here instead)."""
        self._check_open()
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
        ``ShmFullError`` when memory cannot back the chunk's pages:
        nothing is published and the ring stays usable.

        ``committed``: the message already reached other readers (the
        remote ones), so the chunk -- already free, and reserved by
        ``reserve_next`` -- must take it too: no wait, and no
        ``cancel()`` refuses it.
        """
        self._check_open()
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
        cdef Py_ssize_t total = _framed_size(n, lens)
        cdef int idx, status
        cdef char *c
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
        self._check_open()
        if sink.needs_new_pickler():
            return -ST_PICKLER_STALE
        try:
            sink.pickle(pickler, obj)
            return self.send_sink(sink, timeout, False)
        except BaseException:
            # Nothing was published (the publish is the last step and
            # cannot fail): the message's arena slots are free again.
            sink.aborted()
            raise

    def send_pickled(self, PickleSink sink, timeout=None, bint whole=False):
        """Frame the message pickled into ``sink`` into the next chunk and
        publish it (as ``send``); then ``sink``'s arena commit runs and the
        sink lets go of the message's out-of-band buffers.  Returns the
        framed size; 0 when the message does not fit a chunk, or, unless
        ``whole``, is framed to ``parts_min`` bytes or more (nothing sent:
        ``sink.stream()`` gives it for parts, ``sink.frames()`` for the
        overflow path); or a wait status negated, with nothing sent: act on
        it, ``continue_wait()`` until ``READY``, then call this again."""
        self._check_open()
        try:
            return self.send_sink(sink, timeout, whole)
        except BaseException:
            sink.aborted()
            raise

    cdef Py_ssize_t send_sink(self, PickleSink sink, object timeout, bint whole) except -1000:
        if not sink.holding:
            raise RuntimeError("fastmq: no pickled message in the sink")
        cdef list oob = sink.oob
        cdef Py_ssize_t n = 1 + len(oob), i, got = 1, sent, framed
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
            lens[0] = sink.size + sink.span_bytes
            for i in range(1, n):
                PyObject_GetBuffer(oob[i - 1], &views[i - 1], PyBUF_SIMPLE)
                got += 1
                ptrs[i] = <const char *>views[i - 1].buf
                lens[i] = views[i - 1].len
            framed = _framed_size(n, lens)
            # Parts overlap the writer's copy in with the readers' copies
            # out of large buffers; a stream with none (a large list, say)
            # goes whole, as the readers unpickle it from the chunk itself.
            if framed > self.max_chunk_bytes or (
                    framed >= self.parts_min and not whole and (n > 1 or sink.span_bytes)):
                sent = 0    # the overflow path or parts: the spans stay where they are
            else:
                # A message with large in-band payloads that fits a chunk
                # anyway: its stream in one piece first.
                sink.flatten()
                ptrs[0] = sink.buf
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

    cdef char *take_next(self, Py_ssize_t nbytes) except NULL:
        # The next chunk, this end's turn (wait_next() returned READY for
        # it), its first nbytes reserved and its written flag cleared.
        self._check_open()
        cdef int idx = self.current_idx
        self._check_turn(idx)
        self.reserve_chunk(idx, nbytes)
        fmq_store_u8_rel(self.meta(idx), 0)
        return self.chunk(idx)

    def send_overflow_mark(self, uint64_t msg_id):
        """Publish, in the next chunk (``wait_next()`` returned ``READY``
        for it), a mark that says: message ``msg_id`` is on the socket."""
        cdef char *c = self.take_next(MARK_BYTES)
        cdef int idx = self.current_idx
        c[0] = 1
        (<uint32_t *>(c + 4))[0] = 0
        (<uint64_t *>(c + 8))[0] = msg_id
        # Released by the publish below: a reader that sees this mark also
        # sees the id, and can tell a corrupt mark (an id that was never
        # published) from a payload still in flight.
        _u64(self.base, H_OVERFLOW_ID)[0] = msg_id
        self.publish(idx)

    def send_part(self, list pieces, uint32_t index, uint64_t total, uint64_t offset):
        """Publish, in the next chunk (``wait_next()`` returned ``READY``
        for it), part ``index`` of a message's part stream of ``total``
        bytes: the bytes at ``offset``, gathered from ``pieces`` -- (buffer,
        start, length) triples, copied in order.  Returns the part's length."""
        self._check_open()
        cdef Py_ssize_t n = 0, start, ln, at
        cdef Py_buffer view
        for obj, start, ln in pieces:
            if start < 0 or ln < 0:
                raise ValueError("fastmq ring: a part piece has a negative start or length")
            n += ln
        if n > self.max_chunk_bytes - PART_HEAD or offset + <uint64_t>n > total:
            raise ValueError("fastmq ring: a %d-byte part at offset %d of a %d-byte stream "
                             "does not fit a %d-byte chunk" % (n, offset, total,
                                                               self.max_chunk_bytes))
        cdef char *c = self.take_next(PART_HEAD + n)
        at = PART_HEAD
        for obj, start, ln in pieces:
            PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE)
            try:
                # Checked again at the point of use: the first pass summed
                # what the pieces said then.
                if start + ln > view.len or at + ln > PART_HEAD + n:
                    raise ValueError("fastmq ring: a part piece runs past its buffer")
                if ln >= NOGIL_COPY_MIN:
                    with nogil:
                        memcpy(c + at, <char *>view.buf + start, ln)
                else:
                    memcpy(c + at, <char *>view.buf + start, ln)
            finally:
                PyBuffer_Release(&view)
            at += ln
        c[0] = CHUNK_PART
        (<uint32_t *>(c + 4))[0] = index
        (<uint64_t *>(c + 8))[0] = total
        (<uint64_t *>(c + 16))[0] = offset
        (<uint64_t *>(c + 24))[0] = <uint64_t>n
        self.publish(self.current_idx)
        return n

    def send_part_abort(self):
        """Publish, in the next chunk, the end of a part stream that stops
        short: readers drop the parts they have of it."""
        cdef char *c = self.take_next(MARK_BYTES)
        c[0] = CHUNK_PART_ABORT
        (<uint32_t *>(c + 4))[0] = 0
        self.publish(self.current_idx)

    def mark_closed(self):
        """Tell the readers that this writer closed the queue."""
        if self.base != NULL:
            self._check_open()
            fmq_store_u32_rel(_u32(self.base, H_WRITER_STATE), 2)

    # -- the readers' slots ------------------------------------------------
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
        return pid, (SLOT_ALIVE if claim_alive(word) else SLOT_DEAD)

    def unread_readers(self, int idx):
        """Ranks that have not read chunk ``idx`` (for the long-wait log)."""
        self._check_open()
        self._check_idx(idx)
        cdef uint8_t *m = self.meta(idx)
        if fmq_load_u8_acq(m) == 0:
            return []
        return [r for r in range(self.n_reader) if fmq_load_u8_acq(m + 1 + r) == 0]
