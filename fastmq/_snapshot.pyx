"""Read-only views of live segments, for ``fastmq ls``.

These functions read a ring or an arena through any buffer (a read-only
mapping) and never write to it: looking at
a live queue must not disturb it.  The layouts they read are the ones the
ends write (``_ring_layout.pxd``, ``_arena_layout.pxd``).  Every geometry
word is range-checked before it is used as a count or a size.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from fastmq._native.atomic cimport fmq_load_u8_acq, fmq_load_u32_acq, fmq_load_u64_acq
from fastmq._native.layout cimport (HEADER_NO_MAGIC, HEADER_OK, header_status,
                                    word32 as _u32, word64 as _u64)
from fastmq._ring_layout cimport *
cimport fastmq._arena_layout as A

from fastmq._arena import (LAYOUT_VERSION as ARENA_VERSION, MAGIC as ARENA_MAGIC, ArenaError,
                           layout as arena_layout)
from fastmq._ring import (LAYOUT_VERSION as RING_VERSION, MAGIC as RING_MAGIC,
                          SegmentMismatchError, layout as ring_layout)

cdef uint64_t CLAIM_LEFT = 1ULL << CLAIM_LEFT_BIT

cdef inline uint32_t _ro_u32(const char *b, Py_ssize_t off) noexcept nogil:
    return fmq_load_u32_acq(<const uint32_t *>(b + off))


cdef inline uint64_t _ro_u64(const char *b, Py_ssize_t off) noexcept nogil:
    return fmq_load_u64_acq(<const uint64_t *>(b + off))


def ring_snapshot(buf, Py_ssize_t size=-1):
    """Everything the header and flags of a ring say, read from ``buf`` (a
    mapped ring, typically mapped read-only) without writing to it.
    ``size``: the segment's size, when ``buf`` maps only its start (its
    header and flags, which is all that is read); -1: ``buf`` is all of it.

    Returns a dict: the geometry (``n_reader``, ``max_chunk_bytes``,
    ``max_chunks``, ``total``), ``wait_mode``, ``spin_ns``, ``writer_pid``,
    ``writer_start``, ``writer_closed``, ``readers_parked`` (how many readers
    sleep on the futex word or the notify socket now), ``writer_parked``,
    ``readers`` (``(pid, start)`` per rank; pid 0: not attached yet),
    ``written`` (the written flag per chunk) and ``read`` (per rank, the
    read flag per chunk).  The flags are loaded one by one while the queue
    runs, so they are a moment's view, not an atomic one.  Raises
    ``SegmentMismatchError`` when ``buf`` is not a complete ring.
    """
    cdef Py_buffer v
    PyObject_GetBuffer(buf, &v, PyBUF_SIMPLE)
    cdef const char *b = <const char *>v.buf
    cdef const uint8_t *m
    cdef Py_ssize_t i, r, n_reader, n_chunks, stride, meta_off
    cdef Py_ssize_t whole = v.len if size < 0 else size
    try:
        if v.len < H_READER_SLOTS + READER_SLOT:
            raise SegmentMismatchError("%d bytes are too few for a fastmq ring" % v.len)
        if _ro_u64(b, H_MAGIC) != RING_MAGIC:
            raise SegmentMismatchError("not a fastmq ring (no fastmq header)")
        if _ro_u32(b, H_VERSION) != RING_VERSION:
            raise SegmentMismatchError("fastmq ring layout version %d, this fastmq reads "
                                       "version %d" % (_ro_u32(b, H_VERSION), RING_VERSION))
        n_reader_word = _ro_u32(b, H_NREADER)
        n_chunks_word = _ro_u32(b, H_NCHUNKS)
        chunk_bytes = _ro_u64(b, H_CHUNK_BYTES)
        got = (_ro_u32(b, H_META_STRIDE), _ro_u64(b, H_META_OFF), _ro_u64(b, H_DATA_OFF),
               _ro_u64(b, H_TOTAL))
        # Every geometry word is range-checked before it is used as a
        # count or a size: a corrupt or forged file must read as bad, not
        # overflow.  A real ring is no larger than its file, which is no
        # larger than the mapping checked below.
        if not (1 <= n_reader_word <= 4096 and 1 <= n_chunks_word
                and 64 <= chunk_bytes
                and int(chunk_bytes) * int(n_chunks_word) <= int(whole)):
            raise SegmentMismatchError(
                "fastmq ring header has a bad geometry: %d readers, %d chunks of %d bytes "
                "(a %d-byte file)" % (n_reader_word, n_chunks_word, chunk_bytes, whole))
        n_reader = n_reader_word
        n_chunks = n_chunks_word
        want = ring_layout(n_reader, chunk_bytes, n_chunks)
        if got != want or whole < want[3] or v.len < want[2]:
            raise SegmentMismatchError(
                "fastmq ring header %r does not match its geometry %r (a %d-byte segment, "
                "%d bytes mapped)" % (got, want, whole, v.len))
        stride = want[0]
        meta_off = want[1]
        readers = []
        reads = []
        left = []
        for r in range(n_reader):
            word = _ro_u64(b, H_READER_SLOTS + READER_SLOT * r)
            readers.append((word & CLAIM_PID_MASK,
                            _ro_u64(b, H_READER_SLOTS + READER_SLOT * r + SLOT_START)))
            left.append(bool(word & CLAIM_LEFT))
            reads.append(_ro_u64(b, H_READER_SLOTS + READER_SLOT * r + SLOT_READ))
        written = []
        read = [[] for r in range(n_reader)]
        for i in range(n_chunks):
            m = <const uint8_t *>(b + meta_off + i * stride)
            written.append(fmq_load_u8_acq(m))
            for r in range(n_reader):
                read[r].append(fmq_load_u8_acq(m + 1 + r))
        return {
            "n_reader": n_reader,
            "max_chunk_bytes": chunk_bytes,
            "max_chunks": n_chunks,
            "total": want[3],
            "wait_mode": _ro_u32(b, H_WAIT_MODE),
            "spin_ns": _ro_u64(b, H_SPIN_NS),
            "writer_pid": _ro_u32(b, H_WRITER_PID),
            "writer_start": _ro_u64(b, H_WRITER_START),
            "writer_closed": _ro_u32(b, H_WRITER_STATE) == 2,
            "readers_parked": _ro_u32(b, H_READERS_PARKED),
            "writer_parked": _ro_u32(b, H_WRITER_PARKED),
            "readers": readers,
            "left": left,
            "published": _ro_u64(b, H_PUBLISHED),
            "reads": reads,
            "written": written,
            "read": read,
        }
    finally:
        PyBuffer_Release(&v)


def arena_snapshot(buf, Py_ssize_t size=-1):
    """The header and slot flags of an arena, read from ``buf`` (a mapped
    arena, typically mapped read-only) without writing to it; for
    ``fastmq ls``.  ``size``: the segment's size, when ``buf`` maps only
    its header and flags (all that is read); -1: ``buf`` is all of it.  Returns a dict: ``n_reader``, ``n_slots``,
    ``slot_bytes``, ``total``, and per slot ``slots``: ``(epoch, written,
    [done per reader])``.  Raises ``ArenaError`` when ``buf`` is not a
    complete arena of this layout version."""
    cdef Py_buffer v
    PyObject_GetBuffer(buf, &v, PyBUF_SIMPLE)
    cdef char *b = <char *>v.buf
    cdef char *ln
    cdef Py_ssize_t s, r, n_reader, n_slots, stride, flags_off
    cdef Py_ssize_t whole = v.len if size < 0 else size
    try:
        if v.len < A.HEADER:
            raise ArenaError("%d bytes are too few for a fastmq arena" % v.len)
        status = header_status(b, ARENA_MAGIC, ARENA_VERSION)
        if status == HEADER_NO_MAGIC:
            raise ArenaError("not a fastmq arena (no fastmq header)")
        if status != HEADER_OK:
            raise ArenaError("fastmq arena layout version %d, this fastmq reads version %d"
                             % (_u32(b, A.H_VERSION)[0], ARENA_VERSION))
        n_reader_word = _u32(b, A.H_NREADER)[0]
        n_slots_word = _u32(b, A.H_NSLOTS)[0]
        slot_bytes = _u64(b, A.H_SLOT_BYTES)[0]
        got = (_u32(b, A.H_STRIDE)[0], _u64(b, A.H_FLAGS_OFF)[0], _u64(b, A.H_DATA_OFF)[0],
               _u64(b, A.H_TOTAL)[0])
        # Range-checked before use as counts: a forged or corrupt file reads
        # as bad instead of overflowing (an arena's slots lie in its file).
        if not (1 <= n_reader_word <= 4096 and 1 <= n_slots_word <= 65536
                and int(slot_bytes) * int(n_slots_word) <= int(whole)):
            raise ArenaError("fastmq arena header has a bad geometry: %d readers, %d slots "
                             "of %d bytes (a %d-byte file)"
                             % (n_reader_word, n_slots_word, slot_bytes, whole))
        n_reader = n_reader_word
        n_slots = n_slots_word
        try:
            want = arena_layout(n_reader, n_slots, slot_bytes)
        except ValueError as e:
            raise ArenaError("fastmq arena header has a bad geometry: %s" % e)
        if got != want or whole < want[3] or v.len < want[2]:
            raise ArenaError("fastmq arena header %r does not match its geometry %r "
                             "(a %d-byte segment, %d bytes mapped)" % (got, want, whole, v.len))
        stride = want[0]
        flags_off = want[1]
        slots = []
        for s in range(n_slots):
            ln = b + flags_off + s * stride
            slots.append((fmq_load_u64_acq(_u64(ln, A.F_EPOCH)),
                          fmq_load_u8_acq(<uint8_t *>(ln + A.F_WRITTEN)),
                          [fmq_load_u8_acq(<uint8_t *>(ln + A.F_DONE + r))
                           for r in range(n_reader)]))
        return {"n_reader": n_reader, "n_slots": n_slots, "slot_bytes": slot_bytes,
                "total": want[3], "slots": slots}
    finally:
        PyBuffer_Release(&v)
