# cython: freethreading_compatible = False
"""The arena writer's pages (``SlotPages``): how much of each slot is known
to be populated, the check that the host has memory before new pages are
taken, and the background thread that populates pages ahead of the copies
(``prefault``).  Which slot to pre-fault, and when, is the writer's
policy (``fastmq._arena_writer``: ``prefault_next``, ``warm_first``).

The design: docs/design.md, "Tensor arena" ("What it costs").
"""
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free

from fastmq._native.atomic cimport (fmq_local_load_int, fmq_local_load_u64_acq,
                                    fmq_local_max_u64_rel, fmq_local_store_int)
from fastmq._native.layout cimport align_up as _align
from fastmq._memory cimport room_for
from fastmq._segment cimport Segment

import collections
import logging
import os
import threading

from fastmq._arena import PAGE
from fastmq._memory import ShmFullError

logger = logging.getLogger("fastmq")

# Memory the arena leaves to the rest of the host when it takes new pages.
cdef Py_ssize_t MEMORY_HEADROOM = 64 << 20
# How long close() waits for a cancelled background pre-fault (seconds):
# far more than its 2 MiB step takes; a bound, not an expected wait.
JOIN_PREFAULT_S = 5.0

cdef extern from "fmq_populate.h" nogil:
    int fmq_have_populate()
    int fmq_prefault(char *p, size_t n, int *cancel)


cdef class SlotPages:
    """``SlotPages(segment, name, n_slots, slot_bytes, data_off)``: the
    populated pages of an arena's slots, for its writer."""

    def __cinit__(self, Segment segment, str name, int n_slots, Py_ssize_t slot_bytes,
                  Py_ssize_t data_off):
        self.segment = segment
        self.data = <char *>segment.addr + data_off
        self.name = name
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.data_off = data_off
        self.jobs = collections.deque()
        self.lock = threading.Lock()
        self.faulted = <uint64_t *>calloc(n_slots, sizeof(uint64_t))
        self.target = <uint64_t *>calloc(n_slots, sizeof(uint64_t))
        if self.faulted == NULL or self.target == NULL:
            raise MemoryError()

    def __dealloc__(self):
        # Runs only once the thread is gone (it holds a reference).
        free(self.faulted)
        free(self.target)

    def faulted_bytes(self, int slot):
        """Bytes from the start of ``slot`` known to be populated."""
        if not (0 <= slot < self.n_slots):
            return 0
        return fmq_local_load_u64_acq(&self.faulted[slot])

    cdef bint memory_short(self, int slot, Py_ssize_t n) except -1:
        # Asked before new pages are touched: an anonymous memory file has
        # no size limit of its own, so populating past what the host (or
        # this cgroup) has left would wake the OOM killer, not fail.  Some
        # room stays for everything else.  Only on cold pages, never in
        # the steady state; through the kept reading (fastmq._memory), so
        # no file is read here while memory is plentiful.
        cdef long long avail = room_for(n)
        if avail < 0 or avail >= n + MEMORY_HEADROOM:
            return False
        self.n_nomem += 1
        if not self.logged_nomem:
            self.logged_nomem = True
            logger.warning(
                "fastmq arena %s: %d MiB of memory left, too little for %d bytes of slot %d "
                "(the arena leaves %d MiB to the host); buffers take the out-of-band path "
                "while this lasts. Logged once.", self.name, avail >> 20, n, slot,
                MEMORY_HEADROOM >> 20)
        return True

    cdef void populated(self, int slot, Py_ssize_t nbytes) noexcept:
        # The first nbytes of the slot are resident now (a copy or a
        # populate wrote them); the extent only grows.
        fmq_local_max_u64_rel(&self.faulted[slot], min(_align(nbytes, PAGE), self.slot_bytes))

    cdef object failed(self, int slot, Py_ssize_t nbytes, int err):
        # A copy or populate into the slot's cold pages found no memory:
        # counted, and logged once for the arena's life.
        self.n_nomem += 1
        if not self.logged_nomem:
            self.logged_nomem = True
            logger.warning(
                "fastmq arena %s: cannot allocate %d bytes of shared memory for slot %d "
                "(%s); buffers take the out-of-band path while this lasts. Logged once.",
                self.name, nbytes, slot, os.strerror(err))

    cdef int reserve(self, int slot, Py_ssize_t start, Py_ssize_t n) except -2:
        # Kernels without MADV_POPULATE_WRITE: allocate the pages through the
        # segment's descriptor, so that memory running out is an error here and
        # never a SIGBUS in the copy or the pre-fault that touches them.
        try:
            self.segment.reserve(self.data_off + slot * self.slot_bytes + start, n,
                                 "arena slot %d" % slot)
        except (ShmFullError, OSError, ValueError):
            self.n_nomem += 1
            return -1
        return 0

    def prefault(self, slots, upto=None):
        """Populate the first ``upto`` bytes (default: all) of each of
        ``slots`` in a background thread, off the hot path.  What is
        already populated or queued is skipped."""
        cdef int s
        cdef uint64_t want = self.slot_bytes
        if upto is not None:
            want = min(_align(max(0, upto), PAGE), self.slot_bytes)
        if fmq_local_load_int(&self.cancel) or want == 0:
            return
        with self.lock:
            for s in slots:
                if not (0 <= s < self.n_slots):
                    continue
                if (fmq_local_load_u64_acq(&self.faulted[s]) >= want
                        or self.target[s] >= want):
                    continue
                if self.target[s] == 0:
                    self.jobs.append(s)
                self.target[s] = want
            if self.jobs and not self.running:
                self.running = True
                self.thread = threading.Thread(target=self._loop, name="fastmq-arena-prefault",
                                               daemon=True)
                self.thread.start()

    def _loop(self):
        cdef int s = 0, err
        cdef uint64_t start, upto
        cdef char *p
        cdef size_t n
        # Only on a core nobody else wants (SCHED_IDLE, this thread only):
        # pages populated ahead help the next buffer, but never at the cost
        # of the copy or of the readers reading this one (measured on 2
        # vCPUs: a slot's first use about 8% faster).  A busy host leaves
        # the pages to the copies, which fault them in themselves.
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        while True:
            with self.lock:
                if not self.jobs or fmq_local_load_int(&self.cancel):
                    self.running = False
                    return
                s = self.jobs.popleft()
                upto = self.target[s]
                self.target[s] = 0
            start = fmq_local_load_u64_acq(&self.faulted[s])
            if start >= upto:
                continue
            p = self.data + s * self.slot_bytes + start
            n = upto - start
            if self.memory_short(s, n) or (
                    not fmq_have_populate() and self.reserve(s, start, n) != 0):
                logger.warning("fastmq arena %s: no memory to pre-fault slot %d; buffers "
                               "that need it fall back to the socket", self.name, s)
                self.stop()
                return
            with nogil:
                err = fmq_prefault(p, n, &self.cancel)
            if err == 0:
                fmq_local_max_u64_rel(&self.faulted[s], upto)
                self.n_prefaulted += n
            elif err > 0:
                logger.warning("fastmq arena %s: background pre-fault of slot %d failed (%s); "
                               "the copy will fault those pages itself", self.name, s,
                               os.strerror(err))
                self.stop()
                return

    cdef object stop(self):
        # After a failure: drop what is queued (the copies populate what
        # they need themselves, and fall back when they cannot).
        with self.lock:
            self.running = False
            while self.jobs:
                self.target[self.jobs.popleft()] = 0

    def idle(self):
        """True when no background pre-fault is queued or running."""
        with self.lock:
            return not self.running

    cdef object close(self):
        # Cancel, and wait for the thread: it holds the segment, and with
        # it the mapping, while it runs, so a queue closed (or collected)
        # right after it was created, while its first slot is still being
        # warmed, would hold the memory a while longer.  Cancelled, the
        # thread stops within a 2 MiB step once it runs; out of SCHED_IDLE,
        # so that a busy host does not keep it from running.
        fmq_local_store_int(&self.cancel, 1)
        cdef object t = self.thread
        if t is None or t is threading.current_thread() or not t.is_alive():
            return
        try:
            os.sched_setscheduler(t.native_id, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError, TypeError):
            pass
        t.join(JOIN_PREFAULT_S)
