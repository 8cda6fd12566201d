"""The common path: an enqueue() or a dequeue() of a message that fits a
chunk is one call into the ring on each side, and everything the Python
layers did per message still holds there."""
from __future__ import annotations

import copyreg
import gc
import pickle
import sys
import weakref

import numpy as np
import pytest

from _queues import local_pair
from fastmq._ring import OVERFLOW, PARTS, PENDING, PICKLER_STALE
from fastmq._sink import PickleSink


def _python_calls(fn) -> list[str]:
    """The Python functions ``fn()`` runs, by qualified name."""
    seen = []

    def prof(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_qualname)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [name for name in seen if not name.endswith((".prof", "<lambda>"))]


@pytest.mark.parametrize("arena", [True, False])
def test_a_message_that_fits_runs_only_the_facade_and_the_role(arena):
    w, (r,) = local_pair(max_chunk_bytes=1 << 16, max_chunks=4,
                         enable_shm_tensor_arena=arena)
    msg = ("step", 1, b"x" * 1024)
    w.enqueue(msg)          # first use out of the way
    assert r.dequeue(timeout=5) == msg
    assert _python_calls(lambda: w.enqueue(msg)) == ["MessageQueue.enqueue",
                                                     "QueueWriter.enqueue"]
    got = []
    assert _python_calls(lambda: got.append(r.dequeue(timeout=5))) == [
        "MessageQueue.dequeue", "LocalReader.dequeue"]
    assert got == [msg]


class _Custom:
    pass


def _reduce_custom(obj):
    return str, ("reduced",)


def test_a_reducer_registered_after_the_first_message_is_used():
    w, (r,) = local_pair(max_chunk_bytes=1 << 16, max_chunks=4)
    w.enqueue("first")
    assert r.dequeue(timeout=5) == "first"
    copyreg.pickle(_Custom, _reduce_custom)
    try:
        w.enqueue(_Custom())
        assert r.dequeue(timeout=5) == "reduced"
    finally:
        copyreg.dispatch_table.pop(_Custom, None)


class _Unpicklable:
    def __reduce__(self):
        raise ValueError("not this one")


def test_a_failed_pickling_sends_nothing_and_the_next_message_is_intact():
    w, (r,) = local_pair(max_chunk_bytes=1 << 16, max_chunks=4)
    shared = ["shared"]
    published = w._ring.n_published
    with pytest.raises(ValueError, match="not this one"):
        w.enqueue([shared, "x" * 100, _Unpicklable()])
    assert w._ring.n_published == published
    # A memo left from the failed dump would make this refer to it.
    w.enqueue([shared, shared])
    got = r.dequeue(timeout=5)
    assert got == [["shared"], ["shared"]] and got[0] is got[1]
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.05)


def _boom():
    raise ValueError("unpickling failed")


class _FailsToLoad:
    def __reduce__(self):
        return _boom, ()


@pytest.mark.parametrize("pad", [0, 200_000])   # a small stream and a large one
def test_an_unpickling_error_marks_the_chunk_read(pad):
    w, (r,) = local_pair(max_chunk_bytes=1 << 20, max_chunks=2)
    w.enqueue(["x" * pad, _FailsToLoad()])
    with pytest.raises(ValueError, match="unpickling failed"):
        r.dequeue(timeout=5)
    for i in range(4):       # more than the ring holds: every chunk came back
        w.enqueue(i, timeout=5)
        assert r.dequeue(timeout=5) == i


@pytest.mark.parametrize("chunk", [1 << 16, 1 << 22])   # overflow, ring
def test_enqueue_keeps_no_reference_to_the_message(chunk):
    w, (r,) = local_pair(max_chunk_bytes=chunk, max_chunks=2,
                         enable_shm_tensor_arena=False)
    a = np.arange(1 << 18, dtype=np.float64)     # 2 MiB: out of band
    ref = weakref.ref(a)
    w.enqueue(a, timeout=5)
    del a
    gc.collect()
    assert ref() is None
    got = r.dequeue(timeout=5)
    assert np.array_equal(got, np.arange(1 << 18, dtype=np.float64))
    stats = w.stats()
    assert (stats["overflow_messages"], stats["ring_messages"]) == (
        (1, 0) if chunk == 1 << 16 else (0, 1))


def test_ring_statuses_of_the_one_call_path(parts_as_if_waiting, monkeypatch):
    w, (r,) = local_pair(max_chunk_bytes=4096, max_chunks=2, enable_shm_tensor_arena=False)
    ring, enc = w._ring, w._end.encoder
    # A stale pickler is refused before anything is pickled or sent.
    assert not enc.sink.stale()
    table = {}
    enc.sink.expect(table, False, sys.modules)
    table[_Custom] = _reduce_custom                  # as if a reducer was registered
    assert enc.sink.stale()
    assert ring.send_object("x", enc.pickler, enc.sink, 1) == -PICKLER_STALE
    assert ring.n_published == 0
    enc.refresh()
    assert not enc.sink.stale()
    # Too big for a chunk: 0, nothing sent, the frames stay in the sink.
    assert ring.send_object("y" * 8000, enc.pickler, enc.sink, 1) == 0
    assert ring.n_published == 0
    stream, *oob = enc.sink.frames()
    assert pickle.loads(stream) == "y" * 8000 and oob == []
    enc.sink.clear()
    with pytest.raises(RuntimeError, match="no pickled message"):
        ring.send_pickled(enc.sink, 1)
    # The reader's side: a wait status, a message in parts (two, in the two
    # free chunks, as if the reader waited), and an overflow mark (the
    # reader not waiting).
    rring = r._ring
    with pytest.raises(TimeoutError):
        rring.read_object(0.01)
    w.enqueue("z" * 8000)
    assert rring.read_object(5) is PENDING and rring.pending == PARTS
    assert r.dequeue(timeout=5) == "z" * 8000
    monkeypatch.undo()
    w.enqueue("v" * 20000)
    assert rring.read_object(5) is PENDING and rring.pending == OVERFLOW
    assert r.dequeue(timeout=5) == "v" * 20000


def _resident_bytes(address: int) -> int:
    """Rss of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_sink_backs_its_pages_ahead_of_the_pickler():
    # A large stream's pages are populated a stretch (1 MiB) at a time ahead
    # of the frames copied in, in one call each, not faulted one by one by
    # the copies: the buffer is resident past what was written.
    sink = PickleSink()

    def resident() -> int:
        address = np.frombuffer(sink, dtype=np.uint8).ctypes.data
        return _resident_bytes(address)

    sink.write(b"a" * (300 << 10))          # into a fresh 512 KiB mapping
    assert sink.cap == 512 << 10 and sink.touched == sink.cap
    assert resident() >= 512 << 10
    sink.write(b"b" * (500 << 10))          # grown in place to 1 MiB
    assert sink.cap == 1 << 20 and sink.touched == sink.cap and resident() >= 1 << 20
    for _ in range(4):                      # 2.8 MiB in all: a 4 MiB mapping
        sink.write(bytearray(b"c" * (512 << 10)))
    n = sink.nbytes
    assert sink.cap == 4 << 20 and n < sink.touched <= min(sink.cap, n + (1 << 20))
    assert resident() >= sink.touched - 4096
    assert bytes(memoryview(sink)[(300 << 10) - 1:(300 << 10) + 1]) == b"ab"
    sink.clear()
    # A pickled stream in such a buffer reads back intact; after a small
    # message the large buffer goes and a small one takes its place.
    p = pickle.Pickler(sink, protocol=5, buffer_callback=sink.on_buffer)
    sink.expect(copyreg.dispatch_table, False, sys.modules)
    many = [f"{i:08d}" * 100 for i in range(3800)]    # about 3 MiB in 64 KiB frames
    stream, = sink.dump(p, many)
    assert pickle.loads(stream) == many and sink.touched >= sink.nbytes
    sink.dump(p, ("small", 1))
    sink.dump(p, ("small", 2))
    assert sink.cap == sink.touched == 4096
    stream, = sink.dump(p, many)
    assert pickle.loads(stream) == many and sink.touched >= sink.nbytes


def test_the_sink_shrinks_after_a_huge_stream():
    sink = PickleSink()
    p = pickle.Pickler(sink, protocol=5, buffer_callback=sink.on_buffer)
    sink.expect(copyreg.dispatch_table, False, sys.modules)
    big = "b" * (3 << 20)                 # a str: always in band (kept by reference)
    stream, = sink.dump(p, big)
    assert pickle.loads(stream) == big and sink.nbytes == len(stream)
    many = [f"{i:08d}" * 100 for i in range(5000)]    # 4 MiB through the buffer
    for _ in range(2):                    # back to back: the buffer is kept
        stream, = sink.dump(p, many)
        assert pickle.loads(stream) == many and sink.cap >= 4 << 20
    stream, = sink.dump(p, ("small", 1))  # started after a big one: still kept
    assert pickle.loads(stream) == ("small", 1) and sink.cap >= 4 << 20
    sink.dump(p, ("small", 2))            # started after a small one: shrunk
    assert sink.cap == 4096
    # Out-of-band: a large buffer travels beside the stream, a small one in it.
    stream, *oob = sink.dump(p, [pickle.PickleBuffer(b"s" * 10),
                                 pickle.PickleBuffer(bytearray(2 << 20))])
    assert len(oob) == 1 and memoryview(oob[0]).nbytes == 2 << 20
    got = pickle.loads(stream, buffers=oob)
    assert bytes(got[0]) == b"s" * 10 and len(got[1]) == 2 << 20
