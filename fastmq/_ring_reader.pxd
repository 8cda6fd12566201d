from libc.stdint cimport uint64_t
from fastmq._ring cimport RingEnd

cdef class RingReader(RingEnd):
    cdef readonly int reader_rank
    # Messages this end has read (mirrored into its reader slot).
    cdef readonly uint64_t n_read
    # Message id of the overflow mark read_object() last found (pending == OVERFLOW).
    cdef readonly uint64_t overflow_id
    # Why read_object() last returned PENDING: a wait status or OVERFLOW.
    cdef readonly int pending
    # This end holds its reader slot (claim_reader) with this claim word.
    cdef bint claimed
    cdef uint64_t claim
    # Where out-of-band buffers of POOLED_MIN bytes and more are copied to
    # (a fastmq._recv_buffers.BufferPool), or None: fresh bytearrays.
    cdef public object buffers
    # A pidfd of the writer's process (-1: none), and whether its pid is
    # one this process's pid namespace can judge (see writer_alive).
    cdef int writer_pidfd
    cdef bint writer_pid_visible

    cdef inline bint readable(self, int idx) noexcept nogil
    cdef inline bint closed_by_writer(self) noexcept
    cdef int writer_state(self) except -1
    cdef int release_chunk(self, int idx) except -1
    cdef list take_oob(self, int idx, char *c, uint64_t *start0, uint64_t *len0)
    cdef int release_claim(self) noexcept
    cdef void mark_waiting(self, bint on) noexcept
