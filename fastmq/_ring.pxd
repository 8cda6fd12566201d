from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from fastmq._native.atomic cimport (fmq_cpu_relax, fmq_load_u32_acq, fmq_now_ns,
                                    fmq_sched_yield)
from fastmq._segment cimport Segment
from fastmq._ring_layout cimport H_READER_SLOTS, READER_SLOT

# What a wait returns (fastmq._ring's READY, LONG_WAIT, ... mirror these).
cdef enum:
    ST_READY = 0
    ST_LONG_WAIT = 1
    ST_WRITER_CLOSED = 2
    ST_WRITER_DIED = 3
    ST_READER_DIED = 4
    ST_OVERFLOW = 5
    ST_PICKLER_STALE = 6
    ST_PARTS = 7

# Wait modes (fastmq._ring's WAIT_SPIN, WAIT_FUTEX, WAIT_ZMQ).
cdef enum:
    W_SPIN = 0
    W_FUTEX = 1
    W_ZMQ = 2

# Chunk framing (see fastmq/_ring.pyx's docstring) and copy policy.
cdef enum:
    FRAME_HEAD = 8
    MARK_BYTES = 16
    RESERVE_STEP = 4096      # pages are reserved in steps of this many bytes (one page)
    CHECK_STEP = 65536       # ...and the host's memory asked for in steps of this many
    NOGIL_COPY_MIN = 65536   # copies this large release the GIL
    # A message too big for a chunk goes, with node-local readers only, as
    # parts through consecutive chunks (fastmq/_ring.pyx): kind byte, part
    # index, the part stream's length, this part's offset and length.
    CHUNK_PART = 2
    CHUNK_PART_ABORT = 3
    PART_HEAD = 32


cdef class RingEnd:
    """The state and wait engine that a ring's writer end (RingWriter) and
    reader end (RingReader) share; each role overrides ``turn``,
    ``spin_until`` and ``check_peers``."""
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
    # Where this end parks (futex mode): the count of parked waiters of its
    # role and the futex word its peers bump (set by the role at bind).
    cdef uint32_t *park_counter
    cdef uint32_t *park_word
    # This end never parks: it spins (with yields) to the end of a wait.
    cdef bint spin_only
    cdef uint32_t cancelled
    cdef readonly int current_idx
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
    # ZMQ wait mode: the writer's notify XPUB; a reader's notify SUB and
    # the poller it parks on (see use_zmq_wakeup).
    cdef object zmq_notify
    cdef object zmq_poller
    # Wake syscalls this end issued (a busy pipeline should issue none).
    cdef readonly uint64_t wakeups
    # The process that created or attached this end: the only one that may
    # change shared state through it (see fmq_proc.h).
    cdef readonly long owner_pid
    cdef object data_view
    cdef object __weakref__

    cdef inline uint8_t *meta(self, int idx) noexcept nogil:
        return <uint8_t *>(self.base + self.meta_off + idx * self.meta_stride)

    cdef inline char *chunk(self, int idx) noexcept nogil:
        return self.base + self.data_off + idx * self.max_chunk_bytes

    cdef inline uint64_t *claim_word(self, int rank) noexcept nogil:
        return <uint64_t *>(self.base + H_READER_SLOTS + READER_SLOT * rank)

    cdef int bind(self, Segment seg, tuple geometry, int wait_mode, int64_t spin_ns) except -1
    # The role's: whether chunk idx is this end's to take (free to write,
    # or published and unread), and a spin on that until a deadline.
    cdef bint turn(self, int idx) noexcept nogil
    cdef int spin_until(self, int idx, int64_t until_ns) noexcept nogil
    cdef int park_futex(self, int idx, int64_t timeout_ns) noexcept nogil
    cdef int park_zmq(self, int idx, int64_t timeout_ns) except -1
    cdef int set_zmq_wakeup(self, object notify, object poller) except -1
    cdef int begin_wait(self, object timeout) except -1
    cdef int wait_loop(self) except -1
    cdef int spin_then_park(self) except -1
    cdef int between_slices(self, int idx) except -1
    # The role's: whether a peer it waits on is gone (a wait status).
    cdef int check_peers(self, int idx) except -1
    # The role's: say in shared memory that this end is in a wait (readers).
    cdef void mark_waiting(self, bint on) noexcept
    cdef bint peer_check_due(self) noexcept
    cdef inline int _check_open(self) except -1
    cdef inline int _check_idx(self, int idx) except -1


# One failed poll of a role's spin loop (its ``spin_until``): 1 to poll
# again, 0 once ``until_ns`` has passed, -1 once ``cancelled`` is set.  The
# clock and the cancel flag are read every 64th poll only, so that a poll
# costs the flag loads and a pause.
cdef inline int spin_tick(uint32_t *cancelled, unsigned int i,
                          int64_t until_ns) noexcept nogil:
    if (i & 63) == 0:
        if fmq_load_u32_acq(cancelled):
            return -1
        if fmq_now_ns() >= until_ns:
            return 0
        # Give a core back to a writer/reader sharing it (with two cores
        # and several readers the machine is oversubscribed).
        fmq_sched_yield()
    else:
        fmq_cpu_relax()
    return 1


# Whether the process a reader slot's claim word names is running.
cdef bint claim_alive(uint64_t word) except -1
# The object of a message's frames (decode_frames without the checks).
cdef object decode(object stream, list oob, object arena)
