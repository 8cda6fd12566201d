"""Child-process bodies for test_ls: a writer and readers held at known
positions, each waiting on its pipe for the next instruction."""
from __future__ import annotations

import threading

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
    # A slot used on cold pages has the arena pre-fault the next ones in a
    # background thread; the test wants an idle queue: let it finish.
    for t in threading.enumerate():
        if t.name == "fastmq-arena-prefault":
            t.join(60)
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


def demo() -> str:
    """The ``fastmq ls`` output in docs/operations.md: the queue test_ls
    builds (readers that read 3, 1 and 0 of 3 messages; reader 0 then
    parked, reader 2 killed), listed alone so that other queues on the host
    stay out."""
    import multiprocessing as mp
    import time

    from fastmq.listing import format_text, list_queues

    ctx = mp.get_context("spawn")
    w_conn, w_child = ctx.Pipe()
    procs = [ctx.Process(target=writer_main, args=(w_child, 3, 3), daemon=True)]
    procs[0].start()
    try:
        handle = w_conn.recv()
        conns = []
        for rank, k in enumerate([3, 1, 0]):
            a, b = ctx.Pipe()
            procs.append(ctx.Process(target=reader_main, args=(b, handle, rank, k),
                                     daemon=True))
            procs[-1].start()
            conns.append(a)
        assert w_conn.recv() == "sent"
        for c in conns:
            c.recv()
        conns[0].send("park")
        ring = handle.buffer_handle[3].split(":")[0]     # the locator, less ":fd:inode"

        def ours():
            return [q for q in list_queues()["queues"] if q["name"] == ring][0]

        deadline = time.monotonic() + 30
        while ours()["parked_readers"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        procs[3].kill()
        procs[3].join(10)
        listing = list_queues()
        q = ours()
        listing.update(queues=[q], arenas=[], other=[])
        listing["memory"]["fastmq_held_bytes"] = q["held_bytes"] + q["arena"]["held_bytes"]
        return format_text(listing)
    finally:
        w_conn.send("exit")
        procs[0].join(30)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


if __name__ == "__main__":
    print("$ fastmq ls")
    print(demo())
