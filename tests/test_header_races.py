"""A reader attaching to a segment checks its header against the handle;
any process that can write the segment can change a header word while it
does.  What a reader's end is bound by must be what it checked, never a
second read of the word.  A flipper process toggles one geometry word
between its right value and a huge one while this process attaches again
and again: no end may come out with the huge value."""
from __future__ import annotations

import subprocess
import sys
import time

from fastmq._arena import ArenaError
from fastmq._arena_reader import ArenaReaderEnd
from fastmq._ring import SegmentMismatchError
from fastmq._ring_reader import RingReader
from fastmq._segment import Segment, parse_locator
from fastmq.arena import ShmTensorArena

from _queues import local_pair

# The word toggles until this process kills the flipper.
_FLIPPER = r"""
import mmap, struct, sys
path, off, fmt, good, bad = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
with open(path, "r+b") as f:
    m = mmap.mmap(f.fileno(), 4096)
pack = struct.Struct(fmt).pack_into
print("ready", flush=True)
while True:
    pack(m, off, bad)
    pack(m, off, good)
"""

ATTACH_SECONDS = 4.0
BAD = 1 << 40


def _flipper(locator: str, offset: int, fmt: str, good: int) -> subprocess.Popen:
    _, pid, fd, _ = parse_locator(locator)
    p = subprocess.Popen([sys.executable, "-c", _FLIPPER, f"/proc/{pid}/fd/{fd}", str(offset),
                          fmt, str(good), str(BAD)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _race(attach, bound, want, refused_error) -> tuple[int, int, list]:
    """Attach for ATTACH_SECONDS: (attaches, refusals, the bad bounds seen)."""
    tries = refused = 0
    bad = []
    end_at = time.monotonic() + ATTACH_SECONDS
    while time.monotonic() < end_at:
        tries += 1
        try:
            end = attach()
        except refused_error:
            refused += 1
            continue
        if bound(end) != want:
            bad.append(bound(end))
    return tries, refused, bad


def test_a_ring_reader_is_bound_by_the_header_it_checked():
    chunk = 4096
    w, (r,) = local_pair(1, max_chunk_bytes=chunk, max_chunks=2)
    locator = w.export_handle().buffer_handle.name
    flip = _flipper(locator, 16, "<Q", chunk)           # H_CHUNK_BYTES
    try:
        tries, refused, bad = _race(
            lambda: RingReader.attach(Segment.attach(locator), 1, chunk, 2, 0),
            lambda end: end.max_chunk_bytes, chunk, SegmentMismatchError)
    finally:
        flip.kill()
        flip.wait()
    # The flipper ran: some attaches saw the huge value and refused.
    assert refused > 0 and tries > refused, (tries, refused)
    assert bad == [], f"{len(bad)} of {tries} attaches bound by a word changed after the check"
    w.enqueue("still usable")
    assert r.dequeue(timeout=5) == "still usable"
    r.shutdown()
    w.shutdown()


def test_an_arena_reader_is_bound_by_the_header_it_checked():
    slot, n_slots = 1 << 16, 4
    w = ShmTensorArena(1, slot, n_slots, min_bytes=1, prefault="off")
    flip = _flipper(w.name, 24, "<Q", slot)             # H_SLOT_BYTES
    try:
        tries, refused, bad = _race(
            lambda: ArenaReaderEnd.attach(w.name, 1, slot, n_slots, 0),
            lambda end: end.slot_bytes, slot, ArenaError)
    finally:
        flip.kill()
        flip.wait()
        w.close()
    assert refused > 0 and tries > refused, (tries, refused)
    assert bad == [], f"{len(bad)} of {tries} attaches bound by a word changed after the check"
