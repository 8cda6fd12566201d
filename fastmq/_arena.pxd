cimport cython
from libc.stdint cimport uint64_t
from fastmq._segment cimport Segment

# One process's end of an arena segment: what both roles share (the
# mapping, its geometry, the token, the flag lines).  The writer's and the
# readers' state and methods are in their own classes
# (fastmq/_arena_writer.pxd, fastmq/_arena_reader.pxd), so no method here or
# there asks which end it is.
cdef class ArenaEnd:
    cdef readonly Segment segment
    cdef readonly str name
    cdef char *base
    cdef char *data
    cdef readonly int n_reader
    cdef readonly int n_slots              # 0 until bound: every slot index is refused
    cdef readonly Py_ssize_t slot_bytes
    cdef readonly Py_ssize_t total_bytes
    cdef readonly Py_ssize_t flags_off
    cdef readonly Py_ssize_t data_off
    cdef Py_ssize_t stride
    cdef readonly uint64_t token
    cdef readonly bint closed
    cdef readonly bint isolated            # readers map the slots copy-on-write

    cdef int bind(self, Segment seg, tuple geometry, uint64_t token, bint isolated) except -1
    cdef void advise_hugepages(self) noexcept
    @cython.final
    cdef char *line(self, int slot) noexcept nogil
    @cython.final
    cdef char *slot_ptr(self, int slot) noexcept nogil
    @cython.final
    cdef bint slot_free(self, int slot) noexcept nogil
    cdef dict common_stats(self)
    cdef void drop_ref(self, int slot) noexcept


cdef class SlotBuffer:
    cdef ArenaEnd arena
    cdef char *ptr
    cdef readonly Py_ssize_t nbytes
    cdef readonly int slot
