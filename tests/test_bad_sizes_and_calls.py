"""Sizes too large to map, a timeout that is not a number, a writer with
no reader, a remote reader asked for a message before its handshake: each
raises with a message that says what was wrong (or, where vLLM's queue
accepts the call, does what vLLM's does), and the queue, if made, stays
usable."""
from __future__ import annotations

import math
import threading
import time

import pytest

from fastmq import MessageQueue

from _queues import assert_delivers, fanout_and_stream, local_pair, shut


@pytest.mark.parametrize("kw, what", [
    (dict(max_chunk_bytes=2 ** 62, max_chunks=4, enable_shm_tensor_arena=False), "a ring of 4"),
    (dict(arena_slot_mb=1 << 40, arena_slots=16), "an arena of 16"),
])
def test_sizes_whose_product_overflows_are_refused_at_construction(kw, what):
    # In C the product wrapped: the ring came out one page long (every
    # enqueue then failed), the arena one header long (its pre-fault
    # thread wrote past the end: a segfault).
    with pytest.raises(ValueError, match=f"{what} .* is larger than a process can map"):
        MessageQueue(1, 1, **kw)
    w, (r,) = local_pair(1, max_chunk_bytes=4096, max_chunks=2)
    try:
        assert_delivers(w, [r])
    finally:
        shut(r, w)


def test_a_nan_timeout_is_refused_rather_than_never_ending():
    w, (r,) = local_pair(1, max_chunk_bytes=4096, max_chunks=2)
    try:
        with pytest.raises(ValueError, match="timeout=nan"):
            r.dequeue(timeout=math.nan)
        with pytest.raises(ValueError, match="timeout=nan"):
            w.enqueue("x", timeout=math.nan)
        assert_delivers(w, [r])
    finally:
        shut(r, w)


def test_a_writer_with_no_reader_sends_to_nobody():
    # A group of one rank: vLLM's queue takes the call and does nothing.
    w = MessageQueue(0, 0)
    try:
        w.wait_until_ready()
        w.enqueue({"step": 1})
        assert w.broadcast_object("x") == "x"
    finally:
        w.shutdown()


def test_a_remote_reader_asked_before_its_handshake_gets_no_message_and_stays_usable():
    # As vLLM's queue: no message (TimeoutError) within a timeout; without
    # one, which would never end, a RuntimeError that says why.  The stream
    # is left alone: reading the writer's challenge as a message broke it.
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    r = MessageQueue.create_from_handle(w.export_handle(), -1)
    try:
        with pytest.raises(TimeoutError, match="has not returned"):
            r.dequeue(timeout=0.2)
        with pytest.raises(RuntimeError, match="call it first"):
            r.dequeue()
        t = threading.Thread(target=w.wait_until_ready)
        t.start()
        r.wait_until_ready()
        t.join(10)
        assert not t.is_alive()
        assert_delivers(w, [r])
    finally:
        shut(r, w)


def test_local_reader_ranks_listing_a_rank_twice_are_refused():
    # A slot no reader can take: the writer's handshake waited for it for
    # ever.
    with pytest.raises(ValueError, match=r"local_reader_ranks \[0, 0\] lists a rank twice"):
        MessageQueue(2, 2, [0, 0])


def test_a_second_wait_until_ready_on_the_writer_returns_at_once():
    # (vLLM's writer waits for subscriptions that never come again.)
    w, rs = local_pair(1, 1, max_chunk_bytes=4096, max_chunks=2)
    t = threading.Thread(target=w.wait_until_ready, daemon=True)
    try:
        t.start()
        t.join(5)
        assert not t.is_alive(), "the second wait_until_ready() did not return"
        assert_delivers(w, rs)
    finally:
        shut(*rs, w)
        t.join(5)


def test_a_connect_ip_that_does_not_resolve_is_named():
    with pytest.raises(OSError, match="connect_ip='no-such-host.invalid'"):
        MessageQueue(1, 0, connect_ip="no-such-host.invalid")


@pytest.mark.parametrize("var, value", [
    ("FASTMQ_SPIN_US", "inf"),
    ("FASTMQ_SPIN_US", "1e30"),
    ("FASTMQ_WARM_MB", "99999999999999999999"),
    ("FASTMQ_REMOTE_BUFFERS_MB", "99999999999999999999"),
    ("FASTMQ_MAX_CHUNKS", "99999999999999999999"),
    ("FASTMQ_ARENA_SLOTS", "99999999999999999999"),
    ("FASTMQ_ARENA_SLOT_MB", "1e300"),
    ("VLLM_RINGBUFFER_WARNING_INTERVAL", "inf"),
])
def test_a_huge_setting_is_refused_naming_its_variable(monkeypatch, var, value):
    # Each went through to a C integer as an OverflowError that named
    # nothing (or, for a spin or a warning interval, a float conversion).
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        w, rs = local_pair(1, 1, max_chunk_bytes=4096, max_chunks=2)
        shut(*rs, w)


def test_an_infinite_spin_is_refused_naming_the_keyword():
    with pytest.raises(ValueError, match="spin_us must be a number of microseconds"):
        MessageQueue(1, 1, spin_us=math.inf)


@pytest.mark.parametrize("frame_bytes", [1, 0])
@pytest.mark.parametrize("security", ["none", "mac", "encrypt"])
def test_a_small_message_of_very_many_frames_fits_what_a_remote_reader_takes(security,
                                                                             frame_bytes):
    # A message of few bytes goes whole, and a reader takes a whole one
    # into its inbox at once: with 32000 frames its header alone is
    # 256 KiB, so the writer sent what the reader refused as malformed.
    # The writer now sends it in segments (of empty frames: none, the
    # header alone); the reader takes every frame.
    from fastmq import _wire

    fan, stream = fanout_and_stream(security)
    try:
        frames = [bytes([i % 251]) * frame_bytes for i in range(32000)]
        _wire.check_limits(frames)
        m = _wire.Outgoing(fan.seal, 1, 1, frames)
        wire = b"".join(bytes(p) for k in range(m.n_batches) for p in m.batch(k))
        sock = fan.readers[0].sock
        sock.setblocking(True)
        sender = threading.Thread(target=sock.sendall, args=(wire,))
        sender.start()
        got = stream.recv(time.monotonic() + 30)
        sender.join(10)
        assert [bytes(f) for f in got] == frames
    finally:
        stream.close()
        fan.close()
