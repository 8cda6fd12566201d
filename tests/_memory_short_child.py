"""Run as a script inside a memory cgroup with a small limit (see
test_hostile.py): memory that cannot be had is an exception, or the arena
sends the buffer the socket way; never a SIGBUS, never the OOM killer."""
import sys

from fastmq import MessageQueue
from fastmq._segment import ShmFullError, memory_available

from _queues import background_readings, local_pair

MiB = 1 << 20


def ring_larger_than_the_limit() -> None:
    room = memory_available()
    assert 0 <= room < 320 * MiB, room          # the cgroup's room, not the host's
    try:
        MessageQueue(1, 1, max_chunk_bytes=64 * MiB, max_chunks=8)   # 512 MiB
    except ShmFullError as e:
        print("ERROR:", e)
        assert "cannot give now" in str(e) and "512.0 MiB" in str(e), e
    else:
        raise AssertionError("a ring larger than the memory limit was created")
    w, (r,) = local_pair(1, max_chunk_bytes=4 * MiB, max_chunks=4)   # one that fits works
    w.enqueue(b"x" * (3 * MiB))
    assert r.dequeue(timeout=10) == b"x" * (3 * MiB)
    print("ring OK")


def arena_short_of_memory() -> None:
    import numpy as np

    w, (r,) = local_pair(1, max_chunk_bytes=1 * MiB, max_chunks=2,
                         enable_shm_tensor_arena=True, arena_slots=2, arena_slot_mb=64,
                         arena_min_mb=1, arena_prefault="off")
    a = np.arange(1 * MiB, dtype=np.float64)            # 8 MiB: an arena buffer
    # Someone else takes the memory: what is left is less than the buffer
    # and the arena's headroom.
    filler = bytearray(max(0, memory_available() - 40 * MiB))
    # The check answers from a reading kept in the background while the
    # room it shows is ample (fastmq._memory); its next reading, within a
    # second, shows the filler.
    assert background_readings(2), "no background reading of memory"
    w.enqueue(a)
    assert np.array_equal(r.dequeue(timeout=10), a)
    stats = w.stats()
    assert stats["arena_fallback_nomem"] >= 1 and stats["arena_hits"] == 0, stats
    del filler
    w.enqueue(a)
    assert np.array_equal(r.dequeue(timeout=10), a)
    assert w.stats()["arena_hits"] == 1, w.stats()
    print("arena OK")


if __name__ == "__main__":
    ring_larger_than_the_limit()
    if "--ring-only" not in sys.argv:
        arena_short_of_memory()
    print("OK")
    sys.stdout.flush()
