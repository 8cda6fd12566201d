cdef int check_memory(str what, Py_ssize_t nbytes, str name) except -1
cdef long long room_for(Py_ssize_t need) except -2
cdef int segment_opened() except -1
cdef void segment_closed() noexcept
