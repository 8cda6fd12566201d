# cython: freethreading_compatible = False
"""The tensor arena's reader end (``ArenaReaderEnd``): map the segment,
turn a message's slot descriptors into zero-copy views (``map_oob``), hand
slots back when their last view dies (``flush_releases``), drop private
copy-on-write pages first, and page-lock the mapping for CUDA where allowed.
The layout, the flag protocol and the shared base are in ``fastmq._arena``;
why descriptors travel in the out-of-band list in ``fastmq._arena_writer``.

Readers' writes (``H_READERS``): by default each reader maps the slots
copy-on-write (``MAP_PRIVATE``), so what it unpickles is still the shared
memory, but an in-place write (``t.add_(1)``) makes a private copy of the
pages it touches: no other reader, no later message and not the writer
ever sees it.  Before it views a slot again (at its next dequeue, see
``drop_private``), the reader drops its private pages there (``fmq_cow.h``),
so the slot shows the shared bytes again.  Such a
mapping is never registered with CUDA: a long-term pin of a private file
mapping (what ``cudaHostRegister`` does, read-only or not) makes the
kernel unshare every page, i.e. it would pin a private snapshot of the
whole arena that later messages never reach.  ``READERS_SHARED`` (an
explicit opt-in of the writer) maps the slots shared and writable in every
reader: no private copies, pinned for CUDA, and one reader's write is
everybody's.

Lifetimes (see also ``SlotBuffer``): this end's ``__dealloc__`` unregisters
a CUDA pin; it runs before the base releases the ``Segment`` (which unmaps)
and only once the last view is gone, since every view holds this end.
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

from fastmq._arena cimport ArenaEnd, SlotBuffer
from fastmq._native.atomic cimport fmq_load_u8_acq, fmq_load_u64_acq, fmq_store_u8_rel
from fastmq._native.layout cimport (HEADER_NO_MAGIC, HEADER_OK, header_status,
                                    word32 as _u32, word64 as _u64)
from fastmq._native.proc cimport fmq_pid_init, fmq_self_pid
from fastmq._segment cimport Segment, _os_error, open_locator
from fastmq._segment import parse_locator
from libc.errno cimport errno
from libc.string cimport strerror
from posix.fcntl cimport O_CLOEXEC, O_RDONLY, O_RDWR, open as c_open
from posix.mman cimport (MAP_FAILED, MAP_FIXED, MAP_PRIVATE, MAP_SHARED, PROT_NONE, PROT_READ,
                         PROT_WRITE, mmap, mprotect, munlock)
from posix.resource cimport RUSAGE_SELF, getrusage, rusage
from posix.stat cimport fstat, struct_stat
from posix.unistd cimport _SC_PAGESIZE, close as c_close, getpid, sysconf

import logging
import os

from fastmq._arena import (DESC_MAGIC, LAYOUT_VERSION, MAGIC, READERS_ISOLATED, READERS_SHARED,
                           ArenaError, layout)
from fastmq._arena_layout cimport *

logger = logging.getLogger("fastmq")

# Static in the header: this module's copy is the one discard() consults
# (set_cow_scan below).
cdef extern from "fmq_cow.h" nogil:
    int MAP_NORESERVE
    int fmq_cow_scan_ok()
    int fmq_cow_set_scan(int on)
    int fmq_cow_discard(int pagemap_fd, char *p, size_t n, uint64_t *private_bytes, int *whole)


fmq_pid_init()

cdef uint64_t _process_faults() noexcept nogil:
    # Page faults of this whole process (every thread, live or gone), 0 if
    # unknown; see ArenaReaderEnd.discard.
    cdef rusage ru
    if getrusage(RUSAGE_SELF, &ru) != 0:
        return 0
    return <uint64_t>ru.ru_minflt + <uint64_t>ru.ru_majflt + 1


cdef uint64_t C_MAGIC = MAGIC
cdef uint64_t C_DESC_MAGIC = DESC_MAGIC
cdef long _page_bytes = sysconf(_SC_PAGESIZE)


# This process's /proc/self/pagemap, for PAGEMAP_SCAN (see fmq_cow.h):
# opened on first use and again in a forked child (an inherited descriptor
# would scan the parent's page tables).  Only touched with the GIL held.
cdef int _pagemap_fd = -1
cdef long _pagemap_pid = 0


cdef int _pagemap() noexcept:
    global _pagemap_fd, _pagemap_pid
    cdef long pid = getpid()
    if pid == _pagemap_pid:
        return _pagemap_fd
    if _pagemap_fd >= 0:
        # Inherited from the parent across fork(): it walks the parent's
        # page tables.  No thread of this child can be using it (they
        # all look it up here first).
        c_close(_pagemap_fd)
    _pagemap_pid = pid
    # -1 without /proc (some sandboxes): then whole slots are dropped.
    _pagemap_fd = c_open(b"/proc/self/pagemap", O_RDONLY | O_CLOEXEC)
    return _pagemap_fd


def set_cow_scan(bint enabled):
    """Use PAGEMAP_SCAN to find a reader's private pages (default, where
    the kernel has it), or drop whole slots; returns the previous setting.
    For tests of the fallback path."""
    return bool(fmq_cow_set_scan(enabled))


def cow_scan_available():
    """True if releasing a slot drops only the pages the reader wrote."""
    return bool(fmq_cow_scan_ok()) and _pagemap() >= 0


@cython.final
@cython.no_gc_clear
cdef class ArenaReaderEnd(ArenaEnd):
    """Reader ``reader_rank``'s end of an arena segment (``attach``): it maps
    the slots and turns slot descriptors into views of them.  The Python
    surface is ``fastmq.arena.ArenaReader``."""

    def __cinit__(self):
        self.owner_pid = fmq_self_pid()
        self.pending = []
        self.deferred = []

    @staticmethod
    def attach(str locator, int n_reader, Py_ssize_t slot_bytes, int n_slots, int reader_rank):
        """Map reader ``reader_rank`` of the arena segment ``locator`` names
        (``fastmq._segment.Segment.attach``); the header
        must match the handle.  The slots are mapped as the header says:
        copy-on-write (default) or shared."""
        if not (0 <= reader_rank < n_reader):
            raise ValueError("reader rank %d out of range for %d readers" % (reader_rank, n_reader))
        stride, flags_off, data_off, total = layout(n_reader, n_slots, slot_bytes)
        cdef struct_stat st
        cdef int fd = open_locator(locator, True, &st)
        cdef void *p
        cdef void *q
        cdef Segment seg
        cdef char *b
        name = parse_locator(locator)[0]
        try:
            if st.st_size < HEADER:
                raise ArenaError("shared memory segment %r (%d bytes) is too small to be a "
                                 "fastmq arena" % (name, st.st_size))
            p = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if p == MAP_FAILED:
                raise _os_error(errno, "cannot map shared memory segment", name)
            # Owned by a Segment from here on: it unmaps the whole range
            # (both mappings below) when the last reference goes.
            seg = Segment.__new__(Segment)
            seg.addr = <char *>p
            seg.size = st.st_size
            seg.name = name
            seg.owner = False
            seg.mapped()
            b = <char *>p
            status = header_status(b, C_MAGIC, LAYOUT_VERSION)
            if status == HEADER_NO_MAGIC:
                raise ArenaError("shared memory segment %r is not a fastmq tensor arena" % name)
            if status != HEADER_OK:
                raise ArenaError("fastmq arena %r has layout version %d, this fastmq reads %d"
                                 % (name, _u32(b, H_VERSION)[0], LAYOUT_VERSION))
            got = (_u32(b, H_NREADER)[0], _u32(b, H_NSLOTS)[0], _u32(b, H_STRIDE)[0],
                   _u64(b, H_SLOT_BYTES)[0], _u64(b, H_FLAGS_OFF)[0], _u64(b, H_DATA_OFF)[0],
                   _u64(b, H_TOTAL)[0])
            want = (n_reader, n_slots, stride, slot_bytes, flags_off, data_off, total)
            if got != want or st.st_size < total:
                raise ArenaError("fastmq arena %r header %r does not match its handle %r "
                                 "(segment %d bytes)" % (name, got, want, st.st_size))
            # Each word read once: what is checked is what is used.
            mode = _u32(b, H_READERS)[0]
            token = _u64(b, H_TOKEN)[0]
            if mode == READERS_ISOLATED:
                # Same file, same offsets, in place of the shared slots:
                # header and flag lines stay shared.  NORESERVE: private
                # copies exist only while a reader writes, so charging the
                # whole arena as committed memory per reader is pointless.
                # Mapped without access first, unlocked, then opened: under
                # mlockall(MCL_FUTURE) a writable private mapping is locked
                # as it is made, and locking one writes every page, i.e.
                # makes a private snapshot of the whole arena that later
                # messages never reach (and that MADV_DONTNEED then refuses
                # to drop).  Unlocked, its pages are the shared ones.
                q = mmap(b + <Py_ssize_t>data_off, total - data_off, PROT_NONE,
                         MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, fd, data_off)
                if q != MAP_FAILED:
                    munlock(q, total - data_off)
                    if mprotect(q, total - data_off, PROT_READ | PROT_WRITE) != 0:
                        q = MAP_FAILED
                if q == MAP_FAILED:
                    err = errno
                    raise ArenaError(
                        "cannot map the slots of fastmq arena %r copy-on-write (%s); "
                        "FASTMQ_ARENA_READERS=shared in the writer maps them shared instead "
                        "(readers then see each other's in-place writes)"
                        % (name, strerror(err).decode()))
            elif mode != READERS_SHARED:
                raise ArenaError("fastmq arena %r header names reader mode %d, not %d "
                                 "(isolated) or %d (shared)"
                                 % (name, mode, READERS_ISOLATED, READERS_SHARED))
        finally:
            c_close(fd)
        cdef ArenaReaderEnd self = ArenaReaderEnd.__new__(ArenaReaderEnd)
        self.bind(seg, want, token, mode == READERS_ISOLATED)
        self.reader_rank = reader_rank
        if not self.isolated:
            self.advise_hugepages()
        self.refs = <int *>calloc(n_slots, sizeof(int))
        self.ref_epoch = <uint64_t *>calloc(n_slots, sizeof(uint64_t))
        self.view_end = <uint64_t *>calloc(n_slots, sizeof(uint64_t))
        self.clean_faults = <uint64_t *>calloc(n_slots, sizeof(uint64_t))
        if (self.refs == NULL or self.ref_epoch == NULL or self.view_end == NULL
                or self.clean_faults == NULL):
            raise MemoryError()
        return self

    def __dealloc__(self):
        # Runs only once no SlotBuffer is left (they hold references), and
        # before the base releases the Segment: the CUDA registration must
        # go before the memory is unmapped.
        if self.pinned and self.cuda is not None:
            try:
                self.cuda.host_unregister(<uintptr_t>self.base)
            except BaseException:
                pass  # no CUDA context any more (interpreter exit): dies with the process
        free(self.refs)
        free(self.ref_epoch)
        free(self.view_end)
        free(self.clean_faults)

    def set_cuda_source(self, source):
        """Where ``maybe_pin`` finds the CUDA runtime: an object whose
        ``runtime()`` returns it or None (``fastmq._cuda``, given by the
        Python side when it attaches; without one, nothing is pinned).
        Given rather than imported at the first message: that import cost
        a reader's first large message about 2 ms."""
        self.cuda_source = source

    def reader_refs(self, int slot):
        """Live SlotBuffers of this reader over ``slot``."""
        if not (0 <= slot < self.n_slots):
            return 0
        return self.refs[slot]

    @cython.binding(False)   # called per message: a plain C method
    def map_oob(self, list oob):
        """Replace the slot descriptors among a message's out-of-band
        entries by zero-copy views of their slots (memoryviews over
        ``SlotBuffer``s; in place; returns ``oob``).
        All of them are resolved before unpickling, so if unpickling fails
        the buffers die with the list and every slot is still released.
        A bad descriptor does not stop the others: every slot the message
        verifiably names is handed back before the first error is raised
        (else those slots would stay taken for good)."""
        cdef Py_ssize_t i, n = len(oob)
        cdef Py_buffer v
        cdef char desc[C_DESC_LEN]
        cdef bint found
        cdef object error = None
        cdef list mapped = None
        for i in range(n):
            PyObject_GetBuffer(oob[i], &v, PyBUF_SIMPLE)
            found = v.len == C_DESC_LEN and _u64(<char *>v.buf, 0)[0] == C_DESC_MAGIC
            if found:
                memcpy(desc, v.buf, C_DESC_LEN)
            PyBuffer_Release(&v)
            if not found:
                continue
            try:
                sb = self.resolve(desc)
            except ArenaError as e:
                if error is None:
                    error = e
                self.release_named(desc)
                continue
            if mapped is None:
                mapped = []
            mapped.append((i, oob[i]))
            # A memoryview (sliceable, like the bytearray the ring gives
            # for a copied buffer); it holds the SlotBuffer alive.
            oob[i] = memoryview(sb)
            sb = None
        if error is not None:
            # Drop the views now rather than when the traceback (which may
            # hold the caller's list) is freed: their slots go back at once.
            if mapped is not None:
                for i, d in mapped:
                    oob[i] = d
            raise error
        return oob

    def release_named_in(self, chunk):
        """For a message refused before its descriptors were read (its
        framing failed the ring's check): hand back the slots named by the
        descriptors among ``chunk``'s bytes, which never reach ``map_oob``
        and would otherwise stay taken for good.  Descriptors sit at
        8-aligned offsets (the ring aligns every buffer); each one found
        is handed back only under ``release_named``'s conditions."""
        cdef Py_buffer v
        cdef Py_ssize_t off
        cdef char desc[C_DESC_LEN]
        PyObject_GetBuffer(chunk, &v, PyBUF_SIMPLE)
        try:
            off = 0
            while off + C_DESC_LEN <= v.len:
                if _u64(<char *>v.buf, off)[0] == C_DESC_MAGIC:
                    memcpy(desc, <char *>v.buf + off, C_DESC_LEN)
                    self.release_named(desc)
                off += 8
        finally:
            PyBuffer_Release(&v)

    cdef void release_named(self, const char *desc) noexcept:
        # A descriptor that failed validation, but names this arena (token)
        # and the slot's current publication (slot, epoch, written): that
        # slot is this message's, and nothing here will ever view it, so
        # hand it back.  Anything less certain is left alone: it might be a
        # later message's slot that this reader has not read yet.
        cdef uint64_t slot = _u32(<char *>desc, D_SLOT)[0]
        cdef char *ln
        if (_u64(<char *>desc, D_TOKEN)[0] != self.token
                or slot >= <uint64_t>self.n_slots or self.refs[slot] > 0):
            return
        ln = self.line(<int>slot)
        if (fmq_load_u8_acq(<uint8_t *>(ln + F_WRITTEN)) != 1
                or fmq_load_u64_acq(_u64(ln, F_EPOCH)) != _u64(<char *>desc, D_EPOCH)[0]
                or fmq_load_u8_acq(<uint8_t *>(ln + F_DONE + self.reader_rank)) != 0):
            return
        self.mark_done(<int>slot)

    cdef object resolve(self, const char *desc):
        cdef uint64_t token = _u64(<char *>desc, D_TOKEN)[0]
        cdef uint64_t slot = _u32(<char *>desc, D_SLOT)[0]
        cdef uint64_t offset = _u64(<char *>desc, D_OFFSET)[0]
        cdef uint64_t nbytes = _u64(<char *>desc, D_NBYTES)[0]
        cdef uint64_t epoch = _u64(<char *>desc, D_EPOCH)[0]
        if token != self.token:
            raise ArenaError("slot descriptor belongs to another arena (token %#x, arena %s "
                             "has %#x)" % (token, self.name, self.token))
        if slot >= <uint64_t>self.n_slots:
            raise ArenaError("slot descriptor names slot %d; arena %s has %d slots"
                             % (slot, self.name, self.n_slots))
        if offset > <uint64_t>self.slot_bytes or nbytes > <uint64_t>self.slot_bytes - offset:
            raise ArenaError("slot descriptor range [%d, %d+%d) overruns the %d-byte slot of "
                             "arena %s" % (offset, offset, nbytes, self.slot_bytes, self.name))
        cdef char *ln = self.line(<int>slot)
        cdef uint64_t now = fmq_load_u64_acq(_u64(ln, F_EPOCH))
        if fmq_load_u8_acq(<uint8_t *>(ln + F_WRITTEN)) != 1 or now != epoch:
            raise ArenaError("stale slot descriptor: slot %d of arena %s is at epoch %d, "
                             "not %d" % (slot, self.name, now, epoch))
        if self.refs[slot] > 0 and self.ref_epoch[slot] != epoch:
            raise ArenaError("slot %d of arena %s re-published while this reader still "
                             "holds it" % (slot, self.name))
        if (self.view_end[slot] != 0 and self.refs[slot] == 0
                and self.discard(<int>slot, _process_faults()) != 0):
            raise ArenaError("cannot drop reader %d's private pages of slot %d of arena %s: a "
                             "view of it would show this reader's earlier in-place writes "
                             "(FASTMQ_ARENA_READERS=shared in the writer maps slots shared, "
                             "without private copies)" % (self.reader_rank, slot, self.name))
        self.maybe_pin()
        cdef SlotBuffer sb = SlotBuffer.__new__(SlotBuffer)
        sb.arena = self
        sb.ptr = self.slot_ptr(<int>slot) + offset
        sb.nbytes = nbytes
        sb.slot = <int>slot
        self.refs[slot] += 1
        self.ref_epoch[slot] = epoch
        if offset + nbytes > self.view_end[slot]:
            self.view_end[slot] = offset + nbytes
        self.n_views += 1
        return sb

    cdef object maybe_pin(self):
        # Once, lazily, and only where CUDA is already initialised (see
        # fastmq._cuda): registering 8 x 256 MiB allocates and locks all of
        # it, so a queue that never carries a large buffer never pins.
        if self.pin_attempted or self.cuda_source is None:
            return None
        rt = self.cuda_source.runtime()
        if rt is None:
            return None
        try:
            if not rt.is_initialized():
                return None
        except Exception:
            return None
        self.pin_attempted = True
        if self.isolated:
            # Pinning a private mapping would pin private copies of every
            # page (see the module docstring): copies to the GPU read the
            # pageable mapping instead.
            logger.info("fastmq arena %s: not page-locked for CUDA: readers map it "
                        "copy-on-write (FASTMQ_ARENA_READERS=shared pins it, and lets "
                        "readers see each other's in-place writes)", self.name)
            return None
        try:
            rc = rt.host_register(<uintptr_t>self.base, self.total_bytes)
        except Exception as e:
            logger.info("fastmq arena %s: cudaHostRegister skipped: %s", self.name, str(e))
            return None
        self.pinned = rc == 0
        if self.pinned:
            self.cuda = rt
        logger.info("fastmq arena %s: cudaHostRegister(%d MiB) -> %s", self.name,
                    self.total_bytes >> 20, "pinned" if self.pinned else "error %s" % rc)
        return None

    cdef void drop_ref(self, int slot) noexcept:
        # The last view of one resolve() died.
        self.refs[slot] -= 1
        if self.refs[slot] > 0:
            return
        if self.pinned:
            # The memory may still be the source of an async H2D copy: the
            # next flush_releases records an event after it.
            try:
                self.pending.append(slot)
                return
            except BaseException:
                pass
        self.mark_done(slot)

    cdef void mark_done(self, int slot) noexcept:
        if self.owner_pid != fmq_self_pid():
            # A forked child dropping views it inherited: the slot is still
            # its parent's, whose views of it are alive.
            return
        fmq_store_u8_rel(<uint8_t *>(self.line(slot) + F_DONE + self.reader_rank), 1)
        self.n_released += 1

    cdef void drop_private(self) noexcept:
        # Isolated: a slot handed back may still hold this reader's private
        # copies (its in-place writes), which only this reader's mapping
        # shows: they must go before it views the slot again, not before
        # the writer reuses it.  Finding them walks the page tables of what
        # was viewed (~0.3 ms per 16 MiB read), so it is done here, at the
        # next dequeue() (where a worker waits for its next step), rather
        # than in the `del` that ends a step; resolve() does it for a slot
        # still left.  Slots with a live view keep their pages: those are
        # the writes of a tensor in use.
        cdef int s
        cdef uint64_t faults = 0
        if self.owner_pid != fmq_self_pid():
            return    # a forked child: the views and the pages are the parent's
        for s in range(self.n_slots):
            if self.view_end[s] != 0 and self.refs[s] == 0:
                if faults == 0:
                    faults = _process_faults()
                self.discard(s, faults)

    cdef int discard(self, int slot, uint64_t faults) noexcept:
        """Drop this reader's private copies in ``slot`` (its in-place
        writes) so that the next message there shows the shared bytes: 0,
        or an errno (logged once; resolve() refuses to view the slot).
        ``faults``: this process's page-fault count, read now (before the
        walk: a copy made during it counts as after it).
        With the GIL held: another thread's resolve() must not view the
        range while its pages are being dropped."""
        cdef int fd
        cdef int err, whole = 0
        cdef uint64_t private_bytes = 0
        cdef char *p = self.slot_ptr(slot)
        cdef bint owner = self.owner_pid == fmq_self_pid()
        # A private copy is made only by a write fault of this process (a
        # store, a system call writing into the view, a pin taken for
        # writing), and every fault counts in getrusage(RUSAGE_SELF): with
        # the count as it was before the last drop here, there is nothing
        # to find.  Not in a forked child (its count started again; the
        # record is its parent's).
        if owner and faults != 0 and faults == self.clean_faults[slot]:
            self.view_end[slot] = 0
            self.n_walks_skipped += 1
            return 0
        self.clean_faults[slot] = 0
        fd = _pagemap()
        # Only what views covered: a store through one cannot reach past
        # it, and the rest of the slot may hold mapped pages of earlier,
        # larger messages that would make the walk longer for nothing.
        cdef size_t n = (self.view_end[slot] + _page_bytes - 1) & ~(<size_t>_page_bytes - 1)
        if n > <size_t>self.slot_bytes:
            n = self.slot_bytes
        if n == 0:
            return 0
        err = fmq_cow_discard(fd, p, n, &private_bytes, &whole)
        if err == 0:
            self.view_end[slot] = 0
            if owner:
                self.clean_faults[slot] = faults
            self.n_cow_bytes += private_bytes
            self.n_slot_discards += whole
            return 0
        self.n_discard_failed += 1
        if not self.logged_discard:
            self.logged_discard = True
            try:
                logger.warning("fastmq arena %s: cannot drop reader %d's private pages of slot "
                               "%d (%s); its messages in that slot raise ArenaError in this "
                               "reader. Logged once.",
                               self.name, self.reader_rank, slot, os.strerror(err))
            except BaseException:
                pass
        return err

    @cython.binding(False)   # called per message: a plain C method
    def flush_releases(self):
        """Reader, at every dequeue: hand back slots whose views are gone.

        Unpinned, a slot is handed back the moment its last view dies (a
        pageable H2D has consumed its source when the call returns);
        isolated, this reader's private pages in it are dropped here
        (``drop_private``).
        Pinned, the copy is an async DMA that can outlive the view: freed
        slots wait here for an event recorded now, on the current stream,
        i.e. after the previous step's copies, and are handed back once it
        completes (polled, never waited on)."""
        cdef int s
        if self.isolated:
            self.drop_private()
        if self.deferred:
            keep = []
            for ev, slots in self.deferred:
                if ev.query():
                    for s in slots:
                        self.mark_done(s)
                else:
                    keep.append((ev, slots))
            self.deferred = keep
        if self.pending:
            slots, self.pending = self.pending, []
            ev = None
            if self.cuda is not None:
                try:
                    ev = self.cuda.record_event()
                except Exception as e:
                    logger.info("fastmq arena %s: cannot record a CUDA event (%s); "
                                "releasing without one", self.name, str(e))
            if ev is None:
                for s in slots:
                    self.mark_done(s)
            else:
                self.n_event_gated += len(slots)
                self.deferred.append((ev, slots))

    def stats(self):
        out = {
            "arena_views": self.n_views,
            "arena_released": self.n_released,
            "arena_event_gated": self.n_event_gated,
            "arena_pinned": int(self.pinned),
            "arena_private_bytes_dropped": self.n_cow_bytes,
            "arena_whole_slot_drops": self.n_slot_discards,
            "arena_drop_failures": self.n_discard_failed,
            "arena_page_walks_skipped": self.n_walks_skipped,
        }
        out.update(self.common_stats())
        return out

    def __repr__(self):
        return "<fastmq ArenaReaderEnd %r reader %d %d x %d>" % (
            self.name, self.reader_rank, self.n_slots, self.slot_bytes)
