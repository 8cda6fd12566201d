from libc.stdint cimport uint8_t, uint64_t
from fastmq._arena cimport ArenaEnd

cdef class ArenaWriterEnd(ArenaEnd):
    cdef public Py_ssize_t min_bytes
    cdef public int copy_threads
    cdef public Py_ssize_t copy_min_part
    cdef public bint prefault_ahead
    cdef int *reserved                     # live writer SlotBuffers per slot
    cdef uint8_t *in_message               # published by the message being encoded
    cdef int n_in_message
    cdef uint64_t *faulted                 # bytes from the slot start known populated
    cdef uint64_t *prefault_target         # bytes from the slot start queued to pre-fault
    cdef object skip_buffer
    cdef object prefault_jobs
    cdef object prefault_lock
    cdef bint prefault_running
    cdef object prefault_thread            # the background pre-fault, while it runs
    cdef bint warm_unused                  # warm_first's pages wait for the first buffer
    cdef int cancel_prefault
    cdef int prefault_error
    cdef bint logged_oversize
    cdef bint logged_exhausted
    cdef bint logged_nomem
    cdef uint64_t n_hits, n_hit_bytes, n_inplace, n_exhausted, n_oversize
    cdef uint64_t n_declined, n_small, n_nomem, n_empty, n_empty_miss, n_prefaulted

    cdef uint64_t publish(self, int slot) noexcept nogil
    cdef int claim(self, Py_ssize_t nbytes) noexcept nogil
    cdef bytes descriptor(self, int slot, uint64_t offset, uint64_t nbytes, uint64_t epoch)
    cdef object view_to_slot(self, Py_buffer *view)
    cdef object copy_in(self, int slot, const char *src, Py_ssize_t nbytes)
    cdef object in_place(self, char *ptr, Py_ssize_t nbytes)
    cdef int populate_for_use(self, int slot, Py_ssize_t nbytes) except -2
    cdef bint memory_short(self, int slot, Py_ssize_t n) except -1
    cdef int reserve_pages(self, int slot, Py_ssize_t start, Py_ssize_t n) except -2
    cdef object prefault_next(self, int slot, Py_ssize_t nbytes)
    cdef object after_use(self, int slot, Py_ssize_t nbytes, bint cold)
    cdef object stop_prefault(self)
    cdef object join_prefault(self)
