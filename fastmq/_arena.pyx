# cython: freethreading_compatible = False
"""The tensor arena: one copy of a large buffer for N node-local readers.

The design (copy-on-write readers, slot lifetime, pre-faulting, CUDA) is
explained in docs/design.md, section "Tensor arena".

A second shared-memory segment next to the ring holds ``n_slots`` slots of
``slot_bytes``.  The writer copies a large out-of-band buffer (a CPU
tensor's bytes, a numpy array, any protocol-5 ``PickleBuffer``) into a free
slot once and sends, in place of its bytes, a 48-byte *slot descriptor*;
each reader turns the descriptor into a zero-copy ``SlotBuffer`` over the
slot before unpickling, so the tensor/array it rebuilds *is* the shared
memory.  The slot goes back to the writer when the last object using that
memory is freed in every reader.

Why descriptors in the out-of-band list rather than a ``reducer_override``
stub: CPython's C pickler hands ``PickleBuffer`` (and dict, list, tuple,
set, bytearray) objects to its own savers without consulting
``reducer_override``; the only hook that sees every buffer is the
pickler's ``buffer_callback``, which can only choose in-band or
out-of-band.  So the writer's buffer callback (``copy_to_slot``) replaces
the out-of-band entry, and the reader's ring/socket path maps entries back
(``map_oob``).  Real out-of-band entries are never smaller than
``fastmq._serde.OOB_MIN_BYTES`` (1 MiB), so a 48-byte entry with the magic
cannot be mistaken for one.  ``reducer_override`` is still used, but only
to classify tensors (what must not use the arena; see ``reducer_override``).

Segment layout (offsets from the mapping's base)::

    +-------------------------------+ 0
    | header (H_* below)            |  magic, version, geometry, token
    +-------------------------------+ flags_off = 4096
    | line 0 | line 1 | ...         |  one 64-byte-aligned line per slot:
    |                               |  [u64 epoch][u8 written][u8 done x n_reader]
    +-------------------------------+ data_off (2 MiB aligned, so that slots
    | slot 0 | slot 1 | ...         |  can be huge pages where tmpfs allows)
    +-------------------------------+ total

Flag protocol (single writer; same states as the ring and as vLLM's arena):
a slot is free for the writer when ``written == 0`` or every ``done == 1``.

    writer:  claim a free slot ; written = 0 ; copy ; done[*] = 0 (release) ;
             epoch += 1 (release) ; written = 1 (release) ;
             then the ring chunk carrying the descriptor is published
             (release), so a reader that acquires the chunk sees the bytes.
    reader:  resolve: written == 1 and epoch == descriptor's epoch (acquire),
             else the descriptor is stale or forged -> ArenaError ;
             ... last SlotBuffer of the slot freed ... done[me] = 1 (release,
             after every read of the slot) ; the writer's acquire load of
             the done flags orders its next copy after those reads.

Readers' writes (``H_READERS``): by default each reader maps the slots
copy-on-write (``MAP_PRIVATE``), so what it unpickles is still the shared
memory, but an in-place write (``t.add_(1)``) makes a private copy of the
pages it touches: no other reader, no later message and not the writer
ever sees it.  Before a slot is handed back, the reader drops its private
pages (``fmq_cow.h``), so the slot shows the shared bytes again.  Such a
mapping is never registered with CUDA: a long-term pin of a private file
mapping (what ``cudaHostRegister`` does, read-only or not) makes the
kernel unshare every page, i.e. it would pin a private snapshot of the
whole arena that later messages never reach.  ``READERS_SHARED`` (an
explicit opt-in of the writer) maps the slots shared and writable in every
reader: no private copies, pinned for CUDA, and one reader's write is
everybody's.

Lifetimes: a reader's ``SlotBuffer`` holds a reference to its ``ArenaEnd``,
which holds the ``Segment``; so the mapping outlives every view, and the
arena's ``__dealloc__`` (which unregisters a CUDA pin before the segment
unmaps) runs only after the last view is gone.  ``torch.frombuffer`` and
``numpy.frombuffer`` keep a reference to the buffer object for the life of
their storage, so the ``SlotBuffer`` dies exactly when the last tensor,
view, slice or wrapper (``Parameter``) sharing the slot is freed.
"""
cimport cython
from cpython.buffer cimport (PyBUF_FULL_RO, PyBUF_SIMPLE, PyBuffer_FillInfo,
                             PyBuffer_IsContiguous, PyBuffer_Release, PyObject_GetBuffer)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.type cimport PyType_IsSubtype
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from fastmq._native.atomic cimport (fmq_load_u8_acq, fmq_load_u64_acq, fmq_local_load_int,
                                    fmq_local_load_u64_acq, fmq_local_max_u64_rel,
                                    fmq_local_store_int, fmq_store_u8_rel, fmq_store_u64_rel)
from fastmq._native.layout cimport (HEADER_NO_MAGIC, HEADER_OK, align_up as _align,
                                    header_status, word32 as _u32, word64 as _u64)
from fastmq._native.proc cimport fmq_pid_init, fmq_self_pid
from fastmq._segment cimport Segment, _os_error
from fastmq._segment import ShmFullError
from libc.errno cimport errno
from libc.string cimport strerror
from posix.fcntl cimport O_CLOEXEC, O_RDONLY, O_RDWR, open as c_open
from posix.mman cimport (MAP_FAILED, MAP_FIXED, MAP_PRIVATE, MAP_SHARED, PROT_READ, PROT_WRITE,
                         mmap, shm_open)
from posix.stat cimport fstat, struct_stat
from posix.unistd cimport close as c_close, getpid

import collections
import logging
import os
import secrets
import sys
import threading
from pickle import PickleBuffer

logger = logging.getLogger("fastmq")

cdef extern from "fmq_populate.h" nogil:
    int fmq_populate(char *p, size_t n)
    int fmq_have_populate()
    void fmq_set_populate(int on)
    void fmq_hugepage(char *p, size_t n)
    int fmq_prefault(char *p, size_t n, int *cancel)


cdef extern from "fmq_copy.h" nogil:
    int fmq_parallel_copy(char *dst, const char *src, size_t n, size_t cold_from,
                          int threads, size_t min_part, int *used)


cdef extern from "fmq_cow.h" nogil:
    int MAP_NORESERVE
    int fmq_cow_scan_ok()
    int fmq_cow_set_scan(int on)
    int fmq_cow_discard(int pagemap_fd, char *p, size_t n, uint64_t *private_bytes, int *whole)


MAGIC = 0x3141514d54534146        # b"FASTMQA1" little-endian
DESC_MAGIC = 0x31544f4c53514d46   # b"FMQSLOT1"
LAYOUT_VERSION = 2     # 2: H_READERS
READERS_ISOLATED = 0   # readers map the slots copy-on-write (default)
READERS_SHARED = 1     # readers map them shared and writable (opt-in)
DESC_LEN = 48          # bytes of a slot descriptor (C_DESC_LEN)
PAGE = 4096
DATA_ALIGN = 2 << 20

from fastmq._arena_layout cimport *

fmq_pid_init()

cdef uint64_t C_MAGIC = MAGIC
cdef uint64_t C_DESC_MAGIC = DESC_MAGIC


class ArenaError(RuntimeError):
    """An arena descriptor or segment is invalid, stale, or not attached."""


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


def set_populate(bint enabled):
    """Use MADV_POPULATE_WRITE where the kernel has it (default), or behave
    as on a kernel without it (posix_fallocate, then touch).  For tests."""
    fmq_set_populate(enabled)


def cow_scan_available():
    """True if releasing a slot drops only the pages the reader wrote."""
    return bool(fmq_cow_scan_ok()) and _pagemap() >= 0


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


def layout(int n_reader, int n_slots, Py_ssize_t slot_bytes):
    """(stride, flags_off, data_off, total) of an arena's geometry."""
    if n_reader < 1 or n_reader > 4096:
        raise ValueError("n_reader must be in 1..4096, got %d" % n_reader)
    if n_slots < 1 or n_slots > 65536:
        raise ValueError("the arena needs 1..65536 slots, got %d" % n_slots)
    if slot_bytes < PAGE or slot_bytes % PAGE:
        raise ValueError("arena slot size must be a positive multiple of %d bytes, got %d"
                         % (PAGE, slot_bytes))
    stride = _align(F_DONE + n_reader, 64)
    data_off = _align(HEADER + stride * n_slots, DATA_ALIGN)
    return stride, HEADER, data_off, data_off + slot_bytes * n_slots


def is_descriptor(obj):
    """True if ``obj`` (an out-of-band entry) is an arena slot descriptor."""
    cdef Py_buffer v
    try:
        PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE)
    except Exception:
        return False
    try:
        return v.len == C_DESC_LEN and _u64(<char *>v.buf, 0)[0] == C_DESC_MAGIC
    finally:
        PyBuffer_Release(&v)


@cython.final
@cython.no_gc_clear
cdef class ArenaEnd:
    """One process's end of an arena segment: its mapping and the flags it
    keeps, as the writer (``create``) or as reader ``rank`` (``attach``).
    The Python surface is ``fastmq.arena.ArenaWriter`` / ``ArenaReader``."""

    def __cinit__(self):
        self.owner_pid = fmq_self_pid()
        self.reader_rank = -1
        self.n_slots = 0
        self.pending = []
        self.deferred = []

    @staticmethod
    def create(Segment seg, int n_reader, int n_slots, Py_ssize_t slot_bytes,
               Py_ssize_t min_bytes, int copy_threads, Py_ssize_t copy_min_part,
               bint prefault_ahead, bint shared_writes=False):
        """The writer's end over a fresh segment.  ``shared_writes`` makes
        every reader map the slots shared and writable (see the module
        docstring); readers read it from the header."""
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
        _u64(b, H_TOKEN)[0] = int.from_bytes(secrets.token_bytes(8), "little")
        _u32(b, H_READERS)[0] = READERS_SHARED if shared_writes else READERS_ISOLATED
        # Magic last, released: an attacher that sees it sees the rest.
        fmq_store_u64_rel(_u64(b, H_MAGIC), C_MAGIC)
        cdef ArenaEnd self = ArenaEnd.__new__(ArenaEnd)
        self._bind(seg, -1)
        self.min_bytes = max(1, min_bytes)
        self.copy_threads = max(1, copy_threads)
        self.copy_min_part = copy_min_part
        self.prefault_ahead = prefault_ahead
        self.reserved = <int *>calloc(n_slots, sizeof(int))
        self.in_message = <uint8_t *>calloc(n_slots, 1)
        self.faulted = <uint64_t *>calloc(n_slots, sizeof(uint64_t))
        self.prefault_queued = <uint8_t *>calloc(n_slots, 1)
        if (self.reserved == NULL or self.in_message == NULL or self.faulted == NULL
                or self.prefault_queued == NULL):
            raise MemoryError()
        self.prefault_jobs = collections.deque()
        self.prefault_lock = threading.Lock()
        return self

    @staticmethod
    def attach(str name, int n_reader, Py_ssize_t slot_bytes, int n_slots, int reader_rank):
        """Map reader ``reader_rank`` of arena segment ``name``; the header
        must match the handle.  The slots are mapped as the header says:
        copy-on-write (default) or shared."""
        if not (0 <= reader_rank < n_reader):
            raise ValueError("reader rank %d out of range for %d readers" % (reader_rank, n_reader))
        stride, flags_off, data_off, total = layout(n_reader, n_slots, slot_bytes)
        cdef bytes bname = ("/" + name).encode()
        cdef int fd = shm_open(bname, O_RDWR, 0)
        if fd < 0:
            raise _os_error(errno, "cannot open shared memory segment", name)
        cdef struct_stat st
        cdef void *p
        cdef void *q
        cdef Segment seg
        cdef char *b
        try:
            if fstat(fd, &st) != 0:
                raise _os_error(errno, "cannot stat shared memory segment", name)
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
            mode = _u32(b, H_READERS)[0]
            if mode == READERS_ISOLATED:
                # Same file, same offsets, in place of the shared slots:
                # header and flag lines stay shared.  NORESERVE: private
                # copies exist only while a reader writes, so charging the
                # whole arena as committed memory per reader is pointless.
                q = mmap(b + <Py_ssize_t>data_off, total - data_off, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, fd, data_off)
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
        cdef ArenaEnd self = ArenaEnd.__new__(ArenaEnd)
        self._bind(seg, reader_rank)
        self.refs = <int *>calloc(n_slots, sizeof(int))
        self.ref_epoch = <uint64_t *>calloc(n_slots, sizeof(uint64_t))
        if self.refs == NULL or self.ref_epoch == NULL:
            raise MemoryError()
        return self

    def _bind(self, Segment seg, int reader_rank):
        cdef char *b = <char *>seg.addr
        self.segment = seg
        self.name = seg.name
        self.base = b
        self.n_reader = _u32(b, H_NREADER)[0]
        self.n_slots = _u32(b, H_NSLOTS)[0]
        self.stride = _u32(b, H_STRIDE)[0]
        self.slot_bytes = _u64(b, H_SLOT_BYTES)[0]
        self.flags_off = _u64(b, H_FLAGS_OFF)[0]
        self.data_off = _u64(b, H_DATA_OFF)[0]
        self.total_bytes = _u64(b, H_TOTAL)[0]
        self.token = _u64(b, H_TOKEN)[0]
        self.data = b + self.data_off
        self.reader_rank = reader_rank
        self.isolated = _u32(b, H_READERS)[0] == READERS_ISOLATED
        if reader_rank < 0 or not self.isolated:
            # Not on a reader's private mapping: there it could only make
            # its private copies huge, which is all cost.
            fmq_hugepage(self.data, self.slot_bytes * self.n_slots)

    def __dealloc__(self):
        # Runs only once no SlotBuffer and no prefault thread is left (they
        # hold references).  The CUDA registration must go before the
        # Segment (released right after this) unmaps the memory.
        if self.pinned and self.cuda is not None:
            try:
                self.cuda.host_unregister(<uintptr_t>self.base)
            except BaseException:
                pass  # no CUDA context any more (interpreter exit): dies with the process
        free(self.reserved)
        free(self.in_message)
        free(self.faulted)
        free(self.prefault_queued)
        free(self.refs)
        free(self.ref_epoch)

    # -- layout accessors --------------------------------------------------
    cdef inline char *line(self, int slot) noexcept nogil:
        return self.base + self.flags_off + slot * self.stride

    cdef inline char *slot_ptr(self, int slot) noexcept nogil:
        return self.data + slot * self.slot_bytes

    cdef bint slot_free(self, int slot) noexcept nogil:
        cdef char *ln = self.line(slot)
        cdef int r
        if fmq_load_u8_acq(<uint8_t *>(ln + F_WRITTEN)) == 0:
            return True
        for r in range(self.n_reader):
            if fmq_load_u8_acq(<uint8_t *>(ln + F_DONE + r)) == 0:
                return False
        return True

    @property
    def address(self):
        """Base address of this process's mapping."""
        return <uintptr_t>self.base

    @property
    def data_address(self):
        return <uintptr_t>self.data

    def slot_state(self, int slot):
        """``(epoch, written, [done per reader])`` of a slot, for tests and logs."""
        if not (0 <= slot < self.n_slots):
            raise IndexError("slot %d out of range" % slot)
        cdef char *ln = self.line(slot)
        return (fmq_load_u64_acq(_u64(ln, F_EPOCH)),
                fmq_load_u8_acq(<uint8_t *>(ln + F_WRITTEN)),
                [fmq_load_u8_acq(<uint8_t *>(ln + F_DONE + r)) for r in range(self.n_reader)])

    def free_slots(self):
        """Slots the writer could fill now (free by the flags and not held
        by a writer-side ``empty_tensor``)."""
        return [s for s in range(self.n_slots)
                if self.slot_free(s) and (self.reserved == NULL or self.reserved[s] == 0)]

    def reader_refs(self, int slot):
        """Live SlotBuffers of this reader over ``slot``."""
        if self.refs == NULL or not (0 <= slot < self.n_slots):
            return 0
        return self.refs[slot]

    def faulted_bytes(self, int slot):
        """Writer: bytes from the start of ``slot`` known to be populated."""
        if self.faulted == NULL or not (0 <= slot < self.n_slots):
            return 0
        return fmq_local_load_u64_acq(&self.faulted[slot])

    # == writer =============================================================
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
        if self.reader_rank >= 0:
            raise ArenaError("only the arena's writer can divert buffers")
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
        slot = self.claim()
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

    cdef int claim(self) noexcept nogil:
        # Lowest free index first, not round robin: pages of a slot stay
        # allocated once touched, so reusing the few low slots keeps the
        # copy on warm pages (a fresh tmpfs page costs several times the
        # copy itself) and leaves the other slots unallocated.
        cdef int s
        for s in range(self.n_slots):
            if self.reserved[s] == 0 and self.in_message[s] == 0 and self.slot_free(s):
                return s
        return -1

    cdef uint64_t publish(self, int slot) noexcept nogil:
        cdef char *ln = self.line(slot)
        cdef int r
        cdef uint64_t epoch = _u64(ln, F_EPOCH)[0] + 1   # only the writer stores it
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
        cdef uint64_t warm = fmq_local_load_u64_acq(&self.faulted[slot])
        cdef size_t cold_from = warm if warm < <uint64_t>nbytes else nbytes
        cdef int err, used = 1, threads = self.copy_threads
        cdef size_t min_part = self.copy_min_part
        if (not fmq_have_populate() and cold_from < <size_t>nbytes
                and self.reserve_pages(slot, cold_from, nbytes - cold_from) != 0):
            return None           # /dev/shm is full: the buffer takes the socket path
        # written = 0 while the bytes change: a stale descriptor for this
        # slot is refused by readers from here on.
        fmq_store_u8_rel(<uint8_t *>(self.line(slot) + F_WRITTEN), 0)
        # Taken before the GIL is released for the copy, so that
        # empty_tensor() on another thread cannot claim this slot meanwhile.
        self.in_message[slot] = 1
        with nogil:
            err = fmq_parallel_copy(dst, src, nbytes, cold_from, threads, min_part, &used)
        if err:
            self.in_message[slot] = 0
            self.n_nomem += 1
            if not self.logged_nomem:
                self.logged_nomem = True
                logger.warning(
                    "fastmq arena %s: cannot allocate %d bytes of shared memory for slot %d "
                    "(%s; /dev/shm is probably full); buffers take the out-of-band path "
                    "while this lasts. Logged once.", self.name, nbytes, slot, os.strerror(err))
            return None
        fmq_local_max_u64_rel(&self.faulted[slot], min(_align(nbytes, PAGE), self.slot_bytes))
        if cold_from < <size_t>nbytes:
            self.after_cold_use(slot)
        epoch = self.publish(slot)
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
        """Writer: a ``SlotBuffer`` over the first ``nbytes`` of a free slot
        (for ``empty_tensor``), or None.  The slot stays out of the
        writer's rotation while the buffer lives; sending a buffer that lies
        in it publishes the slot without a copy."""
        cdef int slot
        if self.reader_rank >= 0:
            raise ArenaError("only the arena's writer can allocate in it")
        if nbytes <= 0 or nbytes > self.slot_bytes or self.closed:
            self.n_empty_miss += 1
            return None
        slot = self.claim()
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
        sb.writer_side = True
        self.n_empty += 1
        return sb

    cdef int populate_for_use(self, int slot, Py_ssize_t nbytes) except -2:
        """Make ``nbytes`` of ``slot`` resident before the caller writes it:
        0, or -1 when shared memory cannot be allocated (no SIGBUS later)."""
        cdef uint64_t warm = fmq_local_load_u64_acq(&self.faulted[slot])
        cdef int err
        if warm >= <uint64_t>nbytes:
            return 0
        if not fmq_have_populate() and self.reserve_pages(slot, warm, nbytes - warm) != 0:
            return -1
        with nogil:
            err = fmq_populate(self.slot_ptr(slot) + warm, nbytes - warm)
        if err:
            self.n_nomem += 1
            return -1
        fmq_local_max_u64_rel(&self.faulted[slot], min(_align(nbytes, PAGE), self.slot_bytes))
        self.after_cold_use(slot)
        return 0

    cdef int reserve_pages(self, int slot, Py_ssize_t start, Py_ssize_t n) except -2:
        # Kernels without MADV_POPULATE_WRITE: allocate the pages through the
        # segment's descriptor, so that a full /dev/shm is an error here and
        # never a SIGBUS in the copy or the pre-fault that touches them.
        try:
            self.segment.reserve(self.data_off + slot * self.slot_bytes + start, n,
                                 "arena slot %d" % slot)
        except (ShmFullError, OSError, ValueError):
            self.n_nomem += 1
            return -1
        return 0

    cdef void drop_writer_ref(self, int slot) noexcept:
        self.reserved[slot] -= 1

    # -- pre-faulting ----------------------------------------------------------
    cdef object after_cold_use(self, int slot):
        # A slot was just used on cold pages: pre-fault the rest of it and
        # the next untouched slot in the background, so that the next
        # buffer (or a bigger one in this slot) finds warm pages.
        cdef int s
        if not self.prefault_ahead:
            return None
        want = [slot]
        for s in range(self.n_slots):
            if s != slot and fmq_local_load_u64_acq(&self.faulted[s]) < <uint64_t>self.slot_bytes:
                want.append(s)
                break
        self.prefault(want)
        return None

    def prefault(self, slots):
        """Writer: populate ``slots`` fully in a background thread (off the
        hot path).  Slots already populated or queued are skipped."""
        cdef int s
        if self.reader_rank >= 0 or self.closed:
            return
        with self.prefault_lock:
            for s in slots:
                if not (0 <= s < self.n_slots) or self.prefault_queued[s]:
                    continue
                if fmq_local_load_u64_acq(&self.faulted[s]) >= <uint64_t>self.slot_bytes:
                    continue
                self.prefault_queued[s] = 1
                self.prefault_jobs.append(s)
            if self.prefault_jobs and not self.prefault_running:
                self.prefault_running = True
                threading.Thread(target=self._prefault_loop, name="fastmq-arena-prefault",
                                 daemon=True).start()

    def _prefault_loop(self):
        cdef int s = 0, err
        cdef uint64_t start
        cdef char *p
        cdef size_t n
        while True:
            with self.prefault_lock:
                if not self.prefault_jobs or fmq_local_load_int(&self.cancel_prefault):
                    self.prefault_running = False
                    return
                s = self.prefault_jobs.popleft()
            start = fmq_local_load_u64_acq(&self.faulted[s])
            if start >= <uint64_t>self.slot_bytes:
                continue
            p = self.slot_ptr(s) + start
            n = self.slot_bytes - start
            if not fmq_have_populate() and self.reserve_pages(s, start, n) != 0:
                logger.warning("fastmq arena %s: /dev/shm has no room to pre-fault slot %d; "
                               "buffers that need it fall back to the ring", self.name, s)
                with self.prefault_lock:
                    self.prefault_running = False
                    self.prefault_jobs.clear()
                return
            with nogil:
                err = fmq_prefault(p, n, &self.cancel_prefault)
            if err == 0:
                fmq_local_max_u64_rel(&self.faulted[s], self.slot_bytes)
                self.n_prefaulted += n
            elif err > 0:
                self.prefault_error = err
                logger.warning("fastmq arena %s: background pre-fault of slot %d failed (%s); "
                               "the copy will fault those pages itself", self.name, s,
                               os.strerror(err))
                with self.prefault_lock:
                    self.prefault_running = False
                    self.prefault_jobs.clear()
                return

    def prefault_idle(self):
        """True when no background pre-fault is queued or running."""
        if self.prefault_lock is None:
            return True
        with self.prefault_lock:
            return not self.prefault_running

    def close(self):
        """Stop background work and refuse new diversions.  The mapping
        itself goes when the last reference (views included) does."""
        self.closed = True
        fmq_local_store_int(&self.cancel_prefault, 1)

    # == reader =============================================================
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

    cdef void release_named(self, const char *desc) noexcept:
        # A descriptor that failed validation, but names this arena (token)
        # and the slot's current publication (slot, epoch, written): that
        # slot is this message's, and nothing here will ever view it, so
        # hand it back.  Anything less certain is left alone: it might be a
        # later message's slot that this reader has not read yet.
        cdef uint64_t slot = _u32(<char *>desc, D_SLOT)[0]
        cdef char *ln
        if (self.reader_rank < 0 or _u64(<char *>desc, D_TOKEN)[0] != self.token
                or slot >= <uint64_t>self.n_slots or self.refs[slot] > 0):
            return
        ln = self.line(<int>slot)
        if (fmq_load_u8_acq(<uint8_t *>(ln + F_WRITTEN)) != 1
                or fmq_load_u64_acq(_u64(ln, F_EPOCH)) != _u64(<char *>desc, D_EPOCH)[0]
                or fmq_load_u8_acq(<uint8_t *>(ln + F_DONE + self.reader_rank)) != 0):
            return
        self.mark_done(<int>slot)

    cdef object resolve(self, const char *desc):
        if self.reader_rank < 0:
            raise ArenaError("the arena's writer cannot resolve slot descriptors")
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
        self.maybe_pin()
        cdef SlotBuffer sb = SlotBuffer.__new__(SlotBuffer)
        sb.arena = self
        sb.ptr = self.slot_ptr(<int>slot) + offset
        sb.nbytes = nbytes
        sb.slot = <int>slot
        sb.writer_side = False
        self.refs[slot] += 1
        self.ref_epoch[slot] = epoch
        self.n_views += 1
        return sb

    cdef object maybe_pin(self):
        # Once, lazily, and only where CUDA is already initialised (see
        # fastmq._cuda): registering 8 x 256 MiB allocates and locks all of
        # it, so a queue that never carries a large buffer never pins.
        if self.pin_attempted:
            return None
        from fastmq import _cuda
        rt = _cuda.runtime()
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

    cdef void drop_reader_ref(self, int slot) noexcept:
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
        if self.isolated and self.discard(slot) != 0:
            return
        fmq_store_u8_rel(<uint8_t *>(self.line(slot) + F_DONE + self.reader_rank), 1)
        self.n_released += 1

    cdef int discard(self, int slot) noexcept:
        """Drop this reader's private copies in ``slot`` (its in-place
        writes) so that the next message there shows the shared bytes: 0,
        or an errno, and then the slot is kept (logged once): the writer
        loses one slot, but no reader ever sees stale writes."""
        cdef int fd = _pagemap()
        cdef int err, whole = 0
        cdef uint64_t private_bytes = 0
        cdef char *p = self.slot_ptr(slot)
        cdef size_t n = self.slot_bytes
        with nogil:
            err = fmq_cow_discard(fd, p, n, &private_bytes, &whole)
        if err == 0:
            self.n_cow_bytes += private_bytes
            self.n_slot_discards += whole
            return 0
        self.n_discard_failed += 1
        if not self.logged_discard:
            self.logged_discard = True
            try:
                logger.warning("fastmq arena %s: cannot drop reader %d's private pages of slot "
                               "%d (%s); the slot stays with this reader. Logged once.",
                               self.name, self.reader_rank, slot, os.strerror(err))
            except BaseException:
                pass
        return err

    @cython.binding(False)   # called per message: a plain C method
    def flush_releases(self):
        """Reader, at every dequeue: hand back slots whose views are gone.

        Unpinned, a slot is handed back the moment its last view dies (a
        pageable H2D has consumed its source when the call returns).
        Pinned, the copy is an async DMA that can outlive the view: freed
        slots wait here for an event recorded now, on the current stream,
        i.e. after the previous step's copies, and are handed back once it
        completes (polled, never waited on)."""
        cdef int s
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

    # == both =================================================================
    def stats(self):
        if self.reader_rank < 0:
            return {
                "arena_hits": self.n_hits,
                "arena_bytes": self.n_hit_bytes,
                "arena_inplace": self.n_inplace,
                "arena_fallback_exhausted": self.n_exhausted,
                "arena_fallback_oversize": self.n_oversize,
                "arena_fallback_declined": self.n_declined,
                "arena_fallback_small": self.n_small,
                "arena_fallback_nomem": self.n_nomem,
                "arena_empty_tensors": self.n_empty,
                "arena_empty_misses": self.n_empty_miss,
                "arena_prefaulted_bytes": self.n_prefaulted,
                "arena_slots": self.n_slots,
                "arena_slot_bytes": self.slot_bytes,
                "arena_isolated": int(self.isolated),
            }
        return {
            "arena_views": self.n_views,
            "arena_released": self.n_released,
            "arena_event_gated": self.n_event_gated,
            "arena_pinned": int(self.pinned),
            "arena_isolated": int(self.isolated),
            "arena_private_bytes_dropped": self.n_cow_bytes,
            "arena_whole_slot_drops": self.n_slot_discards,
            "arena_drop_failures": self.n_discard_failed,
            "arena_slots": self.n_slots,
            "arena_slot_bytes": self.slot_bytes,
        }

    def __repr__(self):
        return "<fastmq ArenaEnd %r %s %d x %d>" % (
            self.name, "writer" if self.reader_rank < 0 else "reader %d" % self.reader_rank,
            self.n_slots, self.slot_bytes)


@cython.final
@cython.no_gc_clear
cdef class SlotBuffer:
    """Writable bytes of one arena slot (or part of one).

    Whatever is built over it -- a tensor, a numpy array, a memoryview --
    keeps a reference to it; when the last one goes, this object is freed
    and the slot is released (reader) or returns to the writer's rotation
    (``empty_tensor``).  It holds its arena, so the mapping cannot go first.
    """

    def __cinit__(self):
        self.slot = -1

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.ptr, self.nbytes, 0, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def __len__(self):
        return self.nbytes

    @property
    def address(self):
        return <uintptr_t>self.ptr

    def __reduce_ex__(self, protocol):
        # Forwarded to another queue: as a buffer (which that queue's arena
        # may copy to a slot again), rebuilt as a memoryview over whatever arrives.
        if protocol >= 5:
            return memoryview, (PickleBuffer(self),)
        return bytearray, (bytes(self),)

    def __dealloc__(self):
        if self.arena is None or self.slot < 0:
            return
        if self.writer_side:
            self.arena.drop_writer_ref(self.slot)
        else:
            self.arena.drop_reader_ref(self.slot)

    def __repr__(self):
        return "<fastmq SlotBuffer slot=%d nbytes=%d>" % (self.slot, self.nbytes)
