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

This module holds what both ends share: the constants, ``layout``, the
descriptor test, ``ArenaError``, the base class ``ArenaEnd`` (the mapping,
its geometry and the flag lines) and ``SlotBuffer``.  The writer's end is
``fastmq._arena_writer.ArenaWriterEnd`` (claim, copy, publish, pre-fault;
why descriptors travel in the out-of-band list is explained there), a
reader's end ``fastmq._arena_reader.ArenaReaderEnd`` (mapping, resolving
descriptors, releases, copy-on-write, CUDA).

Segment layout (offsets from the mapping's base; fastmq/_arena_layout.pxd)::

    +-------------------------------+ 0
    | header (H_*)                  |  magic, version, geometry, token
    +-------------------------------+ flags_off = 4096
    | line 0 | line 1 | ...         |  one 64-byte-aligned line per slot:
    |                               |  [u64 epoch][u8 written][u8 done x n_reader]
    +-------------------------------+ data_off (2 MiB aligned, so that slots
    | slot 0 | slot 1 | ...         |  can be huge pages where tmpfs allows)
    +-------------------------------+ total

Flag protocol (single writer; same states as the ring and as vLLM's arena):
a slot is free for the writer when ``written == 0`` or every ``done == 1``
(``ArenaEnd.slot_free``).

    writer:  claim a free slot ; written = 0 ; copy ; done[*] = 0 (release) ;
             epoch += 1 (release) ; written = 1 (release) ;
             then the ring chunk carrying the descriptor is published
             (release), so a reader that acquires the chunk sees the bytes.
    reader:  resolve: written == 1 and epoch == descriptor's epoch (acquire),
             else the descriptor is stale or forged -> ArenaError ;
             ... last SlotBuffer of the slot freed ... done[me] = 1 (release,
             after every read of the slot) ; the writer's acquire load of
             the done flags orders its next copy after those reads.
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport uint8_t, uint64_t, uintptr_t

from fastmq._native.atomic cimport fmq_load_u8_acq, fmq_load_u64_acq
from fastmq._native.layout cimport align_up as _align, word32 as _u32, word64 as _u64
from fastmq._segment cimport Segment

from pickle import PickleBuffer

cdef extern from "fmq_populate.h" nogil:
    void fmq_hugepage(char *p, size_t n)


MAGIC = 0x3141514d54534146        # b"FASTMQA1" little-endian
DESC_MAGIC = 0x31544f4c53514d46   # b"FMQSLOT1"
LAYOUT_VERSION = 2     # 2: H_READERS
READERS_ISOLATED = 0   # readers map the slots copy-on-write (default)
READERS_SHARED = 1     # readers map them shared and writable (opt-in)
DESC_LEN = 48          # bytes of a slot descriptor (C_DESC_LEN)
PAGE = 4096
DATA_ALIGN = 2 << 20

from fastmq._arena_layout cimport *

cdef uint64_t C_DESC_MAGIC = DESC_MAGIC


class ArenaError(RuntimeError):
    """An arena descriptor or segment is invalid, stale, or not attached."""


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
    # In Python's integers: a C product of huge sizes wraps, and an arena
    # whose size wrapped small would be written past its end.
    total = data_off + (<object>slot_bytes) * n_slots
    if total > PY_SSIZE_T_MAX:
        raise ValueError("an arena of %d slots of %d bytes (%d bytes) is larger than a "
                         "process can map" % (n_slots, slot_bytes, total))
    return stride, HEADER, data_off, total


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


@cython.no_gc_clear
cdef class ArenaEnd:
    """One process's end of an arena segment: its mapping, geometry and flag
    lines.  Made only as one of its roles: ``ArenaWriterEnd.create`` or
    ``ArenaReaderEnd.attach``.  The Python surface is
    ``fastmq.arena.ArenaWriter`` / ``ArenaReader``."""

    def __cinit__(self):
        self.n_slots = 0

    cdef int bind(self, Segment seg, tuple geometry, uint64_t token, bint isolated) except -1:
        # ``geometry`` is ``layout()``'s for the handle's sizes (n_reader,
        # n_slots, stride, slot_bytes, flags_off, data_off, total), which the
        # writer wrote and a reader found in the header.  Never read back
        # from the header: any process that can write the segment could
        # change a word between a reader's check and a second read, and
        # these bound every slot index, offset and length a reader resolves.
        cdef char *b = <char *>seg.addr
        self.segment = seg
        self.name = seg.name
        self.base = b
        (self.n_reader, self.n_slots, self.stride, self.slot_bytes, self.flags_off,
         self.data_off, self.total_bytes) = geometry
        self.token = token
        self.data = b + self.data_off
        self.isolated = isolated
        return 0

    cdef void advise_hugepages(self) noexcept:
        # Best effort, and only on a shared mapping of the slots (the caller
        # decides): on a reader's private mapping it could only make its
        # private copies huge, which is all cost.
        fmq_hugepage(self.data, self.slot_bytes * self.n_slots)

    # -- layout accessors --------------------------------------------------
    @cython.final
    cdef char *line(self, int slot) noexcept nogil:
        return self.base + self.flags_off + slot * self.stride

    @cython.final
    cdef char *slot_ptr(self, int slot) noexcept nogil:
        return self.data + slot * self.slot_bytes

    @cython.final
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
        """Slots free by the flags: never written, or done in every reader."""
        return [s for s in range(self.n_slots) if self.slot_free(s)]

    cdef void drop_ref(self, int slot) noexcept:
        # The last view of a SlotBuffer over ``slot`` is gone.  Each role
        # counts its own buffers (the writer's empty_tensor reservations, a
        # reader's views); an end of neither role hands none out.
        pass

    def close(self):
        """Refuse new work.  The mapping itself goes when the last
        reference (views included) does."""
        self.closed = True

    cdef dict common_stats(self):
        return {
            "arena_slots": self.n_slots,
            "arena_slot_bytes": self.slot_bytes,
            "arena_isolated": int(self.isolated),
        }

    def stats(self):
        return self.common_stats()


@cython.final
@cython.no_gc_clear
cdef class SlotBuffer:
    """Writable bytes of one arena slot (or part of one).

    Whatever is built over it -- a tensor, a numpy array, a memoryview --
    keeps a reference to it; when the last one goes, this object is freed
    and the slot is released (reader) or returns to the writer's rotation
    (``empty_tensor``).

    Lifetimes: it holds its ``ArenaEnd``, which holds the ``Segment``; so
    the mapping outlives every view, and a reader end's ``__dealloc__``
    (which unregisters a CUDA pin before the segment unmaps) runs only after
    the last view is gone.  ``torch.frombuffer`` and ``numpy.frombuffer``
    keep a reference to the buffer object for the life of their storage, so
    a ``SlotBuffer`` dies exactly when the last tensor, view, slice or
    wrapper (``Parameter``) sharing the slot is freed.
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
        self.arena.drop_ref(self.slot)

    def __repr__(self):
        return "<fastmq SlotBuffer slot=%d nbytes=%d>" % (self.slot, self.nbytes)
