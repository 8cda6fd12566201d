cdef object _os_error(int err, str what, str name)

cdef class Segment:
    cdef readonly str name
    cdef readonly Py_ssize_t size
    cdef readonly bint owner
    cdef char *addr
    cdef int fd
    cdef Py_ssize_t exports
    cdef bint close_pending
    cdef bint unlinked

    cdef int _unmap(self) except -1
