"""Receive buffers for a remote reader's large frames, kept for reuse (and,
on the writer's side of an encrypted remote path, the memory a message's
ciphertext goes into).

A frame of a large message is received straight into memory of its own,
which becomes the caller's tensor.  Fresh memory costs the kernel a page
fault and a page of zeros for every 4 KiB before the socket writes it
again: for a 256 MiB tensor that is as much work as the receive itself.
Memory that a dropped tensor gave back is already mapped, so the next
frame of about its size goes straight in; a frame larger than every kept
block grows the largest of them (``mremap``), whose pages stay, so only
the rest is fresh (a reader's messages grow: a longer prompt, a larger
image).  Fresh pages were most of a first large message's time with
several readers on one core: each reader faulted in the whole new size
while keeping the smaller blocks beside it.  Fresh memory is populated in
one call (``MADV_POPULATE_WRITE``) before the frame is received, which
costs less than a fault per page taken in the middle of the receive, and
from 8 MiB up it is split over a few threads (``BufferPool(cap,
threads)``): the kernel's work per fresh page takes nearly half the time
on two cores (16 MiB in about 3.3 ms instead of 6.5 on 2 vCPUs).
Ordinary pages, not huge ones: with ``MADV_HUGEPAGE`` a first frame was
usually faster, but now and then stalled for hundreds of milliseconds (a
huge page must be found, or made by compaction, at the fault), where
vLLM's receive never asks for one.

Lifetime: a ``PooledBuffer`` is the exporter of its memory (buffer
protocol); a tensor or array made over it holds a reference to it, so the
memory returns to its ``BufferPool`` only when the last view of it is
gone (``__dealloc__``), never while the caller can still see it.  A pool
keeps at most ``cap`` bytes in at most ``MAX_FREE`` blocks; what does not
fit goes back to the kernel.  Blocks are anonymous private mappings: a
fork child gets its own copy of each, and nothing outlives the process.
"""
from cpython.buffer cimport PyBuffer_FillInfo
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uintptr_t
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap

cdef extern from "<sys/mman.h>" nogil:
    enum: MREMAP_MAYMOVE
    void *mremap(void *old_address, size_t old_size, size_t new_size, int flags, ...)

# For Python callers (fastmq._parts).
POOLED_MIN_BYTES = POOLED_MIN

# Advice: refused (a kernel older than 5.14) or short of memory now, the
# receive or copy that fills the pages faults them in itself.
cdef extern from "fmq_populate.h" nogil:
    int fmq_populate(char *p, size_t n)

cdef extern from "fmq_copy.h" nogil:
    int fmq_parallel_populate(char *p, size_t n, int threads, size_t min_part)

cdef extern from "fmq_stream_copy.h" nogil:
    void fmq_stream_copy(char *dst, const char *src, size_t n)

cdef extern from "fmq_heap.h" nogil:
    size_t FMQ_HEAP_HINT_MAX
    void fmq_heap_hint(size_t n)

# The largest size heap_keep() has told malloc about in this process (a
# fork child inherits the allocator's state with it).
cdef size_t _heap_kept = 0

cdef enum:
    PAGE = 4096
    # Fresh memory this large is populated by several threads (fmq_copy.h).
    POPULATE_PART = 4 << 20


cdef size_t _pages(size_t n):
    return (n + PAGE - 1) & ~(<size_t>PAGE - 1)


cdef void _populate(char *p, size_t n) noexcept:
    # The whole pages inside [p, p + n), faulted in by one call: malloc
    # maps a large block fresh, and the copy that fills it would otherwise
    # take a fault per page.  Advice only: refused, the copy faults.
    cdef uintptr_t lo = _pages(<uintptr_t>p), hi = (<uintptr_t>p + n) & ~(<uintptr_t>PAGE - 1)
    if n >= (1 << 20) and hi > lo:
        fmq_populate(<char *>lo, hi - lo)


def fresh_bytes(Py_ssize_t length):
    """``(obj, target)``: a new ``bytes`` of ``length`` bytes (contents
    undefined) and a writable buffer over its memory that keeps it alive,
    for the copy that fills it before anybody else sees the object."""
    if length < 0:
        raise ValueError(f"fresh_bytes: length must be >= 0, got {length}")
    obj = PyBytes_FromStringAndSize(NULL, length)
    _populate(PyBytes_AS_STRING(obj), length)
    cdef Filling target = Filling.__new__(Filling)
    target.obj = obj
    return obj, target


def copy_streaming(dst, src):
    """Copy ``src`` into ``dst`` (writable, the same length) with
    streaming stores (fmq_stream_copy.h): for a received segment on its
    way into a frame larger than the caches, which the copy need not
    read first.  The GIL is released for the copy."""
    cdef const unsigned char[::1] s = src
    cdef unsigned char[::1] d = dst
    cdef size_t n = s.shape[0]
    if <size_t>d.shape[0] != n:
        raise ValueError(f"copy_streaming: the target holds {d.shape[0]} bytes, "
                         f"the source {n}")
    if n:
        with nogil:
            fmq_stream_copy(<char *>&d[0], <const char *>&s[0], n)


cdef void heap_keep(size_t n) noexcept:
    # Costs a mapping only when ``n`` is larger than any before (from 1 MiB).
    global _heap_kept
    if n > FMQ_HEAP_HINT_MAX:
        n = FMQ_HEAP_HINT_MAX
    if n <= _heap_kept or n < POOLED_MIN:
        return
    _heap_kept = n
    fmq_heap_hint(n)


def fresh_bytearray(Py_ssize_t length):
    """A new ``bytearray`` of ``length`` bytes, contents undefined (not
    zeroed: the copy that fills it is the only pass over it)."""
    if length < 0:
        raise ValueError(f"fresh_bytearray: length must be >= 0, got {length}")
    obj = PyByteArray_FromStringAndSize(NULL, length)
    _populate(PyByteArray_AS_STRING(obj), length)
    return obj


cdef class Filling:
    """Writable access to a ``bytes`` object's memory, made only by
    ``fresh_bytes`` for an object nobody else holds yet."""

    cdef object obj

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, PyBytes_AS_STRING(self.obj),
                          PyBytes_GET_SIZE(self.obj), 0, flags)


cdef void _populate_fresh(char *p, size_t n, int threads) noexcept nogil:
    # Fresh pages of a block about to be filled, in one call, or split
    # over ``threads`` threads when large: the kernel's work per page
    # (allocate, zero, map) is most of what a first large frame costs its
    # reader, and a second core is free while the reader waits for the
    # frame's bytes (the writer is then waiting for the reader).
    if threads > 1 and n >= 2 * <size_t>POPULATE_PART:
        fmq_parallel_populate(p, n, threads, POPULATE_PART)
    else:
        fmq_populate(p, n)


cdef class BufferPool:
    """``BufferPool(cap, threads=1)``: hands out ``PooledBuffer``s and keeps
    up to ``cap`` bytes of the ones given back for the next ``take``; fresh
    memory of 8 MiB or more is populated by up to ``threads`` threads."""

    def __cinit__(self, Py_ssize_t cap, int threads=1):
        if cap < 0:
            raise ValueError(f"BufferPool: cap must be >= 0, got {cap}")
        if threads < 1:
            raise ValueError(f"BufferPool: threads must be >= 1, got {threads}")
        self.cap = cap
        self.threads = threads
        self.n = 0
        self.held = 0
        self.reused = 0
        self.grown = 0

    def take(self, Py_ssize_t length):
        """A writable buffer of exactly ``length`` bytes (contents
        undefined): a kept block that fits (at most twice the size
        needed); else the largest kept block smaller than that, grown to
        it (``grown``) if the pool could keep the result; else fresh
        memory."""
        if length <= 0:
            raise ValueError(f"BufferPool.take: length must be > 0, got {length}")
        cdef size_t need = _pages(<size_t>length)
        cdef int i, best = -1, small = -1
        for i in range(self.n):
            if self.sizes[i] >= need and self.sizes[i] <= 2 * need and (
                    best < 0 or self.sizes[i] < self.sizes[best]):
                best = i
            if self.sizes[i] < need and (small < 0 or self.sizes[i] > self.sizes[small]):
                small = i
        cdef void *p = MAP_FAILED
        cdef size_t size
        if best >= 0:
            p, size = self.blocks[best], self.sizes[best]
            self._drop(best)
            self.reused += 1
        elif small >= 0 and need <= self.cap:
            # Moved if it must: the block is no one's until handed out.
            # Refused (no address space), the block stays kept as it was.
            # (A frame larger than the cap goes back to the kernel once
            # dropped: it must not take a block the pool could keep.)
            p = mremap(self.blocks[small], self.sizes[small], need, MREMAP_MAYMOVE)
            if p != MAP_FAILED:
                size = self.sizes[small]
                self._drop(small)
                with nogil:
                    _populate_fresh(<char *>p + size, need - size, self.threads)
                size = need
                self.grown += 1
        if p == MAP_FAILED:
            size = need
            p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            if p == MAP_FAILED:
                raise MemoryError(f"fastmq: cannot map {length} bytes for a received frame")
            with nogil:
                _populate_fresh(<char *>p, size, self.threads)
        cdef PooledBuffer b = PooledBuffer.__new__(PooledBuffer)
        b.p, b.size, b.length, b.pool = <char *>p, size, length, self
        return b

    cdef PooledBuffer adopt(self, char *p, size_t size, size_t length):
        # A mapping someone else filled (the writer's pickle sink): a
        # private anonymous mapping of ``size`` bytes, whole pages, all of
        # them backed, of which the first ``length`` are the frame.  It is
        # this pool's from here: kept or unmapped once the frame is dropped.
        cdef PooledBuffer b = PooledBuffer.__new__(PooledBuffer)
        b.p, b.size, b.length, b.pool = p, size, length, self
        return b

    cdef char *reclaim(self, size_t least, size_t *size) noexcept:
        # The largest kept block of ``least`` bytes or more, out of the pool
        # for good (the caller unmaps it, or adopts it back); NULL if none.
        cdef int i, best = -1
        for i in range(self.n):
            if self.sizes[i] >= least and (best < 0 or self.sizes[i] > self.sizes[best]):
                best = i
        if best < 0:
            return NULL
        cdef char *p = <char *>self.blocks[best]
        size[0] = self.sizes[best]
        self._drop(best)
        self.reused += 1
        return p

    cdef void _drop(self, int i) noexcept:
        self.held -= self.sizes[i]
        self.n -= 1
        self.blocks[i] = self.blocks[self.n]
        self.sizes[i] = self.sizes[self.n]

    cdef void give_back(self, void *p, size_t size) noexcept:
        # A block larger than the whole cap goes back to the kernel; else
        # kept blocks make room for it (the newest is the likeliest to be
        # asked for again: the same tensor shape, step after step).
        if size > self.cap:
            munmap(p, size)
            return
        self._keep_at_most(self.cap - size, MAX_FREE - 1)
        self.blocks[self.n] = p
        self.sizes[self.n] = size
        self.n += 1
        self.held += size

    def warm(self, Py_ssize_t nbytes):
        """Have a populated block of ``nbytes`` (whole pages) kept for the
        next ``take``, unless a kept block would serve that ``take``
        already or the cap is smaller: the first frame of about that size
        then finds its pages in place."""
        if nbytes < 0:
            raise ValueError(f"BufferPool.warm: nbytes must be >= 0, got {nbytes}")
        cdef size_t need = _pages(<size_t>nbytes)
        cdef int i
        if need == 0 or need > self.cap:
            return
        for i in range(self.n):
            if need <= self.sizes[i] <= 2 * need:   # what take() would reuse
                return
        try:
            self.take(nbytes)   # dropped at once: given back, and kept
        except MemoryError:
            pass                # best effort: the first frame maps its own

    def set_cap(self, Py_ssize_t cap):
        """Keep up to ``cap`` bytes from now on (what is kept beyond it goes
        back to the kernel at once, oldest first)."""
        if cap < 0:
            raise ValueError(f"BufferPool: cap must be >= 0, got {cap}")
        self.cap = cap
        self._keep_at_most(self.cap, MAX_FREE)

    cdef void _keep_at_most(self, size_t nbytes, int nblocks) noexcept:
        # Kept blocks go back to the kernel, the first slot's first, until
        # at most ``nbytes`` in at most ``nblocks`` blocks are kept.
        while self.n and (self.n > nblocks or self.held > nbytes):
            munmap(self.blocks[0], self.sizes[0])
            self._drop(0)

    @property
    def held_bytes(self):
        """Bytes kept for reuse now."""
        return self.held

    def close(self):
        """Give every kept block back to the kernel; later returns are not
        kept either."""
        self.cap = 0
        self._keep_at_most(0, 0)

    def __dealloc__(self):
        self.close()


cdef class PooledBuffer:
    """Writable memory of one received frame (buffer protocol, ``len``)."""

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.p, self.length, 0, flags)

    def __len__(self):
        return self.length

    def __dealloc__(self):
        if self.p != NULL:
            if self.pool is not None:
                self.pool.give_back(self.p, self.size)
            else:
                munmap(self.p, self.size)
            self.p = NULL
