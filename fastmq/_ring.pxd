from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from fastmq._segment cimport Segment
from fastmq._sink cimport PickleSink

cdef class RingEnd:
    cdef readonly Segment segment
    cdef char *base
    cdef readonly int n_reader
    cdef readonly int max_chunks
    cdef readonly Py_ssize_t max_chunk_bytes
    cdef Py_ssize_t meta_stride
    cdef Py_ssize_t meta_off
    cdef Py_ssize_t data_off
    cdef uint32_t *read_seq
    cdef uint32_t *readers_parked
    cdef uint32_t *write_seq
    cdef uint32_t *writer_parked
    cdef uint32_t cancelled
    cdef readonly int current_idx
    cdef readonly int reader_rank
    cdef readonly bint is_writer
    cdef readonly int wait_mode
    cdef readonly int64_t spin_ns
    # Seconds between LONG_WAIT statuses of one wait (0: never).
    cdef public double warn_interval
    # Safety-net period of a parked waiter's re-check (tests stretch it to
    # prove that no wakeup depends on it).
    cdef public int64_t park_slice_ns
    # The wait in progress (wait_next / continue_wait): its start, deadline
    # and long-wait clock, in fmq_now_ns() time.
    cdef bint w_active
    cdef int64_t w_start
    cdef int64_t w_deadline
    cdef int64_t w_next_warn
    cdef int64_t w_warn_ns
    cdef int64_t next_peer_check
    # The reader a READER_DIED status (or peer_status) found dead.
    cdef readonly int dead_rank
    cdef readonly uint32_t dead_pid
    # ZMQ wait mode: the writer's notify XPUB; a reader's notify SUB and
    # the poller it parks on (see use_zmq_wakeup).
    cdef object zmq_notify
    cdef object zmq_poller
    # Wake syscalls this end issued (a busy pipeline should issue none).
    cdef readonly uint64_t wakeups
    # Chunks this writer end published (see RingEnd.publish).
    cdef readonly uint64_t n_published
    # Messages this reader end has read (mirrored into its reader slot).
    cdef readonly uint64_t n_read
    # Wakeups the ZMQ notify failed to send, and the last such error.
    cdef readonly uint64_t notify_errors
    cdef readonly object last_notify_error
    # Message id of the overflow mark read_object() last found (pending == OVERFLOW).
    cdef readonly uint64_t overflow_id
    # Messages and framed bytes send_object() / send_pickled() published.
    cdef readonly uint64_t sent_messages
    cdef readonly uint64_t sent_bytes
    # Why read_object() last returned PENDING: a wait status or OVERFLOW.
    cdef readonly int pending
    # Writer: bytes of each chunk reserved in /dev/shm so far.
    cdef Py_ssize_t *reserved
    # Reader: this end holds its reader slot (claim_reader) with this
    # claim word.
    cdef bint claimed
    cdef uint64_t claim
    # The process that created or attached this end: the only one that may
    # change shared state through it (see fmq_proc.h).
    cdef readonly long owner_pid
    # Whether the reader a READER_DIED status names closed its end (left)
    # rather than died.
    cdef readonly bint dead_left
    cdef object data_view
    cdef object __weakref__

    cdef inline uint8_t *meta(self, int idx) nogil
    cdef inline char *chunk(self, int idx) nogil
    cdef inline bint readable(self, int idx) nogil
    cdef inline bint writable(self, int idx) nogil
    cdef inline bint turn(self, int idx) nogil
    cdef int spin_until(self, int idx, int64_t until_ns) nogil
    cdef int park_futex(self, int idx, int64_t timeout_ns) nogil
    cdef int park_zmq(self, int idx, int64_t timeout_ns) except -1
    cdef int begin_wait(self, object timeout) except -1
    cdef int wait_loop(self) except -1
    cdef int spin_then_park(self) except -1
    cdef int between_slices(self, int idx) except -1
    cdef int check_peers(self, int idx) except -1
    cdef bint find_dead_reader(self, int idx) except -1
    cdef inline uint64_t *claim_word(self, int rank) noexcept nogil
    cdef inline bint closed_by_writer(self) noexcept
    cdef int writer_state(self) except -1
    cdef list take_oob(self, int idx, char *c, uint64_t *start0, uint64_t *len0)
    cdef Py_ssize_t frame_and_publish(self, Py_ssize_t n, const char **ptrs,
                                      Py_ssize_t *lens, object timeout,
                                      bint committed) except -1000
    cdef Py_ssize_t send_sink(self, PickleSink sink, object timeout) except -1000
    cdef int publish(self, int idx) except -1
    cdef int release_chunk(self, int idx) except -1
    cdef int reserve_chunk(self, int idx, Py_ssize_t nbytes) except -1
    cdef int release_claim(self) noexcept
    cdef inline int _check_open(self) except -1
    cdef inline int _check_idx(self, int idx) except -1
    cdef inline int _check_turn(self, int idx) except -1
    cdef inline int _check_writer(self) except -1
    cdef inline int _check_reader(self) except -1
