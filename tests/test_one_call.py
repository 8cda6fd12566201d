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


def test_ring_statuses_of_the_one_call_path():
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
    # The reader's side: a wait status, a message in parts (two fit the two
    # free chunks), and an overflow mark (five parts would not).
    rring = r._ring
    with pytest.raises(TimeoutError):
        rring.read_object(0.01)
    w.enqueue("z" * 8000)
    assert rring.read_object(5) is PENDING and rring.pending == PARTS
    assert r.dequeue(timeout=5) == "z" * 8000
    w.enqueue("v" * 20000)
    assert rring.read_object(5) is PENDING and rring.pending == OVERFLOW
    assert r.dequeue(timeout=5) == "v" * 20000


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
    assert sink.cap == 1 << 20
    # Out-of-band: a large buffer travels beside the stream, a small one in it.
    stream, *oob = sink.dump(p, [pickle.PickleBuffer(b"s" * 10),
                                 pickle.PickleBuffer(bytearray(2 << 20))])
    assert len(oob) == 1 and memoryview(oob[0]).nbytes == 2 << 20
    got = pickle.loads(stream, buffers=oob)
    assert bytes(got[0]) == b"s" * 10 and len(got[1]) == 2 << 20
