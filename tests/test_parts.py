"""A message too big for a ring chunk, with node-local readers only, goes
through the ring in parts (fastmq._parts): boundaries, a reader's timeout
between parts, a writer's, a writer stopped or killed between parts, the
arena slots of a message that never completed, and parts that lie."""
from __future__ import annotations

import os
import signal
import struct
import threading
import time

import numpy as np
import pytest
import torch

from _parts_children import big_message, partial_writer_main
from _queues import background_readings, local_pair, shut
from fastmq import MessageQueue
from fastmq._parts import PART_BYTES, PART_BYTES_MAX, PARTS_MIN
from fastmq._ring import PART_HEAD_BYTES, CorruptChunkError

CHUNK = 1 << 16                      # 64 KiB chunks: a 1 MiB message is 17 parts
PAYLOAD = CHUNK - PART_HEAD_BYTES


def _equal(got, want):
    assert got.keys() == want.keys()
    assert got["seed"] == want["seed"] and got["inband"] == want["inband"]
    assert np.array_equal(got["a"], want["a"]) and np.array_equal(got["b"], want["b"])


def _stream_length(n_bytes_inband: int) -> int:
    # One in-band bytes object: the part stream is the head (1 buffer) plus
    # the pickle stream, whose length is measured, not guessed.
    import pickle
    return 16 + len(pickle.dumps(b"x" * n_bytes_inband, protocol=5))


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_stream_lengths_at_part_boundaries(extra, parts_as_if_waiting):
    # An in-band size whose part stream is exactly 5 parts, then one byte
    # either side: the last part full, one byte, or one byte short.
    n = 5 * PAYLOAD - _stream_length(0)
    while _stream_length(n) > 5 * PAYLOAD:
        n -= 1
    while _stream_length(n) < 5 * PAYLOAD:
        n += 1
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=8, enable_shm_tensor_arena=False)
    msg = bytes(range(256)) * ((n + extra) // 256) + b"\x07" * ((n + extra) % 256)
    # The parts fit the free ring, so enqueue() returns before the reader reads.
    w.enqueue(msg, timeout=5)
    assert r.dequeue(timeout=5) == msg
    st = w.stats()
    assert (st["parts_messages"], st["overflow_messages"]) == (1, 0)
    assert st["parts_bytes"] == _stream_length(len(msg))


def test_buffers_of_many_sizes_to_two_readers_in_order(parts_as_if_waiting):
    w, rs = local_pair(2, max_chunk_bytes=CHUNK, max_chunks=40, enable_shm_tensor_arena=False)
    msgs = [[np.full(k * 1000 + 1, i, dtype=np.int64) for k in range(1, 30, 7)]
            + [torch.arange(300_000 + i, dtype=torch.int32)] for i in range(4)]
    for m in msgs:
        w.enqueue(m, timeout=5)
        for r in rs:
            g = r.dequeue(timeout=5)
            assert all(np.array_equal(a, b) for a, b in zip(m[:-1], g[:-1]))
            assert torch.equal(m[-1], g[-1])
    assert (w.stats()["parts_messages"], w.stats()["overflow_messages"]) == (len(msgs), 0)


def test_a_large_message_to_a_reader_not_waiting_takes_the_socket():
    # Parts go only to readers waiting for them, so the writer never waits
    # for a reader and never takes more than one chunk per message: with
    # the reader not reading, a message too big for a chunk goes over the
    # overflow socket (its mark in one chunk), in order, as in vLLM.
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=3, enable_shm_tensor_arena=False)
    three = b"\x03" * (2 * PAYLOAD + 1000)     # 3 parts: would fill the free ring
    w.enqueue(three, timeout=5)
    w.enqueue(("small", 1), timeout=5)
    w.enqueue(three, timeout=5)                 # the third chunk: vLLM's run-ahead
    assert r.dequeue(timeout=5) == three
    assert r.dequeue(timeout=5) == ("small", 1)
    assert r.dequeue(timeout=5) == three
    st = w.stats()
    assert (st["parts_messages"], st["overflow_messages"], st["ring_messages"]) == (0, 2, 1)


def test_a_larger_message_streams_through_the_ring_to_waiting_readers():
    # Two readers waiting in dequeue(): a message of 20 parts goes through a
    # 4-chunk ring in parts, the writer taking each chunk as both readers
    # release it.  Not waiting, the same message takes the socket.
    w, rs = local_pair(2, max_chunk_bytes=CHUNK, max_chunks=4, enable_shm_tensor_arena=False)
    ring = w._end.ring
    assert not ring.readers_waiting()
    msg = big_message(3, 20 * PAYLOAD)
    got = {}

    def read(rank):
        got[rank] = rs[rank].dequeue(timeout=30)

    ts = [threading.Thread(target=read, args=(k,)) for k in (0, 1)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 10
    while not ring.readers_waiting():
        assert time.monotonic() < deadline, "the readers never showed as waiting"
        time.sleep(0.001)
    w.enqueue(msg, timeout=30)
    for t in ts:
        t.join(30)
    for rank in (0, 1):
        _equal(got[rank], msg)
    st = w.stats()
    assert (st["parts_messages"], st["overflow_messages"]) == (1, 0)
    assert not ring.readers_waiting()
    w.enqueue(msg, timeout=30)                  # nobody waiting: the socket
    for r in rs:
        _equal(r.dequeue(timeout=30), msg)
    assert w.stats()["overflow_messages"] == 1


def test_a_large_message_that_fits_a_chunk_goes_in_equal_parts(parts_as_if_waiting):
    # 24 MiB chunks: a 12 MiB tensor fits one, but from PARTS_MIN up it goes
    # in parts (the reader copies one out while the writer copies the next
    # in), cut in equal parts of at most PART_BYTES; a small message after
    # it still takes one chunk.
    w, (r,) = local_pair(max_chunk_bytes=24 << 20, max_chunks=8,
                         enable_shm_tensor_arena=False)
    msg = torch.arange(3 << 20, dtype=torch.int32)      # 12 MiB, out of band
    w.enqueue(msg, timeout=10)
    w.enqueue(("small", 2), timeout=10)
    assert torch.equal(r.dequeue(timeout=10), msg)
    assert r.dequeue(timeout=10) == ("small", 2)
    st = w.stats()
    assert (st["parts_messages"], st["ring_messages"], st["overflow_messages"]) == (1, 1, 0)
    assert 12 << 20 < st["parts_bytes"] < (12 << 20) + 4096
    ring = w._end.ring
    assert ring.parts_min == PARTS_MIN
    # Four parts of the same size (the last no sliver): the stream is just
    # over 12 MiB, so four of at most PART_BYTES each.
    assert ring.n_published == 5


def test_a_large_stream_without_large_buffers_goes_whole(parts_as_if_waiting):
    # A 12 MiB list of small objects has no buffer of its own to copy out
    # while the writer copies the next part in: in parts the reader would
    # only gather the stream before unpickling it, so it goes in one chunk,
    # which the reader unpickles in place; a 12 MiB bytes (kept by
    # reference, its own buffer at the reader) still goes in parts.
    w, (r,) = local_pair(max_chunk_bytes=24 << 20, max_chunks=8,
                         enable_shm_tensor_arena=False)
    items = [bytes([i % 251]) * 1024 for i in range(12 << 10)]
    blob = b"".join(items)
    w.enqueue(items, timeout=10)
    w.enqueue(blob, timeout=10)
    assert r.dequeue(timeout=10) == items
    assert r.dequeue(timeout=10) == blob
    st = w.stats()
    assert (st["parts_messages"], st["ring_messages"], st["overflow_messages"]) == (1, 1, 0)
    assert 12 << 20 < st["parts_bytes"] < (12 << 20) + 4096


def test_a_ring_holds_the_pages_its_messages_wrote_and_one_of_bookkeeping():
    # vLLM's ring holds one page of metadata and, in each chunk, the pages
    # its largest message there wrote; so does fastmq's (the reader slots
    # and chunk flags share the header's page, and a chunk is reserved to
    # the page, not in larger steps), but each chunk's first page is taken
    # with the ring: a fresh queue's first messages take none on their way.
    w, (r,) = local_pair(max_chunk_bytes=1 << 20, max_chunks=4,
                         enable_shm_tensor_arena=False)
    seg = w.buffer.segment
    assert seg.held_bytes() == 4096 * (1 + 4)
    sizes = [100_000, 300_001, 5000, 200_000]
    for n in sizes:
        w.enqueue(b"x" * n, timeout=10)
        assert r.dequeue(timeout=10) == b"x" * n
    st = w.stats()
    assert st["ring_messages"] == len(sizes), st   # whole, each in a chunk of its own
    # Each chunk: its message's pickle (a few bytes of framing around it),
    # rounded up to a page.
    want = 4096 + sum(-(-(n + 64) // 4096) * 4096 for n in sizes)
    assert want - 4096 * len(sizes) <= seg.held_bytes() <= want


def test_a_ring_reads_no_memory_file_while_sizes_creep_up():
    # Pages are reserved one by one as messages grow, each step asked of
    # the memory check; with plenty of room the check answers from the
    # reading kept in the background (fastmq._memory), so no message reads
    # /proc or a cgroup file.  (It used to read once per 64 KiB of growth
    # in each chunk, on the message's path.)
    from fastmq._memory import memory_readings
    w, (r,) = local_pair(max_chunk_bytes=1 << 20, max_chunks=4,
                         enable_shm_tensor_arena=False)
    before = memory_readings()["on_the_spot"]
    sizes = range(1000, 300_000, 700)       # 428 messages, 107 to each chunk
    for n in sizes:
        w.enqueue(b"y" * n, timeout=10)
        assert len(r.dequeue(timeout=10)) == n
    assert memory_readings()["on_the_spot"] == before
    assert w.buffer.segment.held_bytes() <= 4096 + 4 * (300_100 + 4096)
    shut(w, r)


def test_cut_makes_equal_parts_with_the_head_in_the_first():
    from fastmq._parts import cut
    from fastmq._sink import KIND_BUFFER
    stream = [(b"s" * 100, 0, 100)]
    oob = [bytearray(4 * PAYLOAD)]
    parts, total = cut(stream, oob, [KIND_BUFFER], PAYLOAD)
    sizes = [sum(n for _, _, n in pieces) for pieces, _ in parts]
    assert len(parts) == 5 and sum(sizes) == total == 24 + 100 + 4 * PAYLOAD
    assert max(sizes) - min(sizes) <= 1
    assert [off for _, off in parts] == [sum(sizes[:i]) for i in range(5)]
    # A head longer than an equal share stays whole in part 0.
    many = [bytearray(1) for _ in range(40)]
    parts, total = cut([(b"s", 0, 1)], many, [KIND_BUFFER] * 40, 400)
    assert sum(n for _, _, n in parts[0][0]) >= 8 * 42


def test_small_parts_only_for_a_message_of_few_of_them():
    # Up to SMALL_PARTS_MAX parts of PART_BYTES; a larger message in parts
    # of PART_BYTES_MAX; fewer free chunks than parts: larger ones, or none.
    from fastmq._parts import SMALL_PARTS_MAX, cut_to_fit
    from fastmq._sink import KIND_BUFFER

    def sizes(mib, free):
        got = cut_to_fit([(b"s", 0, 1)], [bytearray(mib << 20)], [KIND_BUFFER],
                         24 << 20, free)
        return None if got is None else [sum(n for _, _, n in p) for p, _ in got[0]]

    assert max(sizes(16, None)) <= PART_BYTES and len(sizes(16, None)) == 5
    assert len(sizes(4 * SMALL_PARTS_MAX - 1, None)) == SMALL_PARTS_MAX
    big = sizes(64, None)
    assert len(big) == 9 and PART_BYTES < max(big) <= PART_BYTES_MAX
    assert len(sizes(16, 3)) == 3          # 5 small ones would not fit 3 chunks
    assert sizes(64, 3) is None            # nor 9 large ones


def test_parts_that_would_wait_for_a_busy_reader_go_in_one_chunk():
    # Three of four chunks unread and the reader not waiting: a 12 MiB
    # message that fits a chunk does not go in parts (they would wait for
    # the reader) but in the one free chunk, as a message under PARTS_MIN
    # would; a 30 MiB one, too big for a chunk, takes the socket.
    w, (r,) = local_pair(max_chunk_bytes=24 << 20, max_chunks=4,
                         enable_shm_tensor_arena=False)
    for i in range(3):
        w.enqueue(("small", i), timeout=10)
    msg = torch.arange(3 << 20, dtype=torch.int32)
    w.enqueue(msg, timeout=10)
    st = w.stats()
    assert (st["parts_messages"], st["ring_messages"]) == (0, 4)
    for i in range(3):
        assert r.dequeue(timeout=10) == ("small", i)
    w.enqueue(("small", 3), timeout=10)
    w.enqueue(("small", 4), timeout=10)          # 2 chunks unread, 2 free
    big = torch.arange(30 << 18, dtype=torch.int32)
    w.enqueue(big, timeout=10)
    assert torch.equal(r.dequeue(timeout=10), msg)
    assert r.dequeue(timeout=10) == ("small", 3)
    assert r.dequeue(timeout=10) == ("small", 4)
    assert torch.equal(r.dequeue(timeout=10), big)
    st = w.stats()
    assert (st["parts_messages"], st["overflow_messages"]) == (0, 1)


def test_parts_reserve_a_bounded_share_of_each_chunk():
    # 16 MiB chunks, the reader waiting: a 20 MiB message is five parts of
    # at most PART_BYTES through the four chunks, so the ring holds a part's
    # worth of each chunk for it (16 MiB), not four whole chunks.
    w, (r,) = local_pair(max_chunk_bytes=16 << 20, max_chunks=4,
                         enable_shm_tensor_arena=False)
    ring, got = w._end.ring, []
    before = w.buffer.segment.held_bytes()
    msg = np.arange(20 << 17, dtype=np.int64)          # 20 MiB, out of band
    t = threading.Thread(target=lambda: got.append(r.dequeue(timeout=30)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not ring.readers_waiting():
        assert time.monotonic() < deadline, "the reader never showed as waiting"
        time.sleep(0.001)
    w.enqueue(msg, timeout=30)
    t.join(30)
    assert len(got) == 1 and np.array_equal(got[0], msg)
    assert w.stats()["parts_messages"] == 1
    assert w.buffer.segment.held_bytes() - before <= 4 * (PART_BYTES + 4096)
    assert PART_BYTES_MAX < 16 << 20


class _FailingRing:
    """The writer's ring, failing the publish of part ``fail_at`` as a signal
    or memory running out would."""

    def __init__(self, ring, fail_at: int):
        self._ring, self._fail_at = ring, fail_at

    def send_part(self, pieces, index, total, offset):
        if index == self._fail_at:
            raise KeyboardInterrupt
        return self._ring.send_part(pieces, index, total, offset)

    def __getattr__(self, name):
        return getattr(self._ring, name)


def test_a_send_stopped_between_parts_is_dropped_by_every_reader(parts_as_if_waiting):
    w, rs = local_pair(2, max_chunk_bytes=CHUNK, max_chunks=32, enable_shm_tensor_arena=False)
    ring = w._end.ring
    w._end.ring = _FailingRing(ring, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        w.enqueue(big_message(1, 1 << 20), timeout=5)
    w._end.ring = ring
    w.enqueue("next", timeout=5)
    w.enqueue(big_message(2, 1 << 20), timeout=5)
    for r in rs:
        assert r.dequeue(timeout=5) == "next"
        _equal(r.dequeue(timeout=5), big_message(2, 1 << 20))
        assert r._end._parts is None
    assert w.stats()["parts_messages"] == 1


def test_arena_slots_of_a_message_that_never_completed_are_free_again(parts_as_if_waiting):
    # A tensor in the arena's only slot, beside in-band bytes that need parts;
    # the send stops between parts.  Its slot must not be left to readers who
    # will never see the message.
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=32, arena_slots=1,
                         arena_slot_mb=4, arena_min_mb=1)
    assert w.tensor_arena is not None
    ring = w._end.ring
    w._end.ring = _FailingRing(ring, fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        w.enqueue((torch.ones(1 << 19), b"\x01" * (1 << 20)), timeout=5)
    w._end.ring = ring
    assert w.stats()["arena_hits"] == 1
    msg = (torch.arange(1 << 19, dtype=torch.float32), b"\x02" * (1 << 20))
    w.enqueue(msg, timeout=5)
    got = r.dequeue(timeout=5)
    assert torch.equal(got[0], msg[0]) and got[1] == msg[1]
    assert r.tensor_arena.contains(got[0].data_ptr())
    st = w.stats()
    assert st["arena_hits"] == 2 and st["arena_fallback_exhausted"] == 0


@pytest.mark.parametrize("chunks", [8, 3], ids=["fits", "streams"])
def test_shutdown_from_a_signal_handler_between_parts(procs, chunks):
    """shutdown() in a signal handler between two parts: enqueue() either
    returns and the reader has the message, or raises and it has not."""
    import multiprocessing as mp

    import _lifecycle_children as lc

    w = MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=chunks,
                     enable_shm_tensor_arena=False)
    parent, child = mp.Pipe()
    procs.start(lc.reader_collect_until_closed, w.export_handle(), 0, child)
    w.wait_until_ready()
    w.enqueue(b"small")
    ring = w._end.ring
    deadline = time.monotonic() + 10
    while not ring.readers_waiting():           # the reader waits for more
        assert time.monotonic() < deadline
        time.sleep(0.01)

    def on_signal(signum, frame):
        w.shutdown()
        time.sleep(0.3)

    class _SignalAtPart1(_FailingRing):
        def send_part(self, pieces, index, total, offset):
            if index == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            return self._ring.send_part(pieces, index, total, offset)

    big = b"x" * (5 * PAYLOAD)                  # 6 parts
    old = signal.signal(signal.SIGUSR1, on_signal)
    w._end.ring = _SignalAtPart1(ring, -1)
    try:
        try:
            w.enqueue(big, timeout=10)
            returned = True
        except RuntimeError:
            returned = False
    finally:
        w._end.ring = ring
        signal.signal(signal.SIGUSR1, old)
    got = parent.recv()
    procs.join_all()
    assert got == ([b"small", big] if returned else [b"small"])
    # shutdown() cancels the waits: the next part's turn raises even when free.
    assert not returned
    assert w.stats()["parts_messages"] == (1 if returned else 0)


def _raw_part(w, kind=2, index=0, total=100, offset=0, length=100, payload=b""):
    with w.acquire_write(timeout=5) as buf:
        struct.pack_into("<B3xIQQQ", buf, 0, kind, index, total, offset, length)
        buf[PART_HEAD_BYTES:PART_HEAD_BYTES + len(payload)] = payload


def _head(*lens):
    return struct.pack(f"<{1 + len(lens)}Q", len(lens), *lens)


def _pickled_parts(obj):
    """``obj``'s part stream as the writer cuts it, in PAYLOAD slices."""
    import pickle
    stream = _head(len(p := pickle.dumps(obj, protocol=5))) + p
    return len(stream), [stream[i:i + PAYLOAD] for i in range(0, len(stream), PAYLOAD)]


def test_reader_timeout_between_parts_resumes():
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=8, enable_shm_tensor_arena=False)
    msg = b"\x09" * (3 * PAYLOAD)
    total, parts = _pickled_parts(msg)
    for i in (0, 1):
        _raw_part(w, index=i, total=total, offset=i * PAYLOAD, length=len(parts[i]),
                  payload=parts[i])
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.3)
    assert r._end._parts is not None and r._end._parts.next_index == 2
    for i in range(2, len(parts)):
        _raw_part(w, index=i, total=total, offset=i * PAYLOAD, length=len(parts[i]),
                  payload=parts[i])
    assert r.dequeue(timeout=5) == msg
    w.enqueue("after", timeout=5)
    assert r.dequeue(timeout=5) == "after"


@pytest.mark.parametrize("deadline", [True, False], ids=["timeout", "no-deadline"])
def test_writer_killed_between_parts(procs, spawn_ctx, deadline):
    q = spawn_ctx.Queue()
    p = procs.start(partial_writer_main, q, CHUNK)
    r = MessageQueue.create_from_handle(q.get(timeout=60), 0)
    r.wait_until_ready()
    try:
        assert q.get(timeout=60) == "part 0 out"
        if deadline:
            with pytest.raises(TimeoutError):
                r.dequeue(timeout=0.3)
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            with pytest.raises(RuntimeError, match="died"):
                r.dequeue(timeout=10)
        else:
            # Unpickled as it comes (test_piecewise): the reader waits in
            # the middle of the message when the writer is killed.
            from test_piecewise import _blocking

            threading.Timer(0.3, os.kill, (p.pid, signal.SIGKILL)).start()
            with pytest.raises(RuntimeError, match="died"):
                _blocking(r)
            p.join(10)
    finally:
        r.shutdown()


@pytest.mark.parametrize("part", [
    dict(length=CHUNK),                                        # past the chunk
    dict(total=50, length=100),                                # past its stream
    dict(index=1, offset=0),                                   # no part 0 before it
    dict(length=4, payload=b"\x01\x00\x00\x00"),               # no room for a head
    dict(total=1 << 40, length=16, payload=_head(1 << 59)[:16]),   # absurd count
    dict(total=40, length=40, payload=_head(10, 10) + b"\x00" * 16),   # wrong sum
    dict(total=40, length=40, payload=_head(4, 3 << 62 | 12) + b"\x00" * 16),  # kind
    dict(total=40, length=40, payload=_head(1 << 62 | 4, 12) + b"\x00" * 16),  # stream kind
], ids=["chunk", "stream", "orphan", "short-head", "count", "sum", "kind", "stream-kind"])
def test_parts_that_lie_raise_and_the_queue_stays_usable(part):
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=4, enable_shm_tensor_arena=False)
    _raw_part(w, **part)
    with pytest.raises(CorruptChunkError):
        r.dequeue(timeout=5)
    w.enqueue(("after", 1), timeout=5)
    assert r.dequeue(timeout=5) == ("after", 1)
    assert r._end._parts is None


def test_a_message_larger_than_the_host_is_refused_before_any_allocation():
    # A well-formed first part of a 1 TiB message: refused at once (no page
    # populated), its other parts passed over; a chunk that is not its next
    # part is named as corrupt, and the queue goes on.
    w, (r,) = local_pair(max_chunk_bytes=CHUNK, max_chunks=4, enable_shm_tensor_arena=False)
    total = 1 << 40
    _raw_part(w, total=total, length=PAYLOAD, payload=_head(total - 16))
    _raw_part(w, index=1, total=total, offset=PAYLOAD, length=PAYLOAD)
    w.enqueue("not a part", timeout=5)
    with pytest.raises(MemoryError, match="more than this host has"):
        r.dequeue(timeout=5)
    with pytest.raises(CorruptChunkError, match="expected the next part"):
        r.dequeue(timeout=5)
    w.enqueue(("after", 1), timeout=5)
    assert r.dequeue(timeout=5) == ("after", 1)
    assert r._end._parts is None


def test_large_in_band_bytes_reach_the_reader_as_their_own_objects(parts_as_if_waiting):
    # A large bytes or bytearray pickled in band leaves the pickle stream
    # for the parts (fastmq._sink): the reader gets objects of the same
    # type and content, a repeated one once, next to out-of-band arrays in
    # their order; a message that fits a chunk after all keeps it in band.
    w, (r,) = local_pair(max_chunk_bytes=8 << 20, max_chunks=8, enable_shm_tensor_arena=False)
    big = bytes(range(256)) * (12 << 12)                  # 12 MiB
    ba = bytearray(b"\x5a" * (3 << 20) + b"end")
    arr = np.arange(1 << 18, dtype=np.int64)              # 2 MiB out of band
    msg = ("x", big, ba, arr, big, b"small", [ba])
    w.enqueue(msg, timeout=10)
    got = r.dequeue(timeout=10)
    assert got[0] == "x" and got[5] == b"small"
    assert type(got[1]) is bytes and got[1] == big and got[4] is got[1]
    assert type(got[2]) is bytearray and got[2] == ba and got[6][0] is got[2]
    assert np.array_equal(got[3], arr)
    got[2][0] = 0                                         # its own, writable memory
    assert ba[0] == 0x5a
    fits = (b"\x01" * (2 << 20), bytearray(b"\x02" * (1 << 20)))
    w.enqueue(fits, timeout=10)
    assert r.dequeue(timeout=10) == fits
    st = w.stats()
    assert (st["parts_messages"], st["ring_messages"], st["overflow_messages"]) == (1, 1, 0)


def test_the_sink_keeps_large_in_band_payloads_by_reference():
    import pickle

    from fastmq._parts import cut
    from fastmq._sink import KIND_BUFFER, KIND_BYTEARRAY, KIND_BYTES

    w, (r,) = local_pair(max_chunk_bytes=1 << 20, max_chunks=4, enable_shm_tensor_arena=False)
    ring, enc = w._ring, w._end.encoder
    sink = enc.sink
    big, ba, text = b"\x07" * (2 << 20), bytearray(3 << 20), "t" * (2 << 20)
    arr = np.ones(4 << 20, dtype=np.uint8)
    obj = [big, arr, ba, text]
    # Too big for a chunk: the message stays in the sink, nothing copied.
    assert ring.send_object(obj, enc.pickler, sink, 1) == 0
    # frames(): the stream gathered as pickle writes it, out-of-band after.
    stream, oob = sink.frames()
    assert sink.nbytes == len(stream)
    got = pickle.loads(stream, buffers=[oob])
    assert got[0] == big and np.array_equal(got[1], arr) and got[2:] == [ba, text]
    # stream(): bytes and bytearray leave the stream, in the order the
    # unpickler takes its buffers, as the caller's own objects; a str (no
    # such opcode) stays in it, also by reference.
    pieces, oob, kinds = sink.stream()
    assert oob[0] is big and oob[2] is ba and memoryview(oob[1]).nbytes == 4 << 20
    assert kinds == [KIND_BYTES, KIND_BUFFER, KIND_BYTEARRAY]
    assert [n for buf, _, n in pieces if buf is not sink and n > 1] == [len(text)]
    main = b"".join(bytes(memoryview(buf)[a:a + n]) for buf, a, n in pieces)
    got = pickle.loads(main, buffers=oob)
    assert got[0] is big and got[2] is ba and got[3] == text
    parts, total = cut(pieces, oob, kinds, 1 << 20)
    assert total == 8 * (1 + 4) + len(main) + sum(memoryview(o).nbytes for o in oob)
    # A bytearray that changed size since it was pickled is named, not sent.
    ba.extend(b"more")
    with pytest.raises(BufferError, match="changed size"):
        sink.frames()
    sink.clear()
    w.enqueue(("after", 1), timeout=5)
    assert r.dequeue(timeout=5) == ("after", 1)


def test_a_large_stream_grows_in_the_sink_without_faulting_its_pages_twice():
    # A pickle stream of 16 MiB (a list of small bytes: nothing leaves the
    # stream) is written into a buffer that doubles.  Grown through the
    # heap, each doubling was a fresh block and a copy: with glibc's mmap
    # threshold raised (as freeing any large block does), the stream's
    # first pickling faulted about twice its pages.  It is a mapping that
    # grows in place now: about one fault per page, once.
    import pickle
    import resource

    w, (r,) = local_pair(max_chunk_bytes=1 << 20, max_chunks=4, enable_shm_tensor_arena=False)
    ring, enc = w._ring, w._end.encoder
    item = bytes(range(256)) * 4
    obj = [item[:1000] + i.to_bytes(24, "little") for i in range(16 << 10)]   # ~16 MiB
    big = bytearray(24 << 20)
    del big   # glibc now serves up to 24 MiB from its heap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert ring.send_object(obj, enc.pickler, enc.sink, 1) == 0   # too big: left in the sink
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = enc.sink.nbytes // 4096
    assert pages >= 4000 and faults < 1.25 * pages, (faults, pages)
    stream, *oob = enc.sink.frames()
    assert not oob and pickle.loads(stream) == obj
    enc.sink.clear()
    w.enqueue(("after", 1), timeout=5)
    assert r.dequeue(timeout=5) == ("after", 1)


def test_a_step_with_a_large_in_band_payload_faults_no_fresh_page_once_warm():
    # A message that fits a chunk but holds a payload the sink kept by
    # reference (1 MiB bytes: vLLM-sized step data) is put in one piece
    # (flatten) before its copy into the chunk.  That is done in the sink's
    # own buffer: a fresh mapping per message faulted its pages every time
    # (fastmq-bench's step round trip at 1 MiB, N=1: 406 -> 927 us).
    import resource

    w, (r,) = local_pair(max_chunk_bytes=4 << 20, max_chunks=2, enable_shm_tensor_arena=False)
    payload = bytes(range(256)) * (4 << 10)                 # 1 MiB: kept as a span

    def step(i):
        w.enqueue(("step", i, payload), timeout=10)
        got = r.dequeue(timeout=10)
        assert got[:2] == ("step", i) and got[2] == payload

    for i in range(4):                                       # every chunk and buffer warm
        step(i)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(4, 12):
        step(i)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # A fresh sink buffer per message: 8 x 257 faults.  (The reader's
    # result, a 1 MiB bytes each time, comes from the heap that the earlier
    # ones gave back once glibc raised its mmap threshold: none.)
    assert faults < 8 * 256 // 2, faults
    assert w.stats()["ring_messages"] == 12


def test_a_reader_without_a_deadline_refuses_parts_larger_than_the_host_has(monkeypatch):
    # A reader waiting without a deadline (vLLM's workers) unpickles a
    # message of one pickle stream straight out of its parts; asked first
    # whether the host has the memory, as an assembled one is, it refuses
    # with a MemoryError rather than populating what was claimed (the OOM
    # killer's business), and the next message still arrives.
    from fastmq import _parts
    w, (r,) = local_pair(max_chunk_bytes=1 << 20, max_chunks=4,
                         enable_shm_tensor_arena=False)
    big = list(range(1_000_000))                 # about 5 MB of pickle, no buffers
    # The reader's check finds 1 MiB (the writer's, in this process too, is
    # left as it is).
    monkeypatch.setattr(_parts, "memory_room", lambda need: 1 << 20)
    sender = threading.Thread(target=lambda: (w.enqueue(big, timeout=30),
                                              w.enqueue("next", timeout=30)))
    sender.start()
    try:
        with pytest.raises(MemoryError, match="more than this host has available"):
            r.dequeue()
        monkeypatch.undo()
        assert r.dequeue() == "next"
    finally:
        sender.join(30)
        r.shutdown()
        w.shutdown()


@pytest.mark.parametrize("room, short", [(64 << 30, False), (40 << 20, True)])
def test_a_run_of_large_messages_reads_memory_files_only_when_memory_is_short(
        monkeypatch, room, short):
    # Each message in parts asks whether the host has its memory.  A read
    # of /proc and the cgroup files costs as much as copying a megabyte:
    # with plenty of room the reading kept in the background answers (each
    # message taken off it); with little, every message reads afresh.
    # (It used to read on the first message and then twice a second.)
    from fastmq import _memory
    monkeypatch.setattr(_memory, "memory_available", lambda: room)
    w, (r,) = local_pair(max_chunk_bytes=1 << 20, max_chunks=4,
                         enable_shm_tensor_arena=False)
    big = bytes(6 << 20)
    # The room patched in shows in the reading kept in the background once
    # the next one is taken (within a second).
    assert background_readings(2), "no background reading of memory"
    before = _memory.memory_readings()["on_the_spot"]
    try:
        for i in range(5):
            # One at a time: each finds the ring free and goes in parts.
            sender = threading.Thread(target=w.enqueue, args=((i, big), 30))
            sender.start()
            got = r.dequeue(timeout=30)
            sender.join(30)
            assert got[0] == i and len(got[1]) == len(big)
    finally:
        r.shutdown()
        w.shutdown()
    assert w.stats()["parts_messages"] == 5
    read = _memory.memory_readings()["on_the_spot"] - before
    # Short: each of the 5 at the reader, and the writer's steps into
    # the chunks too (writer and reader share this process).
    assert read >= 5 if short else read == 0, read
