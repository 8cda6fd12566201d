"""A reader's buffers for large frames (remote, in parts, copied out of a
chunk): memory a dropped tensor gave back is reused for the next frame, and
never while the caller can still see it."""
from __future__ import annotations

import ctypes
import gc
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from fastmq import MessageQueue, _wire
from fastmq._recv_buffers import BufferPool, copy_streaming
from fastmq.shm_usage import resident_bytes

from _queues import local_pair

MiB = 1 << 20


def _addr(buf) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_a_buffer_has_exactly_the_length_asked_and_is_writable():
    pool = BufferPool(64 * MiB)
    b = pool.take(3 * MiB + 5)
    assert len(b) == 3 * MiB + 5
    mv = memoryview(b)
    assert (mv.nbytes, mv.readonly) == (3 * MiB + 5, False)
    mv[-1] = 7
    assert mv[-1] == 7


def test_fresh_memory_split_over_threads_is_populated_whole():
    # A large fresh block is populated before the frame is received into
    # it, split over threads (the kernel's work per fresh page is most of
    # a first large frame's cost, and a core is free while the reader
    # waits): every page is resident when take() returns, and so are the
    # new pages of a block grown for a larger frame.
    with pytest.raises(ValueError, match="threads must be >= 1"):
        BufferPool(64 * MiB, 0)
    pool = BufferPool(64 * MiB, 2)
    b = pool.take(16 * MiB)
    assert resident_bytes(_addr(b), 16 * MiB) == 16 * MiB
    memoryview(b)[:] = b"\x05" * (16 * MiB)
    del b
    grown = pool.take(24 * MiB)             # the 16 MiB block, grown
    assert pool.grown == 1 and resident_bytes(_addr(grown), 24 * MiB) == 24 * MiB
    assert bytes(memoryview(grown)[16 * MiB - 1:16 * MiB + 1]) == b"\x05\x00"


def test_memory_comes_back_only_when_the_last_view_is_gone():
    pool = BufferPool(64 * MiB)
    b = pool.take(4 * MiB)
    addr = _addr(b)
    t = torch.frombuffer(b, dtype=torch.uint8)
    t.fill_(1)
    del b
    gc.collect()
    assert pool.held_bytes == 0          # the tensor still sees it
    other = pool.take(4 * MiB)
    assert _addr(other) != addr
    memoryview(other)[:] = b"\x02" * (4 * MiB)
    assert int(t.sum()) == 4 * MiB       # untouched by the new frame
    del t
    gc.collect()
    assert pool.held_bytes == 4 * MiB
    again = pool.take(4 * MiB - 100)     # about the same size: reused
    assert _addr(again) == addr and pool.reused == 1 and pool.held_bytes == 0


def test_the_pool_keeps_no_more_than_its_cap():
    pool = BufferPool(8 * MiB)
    big = pool.take(16 * MiB)
    del big                              # larger than the whole cap
    assert pool.held_bytes == 0
    blocks = [pool.take(4 * MiB) for _ in range(3)]
    del blocks
    assert pool.held_bytes == 8 * MiB    # two of the three kept
    small = pool.take(1 * MiB)           # a 4 MiB block is too big to lend for it
    assert pool.reused == 0
    del small
    pool.close()
    assert pool.held_bytes == 0
    after = pool.take(2 * MiB)
    del after                            # a closed pool keeps nothing
    assert pool.held_bytes == 0


def test_a_frame_larger_than_every_kept_block_grows_the_largest_one():
    pool = BufferPool(64 * MiB)
    small, larger = pool.take(2 * MiB), pool.take(4 * MiB)
    memoryview(larger)[:4] = b"kept"
    del small, larger
    assert pool.held_bytes == 6 * MiB
    big = pool.take(16 * MiB)
    assert len(big) == 16 * MiB and pool.grown == 1 and pool.reused == 0
    # The 4 MiB block is in it (its pages, not fresh zeros); the 2 MiB one stays kept.
    assert bytes(memoryview(big)[:4]) == b"kept"
    assert pool.held_bytes == 2 * MiB
    memoryview(big)[16 * MiB - 1] = 9
    del big
    assert pool.held_bytes == 18 * MiB
    again = pool.take(16 * MiB)          # kept at its new size
    assert pool.reused == 1 and pool.grown == 1 and memoryview(again)[16 * MiB - 1] == 9


def test_a_frame_larger_than_the_cap_does_not_take_a_kept_block():
    pool = BufferPool(8 * MiB)
    kept = pool.take(4 * MiB)
    del kept
    big = pool.take(16 * MiB)            # goes back to the kernel once dropped
    assert pool.grown == 0 and pool.held_bytes == 4 * MiB
    del big
    again = pool.take(4 * MiB)           # the kept block is still there
    assert pool.reused == 1 and pool.held_bytes == 0


def test_a_streaming_copy_is_byte_exact_at_any_alignment():
    # Heads before the first 64-byte line of the target, whole lines,
    # tails; and nothing outside the target is written.
    rng = np.random.default_rng(5)
    for n in (0, 1, 63, 64, 65, 200, 4096 + 17, (1 << 20) + 5):
        src = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for off in (0, 1, 31, 63):
            out = bytearray(n + off + 70)
            copy_streaming(memoryview(out)[off:off + n], src)
            assert bytes(out[off:off + n]) == src
            assert out[:off] == bytes(off) and out[off + n:] == bytes(70)


def test_a_streaming_copy_names_a_length_mismatch():
    with pytest.raises(ValueError, match="target holds 3 bytes, the source 2"):
        copy_streaming(bytearray(3), b"ab")
    with pytest.raises((TypeError, BufferError, ValueError)):
        copy_streaming(b"abc", b"abc")     # read-only target


@pytest.mark.parametrize("length", [0, -1])
def test_a_bad_length_is_refused(length):
    with pytest.raises(ValueError, match="length"):
        BufferPool(MiB).take(length)


def _remote_pair(**kw):
    w, (r,) = local_pair(0, n_remote=1, **kw)
    return w, r


def _tensor(i: int) -> torch.Tensor:
    return torch.full((3 * MiB // 8,), i, dtype=torch.int64)


def _send_while_reading(w, r, t):
    """``t`` through the queue, read while the writer sends (a large one is
    more than the sockets hold at once); what the reader got."""
    got = []
    th = threading.Thread(target=lambda: got.append(r.dequeue(timeout=30)))
    th.start()
    w.enqueue(t, timeout=30)
    th.join(30)
    return got[0]


def test_a_remote_reader_reuses_dropped_frames_and_keeps_live_ones_intact():
    w, r = _remote_pair()
    try:
        kept = []
        for i in range(4):               # the caller holds every tensor
            w.enqueue(_tensor(i))
            kept.append(r.dequeue(timeout=10))
        assert r.remote_socket.buffers.reused == 0
        for i, t in enumerate(kept):
            assert torch.equal(t, _tensor(i))
        del kept, t
        gc.collect()
        for i in range(4, 8):            # dropped at once: the memory goes round
            w.enqueue(_tensor(i))
            got = r.dequeue(timeout=10)
            assert torch.equal(got, _tensor(i))
            del got
        assert r.remote_socket.buffers.reused >= 3
    finally:
        r.shutdown()
        w.shutdown()


def test_a_remote_reader_grows_a_dropped_frame_for_a_larger_message():
    w, r = _remote_pair()
    try:
        w.enqueue(_tensor(1))
        got = r.dequeue(timeout=10)
        assert torch.equal(got, _tensor(1))
        del got
        gc.collect()
        larger = torch.arange(4 * MiB, dtype=torch.int64)      # 32 MiB
        assert torch.equal(_send_while_reading(w, r, larger), larger)
        assert r.remote_socket.buffers.grown == 1
    finally:
        r.shutdown()
        w.shutdown()


def test_a_mac_reader_takes_a_landing_buffer_only_for_frames_larger_than_the_caches():
    # Under the default MAC a frame below STREAMING_STORE_BYTES is received
    # straight into place: the reader holds no 1 MiB landing buffer for it.
    from fastmq._stream import STREAMING_STORE_BYTES
    w, r = _remote_pair()
    try:
        stream = r.remote_socket
        for n in (6 * MiB, STREAMING_STORE_BYTES + MiB):
            t = torch.arange(n // 8, dtype=torch.int64)
            assert torch.equal(_send_while_reading(w, r, t), t)
            assert (stream._landing is not None) == (n >= STREAMING_STORE_BYTES), n
    finally:
        r.shutdown()
        w.shutdown()


def test_a_remote_reader_has_memory_ready_for_its_first_large_frame(monkeypatch):
    # FASTMQ_WARM_MB of receive memory is populated while the reader
    # connects (wait_until_ready), not when the first large frame comes:
    # that frame is received into it.
    monkeypatch.setenv("FASTMQ_WARM_MB", "8")
    w, r = _remote_pair()
    try:
        pool = r.remote_socket.buffers
        assert (pool.held_bytes, pool.reused) == (8 * MiB, 0)
        t = torch.full((8 * MiB // 8,), 3, dtype=torch.int64)
        got = _send_while_reading(w, r, t)
        assert torch.equal(got, t)
        assert (pool.reused, pool.held_bytes) == (1, 0)
        assert resident_bytes(got.data_ptr(), 8 * MiB) == 8 * MiB
    finally:
        r.shutdown()
        w.shutdown()
    for value, held in (("0", 0), ("1024", 0)):      # none; more than the pool keeps
        monkeypatch.setenv("FASTMQ_WARM_MB", value)
        monkeypatch.setenv("FASTMQ_REMOTE_BUFFERS_MB", "64")
        w, r = _remote_pair()
        try:
            assert r.remote_socket.buffers.held_bytes == held
        finally:
            r.shutdown()
            w.shutdown()


def test_keeping_no_buffers_is_a_setting(monkeypatch):
    monkeypatch.setenv("FASTMQ_REMOTE_BUFFERS_MB", "0")
    w, r = _remote_pair()
    try:
        for i in range(3):
            w.enqueue(np.full(MiB, i, dtype=np.uint8))
            assert int(r.dequeue(timeout=10)[0]) == i
        assert r.remote_socket.buffers.reused == 0
        assert r.remote_socket.buffers.held_bytes == 0
        # The writer's process keeps none either from now on.
        w.enqueue([bytes(1000)] * 3000)
        assert r.dequeue(timeout=10) == [bytes(1000)] * 3000
        assert w._end.encoder.pool.held_bytes == 0
    finally:
        r.shutdown()
        w.shutdown()


def test_a_bad_setting_is_named(monkeypatch):
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    monkeypatch.setenv("FASTMQ_REMOTE_BUFFERS_MB", "lots")
    try:
        with pytest.raises(ValueError, match="FASTMQ_REMOTE_BUFFERS_MB"):
            MessageQueue.create_from_handle(w.export_handle(), 0)
        monkeypatch.delenv("FASTMQ_REMOTE_BUFFERS_MB")
        monkeypatch.setenv("FASTMQ_WARM_MB", "-3")
        with pytest.raises(ValueError, match="FASTMQ_WARM_MB"):
            MessageQueue.create_from_handle(w.export_handle(), 0)
        monkeypatch.setenv("FASTMQ_REMOTE_BUFFERS_MB", "lots")
        # A writer keeps such memory too (large streams it sends).
        with pytest.raises(ValueError, match="FASTMQ_REMOTE_BUFFERS_MB"):
            MessageQueue(1, 0, connect_ip="127.0.0.1")
    finally:
        w.shutdown()


def test_a_writer_sends_large_in_band_streams_from_reused_memory():
    # Remote readers: a large in-band stream is gathered into memory that
    # the last one gave back once it was sent, not into fresh pages.
    w, r = _remote_pair()
    try:
        pool = w._end.encoder.pool
        before = pool.reused
        for i in range(4):
            msg = [bytes([i]) * 1000 + str(k).encode() for k in range(3000)]
            w.enqueue(msg)
            assert r.dequeue(timeout=10) == msg
        assert pool.reused - before >= 3
    finally:
        r.shutdown()
        w.shutdown()


def test_a_large_stream_is_sent_from_the_memory_it_was_pickled_into(monkeypatch):
    # A large stream with no large payload in it (a long list) used to be
    # copied out of the sink's buffer into pooled memory for the socket.
    # Now the sink's buffer itself is the frame (handed over, not lent),
    # and the next message takes a block the pool kept back as its buffer.
    from fastmq import _pools

    # The process's pool, fresh for this test: no block of an earlier one.
    monkeypatch.setattr(_pools, "_streams", BufferPool(64 * MiB))
    w, (r,) = local_pair(max_chunk_bytes=1 * MiB, max_chunks=4, enable_shm_tensor_arena=False)
    ring, enc = w._ring, w._end.encoder
    sink = enc.sink

    def pickled(tag: int) -> tuple:
        # The message left in the sink (too big for a chunk), and where
        # the sink's buffer holding it is.
        obj = [bytes([tag]) * 1000 + str(k).encode() for k in range(4000)]
        assert ring.send_object(obj, enc.pickler, sink, 1) == 0
        with memoryview(sink) as mv:
            at = np.frombuffer(mv, dtype=np.uint8).ctypes.data
        return obj, at

    try:
        obj1, at1 = pickled(1)
        first, *oob = sink.frames(enc.pool)
        assert not oob and _addr(first) == at1 and pickle.loads(first) == obj1
        assert sink.cap < MiB   # the buffer went with the frame
        with pytest.raises(RuntimeError, match="no pickled message"):
            sink.frames(enc.pool)
        sink.clear()
        # The first frame is still held (a slow socket, a traceback): the
        # next message is pickled elsewhere and leaves it as it was.
        obj2, at2 = pickled(2)
        second, = sink.frames(enc.pool)
        sink.clear()
        assert at2 != at1 and pickle.loads(second) == obj2 and pickle.loads(first) == obj1
        # Both dropped: the next message is pickled into one of them.
        del first, second
        obj3, at3 = pickled(3)
        third, = sink.frames(enc.pool)
        sink.clear()
        assert at3 in (at1, at2) and _addr(third) == at3 and pickle.loads(third) == obj3
        del third
        w.enqueue(("after", 1), timeout=5)
        assert r.dequeue(timeout=5) == ("after", 1)
    finally:
        r.shutdown()
        w.shutdown()


def test_a_new_queue_sends_from_memory_an_earlier_queue_of_the_process_gave_back():
    # Writers keep the memory they send large messages from once per
    # process, not per queue: a queue made after another was dropped (or
    # beside it) starts from what that one gave back, as a malloc'd buffer
    # would for vLLM's writer, instead of faulting in fresh pages.
    import resource

    from fastmq import _pools
    from fastmq._serde import Encoder
    from fastmq._sink import PickleSink

    msg = [bytes(1000) + k.to_bytes(24, "little") for k in range(8000)]      # 8 MiB
    first = Encoder()
    assert first.pool is _pools.streams() and Encoder().pool is first.pool
    first.encode(msg)       # its frames dropped at once: the memory goes back
    del first
    second = Encoder()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    frames = second.encode(msg)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < len(frames[0]) // 4096 // 4, faults      # fresh: about one a page
    del frames
    # A sink dropped with a large buffer gives it to its pool too.
    pool = BufferPool(64 * MiB)
    sink = PickleSink(pool=pool)
    sink.dump(pickle.Pickler(sink, protocol=5), msg)
    del sink
    assert pool.held_bytes >= 8 * MiB


def test_an_encrypting_writer_seals_segments_into_blocks_that_go_round():
    # "encrypt": each 1 MiB segment's ciphertext used to be a fresh bytes
    # (fresh pages on every message); now a few pooled blocks go round,
    # the first message included, and the readers still get every byte.
    w, r = _remote_pair(remote_security="encrypt")
    try:
        pool = w._end.fanout._ciphertexts
        before = pool.reused
        for i in range(4):
            w.enqueue(_tensor(i))           # 3 MiB: three sealed segments
            assert torch.equal(r.dequeue(timeout=10), _tensor(i))
        assert pool.reused - before >= 8
        assert pool.held_bytes <= _wire.CIPHER_POOL_BYTES
    finally:
        r.shutdown()
        w.shutdown()


def test_an_encrypting_writer_holds_the_fastest_reader_near_the_slowest():
    # Two readers, one slow: the batches between them are ciphertext the
    # writer keeps.  The fastest used to run a whole message ahead, so each
    # message's ciphertext was fresh memory (a block per segment, more than
    # the pool keeps); now it stays within the lead and the blocks go round.
    w, rs = local_pair(0, n_remote=2, remote_security="encrypt")
    size, n_msgs = 24 * MiB, 4
    got: dict = {0: [], 1: []}
    errors: list = []

    def read(rank: int, pause: float) -> None:
        try:
            for _ in range(n_msgs):
                time.sleep(pause)
                t = rs[rank].dequeue(timeout=30)
                got[rank].append(int(t[0]))
                del t
        except BaseException as e:   # (seen by the test below)
            errors.append(e)

    threads = [threading.Thread(target=read, args=(0, 0.0)),
               threading.Thread(target=read, args=(1, 0.2))]
    try:
        pool = w._end.fanout._ciphertexts
        before = pool.reused
        for t in threads:
            t.start()
        for i in range(n_msgs):
            w.enqueue(torch.full((size // 8,), i, dtype=torch.int64), timeout=30)
        for t in threads:
            t.join(30)
        assert not errors and got == {0: list(range(n_msgs)), 1: list(range(n_msgs))}
        segments = n_msgs * size // _wire.SEGMENT_BYTES
        fresh = segments - (pool.reused - before)
        assert fresh <= 2 * _wire.CIPHER_LEAD_BATCHES + 2, (fresh, segments)
        assert pool.held_bytes <= _wire.CIPHER_POOL_BYTES
    finally:
        for t in threads:
            t.join(30)
        for r in rs:
            r.shutdown()
        w.shutdown()


def test_a_local_reader_copies_large_buffers_out_of_a_chunk_into_reused_memory():
    # A message that fits a chunk: its out-of-band buffers of 1 MiB and more
    # are copied into the reader's pool, reused once dropped, never while held.
    w, (r,) = local_pair(max_chunk_bytes=8 * MiB, max_chunks=4, enable_shm_tensor_arena=False)
    pool = r._end._part_buffers
    held = []
    for i in range(3):
        w.enqueue(_tensor(i), timeout=10)
        held.append(r.dequeue(timeout=10))
    assert pool.reused == 0 and w.stats()["ring_messages"] == 3
    addrs = {t.data_ptr() for t in held}
    assert len(addrs) == 3
    for i, t in enumerate(held):
        assert torch.equal(t, _tensor(i))
    del held, t
    gc.collect()
    for i in range(3, 6):
        w.enqueue(_tensor(i), timeout=10)
        got = r.dequeue(timeout=10)
        assert torch.equal(got, _tensor(i))
        del got
    assert pool.reused >= 3
    small = np.arange(1000)             # below 1 MiB: its own bytearray, as before
    w.enqueue(small, timeout=10)
    assert np.array_equal(r.dequeue(timeout=10), small) and pool.reused >= 3
