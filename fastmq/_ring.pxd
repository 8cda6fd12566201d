from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from fastmq._shm cimport Segment

cdef class Ring:
    cdef readonly Segment segment
    cdef char *base
    cdef readonly int n_reader
    cdef readonly int max_chunks
    cdef readonly Py_ssize_t max_chunk_bytes
    cdef Py_ssize_t meta_stride
    cdef Py_ssize_t meta_off
    cdef Py_ssize_t data_off
    cdef uint32_t *read_seq
    cdef uint32_t *readers_parked
    cdef uint32_t *write_seq
    cdef uint32_t *writer_parked
    cdef uint32_t cancelled
    cdef readonly int current_idx
    cdef readonly int reader_rank
    cdef readonly int wait_mode
    cdef readonly int64_t spin_ns
    cdef public object hooks
    cdef public double warn_interval
    # Safety-net period of a parked waiter's re-check (tests stretch it to
    # prove that no wakeup depends on it).
    cdef public int64_t park_slice_ns
    # Wake syscalls this end issued (a busy pipeline should issue none).
    cdef readonly uint64_t wakeups
    # Chunks this writer end published (see Ring.publish).
    cdef readonly uint64_t n_published
    # Messages this reader end has read (mirrored into its reader slot).
    cdef readonly uint64_t n_read
    # Wakeups the ZMQ notify failed to send, and the last such error.
    cdef readonly uint64_t notify_errors
    cdef readonly object last_notify_error
    # Message id of the overflow mark that recv() last returned OVERFLOW for.
    cdef readonly uint64_t overflow_id
    # Writer: bytes of each chunk reserved in /dev/shm so far.
    cdef Py_ssize_t *reserved
    # Reader: this end holds its reader slot (claim_reader).
    cdef bint claimed
    cdef object data_view
    cdef object __weakref__
    cdef object loads
    # Called as oob_hook(oob_list) -> list before unpickling a message that
    # has out-of-band buffers (the tensor arena maps slot descriptors).
    cdef public object oob_hook

    cdef inline uint8_t *meta(self, int idx) nogil
    cdef inline char *chunk(self, int idx) nogil
    cdef inline bint readable(self, int idx) nogil
    cdef inline bint writable(self, int idx) nogil
    cdef int spin_until(self, int idx, bint writer, int64_t until_ns) nogil
    cdef int park_futex(self, int idx, bint writer, int64_t timeout_ns) nogil
    cdef int wait(self, int idx, bint writer, object timeout, bint warn) except -1
    cdef int publish(self, int idx) except -1
    cdef int release_chunk(self, int idx) except -1
    cdef int reserve_chunk(self, int idx, Py_ssize_t nbytes) except -1
    cdef int release_claim(self) noexcept
    cdef inline int _check_open(self) except -1
    cdef inline int _check_idx(self, int idx) except -1
    cdef object _decode(self, int idx)
    cdef int park_zmq(self, int idx, bint writer, int64_t timeout_ns) except -1
    cdef int _slice(self, int64_t start, int64_t deadline, int64_t *next_warn,
                    int64_t warn_ns, bint writer, int idx) except -1
