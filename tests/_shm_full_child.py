"""Run as a script inside a private mount namespace whose /dev/shm is a
small tmpfs (see test_hostile.py): fills /dev/shm after the queue was
created and checks that the writer gets an exception, not a SIGBUS."""
import os
import sys
import threading

from fastmq import MessageQueue
from fastmq._segment import ShmFullError

MiB = 1 << 20


def _pair(**kw):
    w = MessageQueue(1, 1, **kw)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join(10)
    return w, r


def _fill_dev_shm(leave: int) -> str:
    filler = "/dev/shm/filler"
    st = os.statvfs("/dev/shm")
    with open(filler, "wb") as f:
        f.write(b"\1" * (st.f_bavail * st.f_frsize - leave))
    return filler


def arena_on_old_kernel() -> None:
    """The arena without MADV_POPULATE_WRITE (kernels before 5.14): its
    pages are reserved with posix_fallocate first, so a full /dev/shm sends
    the array the socket way instead of killing the writer."""
    import numpy as np
    from fastmq import _arena_writer

    _arena_writer.set_populate(False)
    w, r = _pair(max_chunk_bytes=64 * 1024, max_chunks=2, enable_shm_tensor_arena=True,
                 arena_slots=2, arena_slot_mb=2, arena_min_mb=0.5, arena_prefault="off")
    filler = _fill_dev_shm(MiB // 2)
    a = np.arange(200_000, dtype=np.float64)            # 1.5 MiB: an arena buffer
    w.enqueue(a)
    assert np.array_equal(r.dequeue(timeout=10), a)
    stats = w.stats()
    assert stats["arena_fallback_nomem"] >= 1, stats
    os.unlink(filler)
    w.enqueue(a)
    assert np.array_equal(r.dequeue(timeout=10), a)
    assert w.stats()["arena_hits"] >= 1
    _arena_writer.set_populate(True)
    print("arena OK")


def _wait_prefault(core) -> None:
    import time

    end = time.monotonic() + 10
    while not core.prefault_idle():
        assert time.monotonic() < end, "background pre-fault did not finish"
        time.sleep(0.005)


def arena_on_full_shm() -> None:
    """The arena with MADV_POPULATE_WRITE and its default pre-fault: pages
    pre-faulted before /dev/shm filled up still take buffers; a slot whose
    pages cannot be had sends its buffer the normal way; a background
    pre-fault that cannot get memory stops.  Never a SIGBUS."""
    import numpy as np

    w, r = _pair(max_chunk_bytes=64 * 1024, max_chunks=2, enable_shm_tensor_arena=True,
                 arena_slots=4, arena_slot_mb=1, arena_min_mb=0.25)
    core = w.tensor_arena.core
    kib = 1024
    a = np.arange(96 * kib, dtype=np.float64)            # 768 KiB: an arena buffer
    held = []

    def send(x, hit):
        before = w.stats()
        w.enqueue(x)
        got = r.dequeue(timeout=10)
        assert np.array_equal(got, x)
        after = w.stats()
        assert after["arena_hits"] - before["arena_hits"] == int(hit), (hit, after)
        if not hit:
            assert after["arena_fallback_nomem"] > before["arena_fallback_nomem"], after
        held.append(got)                                  # the reader keeps every slot

    send(a, True)                                         # slot 0, cold
    _wait_prefault(core)
    assert core.faulted_bytes(1) == a.nbytes              # pre-faulted behind it, no more
    filler = _fill_dev_shm(256 * kib)
    send(a + 1, True)                                     # slot 1: its pages are there
    send(a + 2, False)                                    # slot 2: no room, normal path
    os.unlink(filler)
    filler = _fill_dev_shm(MiB)
    send(a + 3, True)                                     # slot 2 now fits; slot 3's
    _wait_prefault(core)                                  # pre-fault runs out of room
    assert core.faulted_bytes(3) < a.nbytes
    send(a + 4, False)                                    # slot 3: normal path
    os.unlink(filler)
    held.clear()
    send(a + 5, True)
    print("arena populate OK")


def main() -> None:
    arena_on_old_kernel()
    arena_on_full_shm()
    w = MessageQueue(1, 1, max_chunk_bytes=3 * MiB, max_chunks=2,
                     enable_shm_tensor_arena=False)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join(10)
    w.enqueue(b"small")
    # Another process fills /dev/shm after the queue passed its space check.
    filler = "/dev/shm/filler"
    st = os.statvfs("/dev/shm")
    with open(filler, "wb") as f:
        f.write(b"\1" * (st.f_bavail * st.f_frsize - MiB // 2))
    big = bytes(range(256)) * (10 * 1024)         # 2.5 MiB: chunk 1, never touched
    try:
        w.enqueue(big)
    except ShmFullError as e:
        print("ERROR:", e)
        assert "/dev/shm" in str(e) and "MiB" in str(e), e
    else:
        raise AssertionError("enqueue into a full /dev/shm did not raise")
    os.unlink(filler)
    w.enqueue(big)                                # usable again once space is back
    assert r.dequeue(timeout=10) == b"small"
    assert r.dequeue(timeout=10) == big           # exactly once, after the failure
    try:
        r.dequeue(timeout=0.2)
    except TimeoutError:
        pass
    else:
        raise AssertionError("the failed enqueue delivered a message")
    print("OK")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
