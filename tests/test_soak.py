"""Soak: mixed traffic to 4 reader processes with random pauses, bounded by
message count; every reader checks every message by content."""
from __future__ import annotations

import queue as pyqueue

import pytest

from fastmq import MessageQueue

import _fault_children as children

N_MESSAGES = 240


def test_soak_mixed_traffic_four_readers(procs, spawn_ctx):
    # Four readers on this node: ring, parts or overflow socket and a small tensor
    # arena (buffers from 128 KiB, 4 slots of 2 MiB: often all taken).
    writer = MessageQueue(4, 4, max_chunks=4, max_chunk_bytes=children.SOAK_CHUNK,
                          enable_shm_tensor_arena=True, arena_slots=4, arena_slot_mb=2,
                          arena_min_mb=0.125)
    results = spawn_ctx.Queue()
    for rank in range(4):
        procs.start(children.soak_reader, writer.export_handle(), rank, N_MESSAGES,
                    1000 + rank, results)
    writer.wait_until_ready()
    for seq in range(N_MESSAGES):
        writer.enqueue(children.soak_message(seq), timeout=60)
    got = {}
    for _ in range(4):
        try:
            rank, pid, bad = results.get(timeout=120)
        except pyqueue.Empty:
            pytest.fail(f"only readers {sorted(got)} finished")
        got[rank] = bad
    procs.join_all(timeout=30)
    assert got == {r: [] for r in range(4)}, "readers got wrong messages (seq numbers)"
    stats = writer.stats()
    # Every path carried traffic.
    assert stats["ring_messages"] > 0
    assert stats["parts_messages"] + stats["overflow_messages"] > 0
    assert stats["arena_hits"] > 0
