"""A large message that is its pickle stream alone (a long list of small
objects), read by a reader that waits without a deadline (vLLM's workers:
dequeue(indefinite=True)), is unpickled as it arrives (fastmq._piecewise):
straight from the ring's chunks (fastmq._parts.PartStream), or a remote
one a checked segment at a time (fastmq._stream.SegmentStream).  No buffer
of the message's size, every tag checked before its bytes are used, and
every way out of the middle of it leaves the queue where the next message
starts."""
from __future__ import annotations

import pickle
import platform
import struct
import threading

import pytest

from _parts_children import heap_reader_main
from _queues import local_pair
from fastmq import MessageQueue
from fastmq._ring import PART_HEAD_BYTES, CorruptChunkError
from test_parts import _FailingRing, _raw_part

CHUNK = 1 << 18
PAYLOAD = CHUNK - PART_HEAD_BYTES


def _items(seed: int, n: int = 20000) -> list:
    # About 2 MiB of pickle stream (more than the reader's pool starts at):
    # nine parts of a 256 KiB chunk.
    return [bytes([(seed + i) % 251]) * 100 for i in range(n)]


class _CountingPool:
    """The reader's pool of reassembly buffers, counting what is taken."""

    def __init__(self, pool):
        self._pool, self.taken = pool, []

    def take(self, n):
        self.taken.append(n)
        return self._pool.take(n)


def _blocking(r, limit: float = 30.0):
    """``r.dequeue(indefinite=True)`` (no deadline), in a thread so that a
    hang fails the test instead of stalling it (shutdown() frees it)."""
    out = {}

    def run():
        try:
            out["got"] = r.dequeue(indefinite=True)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        r.shutdown()
        t.join(10)
        raise AssertionError("dequeue() without a deadline did not return")
    if "error" in out:
        raise out["error"]
    return out["got"]


def _pickled_parts(obj):
    p = pickle.dumps(obj, protocol=5)
    stream = struct.pack("<2Q", 1, len(p)) + p
    return len(stream), [stream[i:i + PAYLOAD] for i in range(0, len(stream), PAYLOAD)]


def test_no_reassembly_buffer_without_a_deadline_and_one_with_it(parts_as_if_waiting):
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=32, enable_shm_tensor_arena=False)
    pool = r._end._part_buffers = _CountingPool(r._end._part_buffers)
    for seed in range(3):
        w.enqueue(_items(seed), timeout=5)       # in parts, in the free ring
        assert _blocking(r) == _items(seed)
    assert pool.taken == []
    # With a timeout the message is copied out first (a timeout in its
    # middle keeps what came): one buffer of the stream's size.
    w.enqueue(_items(7), timeout=5)
    assert r.dequeue(timeout=5) == _items(7)
    assert pool.taken == [len(pickle.dumps(_items(7), protocol=5))]
    assert w.stats()["parts_messages"] == 4
    w.enqueue("after", timeout=5)
    assert _blocking(r) == "after"


def test_streamed_to_two_readers_through_a_ring_smaller_than_the_message():
    # 4 chunks, a message of nine parts: the writer reuses each chunk as both
    # readers release it, which a streaming reader does part by part.
    w, rs = local_pair(2, max_chunk_bytes=CHUNK, max_chunks=4, enable_shm_tensor_arena=False)
    ring, got = w._end.ring, {}

    def read(k):
        got[k] = _blocking(rs[k])

    for seed in range(3):
        ts = [threading.Thread(target=read, args=(k,)) for k in (0, 1)]
        for t in ts:
            t.start()
        while not ring.readers_waiting():
            threading.Event().wait(0.001)
        w.enqueue(_items(seed), timeout=30)
        for t in ts:
            t.join(30)
        assert got == {0: _items(seed), 1: _items(seed)}
    st = w.stats()
    assert (st["parts_messages"], st["overflow_messages"]) == (3, 0)


class _Refused:
    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise LookupError("this object refuses to be unpickled")


class _Interrupts:
    def __reduce__(self):
        return (_interrupt, ())


def _interrupt():
    raise KeyboardInterrupt


def test_an_unpickling_error_in_the_middle_consumes_the_rest_of_the_message():
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=32, enable_shm_tensor_arena=False)
    bad = _items(1, 10000) + [_Refused()] + _items(2, 10000)
    w.enqueue(bad, timeout=5)
    w.enqueue(_items(3), timeout=5)
    with pytest.raises(LookupError, match="refuses"):
        _blocking(r)
    assert r._end._parts is None
    assert _blocking(r) == _items(3)


def test_a_send_stopped_between_parts_is_dropped_by_a_streaming_reader(parts_as_if_waiting):
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=32, enable_shm_tensor_arena=False)
    ring = w._end.ring
    w._end.ring = _FailingRing(ring, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        w.enqueue(_items(1), timeout=5)
    w._end.ring = ring
    w.enqueue("next", timeout=5)
    w.enqueue(_items(2), timeout=5)
    assert _blocking(r) == "next"                # the stopped message: dropped
    assert _blocking(r) == _items(2)
    assert r._end._parts is None


def test_an_interrupt_in_the_middle_drops_that_message_and_the_next_comes(
        parts_as_if_waiting):
    # The unpickler cannot resume: the interrupted message is lost to this
    # reader (it was being delivered when the caller stopped it), and the
    # next call passes over what remains of it.
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=32, enable_shm_tensor_arena=False)
    w.enqueue(_items(1, 3000) + [_Interrupts()] + _items(2, 17000), timeout=5)
    w.enqueue(_items(3), timeout=5)
    with pytest.raises(KeyboardInterrupt):
        _blocking(r)
    assert r._end._parts.skipping
    assert _blocking(r) == _items(3)
    assert r._end._parts is None


@pytest.mark.parametrize("lie", [dict(index=5), dict(offset=1), dict(total=1 << 30)],
                         ids=["index", "offset", "total"])
def test_a_part_that_does_not_follow_raises_and_the_queue_stays_usable(lie):
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=8, enable_shm_tensor_arena=False)
    total, parts = _pickled_parts(_items(4))
    _raw_part(w, index=0, total=total, offset=0, length=len(parts[0]), payload=parts[0])
    part1 = dict(index=1, total=total, offset=PAYLOAD, length=len(parts[1]), payload=parts[1])
    _raw_part(w, **{**part1, **lie})
    with pytest.raises(CorruptChunkError, match="does not follow"):
        _blocking(r)
    assert r._end._parts is None
    w.enqueue(("after", 1), timeout=5)
    assert _blocking(r) == ("after", 1)


def test_a_failed_wait_in_the_middle_passes_over_the_rest_on_the_next_call():
    # The writer stops between two parts; shutdown() ends the reader's wait
    # for the next one.  The message cannot be delivered any more: what
    # remains of it is passed over by a later call (here: none comes).
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=8, enable_shm_tensor_arena=False)
    total, parts = _pickled_parts(_items(5))
    for i in (0, 1):
        _raw_part(w, index=i, total=total, offset=i * PAYLOAD, length=len(parts[i]),
                  payload=parts[i])
    threading.Timer(0.3, r.shutdown).start()
    with pytest.raises(RuntimeError, match="cancelled"):
        _blocking(r)
    asm = r._end._parts
    assert asm.skipping and (asm.next_index, asm.received) == (2, 2 * PAYLOAD)


# -- remote readers --------------------------------------------------------------------


def _remote(security: str, relay=None):
    if relay is None:
        w, (r,) = local_pair(0, 1, remote_security=security)
        return w, r
    from test_remote_security import _through_middle
    return _through_middle(relay, security)


def _send(w, *msgs):
    def run():
        for m in msgs:
            try:
                w.enqueue(m, timeout=30)
            except RuntimeError:
                return   # the reader hung up (a forgery it refused)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("security", ["mac", "encrypt", "none"])
def test_a_remote_reader_without_a_deadline_unpickles_segment_by_segment(security):
    w, r = _remote(security)
    stream = r._end.stream
    pool = stream.buffers = _CountingPool(stream.buffers)
    big = _items(1, 40000)                      # about 4 MiB: four segments and a bit
    t = _send(w, big, big, "small", _items(2, 40000))
    assert _blocking(r) == big
    assert pool.taken == []
    # With a deadline it is received whole first (resumable after a timeout).
    assert r.dequeue(timeout=30) == big
    assert pool.taken == [len(pickle.dumps(big, protocol=5))]
    assert _blocking(r) == "small"
    assert _blocking(r) == _items(2, 40000)
    t.join(30)


def test_a_remote_unpickling_error_or_interrupt_in_the_middle_leaves_the_next_message():
    w, r = _remote("mac")
    t = _send(w, _items(1, 20000) + [_Refused()] + _items(2, 20000),
              _items(3, 20000) + [_Interrupts()] + _items(4, 20000), _items(5, 40000))
    with pytest.raises(LookupError, match="refuses"):
        _blocking(r)
    with pytest.raises(KeyboardInterrupt):
        _blocking(r)
    assert _blocking(r) == _items(5, 40000)
    t.join(30)


@pytest.mark.parametrize("security", ["mac", "encrypt"])
def test_a_changed_byte_in_a_later_segment_is_refused_and_the_stream_stays_refused(security):
    from fastmq._stream import StreamBroken

    seen = []

    def flip_past_2mib(data):
        # One byte changed once 2 MiB have gone by: the first segments
        # check, the unpickler takes them, and then a tag fails.
        before = sum(seen)
        seen.append(len(data))
        at = (2 << 20) + 100 - before
        if 0 <= at < len(data):
            data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
        return data

    w, r = _remote(security, flip_past_2mib)
    _send(w, _items(1, 40000), "after")
    with pytest.raises(CorruptChunkError, match="failed authentication"):
        _blocking(r)
    with pytest.raises(StreamBroken, match="failed a check earlier"):
        _blocking(r)


# -- the reader's heap -------------------------------------------------------------------
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
@pytest.mark.parametrize("path", ["chunk", "parts", "remote", "parts-deadline",
                                  "remote-deadline"])
def test_a_large_list_leaves_its_heap_to_the_next_one(path, procs, spawn_ctx):
    # With no buffer of the message's size coming and going, glibc would
    # hand the heap a 16 MiB list of small objects took back to the kernel
    # when the list is freed, and fault it in again for the next message
    # (a third of the round trip on 2 vCPUs). The reader has malloc keep it,
    # whichever way the list comes (with a deadline: reassembled in pooled
    # memory, which is not malloc's either).
    path, _, deadline = path.partition("-")
    kw = {"chunk": dict(enable_shm_tensor_arena=False),
          "parts": dict(max_chunk_bytes=4 << 20, max_chunks=8, enable_shm_tensor_arena=False),
          "remote": dict(connect_ip="127.0.0.1")}[path]
    w = MessageQueue(1, 0 if path == "remote" else 1, **kw)
    q = spawn_ctx.Queue()
    procs.start(heap_reader_main, q, w.export_handle(), 3, bool(deadline))
    w.wait_until_ready()
    items = [bytes([i % 251]) * 1024 for i in range(16 << 10)]
    try:
        for _ in range(3):
            w.enqueue(items, timeout=60)
        n, sizes = q.get(timeout=120)
    finally:
        w.shutdown()
    assert n == 16 << 20
    before, after = sizes[0], sizes[1:]
    assert all(s >= before + (12 << 20) for s in after), (
        f"the reader's heap went from {before} bytes to {after} after each list was freed")
