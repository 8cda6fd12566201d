"""Physical floors for ``fastmq-bench``: what the benchmark's scenarios cost
with no queue, no pickling and no Python in the loop.

``pingpong_writer`` / ``pingpong_reader`` run the executor step with bare
shared memory between processes: the writer copies the payload into a shared
segment and bumps a sequence word; each reader waits for the word, copies the
payload out (as any transport must hand the reader its own bytes) and
answers on its own cache line.

``wake_writer`` / ``wake_reader`` are the wake-from-idle floor: each reader
parks in ``FUTEX_WAIT`` on a word in a shared segment; the writer sleeps
(``clock_nanosleep``), reads ``CLOCK_MONOTONIC``, bumps the word and issues
``FUTEX_WAKE``; each reader reads the same clock as soon as it runs again.
No Python runs between the writer's clock read and the reader's.

Segment layout (offsets from the mapping's base)::

    +-------------------------+ 0
    | seq  (u64, writer)      |   one 64-byte line each, so that the writer
    | ack 0 (u64, reader 0)   |   polling the acks never false-shares with
    | ack 1 ...               |   a reader polling seq
    +-------------------------+ PAYLOAD_OFF (4096)
    | payload                 |
    +-------------------------+

Ordering: the writer copies the payload, stamps it, then stores ``seq``
with release; a reader that loads ``seq`` with acquire sees the whole
payload.  The reader copies it out, then stores its ack with release, so the
writer (acquire) may overwrite the payload for the next round.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from fastmq._native.atomic cimport (fmq_cpu_relax, fmq_futex_wait, fmq_futex_wake_all,
                                    fmq_have_futex, fmq_load_u32_acq, fmq_load_u64_acq,
                                    fmq_now_ns, fmq_sched_yield, fmq_store_u32_rel,
                                    fmq_store_u64_rel)


cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_nanosleep(int clock_id, int flags, const timespec *request, timespec *remain)
    int CLOCK_MONOTONIC
from fastmq._segment cimport Segment

cdef enum:
    LINE = 64
    PAYLOAD_OFF_C = 4096

PAYLOAD_OFF = PAYLOAD_OFF_C
MAX_READERS = PAYLOAD_OFF_C // LINE - 1


def segment_size(int n_readers, Py_ssize_t max_payload):
    """Bytes the floor's shared segment needs."""
    _check_readers(n_readers)
    if max_payload < 0:
        raise ValueError("max_payload must be >= 0, got %d" % max_payload)
    return PAYLOAD_OFF + max_payload


cdef int _check_readers(int n_readers) except -1:
    if n_readers < 1 or n_readers > MAX_READERS:
        raise ValueError("n_readers must be in 1..%d, got %d" % (MAX_READERS, n_readers))
    return 0


cdef char *_base(Segment seg, int n_readers, Py_ssize_t size) except NULL:
    _check_readers(n_readers)
    if seg.addr == NULL:
        raise ValueError("floor segment is closed")
    if size < 0 or PAYLOAD_OFF_C + size > seg.size:
        raise ValueError("payload of %d bytes does not fit the floor segment (%d bytes)"
                         % (size, seg.size))
    return seg.addr


cdef inline uint64_t *_word(char *base, int line) noexcept nogil:
    return <uint64_t *>(base + line * LINE)


cdef int _wait_for(uint64_t *word, uint64_t value, int64_t deadline,
                   int64_t spin_ns) noexcept nogil:
    """Spin until ``*word == value``, for ``spin_ns`` purely, then yielding
    the core between polls; 0 on success, 1 when ``deadline`` passed first.

    With more busy processes than cores (two cores, a writer and two
    readers) a pure spinner holds its core for a whole time slice while the
    peer it waits for cannot run: there the caller passes ``spin_ns=0``."""
    cdef unsigned int i = 0
    cdef int64_t now, yield_from = 0
    while fmq_load_u64_acq(word) != value:
        i += 1
        if (i & 63) != 0:
            fmq_cpu_relax()
            continue
        now = fmq_now_ns()
        if yield_from == 0:
            yield_from = now + spin_ns
        elif now > deadline:
            return 1
        elif now >= yield_from:
            fmq_sched_yield()
    return 0


def pingpong_writer(Segment seg, int n_readers, const unsigned char[::1] src,
                    uint64_t first_seq, int64_t[::1] out, double timeout_s,
                    int64_t spin_ns=2_000):
    """Run ``len(out)`` round trips, numbered ``first_seq``, ``first_seq + 1``...;
    ``out[i]`` receives round trip ``i`` in nanoseconds: copy ``src`` in,
    publish, wait for every reader's ack."""
    cdef Py_ssize_t size = src.shape[0]
    cdef char *base = _base(seg, n_readers, size)
    cdef Py_ssize_t n = out.shape[0], i
    cdef int r, late = 0
    cdef uint64_t s
    cdef int64_t t0, deadline
    cdef const unsigned char *psrc = &src[0] if size > 0 else NULL
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9)
    with nogil:
        for i in range(n):
            s = first_seq + <uint64_t>i
            t0 = fmq_now_ns()
            if size > 0:
                memcpy(base + PAYLOAD_OFF_C, psrc, size)
            if size >= 8:
                # Stamp the round's number into the payload so a reader that
                # copied a stale payload notices.
                memcpy(base + PAYLOAD_OFF_C, &s, 8)
            fmq_store_u64_rel(_word(base, 0), s)
            deadline = t0 + timeout_ns
            for r in range(n_readers):
                if _wait_for(_word(base, 1 + r), s, deadline, spin_ns):
                    late = 1 + r
                    break
            if late:
                break
            out[i] = fmq_now_ns() - t0
    if late:
        raise TimeoutError("floor: reader %d did not answer round %d within %.1f s"
                           % (late - 1, s, timeout_s))


def pingpong_reader(Segment seg, int n_readers, int rank, unsigned char[::1] dst,
                    uint64_t first_seq, Py_ssize_t rounds, double timeout_s,
                    int64_t spin_ns=2_000):
    """Answer ``rounds`` round trips as reader ``rank``: wait for each
    number, copy the payload into ``dst``, check its stamp, ack."""
    cdef Py_ssize_t size = dst.shape[0]
    cdef char *base = _base(seg, n_readers, size)
    if rank < 0 or rank >= n_readers:
        raise ValueError("rank %d out of range for %d readers" % (rank, n_readers))
    cdef Py_ssize_t i
    cdef uint64_t s, stamp = 0
    cdef int late = 0, bad = 0
    cdef unsigned char *pdst = &dst[0] if size > 0 else NULL
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9)
    with nogil:
        for i in range(rounds):
            s = first_seq + <uint64_t>i
            if _wait_for(_word(base, 0), s, fmq_now_ns() + timeout_ns, spin_ns):
                late = 1
                break
            if size > 0:
                memcpy(pdst, base + PAYLOAD_OFF_C, size)
            if size >= 8:
                memcpy(&stamp, pdst, 8)
                if stamp != s:
                    bad = 1
                    break
            fmq_store_u64_rel(_word(base, 1 + rank), s)
    if late:
        raise TimeoutError("floor: reader %d saw no round %d within %.1f s"
                           % (rank, s, timeout_s))
    if bad:
        raise RuntimeError("floor: reader %d copied a payload stamped %d in round %d"
                           % (rank, stamp, s))


# -- wake from idle ----------------------------------------------------------
# Layout: line 0 holds the futex word (u32, the round number the writer
# published); line 1 + r holds reader r's answer: the round (u64) at +0 and
# its clock reading at +8.

cdef int _sleep_ns(int64_t ns) noexcept nogil:
    cdef timespec ts
    if ns <= 0:
        return 0
    ts.tv_sec = ns // 1000000000
    ts.tv_nsec = ns % 1000000000
    while clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, &ts) != 0:
        pass  # interrupted: sleep the rest
    return 0


def wake_segment_size(int n_readers):
    """Bytes the wake floor's shared segment needs."""
    _check_readers(n_readers)
    return PAYLOAD_OFF


def wake_writer(Segment seg, int n_readers, uint32_t first_round, int64_t idle_ns,
                int64_t[:, ::1] out, double timeout_s):
    """Run ``out.shape[0]`` rounds numbered from ``first_round``: sleep
    ``idle_ns``, read the clock, publish the round and wake the readers,
    then wait (spinning, not measured) for every reader's clock reading;
    ``out[i, r]``: reader r's wake latency in round i, nanoseconds."""
    if not fmq_have_futex():
        raise OSError("no futex support on this system")
    cdef char *base = _base(seg, n_readers, 0)
    if out.shape[1] != n_readers:
        raise ValueError("out must have one column per reader")
    cdef Py_ssize_t n = out.shape[0], i
    cdef int r, late = 0
    if first_round < 1:
        raise ValueError("rounds are numbered from 1")
    cdef uint32_t s = first_round
    cdef int64_t t0
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9)
    cdef uint32_t *word = <uint32_t *>base
    with nogil:
        for i in range(n):
            s = first_round + <uint32_t>i
            _sleep_ns(idle_ns)
            t0 = fmq_now_ns()
            fmq_store_u32_rel(word, s)
            fmq_futex_wake_all(word)
            for r in range(n_readers):
                if _wait_for(_word(base, 1 + r), s, t0 + timeout_ns, 2_000):
                    late = 1 + r
                    break
                out[i, r] = (<int64_t *>(base + (1 + r) * LINE + 8))[0] - t0
            if late:
                break
    if late:
        raise TimeoutError("wake floor: reader %d did not wake for round %d within %.1f s"
                           % (late - 1, s, timeout_s))


def wake_reader(Segment seg, int n_readers, int rank, uint32_t first_round,
                Py_ssize_t rounds, double timeout_s):
    """Reader ``rank`` of the wake floor: for each round, park in
    ``FUTEX_WAIT`` until the writer publishes it, read the clock, answer."""
    if not fmq_have_futex():
        raise OSError("no futex support on this system")
    cdef char *base = _base(seg, n_readers, 0)
    if rank < 0 or rank >= n_readers:
        raise ValueError("rank %d out of range for %d readers" % (rank, n_readers))
    cdef Py_ssize_t i
    cdef uint32_t s = first_round, seen
    cdef int late = 0
    cdef int64_t t1, deadline
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9)
    cdef uint32_t *word = <uint32_t *>base
    with nogil:
        for i in range(rounds):
            s = first_round + <uint32_t>i
            deadline = fmq_now_ns() + timeout_ns
            while True:
                seen = fmq_load_u32_acq(word)
                if seen == s:
                    break
                if fmq_now_ns() > deadline:
                    late = 1
                    break
                fmq_futex_wait(word, seen, deadline - fmq_now_ns())
            if late:
                break
            t1 = fmq_now_ns()
            (<int64_t *>(base + (1 + rank) * LINE + 8))[0] = t1
            fmq_store_u64_rel(_word(base, 1 + rank), s)
    if late:
        raise TimeoutError("wake floor: reader %d saw no round %d within %.1f s"
                           % (rank, s, timeout_s))
