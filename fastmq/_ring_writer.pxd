from libc.stdint cimport uint32_t, uint64_t, int64_t
from fastmq._ring cimport RingEnd
from fastmq._sink cimport PickleSink

cdef class RingWriter(RingEnd):
    # Reader that a READER_DIED status (or peer_status) found gone, and
    # whether it closed its end (left) rather than died.
    cdef readonly int dead_rank
    cdef readonly uint32_t dead_pid
    cdef readonly bint dead_left
    # Chunks this end published (see publish).
    cdef readonly uint64_t n_published
    # Wakeups the ZMQ notify failed to send, and the last such error.
    cdef readonly uint64_t notify_errors
    cdef readonly object last_notify_error
    # Messages and framed bytes send_object() / send_pickled() published.
    cdef readonly uint64_t sent_messages
    cdef readonly uint64_t sent_bytes
    # Messages framed to at least this many bytes are left to the caller
    # (send_sink returns 0) to go in parts, though they fit a chunk.
    cdef public Py_ssize_t parts_min
    # Bytes of each chunk reserved so far.
    cdef Py_ssize_t *reserved
    # Bytes of every chunk whose memory the ring's creation asked for.
    cdef Py_ssize_t asked_first

    cdef inline bint writable(self, int idx) noexcept nogil
    cdef bint find_dead_reader(self, int idx) except -1
    cdef int publish(self, int idx) except -1
    cdef int reserve_chunk(self, int idx, Py_ssize_t nbytes) except -1
    cdef char *take_next(self, Py_ssize_t nbytes) except NULL
    cdef Py_ssize_t frame_and_publish(self, Py_ssize_t n, const char **ptrs,
                                      Py_ssize_t *lens, object timeout,
                                      bint committed) except -1000
    cdef Py_ssize_t send_sink(self, PickleSink sink, object timeout, bint whole) except -1000
    cdef inline int _check_turn(self, int idx) except -1
