from libc.stdint cimport uint8_t, uint64_t
from fastmq._arena cimport ArenaEnd
from fastmq._arena_pages cimport SlotPages

cdef class ArenaWriterEnd(ArenaEnd):
    cdef public Py_ssize_t min_bytes
    cdef public int copy_threads
    cdef public Py_ssize_t copy_min_part
    cdef public bint prefault_ahead
    cdef readonly SlotPages pages          # which slot pages are populated; the pre-fault
    cdef int *reserved                     # live writer SlotBuffers per slot
    cdef uint8_t *in_message               # published by the message being encoded
    cdef int n_in_message
    cdef uint64_t epochs                   # the last publication's number, arena-wide
    cdef object skip_buffer
    cdef bint warm_unused                  # warm_first's pages wait for the first buffer
    cdef bint logged_oversize
    cdef bint logged_exhausted
    cdef uint64_t n_hits, n_hit_bytes, n_inplace, n_exhausted, n_oversize
    cdef uint64_t n_declined, n_small, n_empty, n_empty_miss

    cdef uint64_t publish(self, int slot) noexcept nogil
    cdef int claim(self, Py_ssize_t nbytes) noexcept nogil
    cdef bytes descriptor(self, int slot, uint64_t offset, uint64_t nbytes, uint64_t epoch)
    cdef object view_to_slot(self, Py_buffer *view)
    cdef object copy_in(self, int slot, const char *src, Py_ssize_t nbytes)
    cdef object in_place(self, char *ptr, Py_ssize_t nbytes)
    cdef int populate_for_use(self, int slot, Py_ssize_t nbytes) except -2
    cdef object prefault_next(self, int slot, Py_ssize_t nbytes)
    cdef object after_use(self, int slot, Py_ssize_t nbytes, bint cold)
