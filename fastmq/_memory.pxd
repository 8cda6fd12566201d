cdef int check_memory(str what, Py_ssize_t nbytes, str name) except -1
