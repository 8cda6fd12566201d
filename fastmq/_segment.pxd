from posix.stat cimport struct_stat

cdef object _os_error(int err, str what, str name)
cdef int open_locator(str locator, bint writable, struct_stat *st) except -1

cdef class Segment:
    cdef readonly str name
    cdef readonly Py_ssize_t size
    cdef readonly bint owner
    cdef char *addr
    cdef int fd
    cdef unsigned long long inode
    cdef Py_ssize_t exports
    cdef bint close_pending
    cdef bint readonly
    # Counted among this process's open segments (fastmq._memory's watcher
    # runs while any is): set by mapped(), cleared by _unmap().
    cdef bint counted

    cdef int mapped(self) except -1
    cdef int _unmap(self) except -1
