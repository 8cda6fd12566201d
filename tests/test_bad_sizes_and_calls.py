"""Sizes too large to map, a timeout that is not a number, a writer with
no reader, a remote reader asked for a message before its handshake: each
raises with a message that says what was wrong (or, where vLLM's queue
accepts the call, does what vLLM's does), and the queue, if made, stays
usable."""
from __future__ import annotations

import math
import threading

import pytest

from fastmq import MessageQueue

from _queues import local_pair


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
    w.enqueue("still fine", timeout=10)
    assert r.dequeue(timeout=10) == "still fine"
    r.shutdown()
    w.shutdown()


def test_a_nan_timeout_is_refused_rather_than_never_ending():
    w, (r,) = local_pair(1, max_chunk_bytes=4096, max_chunks=2)
    try:
        with pytest.raises(ValueError, match="timeout=nan"):
            r.dequeue(timeout=math.nan)
        with pytest.raises(ValueError, match="timeout=nan"):
            w.enqueue("x", timeout=math.nan)
        w.enqueue("after", timeout=10)
        assert r.dequeue(timeout=10) == "after"
    finally:
        r.shutdown()
        w.shutdown()


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
        w.enqueue("hello", timeout=10)
        assert r.dequeue(timeout=10) == "hello"
    finally:
        r.shutdown()
        w.shutdown()
