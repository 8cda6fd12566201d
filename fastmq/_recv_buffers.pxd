cdef enum:
    # A buffer of this size or more comes from a BufferPool (a reader's
    # copy of a large out-of-band buffer or reassembled stream, a stream
    # gathered for a socket): fresh pages cost a fault and a page of zeros
    # each, about what filling them costs.  Smaller ones are plain objects.
    POOLED_MIN = 1 << 20


# Before unpickling ``n`` bytes of pickle stream (fastmq._ring's decode): have
# malloc keep the heap the objects take once they are freed (fmq_heap.h).
cdef void heap_keep(size_t n) noexcept

cdef enum:
    # At most this many blocks are kept (enough for the encrypting writer's
    # ciphertext blocks, fastmq._wire CIPHER_POOL_BYTES: a megabyte each).
    MAX_FREE = 32


cdef class BufferPool:
    cdef void *blocks[MAX_FREE]
    cdef size_t sizes[MAX_FREE]
    cdef int n
    cdef size_t held
    cdef size_t cap
    cdef int threads
    cdef public Py_ssize_t reused
    cdef public Py_ssize_t grown

    cdef PooledBuffer adopt(self, char *p, size_t size, size_t length)
    cdef char *reclaim(self, size_t least, size_t *size) noexcept
    cdef void _drop(self, int i) noexcept
    cdef void _keep_at_most(self, size_t nbytes, int nblocks) noexcept
    cdef void give_back(self, void *p, size_t size) noexcept


cdef class PooledBuffer:
    cdef char *p
    cdef size_t size
    cdef size_t length
    cdef BufferPool pool
