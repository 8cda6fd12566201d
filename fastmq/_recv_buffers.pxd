cdef enum:
    # A buffer of this size or more comes from a BufferPool (a reader's
    # copy of a large out-of-band buffer or reassembled stream, a stream
    # gathered for a socket): fresh pages cost a fault and a page of zeros
    # each, about what filling them costs.  Smaller ones are plain objects.
    POOLED_MIN = 1 << 20


# Before unpickling ``n`` bytes of pickle stream (fastmq._ring's decode): have
# malloc keep the heap the objects take once they are freed (fmq_heap.h).
cdef void heap_keep(size_t n) noexcept
