"""The header check every segment layout shares (fastmq/_native/layout.pxd):
a reader attaching to a segment refuses one without a finished header of
its kind, and one of another layout version, each with its own error."""
from __future__ import annotations

import struct

import pytest

from fastmq import MessageQueue
from fastmq._arena import ArenaError
from fastmq._arena_reader import ArenaReaderEnd
from fastmq._ring import RingEnd, SegmentMismatchError
from fastmq._segment import Segment

VERSION_OFFSET = 8   # every fastmq segment header: u64 magic, then u32 version


def _poke_u32(name: str, off: int, value: int) -> int:
    with open(f"/dev/shm/{name}", "r+b") as f:
        f.seek(off)
        old, = struct.unpack("<I", f.read(4))
        f.seek(off)
        f.write(struct.pack("<I", value))
    return old


def _queue() -> MessageQueue:
    # Its segments go when it is collected, at the end of each test.
    return MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2,
                        arena_slots=1, arena_slot_mb=2, arena_min_mb=1)


def test_ring_attach_refuses_a_foreign_segment_and_another_version():
    queue = _queue()
    bh = queue.export_handle().buffer_handle     # indexed: it refuses to be unpacked
    n_reader, chunk_bytes, n_chunks, name = bh[0], bh[1], bh[2], bh[3]
    seg = Segment.attach(name)
    old = _poke_u32(name, VERSION_OFFSET, 99)
    with pytest.raises(SegmentMismatchError, match="layout version 99"):
        RingEnd.attach(seg, n_reader, chunk_bytes, n_chunks, 0)
    _poke_u32(name, VERSION_OFFSET, old)
    RingEnd.attach(seg, n_reader, chunk_bytes, n_chunks, 0)   # intact again: attaches

    arena = queue.tensor_arena
    foreign = Segment.attach(arena.name)   # a real segment, but an arena's
    with pytest.raises(SegmentMismatchError, match="not a fastmq ring"):
        RingEnd.attach(foreign, n_reader, chunk_bytes, n_chunks, 0)


def test_arena_attach_refuses_a_foreign_segment_and_another_version():
    queue = _queue()
    n_reader, slot_bytes, n_slots, name = queue.tensor_arena.handle()
    old = _poke_u32(name, VERSION_OFFSET, 99)
    with pytest.raises(ArenaError, match="layout version 99"):
        ArenaReaderEnd.attach(name, n_reader, slot_bytes, n_slots, 0)
    _poke_u32(name, VERSION_OFFSET, old)
    ArenaReaderEnd.attach(name, n_reader, slot_bytes, n_slots, 0).close()

    ring_name = queue.export_handle().buffer_handle[3]
    with pytest.raises(ArenaError, match="not a fastmq tensor arena"):
        ArenaReaderEnd.attach(ring_name, n_reader, slot_bytes, n_slots, 0)
