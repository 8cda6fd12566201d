"""Child-process bodies for test_ls: a writer and readers held at known
positions, each waiting on its pipe for the next instruction."""
from __future__ import annotations

import numpy as np

CHUNK = 64 << 10
CHUNKS = 4
ARRAY_BYTES = 1 << 20     # out of band (>= 1 MiB) and >= arena_min_mb: an arena slot


def message(i: int):
    if i == 2:
        return {"i": i, "array": np.full(ARRAY_BYTES // 8, i, dtype=np.int64)}
    return {"i": i}


def writer_main(conn, n_reader: int, n_msgs: int):
    from fastmq import MessageQueue

    mq = MessageQueue(n_reader, n_reader, max_chunk_bytes=CHUNK, max_chunks=CHUNKS,
                      wait_mode="futex", enable_shm_tensor_arena=True, arena_slots=2,
                      arena_slot_mb=2, arena_min_mb=1)
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    for i in range(n_msgs):
        mq.enqueue(message(i))
    conn.send("sent")
    conn.recv()                 # held here until told to exit (or killed)


def reader_main(conn, handle, rank: int, k: int):
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    for i in range(k):
        got = mq.dequeue(timeout=60)
        assert got["i"] == i, (rank, i, got)
        del got                 # releases an arena slot at once
    conn.send(("read", k))
    if conn.recv() == "park":
        # Nothing more comes: spins for spin_us, then parks on the futex.
        try:
            mq.dequeue(timeout=300)
        except RuntimeError:
            pass                # the writer died or shut down
