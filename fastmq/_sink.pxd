from fastmq._recv_buffers cimport BufferPool, PooledBuffer


cdef class PickleSink:
    cdef char *buf
    cdef Py_ssize_t size
    cdef readonly Py_ssize_t cap
    # The first ``touched`` bytes of the buffer have pages (all of a
    # malloc'd one): a write beyond populates ahead first (``ahead``).
    cdef readonly Py_ssize_t touched
    # The out-of-band buffers of the message in the buffer, and whether
    # the buffer holds a message not yet sent or let go.
    cdef list oob
    # Large in-band payloads kept by reference: (offset in the stream's
    # buffer, object, length); their bytes in all; views of the buffer.
    cdef list spans
    cdef readonly Py_ssize_t span_bytes
    cdef Py_ssize_t exports
    cdef bint holding
    # The arena was asked for a slot for this message (see committed()).
    cdef bint arena_asked
    cdef object to_slot
    cdef object commit
    cdef object abort
    cdef readonly Py_ssize_t oob_min
    # What the pickler was built against (see expect()).
    cdef dict copyreg_table
    cdef Py_ssize_t copyreg_len
    cdef bint torch_pending
    cdef dict modules
    cdef readonly bint broken
    # Where a large buffer comes from and goes back to (the process's pool,
    # fastmq._pools), or None: mappings of the sink's own.
    cdef BufferPool home
    # The last stream's buffer was handed to the home pool (frames()): the
    # next message takes a block back from there first (reclaim).
    cdef bint handed

    cdef int grow(self, Py_ssize_t need) except -1
    cdef void ahead(self, Py_ssize_t end) noexcept
    cdef Py_ssize_t keep(self, object data, Py_ssize_t n) except -1
    cdef int check_unexported(self) except -1
    cdef int check_holding(self) except -1
    cdef int gather(self, char *out) except -1
    cdef PooledBuffer hand_over(self)
    cdef int put_back(self) except -1
    cdef void start_over(self, char *small) noexcept
    cdef void release(self) noexcept
    cdef bint reclaim(self, Py_ssize_t least) except -1
    cdef int flatten(self) except -1
    cdef int pickle(self, object pickler, object obj) except -1
    cdef int committed(self) except -1
    cdef inline int let_go(self) except -1
    cdef int aborted(self) except -1
    cdef bint needs_new_pickler(self) except -1
