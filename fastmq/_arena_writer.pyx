# cython: freethreading_compatible = False
"""The tensor arena's writer end (``ArenaWriterEnd``): claim a free slot,
copy a large buffer into it (in parallel threads), publish it and send a
slot descriptor in its place; commit or abort a message's slots; reserve
slots for ``empty_tensor``; choose what to pre-fault, off the hot path:
the pages the next buffer of that size will need (the pages themselves and
the background thread are in ``fastmq._arena_pages``).  The layout, the
flag protocol and the shared base are in ``fastmq._arena``.

Why descriptors in the out-of-band list rather than a ``reducer_override``
stub: CPython's C pickler hands ``PickleBuffer`` (and dict, list, tuple,
set, bytearray) objects to its own savers without consulting
``reducer_override``; the only hook that sees every buffer is the
pickler's ``buffer_callback``, which can only choose in-band or
out-of-band.  So the writer's buffer callback (``copy_to_slot``) replaces
the out-of-band entry, and the reader's ring/socket path maps entries back
(``ArenaReaderEnd.map_oob``).  Real out-of-band entries are never smaller
than ``fastmq._serde.OOB_MIN_BYTES`` (1 MiB), so a 48-byte entry with the
magic cannot be mistaken for one.  ``reducer_override`` is still used, but
only to classify tensors (what must not use the arena; see
``reducer_override``).
"""
cimport cython
from cpython.buffer cimport (PyBUF_FULL_RO, PyBuffer_IsContiguous, PyBuffer_Release,
                             PyObject_GetBuffer)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.type cimport PyType_IsSubtype
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

from fastmq._arena cimport ArenaEnd, SlotBuffer
from fastmq._native.atomic cimport (fmq_local_load_u64_acq,
                                    fmq_store_u8_rel, fmq_store_u64_rel)
from fastmq._native.layout cimport align_up as _align, word32 as _u32, word64 as _u64
from fastmq._arena_pages cimport SlotPages
from fastmq._segment cimport Segment

import logging
import os
import secrets
import sys
from pickle import PickleBuffer

from fastmq._arena import (DESC_MAGIC, LAYOUT_VERSION, MAGIC, PAGE, READERS_ISOLATED,
                           READERS_SHARED, layout)
from fastmq._arena_layout cimport *

logger = logging.getLogger("fastmq")

cdef extern from "fmq_populate.h" nogil:
    int fmq_populate(char *p, size_t n)
    int fmq_have_populate()


cdef extern from "fmq_copy.h" nogil:
    int fmq_parallel_copy(char *dst, const char *src, size_t n, size_t cold_from,
                          int threads, size_t min_part, int *used)


cdef uint64_t C_MAGIC = MAGIC
cdef uint64_t C_DESC_MAGIC = DESC_MAGIC


# torch is optional; without it only numpy arrays and raw buffers use slots.
# (object, not ``cdef type``: torch's classes have a metaclass, which a
# ``type``-typed variable refuses.)  Bound by _bind_torch once this process
# has imported torch: importing fastmq does not import it.
cdef object _Tensor = None
cdef object _Parameter = None
cdef object _strided = None
from fastmq._serde import reduce_tensor as _reduce_tensor


cdef bint _bind_torch() except -1:
    # A message can hold a tensor only once torch is imported.
    global _Tensor, _Parameter, _strided
    mod = sys.modules.get("torch")
    if mod is None:
        return False
    try:
        tensor, parameter, strided = mod.Tensor, mod.nn.Parameter, mod.strided
    except AttributeError:  # torch is still being imported
        return False
    _Tensor, _Parameter, _strided = tensor, parameter, strided
    return True


@cython.final
@cython.no_gc_clear
cdef class ArenaWriterEnd(ArenaEnd):
    """The writer's end of an arena segment (``create``): it claims slots,
    copies buffers into them and publishes them.  The Python surface is
    ``fastmq.arena.ArenaWriter``."""

    @staticmethod
    def create(Segment seg, int n_reader, int n_slots, Py_ssize_t slot_bytes,
               Py_ssize_t min_bytes, int copy_threads, Py_ssize_t copy_min_part,
               bint prefault_ahead, bint shared_writes=False):
        """The writer's end over a fresh segment.  ``shared_writes`` makes
        every reader map the slots shared and writable (see
        ``fastmq._arena_reader``); readers read it from the header."""
        stride, flags_off, data_off, total = layout(n_reader, n_slots, slot_bytes)
        if seg.size < total:
            raise ValueError("segment of %d bytes is smaller than the arena (%d)" % (seg.size, total))
        cdef char *b = <char *>seg.addr
        # Only the header and flag lines are touched (a new segment reads as
        # zeros anyway); slot pages stay unallocated until first use, so an
        # idle arena costs no memory.
        memset(b, 0, flags_off + stride * n_slots)
        _u32(b, H_VERSION)[0] = LAYOUT_VERSION
        _u32(b, H_NREADER)[0] = n_reader
        _u32(b, H_NSLOTS)[0] = n_slots
        _u32(b, H_STRIDE)[0] = stride
        _u64(b, H_SLOT_BYTES)[0] = slot_bytes
        _u64(b, H_FLAGS_OFF)[0] = flags_off
        _u64(b, H_DATA_OFF)[0] = data_off
        _u64(b, H_TOTAL)[0] = total
        token = int.from_bytes(secrets.token_bytes(8), "little")
        _u64(b, H_TOKEN)[0] = token
        _u32(b, H_READERS)[0] = READERS_SHARED if shared_writes else READERS_ISOLATED
        # Magic last, released: an attacher that sees it sees the rest.
        fmq_store_u64_rel(_u64(b, H_MAGIC), C_MAGIC)
        cdef ArenaWriterEnd self = ArenaWriterEnd.__new__(ArenaWriterEnd)
        self.bind(seg, (n_reader, n_slots, stride, slot_bytes, flags_off, data_off, total),
                  token, not shared_writes)
        self.advise_hugepages()
        self.min_bytes = max(1, min_bytes)
        self.copy_threads = max(1, copy_threads)
        self.copy_min_part = copy_min_part
        self.prefault_ahead = prefault_ahead
        self.reserved = <int *>calloc(n_slots, sizeof(int))
        self.in_message = <uint8_t *>calloc(n_slots, 1)
        if self.reserved == NULL or self.in_message == NULL:
            raise MemoryError()
        self.pages = SlotPages(seg, self.name, self.n_slots, self.slot_bytes, self.data_off)
        return self

    def __dealloc__(self):
        # Runs only once no SlotBuffer is left (they hold references).
        free(self.reserved)
        free(self.in_message)

    def free_slots(self):
        """Slots the writer could fill now (free by the flags and not held
        by a writer-side ``empty_tensor``)."""
        return [s for s in range(self.n_slots) if self.slot_free(s) and self.reserved[s] == 0]

    def faulted_bytes(self, int slot):
        """Bytes from the start of ``slot`` known to be populated."""
        return self.pages.faulted_bytes(slot)

    # binding(False): a plain METH_O method, the cheapest callable the C
    # pickler can call (it calls this for every non-builtin object).
    @cython.binding(False)
    def reducer_override(self, obj):
        """Consulted by the pickler for every object that is not a builtin
        container/atom, so the common case returns after one subtype check.

        It never puts anything in a slot itself (buffers are copied in
        ``copy_to_slot``); it makes sure that tensors which must not use the
        arena do not, and counts them: unknown ``Tensor`` subclasses (their
        type could not be rebuilt from bytes), ``requires_grad``,
        conjugate/negative-bit, non-strided, and non-contiguous tensors.  The
        last kind would reach the buffer callback as the contiguous copy
        ``reduce_tensor`` makes; it is reduced here and that buffer is marked
        so that it takes the out-of-band path: one copy into the socket
        message rather than a second copy into the arena.
        ``Parameter`` passes: torch reduces it through ``.data``, an exact
        tensor checked here, and rebuilds it with its own
        ``_rebuild_parameter`` over the arena-backed data.
        """
        cdef object t = type(obj)
        if _Tensor is None and not _bind_torch():
            return NotImplemented
        if not PyType_IsSubtype(<type>t, <type>_Tensor):
            return NotImplemented
        if t is _Parameter:
            return NotImplemented
        try:
            if not obj.is_cpu:
                return NotImplemented
            nbytes = obj.nbytes
        except Exception:
            return NotImplemented
        if nbytes < self.min_bytes:
            return NotImplemented
        if t is not _Tensor:
            self.n_declined += 1
            return NotImplemented
        if (obj.layout is not _strided or obj.requires_grad or obj.is_conj()
                or obj.is_neg()):
            self.n_declined += 1
            return NotImplemented
        if not obj.is_contiguous():
            self.n_declined += 1
            rv = _reduce_tensor(obj)
            args = rv[1]
            if args and type(args[0]) is PickleBuffer:
                self.skip_buffer = args[0]
            return rv
        return NotImplemented

    @cython.binding(False)   # called per message: a plain C method
    def copy_to_slot(self, buf):
        """The pickler's buffer callback asks this first for every
        ``PickleBuffer``: returns a slot descriptor (bytes) to send out of
        band instead of the buffer, or None (the normal path).  Never
        blocks: a full arena, a buffer over a slot or under the threshold,
        or a declined one returns None."""
        if buf is self.skip_buffer:
            self.skip_buffer = None
            return None
        cdef Py_buffer view
        PyObject_GetBuffer(buf, &view, PyBUF_FULL_RO)
        try:
            return self.view_to_slot(&view)
        finally:
            PyBuffer_Release(&view)

    cdef object view_to_slot(self, Py_buffer *view):
        cdef Py_ssize_t nbytes = view.len
        cdef char *ptr = <char *>view.buf
        cdef int slot
        if not PyBuffer_IsContiguous(view, b'A'):
            if nbytes >= self.min_bytes:
                self.n_declined += 1
            return None
        if self.closed:
            return None
        if nbytes > 0 and self.data <= ptr and ptr < self.data + self.slot_bytes * self.n_slots:
            desc = self.in_place(ptr, nbytes)
            if desc is not None:
                return desc
        if nbytes < self.min_bytes:
            self.n_small += 1
            return None
        if nbytes > self.slot_bytes:
            self.n_oversize += 1
            if not self.logged_oversize:
                self.logged_oversize = True
                logger.warning(
                    "fastmq arena %s: a %d-byte buffer does not fit a %d-byte slot; it "
                    "takes the out-of-band path (raise FASTMQ_ARENA_SLOT_MB to divert "
                    "buffers this large). Logged once.", self.name, nbytes, self.slot_bytes)
            return None
        slot = self.claim(nbytes)
        if slot < 0:
            self.n_exhausted += 1
            if not self.logged_exhausted:
                self.logged_exhausted = True
                logger.warning(
                    "fastmq arena %s: no free slot for a %d-byte buffer (all %d slots of "
                    "%d bytes are held until every reader frees its views); it takes the "
                    "out-of-band path (raise FASTMQ_ARENA_SLOTS if this repeats). Logged once.",
                    self.name, nbytes, self.n_slots, self.slot_bytes)
            return None
        return self.copy_in(slot, ptr, nbytes)

    cdef int claim(self, Py_ssize_t nbytes) noexcept nogil:
        # The lowest free slot whose pages already hold ``nbytes``; else the
        # free slot with the most pages populated (the lowest of equals).
        # Not round robin: pages of a slot stay allocated once touched, so
        # reusing the few low slots keeps the copy on warm pages (a fresh
        # tmpfs page costs several times the copy itself) and leaves the
        # other slots unallocated; and a buffer larger than any before goes
        # where the pre-fault ahead made room for it (prefault_next).
        cdef int s, best = -1
        cdef uint64_t warm, best_warm = 0
        for s in range(self.n_slots):
            if self.reserved[s] == 0 and self.in_message[s] == 0 and self.slot_free(s):
                warm = fmq_local_load_u64_acq(&self.pages.faulted[s])
                if warm >= <uint64_t>nbytes:
                    return s
                if best < 0 or warm > best_warm:
                    best, best_warm = s, warm
        return best

    cdef uint64_t publish(self, int slot) noexcept nogil:
        cdef char *ln = self.line(slot)
        cdef int r
        # Numbered across the arena, not per slot: a descriptor whose slot
        # was changed to another slot's then names a publication that slot
        # never had, and is refused as stale (per slot, two slots used
        # equally often would be at the same number).
        self.epochs += 1
        cdef uint64_t epoch = self.epochs
        for r in range(self.n_reader):
            fmq_store_u8_rel(<uint8_t *>(ln + F_DONE + r), 0)
        fmq_store_u64_rel(_u64(ln, F_EPOCH), epoch)
        fmq_store_u8_rel(<uint8_t *>(ln + F_WRITTEN), 1)
        self.in_message[slot] = 1
        self.n_in_message += 1
        return epoch

    cdef bytes descriptor(self, int slot, uint64_t offset, uint64_t nbytes, uint64_t epoch):
        cdef bytes d = PyBytes_FromStringAndSize(NULL, C_DESC_LEN)
        cdef char *p = PyBytes_AS_STRING(d)
        memset(p, 0, C_DESC_LEN)
        _u64(p, D_MAGIC)[0] = C_DESC_MAGIC
        _u64(p, D_TOKEN)[0] = self.token
        _u32(p, D_SLOT)[0] = slot
        _u64(p, D_OFFSET)[0] = offset
        _u64(p, D_NBYTES)[0] = nbytes
        _u64(p, D_EPOCH)[0] = epoch
        return d

    cdef object copy_in(self, int slot, const char *src, Py_ssize_t nbytes):
        cdef char *dst = self.slot_ptr(slot)
        cdef uint64_t warm = fmq_local_load_u64_acq(&self.pages.faulted[slot])
        cdef size_t cold_from = warm if warm < <uint64_t>nbytes else nbytes
        cdef int err, used = 1, threads = self.copy_threads
        cdef size_t min_part = self.copy_min_part
        # Taken at once, before anything that may release the GIL (the
        # memory check reads /proc, then the copy), so that empty_tensor()
        # on another thread cannot claim this slot meanwhile.
        self.in_message[slot] = 1
        if cold_from < <size_t>nbytes and (
                self.pages.memory_short(slot, nbytes - cold_from)
                or (not fmq_have_populate()
                    and self.pages.reserve(slot, cold_from, nbytes - cold_from) != 0)):
            self.in_message[slot] = 0
            return None           # no memory for it: the buffer takes the socket path
        # written = 0 while the bytes change: a stale descriptor for this
        # slot is refused by readers from here on.
        fmq_store_u8_rel(<uint8_t *>(self.line(slot) + F_WRITTEN), 0)
        with nogil:
            err = fmq_parallel_copy(dst, src, nbytes, cold_from, threads, min_part, &used)
        if err:
            self.in_message[slot] = 0
            self.pages.failed(slot, nbytes, err)
            return None
        self.pages.populated(slot, nbytes)
        epoch = self.publish(slot)
        self.after_use(slot, nbytes, cold_from < <size_t>nbytes)
        self.n_hits += 1
        self.n_hit_bytes += nbytes
        return self.descriptor(slot, 0, nbytes, epoch)

    cdef object in_place(self, char *ptr, Py_ssize_t nbytes):
        """A buffer already inside one of our slots (``empty_tensor``):
        publish that slot instead of copying, or None to copy it."""
        cdef Py_ssize_t off = ptr - self.data
        cdef int slot = off // self.slot_bytes
        cdef Py_ssize_t start = off - slot * self.slot_bytes
        cdef char *ln = self.line(slot)
        if nbytes > self.slot_bytes - start:
            return None
        if self.in_message[slot]:
            # Another view of a slot this message already published.
            self.n_inplace += 1
            return self.descriptor(slot, start, nbytes, _u64(ln, F_EPOCH)[0])
        if self.reserved[slot] == 0 or not self.slot_free(slot):
            # Still published by an earlier message (its readers hold it):
            # re-publishing would reset their done flags, so copy instead.
            return None
        epoch = self.publish(slot)
        self.n_inplace += 1
        self.n_hits += 1
        self.n_hit_bytes += nbytes
        return self.descriptor(slot, start, nbytes, epoch)

    @cython.binding(False)   # called per message: a plain C method
    def commit(self):
        """The message was sent: its slots belong to the readers now."""
        cdef int s
        if self.n_in_message:
            for s in range(self.n_slots):
                self.in_message[s] = 0
            self.n_in_message = 0
        self.skip_buffer = None

    def abort(self):
        """The message was not sent (pickling error, timeout, cancel): no
        reader will ever see its descriptors, so its slots are free again."""
        cdef int s
        if self.n_in_message:
            for s in range(self.n_slots):
                if self.in_message[s]:
                    fmq_store_u8_rel(<uint8_t *>(self.line(s) + F_WRITTEN), 0)
                    self.in_message[s] = 0
            self.n_in_message = 0
        self.skip_buffer = None

    def reserve(self, Py_ssize_t nbytes):
        """A ``SlotBuffer`` over the first ``nbytes`` of a free slot
        (for ``empty_tensor``), or None.  The slot stays out of the
        writer's rotation while the buffer lives; sending a buffer that lies
        in it publishes the slot without a copy."""
        cdef int slot
        if nbytes <= 0 or nbytes > self.slot_bytes or self.closed:
            self.n_empty_miss += 1
            return None
        slot = self.claim(nbytes)
        if slot < 0:
            self.n_empty_miss += 1
            return None
        # Held before populate_for_use releases the GIL, so that an enqueue
        # on another thread cannot copy into this slot meanwhile.
        self.reserved[slot] += 1
        if self.populate_for_use(slot, nbytes) != 0:
            self.reserved[slot] -= 1
            self.n_empty_miss += 1
            return None
        cdef SlotBuffer sb = SlotBuffer.__new__(SlotBuffer)
        sb.arena = self
        sb.ptr = self.slot_ptr(slot)
        sb.nbytes = nbytes
        sb.slot = slot
        self.n_empty += 1
        return sb

    cdef int populate_for_use(self, int slot, Py_ssize_t nbytes) except -2:
        """Make ``nbytes`` of ``slot`` resident before the caller writes it:
        0, or -1 when shared memory cannot be allocated (no SIGBUS later)."""
        cdef uint64_t warm = fmq_local_load_u64_acq(&self.pages.faulted[slot])
        cdef int err
        if warm >= <uint64_t>nbytes:
            self.after_use(slot, nbytes, False)
            return 0
        if self.pages.memory_short(slot, nbytes - warm):
            return -1
        if not fmq_have_populate() and self.pages.reserve(slot, warm, nbytes - warm) != 0:
            return -1
        with nogil:
            err = fmq_populate(self.slot_ptr(slot) + warm, nbytes - warm)
        if err:
            self.pages.failed(slot, nbytes, err)
            return -1
        self.pages.populated(slot, nbytes)
        self.after_use(slot, nbytes, True)
        return 0

    cdef void drop_ref(self, int slot) noexcept:
        # An empty_tensor's buffer died: the slot rejoins the rotation.
        self.reserved[slot] -= 1

    # -- pre-faulting ----------------------------------------------------------
    cdef object prefault_next(self, int slot, Py_ssize_t nbytes):
        # ``nbytes`` just went into cold pages of ``slot``.  Have the lowest
        # other free slot's first 2 x ``nbytes`` populated in the background:
        # the next buffer takes it if readers still hold this one, and a
        # larger buffer than any before goes to it (claim: the warmest free
        # slot) and finds up to twice this size warm, as a growing buffer
        # doubles.  Only that much: pre-faulting whole slots committed up to
        # 2 x slot_bytes of memory for one small tensor, for the arena's
        # life; this holds 3 x ``nbytes`` for a stream of one size.  Where
        # readers hold more slots at once, the first copy into a cold slot
        # further down does the same for the slot after it; a copy into warm
        # pages asks for nothing more.
        cdef int s
        cdef uint64_t want
        if not self.prefault_ahead or self.closed:
            return None
        want = min(_align(2 * nbytes, PAGE), self.slot_bytes)
        for s in range(self.n_slots):
            if (s == slot or self.reserved[s] != 0 or self.in_message[s] != 0
                    or not self.slot_free(s)):
                continue
            if (fmq_local_load_u64_acq(&self.pages.faulted[s]) < want
                    and self.pages.target[s] < want):
                self.pages.prefault((s,), want)
            return None
        return None

    cdef object after_use(self, int slot, Py_ssize_t nbytes, bint cold):
        # ``nbytes`` of ``slot`` are being used.  After a copy into cold
        # pages, and after the first buffer (it found the pages warm_first
        # populated, which its copy would otherwise have), the slot the next
        # buffer takes gets its pages ahead.
        if cold or self.warm_unused:
            self.warm_unused = False
            self.prefault_next(slot, nbytes)

    def warm_first(self, upto):
        """Populate the first ``upto`` bytes of the slot the first buffer
        takes (slot 0: the warmest free one) in the background, so that the
        first large buffer does not wait for fresh pages."""
        if upto > 0 and self.prefault_ahead and not self.closed:
            self.warm_unused = True
            self.pages.prefault((0,), upto)

    def prefault(self, slots, upto=None):
        """Populate the first ``upto`` bytes (default: all) of each of
        ``slots`` in a background thread, off the hot path.  What is
        already populated or queued is skipped."""
        if not self.closed:
            self.pages.prefault(slots, upto)

    def prefault_idle(self):
        """True when no background pre-fault is queued or running."""
        return self.pages.idle()

    def close(self):
        """Stop background work and refuse new diversions.  The mapping
        itself goes when the last reference (views included) does."""
        ArenaEnd.close(self)
        self.pages.close()

    def stats(self):
        out = {
            "arena_hits": self.n_hits,
            "arena_bytes": self.n_hit_bytes,
            "arena_inplace": self.n_inplace,
            "arena_fallback_exhausted": self.n_exhausted,
            "arena_fallback_oversize": self.n_oversize,
            "arena_fallback_declined": self.n_declined,
            "arena_fallback_small": self.n_small,
            "arena_fallback_nomem": self.pages.n_nomem,
            "arena_empty_tensors": self.n_empty,
            "arena_empty_misses": self.n_empty_miss,
            "arena_prefaulted_bytes": self.pages.n_prefaulted,
        }
        out.update(self.common_stats())
        return out

    def __repr__(self):
        return "<fastmq ArenaWriterEnd %r %d x %d>" % (self.name, self.n_slots, self.slot_bytes)
