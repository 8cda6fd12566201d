"""Where the writer's pickler writes: one buffer, kept from message to
message, and the message's out-of-band buffers.

The pickler (the stdlib's C ``pickle.Pickler``) is built with a
``PickleSink`` as its file and ``PickleSink.on_buffer`` as its buffer
callback, so pickling a message allocates no stream object: the ring frames
straight from this buffer (``RingWriter.send_object``).  The sink never holds
the pickler (the pickler holds the sink): no reference cycle keeps the
arena's mapping alive until a GC pass.

A large ``bytes`` or ``bytearray`` pickled in band is not copied: the C
pickler hands a payload of 64 KiB or more to ``write`` as the object itself,
and the sink keeps a reference to one of ``SPAN_MIN`` bytes or more (a
"span", at its offset in the stream) instead of copying it.  The stream is
then the buffer with the spans inserted: ``frames()`` gathers it into one
buffer (one copy: the overflow socket, remote readers), and a message
that fits a chunk is flattened into the buffer first (the copy the writer
made before).  ``stream()``, for the ring's parts, goes further: a span
that is a ``bytes`` or ``bytearray`` payload (its opcode and length end
the buffer before it) leaves the stream as an out-of-band buffer, its
opcode replaced by ``NEXT_BUFFER``, so that the reader can copy the parts
straight into a ``bytes`` (or ``bytearray``) of its own and hand that very
object to the unpickler (which pushes a buffer as given): one copy on each
side where pickling in band makes two.  Only the caller's own objects are
kept, for the length of one ``enqueue()``, as with the out-of-band buffers.

A large stream with no spans (a long list, a big dict) is not copied for a
socket at all: ``frames(pool)`` hands the sink's own buffer over as a
frame of the pool, and the next message takes a kept block back from the
pool as its buffer (the same one, once the send let go of it).  Handing
over, not lending a view, is what keeps it safe: the sink never writes
into memory a frame still in flight (a slow reader's socket, a traceback
holding the frames) can show, and nothing can make the next message fail
for a view left behind.

The sink also knows what its pickler was built against (the size of
``copyreg.dispatch_table``, whether torch was imported yet) and whether
the pickler's last dump failed: ``needs_new_pickler`` tells the writer's
encoder to build a fresh one before the next message.
"""
from cpython.buffer cimport (PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_FillInfo, PyBuffer_Release,
                             PyObject_GetBuffer)
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize,
                            PyBytes_GET_SIZE)
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memmove

from fastmq._recv_buffers cimport POOLED_MIN, BufferPool, PooledBuffer

cdef extern from "fmq_growbuf.h" nogil:
    char *fmq_growbuf_alloc(size_t cap)
    void fmq_growbuf_free(char *p, size_t cap)
    char *fmq_growbuf_resize(char *p, size_t old_cap, size_t new_cap)
    bint fmq_growbuf_mapped(size_t cap)
    size_t fmq_growbuf_trim(char *p, size_t cap, size_t used)
    size_t FMQ_GROWBUF_MAP_MIN

cdef extern from "fmq_populate.h" nogil:
    int fmq_populate(char *p, size_t n)

cdef enum:
    # The buffer grows by doubling from here; from 256 KiB up it is a
    # mapping of its own that grows without a copy (fmq_growbuf.h).
    FIRST_CAP = 4096
    # A buffer grown past this for big streams goes (to the home pool, or
    # back to the kernel) once a message did not need it (checked as the
    # next one starts), and a small one takes its place: a queue that once
    # sent a huge in-band message does not hold that much memory for the
    # rest of its life, and one sending big messages back to back does not
    # fault its pages in again for each.
    KEEP_CAP = 1 << 20
    # In-band payloads this large are kept by reference (see the module
    # docstring); below it a copy costs less than gathering it later.
    SPAN_MIN = 1 << 20
    # A mapped buffer's pages are backed this far past a write in one call
    # (MADV_POPULATE_WRITE) before the write: a fresh 16 MiB stream took a
    # fault per 4 KiB page as the pickler's frames were copied in, about
    # twice the time of populating ahead.
    AHEAD = 1 << 20

# What an out-of-band buffer of the part stream becomes at the reader (see
# stream() and fastmq._parts): the buffer it arrives in, or a bytes /
# bytearray of its own that the unpickler takes as the object itself.
KIND_BUFFER = 0
KIND_BYTES = 1
KIND_BYTEARRAY = 2

# Pickle opcodes (Lib/pickletools.py) that introduce a large payload, and
# the one that takes the next out-of-band buffer instead.
cdef enum:
    OP_BINBYTES = 0x42      # 'B', u32 length
    OP_BINBYTES8 = 0x8e     # u64 length
    OP_BYTEARRAY8 = 0x96    # u64 length
_NEXT_BUFFER = b"\x97"


cdef inline uint64_t _u64_le(const char *p) noexcept:
    cdef uint64_t v
    # Native order: pickle's is little-endian, so on a big-endian host no
    # length matches and every span stays in the stream (still correct).
    memcpy(&v, p, 8)
    return v


cdef inline uint64_t _u32_le(const char *p) noexcept:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef int _copy_span(object data, Py_ssize_t n, char *out) except -1:
    # A span's n bytes into ``out``, its length checked again here (a
    # bytearray can change between pickle and send); the view held keeps
    # it from changing during the copy.
    cdef Py_buffer v
    PyObject_GetBuffer(data, &v, PyBUF_SIMPLE)
    try:
        if v.len != n:
            raise BufferError("fastmq: an in-band buffer of %d bytes changed size "
                              "(now %d) while it was being sent" % (n, v.len))
        with nogil:
            memcpy(out, v.buf, n)
    finally:
        PyBuffer_Release(&v)
    return 0


cdef class PickleSink:
    """``PickleSink(to_slot=None, commit=None, abort=None, oob_min=1 MiB, pool=None)``.

    ``to_slot(buf)`` (the tensor arena's ``copy_to_slot``) is asked first
    for every ``PickleBuffer`` and may return a slot descriptor to send out
    of band instead; ``commit()`` (the arena's) is called once a message is
    published, so its slots belong to the readers, and ``abort()`` when
    sending it failed before anything was published, so they are free.
    Out-of-band buffers of ``oob_min`` bytes and more travel beside the
    stream, smaller ones in band.  ``pool`` (a ``BufferPool``: the
    process's, ``fastmq._pools.streams()``) is where a large buffer comes
    from when it can, and where it goes once messages no longer need it or
    the sink is dropped."""

    def __cinit__(self, to_slot=None, commit=None, abort=None, Py_ssize_t oob_min=1 << 20,
                  BufferPool pool=None):
        self.buf = fmq_growbuf_alloc(FIRST_CAP)
        if self.buf == NULL:
            raise MemoryError()
        self.cap = FIRST_CAP
        self.touched = FIRST_CAP
        self.size = 0
        self.to_slot = to_slot
        self.commit = commit
        self.abort = abort
        self.oob_min = oob_min
        self.home = pool
        self.oob = []
        self.spans = []
        self.span_bytes = 0
        self.exports = 0
        self.holding = False
        self.copyreg_table = None
        self.broken = True    # no pickler built yet

    def __dealloc__(self):
        # (home is None here if a GC pass cleared it first: then unmapped.)
        if self.buf != NULL:
            self.release()

    def expect(self, dict copyreg_table, bint torch_pending, dict modules):
        """The encoder built a fresh pickler against ``copyreg_table`` (as it
        is now) and, with ``torch_pending``, before torch was imported (it
        shows up in ``modules``, i.e. ``sys.modules``)."""
        self.copyreg_table = copyreg_table
        self.copyreg_len = len(copyreg_table)
        self.torch_pending = torch_pending
        self.modules = modules
        self.broken = False

    cdef bint needs_new_pickler(self) except -1:
        # Somebody registered a reducer or imported torch since the pickler
        # was built, or its last dump failed (its memo and framing can be
        # in any state).
        if self.broken or len(self.copyreg_table) != self.copyreg_len:
            return True
        return self.torch_pending and "torch" in self.modules

    def stale(self):
        """Whether the pickler must be rebuilt before the next message."""
        return self.needs_new_pickler()

    # -- the pickler's side -----------------------------------------------
    def write(self, data):
        """The pickler's ``file.write``: append ``data`` to the buffer (or,
        ``SPAN_MIN`` bytes or more, keep it as a span)."""
        cdef Py_buffer v
        cdef Py_ssize_t n
        if PyBytes_CheckExact(data):
            n = PyBytes_GET_SIZE(data)
            if n >= SPAN_MIN:
                return self.keep(data, n)
            if self.size + n > self.cap:
                self.grow(self.size + n)
            if self.size + n > self.touched:
                self.ahead(self.size + n)
            memcpy(self.buf + self.size, PyBytes_AS_STRING(data), n)
            self.size += n
            return n
        PyObject_GetBuffer(data, &v, PyBUF_SIMPLE)
        try:
            n = v.len
            if n >= SPAN_MIN:
                return self.keep(data, n)
            if self.size + n > self.cap:
                self.grow(self.size + n)
            if self.size + n > self.touched:
                self.ahead(self.size + n)
            if n >= 65536:
                with nogil:
                    memcpy(self.buf + self.size, v.buf, n)
            else:
                memcpy(self.buf + self.size, v.buf, n)
            self.size += n
        finally:
            PyBuffer_Release(&v)
        return n

    cdef Py_ssize_t keep(self, object data, Py_ssize_t n) except -1:
        # The pickler does not touch ``data`` again; the caller may not
        # either until enqueue() returns (its length is checked again where
        # it is copied).  The pickler wrote the payload's opcode and length
        # just before (its last flush, into the buffer): if they are there,
        # whole and naming this length, the payload may leave the stream.
        cdef Py_ssize_t at = self.size, after = 0
        cdef int kind = KIND_BUFFER, head = 0
        cdef unsigned char op
        if self.spans:
            after = self.spans[len(self.spans) - 1][0]   # (no wraparound here)
        if at - 9 >= after:
            op = <unsigned char>self.buf[at - 9]
            if (op == OP_BINBYTES8 or op == OP_BYTEARRAY8) and _u64_le(self.buf + at - 8) == <uint64_t>n:
                kind = KIND_BYTES if op == OP_BINBYTES8 else KIND_BYTEARRAY
                head = 9
        if head == 0 and at - 5 >= after and <unsigned char>self.buf[at - 5] == OP_BINBYTES \
                and _u32_le(self.buf + at - 4) == <uint64_t>n:
            kind = KIND_BYTES
            head = 5
        self.spans.append((at, data, n, kind, head, len(self.oob)))
        self.span_bytes += n
        return n

    cdef int grow(self, Py_ssize_t need) except -1:
        self.check_unexported()
        cdef Py_ssize_t cap = self.cap
        while cap < need:
            cap *= 2
        # Large: memory the process kept (an earlier stream's, of this
        # queue or another) before fresh pages.
        if fmq_growbuf_mapped(cap) and self.reclaim(cap):
            return 0
        cdef Py_ssize_t old = self.cap
        cdef char *p = fmq_growbuf_resize(self.buf, self.cap, cap)
        if p == NULL:
            raise MemoryError()
        self.buf = p
        self.cap = cap
        if not fmq_growbuf_mapped(cap):
            self.touched = cap          # malloc's: never populated ahead
        elif not fmq_growbuf_mapped(old):
            self.touched = old          # what the move into the mapping wrote
        # (a mapping that grew with mremap kept its pages: touched stands)
        return 0

    cdef void ahead(self, Py_ssize_t end) noexcept:
        # Back [touched, end + AHEAD) of a mapped buffer with pages in one
        # call before a write reaches them.  Advice only: refused (an old
        # kernel) or short of memory, the copy faults its pages as before.
        cdef Py_ssize_t hi = end + AHEAD
        if hi > self.cap:
            hi = self.cap
        if hi > self.touched:
            fmq_populate(self.buf + self.touched, <size_t>(hi - self.touched))
            self.touched = hi

    def on_buffer(self, buf):
        """The pickler's ``buffer_callback``: False keeps ``buf`` out of band."""
        if self.to_slot is not None:
            self.arena_asked = True
            desc = self.to_slot(buf)
            if desc is not None:
                self.oob.append(desc)
                return False
        raw = buf.raw()
        if raw.nbytes < self.oob_min:
            return True
        self.oob.append(raw)
        return False

    # -- one message ------------------------------------------------------
    cdef int pickle(self, object pickler, object obj) except -1:
        """Pickle ``obj`` into the buffer with ``pickler`` (whose file and
        buffer callback are this sink)."""
        self.check_unexported()
        if self.handed:
            # After a hand-over: a block the pool keeps (the handed-over
            # one, once the send let go of it) is the buffer again, so a
            # stream as large as the last is written without a fresh page.
            self.handed = False
            self.reclaim(FMQ_GROWBUF_MAP_MIN)
        elif self.cap > KEEP_CAP and self.size <= KEEP_CAP:   # (size: the last stream's)
            self.put_back()
        self.size = 0
        self.span_bytes = 0
        self.let_go()
        try:
            pickler.dump(obj)
        except BaseException:
            self.broken = True
            self.let_go()
            raise
        finally:
            pickler.clear_memo()
        self.holding = True
        return 0

    cdef inline int let_go(self) except -1:
        # The list is kept from message to message; only its items go.
        self.holding = False
        self.arena_asked = False
        if self.oob:
            del self.oob[:]
        if self.spans:
            # (span_bytes stays: nbytes is the last stream's length.)
            del self.spans[:]
        return 0

    cdef int check_unexported(self) except -1:
        # The buffer moves (grow, flatten) only while nobody holds a view of it.
        if self.exports:
            raise BufferError("fastmq: the pickle buffer is still exported")
        return 0

    def __getbuffer__(self, Py_buffer *view, int flags):
        # The buffer's bytes of the stream (not the spans): what the ring's
        # part copy reads while it holds this view.
        PyBuffer_FillInfo(view, self, self.buf, self.size, 1, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1

    cdef int committed(self) except -1:
        # The message is published: its arena slots are the readers', and
        # its out-of-band buffers (the caller's memory) are let go.  A
        # message whose buffers the arena never saw has nothing to commit.
        cdef bint asked = self.arena_asked
        self.let_go()
        if asked and self.commit is not None:
            self.commit()
        return 0

    cdef int aborted(self) except -1:
        self.let_go()
        if self.abort is not None:
            self.abort()
        return 0

    def dump(self, pickler, obj, pool=None):
        """Pickle ``obj`` and return its frames (``frames(pool)``); the sink
        keeps nothing of it."""
        self.pickle(pickler, obj)
        frames = self.frames(pool)
        self.let_go()
        return frames

    def frames(self, BufferPool pool=None):
        """The frames of the message in the buffer: ``[stream, oob...]``.

        With ``pool`` (a ``fastmq._recv_buffers.BufferPool``), a stream of
        ``POOLED_MIN`` bytes or more is a ``PooledBuffer`` of that pool: the
        sink's own buffer itself, handed over, when the stream is all in it
        and ``pool`` is the sink's home (no spans; the sink takes a kept
        block back for the next message), else a block the stream is
        gathered into, memory that earlier
        streams used and gave back (a fresh ``bytes`` would cost a page
        fault per 4 KiB).  Otherwise the stream is gathered into a
        ``bytes``.  Either way the stream's frame is nobody's but the
        caller's: the sink never writes into it again."""
        self.check_holding()
        cdef Py_ssize_t total = self.size + self.span_bytes
        cdef Py_buffer v
        if pool is not None and pool is self.home and total >= POOLED_MIN \
                and not self.spans and fmq_growbuf_mapped(self.cap):
            return [self.hand_over()] + self.oob
        if pool is not None and total >= POOLED_MIN:
            out = pool.take(total)
            PyObject_GetBuffer(out, &v, PyBUF_WRITABLE)
            try:
                if v.len != total:
                    raise BufferError("fastmq: a pooled buffer of the wrong size")
                self.gather(<char *>v.buf)
            finally:
                PyBuffer_Release(&v)
            return [out] + self.oob
        if not self.spans:
            return [PyBytes_FromStringAndSize(self.buf, self.size)] + self.oob
        out = PyBytes_FromStringAndSize(NULL, total)
        self.gather(PyBytes_AS_STRING(out))
        return [out] + self.oob

    def stream(self):
        """The message for the ring's parts: ``(pieces, oob, kinds)``.  The
        pickle stream as ``(buffer, start, length)`` pieces, in order (this
        sink's buffer, and the spans that stay in it); the out-of-band
        buffers, with the spans that left the stream among them in stream
        order; and each out-of-band buffer's kind (``KIND_*``)."""
        self.check_holding()
        cdef list pieces = [], oob = list(self.oob), kinds = [KIND_BUFFER] * len(self.oob)
        cdef Py_ssize_t prev = 0, at, n, head, before, moved = 0
        cdef int kind
        for at, data, n, kind, head, before in self.spans:
            if at - head > prev:
                pieces.append((self, prev, at - head - prev))
            if kind == KIND_BUFFER:
                pieces.append((data, 0, n))
            else:
                pieces.append((_NEXT_BUFFER, 0, 1))
                oob.insert(before + moved, data)
                kinds.insert(before + moved, kind)
                moved += 1
            prev = at
        if self.size > prev:
            pieces.append((self, prev, self.size - prev))
        return pieces, oob, kinds

    cdef int check_holding(self) except -1:
        if not self.holding:
            raise RuntimeError("fastmq: no pickled message in the sink")
        return 0

    # -- where a large buffer comes from and goes -------------------------
    # A pool's blocks are private anonymous mappings of whole pages, backed
    # throughout; a mapped buffer goes to a pool cut down to the pages it
    # has backed (fmq_growbuf_trim), and one taken from a pool is backed to
    # its end.

    cdef PooledBuffer hand_over(self):
        # The stream's mapping becomes a frame of the home pool (the
        # caller's alone: no view of the sink is exported, so nothing the
        # sink does next can change it), and the sink starts again from a
        # small buffer.  Sending the stream from where the pickler wrote it
        # saves a copy of it, and on a first message the fresh pages of a
        # second buffer as large.
        self.check_unexported()
        cdef char *small = fmq_growbuf_alloc(FIRST_CAP)
        if small == NULL:
            raise MemoryError()
        # (cap: the mapping's length from here, whatever happens next.)
        self.cap = <Py_ssize_t>fmq_growbuf_trim(self.buf, self.cap, self.touched)
        try:
            out = self.home.adopt(self.buf, self.cap, self.size)
        except BaseException:
            fmq_growbuf_free(small, FIRST_CAP)
            raise
        self.start_over(small)
        self.size = 0
        self.holding = False    # (its out-of-band buffers go with let_go)
        self.handed = True
        return out

    cdef int put_back(self) except -1:
        # A small buffer in place of the large one, which goes (release).
        cdef char *small = fmq_growbuf_alloc(FIRST_CAP)
        if small == NULL:
            return 0    # keep the large one: still valid
        self.release()
        self.start_over(small)
        return 0

    cdef void start_over(self, char *small) noexcept:
        # ``small`` (FIRST_CAP bytes from fmq_growbuf_alloc) is the buffer now.
        self.buf = small
        self.cap = self.touched = FIRST_CAP

    cdef void release(self) noexcept:
        # The buffer goes: a mapped one to the home pool, cut down to the
        # pages it has backed; else (or with no home) back to the kernel or
        # the allocator.  The caller puts another in its place.
        if self.home is not None and fmq_growbuf_mapped(self.cap):
            self.home.give_back(self.buf, fmq_growbuf_trim(self.buf, self.cap, self.touched))
        else:
            fmq_growbuf_free(self.buf, self.cap)
        self.buf = NULL

    cdef bint reclaim(self, Py_ssize_t least) except -1:
        # The largest block of ``least`` bytes or more that the home pool
        # keeps becomes the buffer, the stream written so far copied into
        # it (a mapped buffer it replaces goes back there); False, nothing
        # changed, with no home or when it keeps none.
        cdef size_t n = 0
        if self.home is None:
            return False
        if least < <Py_ssize_t>FMQ_GROWBUF_MAP_MIN:
            least = FMQ_GROWBUF_MAP_MIN     # (the buffer's kind follows from its size)
        cdef char *p = self.home.reclaim(<size_t>least, &n)
        if p == NULL:
            return False
        if self.size:
            memcpy(p, self.buf, self.size)
        self.release()
        self.buf = p
        self.cap = self.touched = <Py_ssize_t>n
        return True

    cdef int gather(self, char *out) except -1:
        # The stream into ``out`` (size + span_bytes bytes): the buffer's
        # bytes between the spans, and each span, whose length is checked
        # again here (a bytearray can change between pickle and send).
        cdef Py_ssize_t prev = 0, done = 0, at, n
        for at, data, n, _, _, _ in self.spans:
            memcpy(out + done, self.buf + prev, at - prev)
            done += at - prev
            prev = at
            _copy_span(data, n, out + done)
            done += n
        n = self.size - prev
        if n >= 65536:
            with nogil:
                memcpy(out + done, self.buf + prev, n)
        else:
            memcpy(out + done, self.buf + prev, n)
        return 0

    cdef int flatten(self) except -1:
        """Copy the spans into the buffer: the stream in one piece.  In
        place, from the back: a span only pushes the bytes after it further
        along, so each stretch of the buffer moves (memmove) before a span
        fills the gap in front of it.  Flatten only grows the buffer (mremap
        keeps its pages), so a message like this on every step faults no
        fresh page once the buffer is large enough (a fresh buffer per
        message did)."""
        if not self.spans:
            return 0
        self.check_unexported()
        cdef Py_ssize_t total = self.size + self.span_bytes
        cdef Py_ssize_t end = total, stop = self.size, at, n, i, seg
        if total > self.cap:
            self.grow(total)
        if total > self.touched:
            self.ahead(total)
        for i in range(len(self.spans) - 1, -1, -1):
            at, data, n, _, _, _ = self.spans[i]
            seg = stop - at
            with nogil:
                memmove(self.buf + end - seg, self.buf + at, seg)
            end -= seg
            # A span that changed size raises: the caller aborts the message,
            # the half-moved buffer is never sent, the next message starts it afresh.
            _copy_span(data, n, self.buf + end - n)
            end -= n
            stop = at
        self.size = total
        del self.spans[:]
        self.span_bytes = 0
        return 0

    def clear(self):
        """Let go of the message's out-of-band buffers (the caller's memory)."""
        self.let_go()

    @property
    def nbytes(self):
        """Bytes of the pickle stream (the buffer's and the spans')."""
        return self.size + self.span_bytes
