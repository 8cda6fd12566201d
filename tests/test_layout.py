"""The header check every segment layout shares (fastmq/_native/layout.pxd):
a reader attaching to a segment refuses one without a finished header of
its kind, and one of another layout version, each with its own error.  And
the ring's ends: one class per role, none asking which end it is."""
from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import pytest

from fastmq import MessageQueue
from fastmq._arena import ArenaError
from fastmq._arena_reader import ArenaReaderEnd
from fastmq._ring import RingEnd, SegmentMismatchError
from fastmq._ring_reader import RingReader
from fastmq._ring_writer import RingWriter
from fastmq._segment import Segment

VERSION_OFFSET = 8   # every fastmq segment header: u64 magic, then u32 version


def _poke_u32(locator: str, off: int, value: int) -> int:
    _, fd, _ = locator.rsplit(":", 2)      # this process made it: its own descriptor
    with open(f"/proc/self/fd/{fd}", "r+b") as f:
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
        RingReader.attach(seg, n_reader, chunk_bytes, n_chunks, 0)
    _poke_u32(name, VERSION_OFFSET, old)
    RingReader.attach(seg, n_reader, chunk_bytes, n_chunks, 0)   # intact again: attaches

    arena = queue.tensor_arena
    foreign = Segment.attach(arena.name)   # a real segment, but an arena's
    with pytest.raises(SegmentMismatchError, match="not a fastmq ring"):
        RingReader.attach(foreign, n_reader, chunk_bytes, n_chunks, 0)


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


# What only one end of a ring does: a class that has the other role's
# methods would be one class asking which end it is.
WRITER_ONLY = ["create", "begin_write", "publish_chunk", "framed_size", "send",
               "send_object", "send_pickled", "send_overflow_mark", "mark_closed",
               "reader_identity", "reader_state", "unread_readers", "dead_rank", "dead_pid",
               "dead_left", "n_published", "sent_messages", "sent_bytes", "notify_errors",
               "last_notify_error"]
READER_ONLY = ["attach", "claim_reader", "read_object", "release_read", "overflow_latest",
               "overflow_id", "pending", "n_read", "reader_rank", "writer_pid",
               "writer_start", "writer_closed"]
SHARED = ["wait_next", "continue_wait", "waited", "peer_status", "cancel", "close",
          "use_zmq_wakeup", "chunk_view", "meta_view", "current_idx", "wakeups",
          "warn_interval", "park_slice_ns", "parked_readers", "parked_writer"]


def test_ring_ends_are_one_class_per_role():
    assert issubclass(RingWriter, RingEnd) and issubclass(RingReader, RingEnd)
    assert not issubclass(RingWriter, RingReader) and not issubclass(RingReader, RingWriter)
    for name in WRITER_ONLY:
        assert hasattr(RingWriter, name), name
        assert not hasattr(RingReader, name), f"RingReader has the writer's {name}"
        assert not hasattr(RingEnd, name), f"RingEnd has the writer's {name}"
    for name in READER_ONLY:
        assert hasattr(RingReader, name), name
        assert not hasattr(RingWriter, name), f"RingWriter has the reader's {name}"
        assert not hasattr(RingEnd, name), f"RingEnd has the reader's {name}"
    for name in SHARED:
        assert hasattr(RingWriter, name) and hasattr(RingReader, name), name
    for cls in (RingEnd, RingWriter, RingReader):
        assert not hasattr(cls, "is_writer"), cls


def test_ring_sources_never_ask_which_end_they_are():
    src = Path(__file__).resolve().parent.parent / "fastmq"
    files = sorted(src.glob("_ring*.pyx")) + sorted(src.glob("_ring*.pxd"))
    assert {f.name for f in files} >= {"_ring.pyx", "_ring_writer.pyx", "_ring_reader.pyx"}
    for f in files:
        text = f.read_text()
        found = re.findall(r"is_writer|_check_writer|_check_reader|reader_rank\s*<\s*0", text)
        assert not found, f"{f.name}: {found}"


def test_each_end_keeps_its_role():
    queue = _queue()
    ring = queue._ring
    assert isinstance(ring, RingWriter)
    bh = queue.export_handle().buffer_handle
    n_reader, chunk_bytes, n_chunks, name = bh[0], bh[1], bh[2], bh[3]
    reader = RingReader.attach(Segment.attach(name), n_reader, chunk_bytes, n_chunks, 0)
    try:
        assert reader.reader_rank == 0 and reader.writer_pid == os.getpid()
        assert ring.send([b"x"]) > 0
        idx = reader.current_idx
        assert reader.wait_next(0) == 0
        with reader.chunk_view(idx) as view:
            assert bytes(view[:1]) == b"\x00"      # a framed message, not a mark
        reader.release_read(idx)
        assert reader.n_read == 1 and ring.n_published == 1
    finally:
        reader.close()
