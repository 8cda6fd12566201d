# Declarations of fmq_proc.h: this process's pid, right across fork().
cdef extern from "fmq_proc.h" nogil:
    int fmq_pid_init()
    long fmq_self_pid()
