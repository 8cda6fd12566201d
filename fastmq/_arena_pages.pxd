from libc.stdint cimport uint64_t
from fastmq._segment cimport Segment

# Which pages of the writer's slots are populated, the memory checks before
# new ones are taken, and the background pre-fault (fastmq/_arena_pages.pyx).
cdef class SlotPages:
    cdef Segment segment                   # keeps the mapping while the thread runs
    cdef char *data
    cdef str name
    cdef int n_slots
    cdef Py_ssize_t slot_bytes, data_off
    cdef uint64_t *faulted                 # bytes from the slot start known populated
    cdef uint64_t *target                  # bytes from the slot start queued to pre-fault
    cdef object jobs
    cdef object lock
    cdef object thread                     # the background pre-fault, while it runs
    cdef bint running
    cdef int cancel
    cdef readonly uint64_t n_prefaulted
    cdef readonly uint64_t n_nomem
    cdef bint logged_nomem

    cdef bint memory_short(self, int slot, Py_ssize_t n) except -1
    cdef void populated(self, int slot, Py_ssize_t nbytes) noexcept
    cdef object failed(self, int slot, Py_ssize_t nbytes, int err)
    cdef int reserve(self, int slot, Py_ssize_t start, Py_ssize_t n) except -2
    cdef object stop(self)
    cdef object close(self)
