"""How much shared memory a queue holds now: the pages of its segments that
are allocated, not their reserved size.

A segment is sparse: the tensor arena reserves ``n_slots x slot_bytes``
and the ring all its chunks, but memory is allocated only for the pages a
message (or a pre-fault) touched, and it stays allocated until the segment
goes.  ``held_bytes(queue)`` counts, for fastmq's segments in the process
that made them, the file's allocated blocks (pages reserved ahead
included); for others (vLLM's, or a reader's mapping), the pages this
process's mapping sees allocated (``mincore``).

It takes fastmq's ``MessageQueue`` and vLLM's alike (both keep their ring
as ``queue.buffer`` and their arena as ``queue.tensor_arena``), so that a
benchmark can report both the same way.  For a segment that has a name in
``/dev/shm`` the same figure is ``os.stat(path).st_blocks * 512``.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

PAGE = mmap.PAGESIZE
_libc: Any = None


def _mincore():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.mincore.restype = ctypes.c_int
        _libc = lib
    return _libc.mincore


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the mapping ``[address, address + nbytes)`` whose pages are
    allocated (for a shared-memory mapping: in the segment, whether or not
    this process touched them).  ``address`` must be page aligned."""
    if nbytes <= 0:
        return 0
    if address % PAGE:
        raise ValueError(f"address {address:#x} is not page aligned")
    pages = -(-nbytes // PAGE)
    vec = ctypes.create_string_buffer(pages)
    if _mincore()(address, nbytes, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore of {nbytes} bytes at {address:#x}: {os.strerror(err)}")
    # One byte per page, bit 0 set where the page is resident (the other
    # bits are reserved and zero).
    return (pages - vec.raw.count(0)) * PAGE


def _mapping(obj: Any) -> tuple[int, int] | None:
    """``(address, size)`` of the mapping behind a ring or an arena end:
    fastmq's keep a ``Segment`` (``.segment``), vLLM's a ``SharedMemory``
    (``.shared_memory``)."""
    seg = getattr(obj, "segment", None)
    if seg is not None:
        return (int(seg.address), int(seg.size)) if seg.address else None   # 0: unmapped
    shm = getattr(obj, "shared_memory", None)
    buf = getattr(shm, "buf", None)
    if buf is None:
        return None
    holder = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(holder), len(buf)
    finally:
        del holder


def held_bytes(queue: Any) -> dict[str, int]:
    """``{"ring": ..., "arena": ..., "total": ...}``: the bytes of shared
    memory ``queue``'s ring and tensor arena hold now (0 for one it does
    not have).  Call it in the writer after a run, for example, once any
    background pre-fault is done."""
    out = {"ring": 0, "arena": 0}
    ring = getattr(queue, "buffer", None)
    arena = getattr(queue, "tensor_arena", None)
    if arena is not None:
        arena = getattr(arena, "core", arena)
    for key, obj in (("ring", ring), ("arena", arena)):
        seg = getattr(obj, "segment", None)
        if getattr(seg, "owner", False) and not seg.closed:
            # The creator's own count (the file's allocated blocks): pages
            # reserved ahead with posix_fallocate are held, but mincore
            # does not see them until they are first written.
            out[key] = seg.held_bytes()
            continue
        where = _mapping(obj) if obj is not None else None
        if where is not None:
            out[key] = resident_bytes(*where)
    out["total"] = out["ring"] + out["arena"]
    return out


__all__ = ["held_bytes", "resident_bytes"]
