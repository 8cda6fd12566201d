"""The processes of tests/test_lifetime.py (spawned; module level so that
the spawn start method finds them).  Each reports over ``conn`` when it
has reached the moment at which the test kills it, then waits."""
from __future__ import annotations

import time

RING = dict(max_chunk_bytes=32 << 20, max_chunks=4)
TENSOR_BYTES = 16 << 20
PREFAULTED = 64 << 20


def _wait_forever():
    while True:     # until the test kills us
        time.sleep(60)


def writer(conn, n_reader: int, moment: str):
    """Create a queue for ``n_reader`` local readers and send its handle;
    then, by ``moment``:

    * ``handshake``: wait for readers that never subscribe;
    * ``message``: fill the ring and block in an ``enqueue()`` of a message
      too large for a chunk (its payload on the overflow socket);
    * ``arena``: send a tensor through the arena and wait.
    """
    from fastmq import MessageQueue, ReaderGoneError

    if moment == "arena":
        import torch
    # One arena slot pre-faulted at creation: memory a leak could not hide.
    mq = MessageQueue(n_reader, n_reader, enable_shm_tensor_arena=True, arena_slots=2,
                      arena_slot_mb=PREFAULTED >> 20, arena_prefault=1, **RING)
    while not mq.tensor_arena.core.prefault_idle():
        time.sleep(0.01)
    conn.send(mq.export_handle())
    if moment == "handshake":
        conn.send("waiting")
        mq.wait_until_ready()       # the readers never subscribe
        _wait_forever()
    mq.wait_until_ready()
    if moment == "message":
        for i in range(RING["max_chunks"]):
            mq.enqueue(i)
        conn.send("waiting")
        try:
            mq.enqueue(b"x" * (RING["max_chunk_bytes"] + 1))   # no reader reads: blocks
        except ReaderGoneError as e:
            # The readers were killed and the writer noticed: it must live
            # on, holding the queue, for the test to see who holds what.
            if e.how != "died":
                raise
    else:
        mq.enqueue(torch.full((TENSOR_BYTES,), 7, dtype=torch.uint8))
        conn.send("waiting")
    _wait_forever()


def reader(conn, handle, rank: int, moment: str):
    """Reader ``rank``: at ``handshake``, attach and never subscribe; at
    ``message``, subscribe and never read; at ``arena``, hold the tensor
    it received (a view of the arena), and on request (after the writer is
    gone) say what it still reads there."""
    from fastmq import MessageQueue, ReaderGoneError

    mq = MessageQueue.create_from_handle(handle, rank)
    if moment == "handshake":
        conn.send("waiting")
        _wait_forever()
    mq.wait_until_ready()
    if moment == "message":
        conn.send("waiting")
        _wait_forever()
    t = mq.dequeue(timeout=60)
    conn.send("waiting")
    conn.recv()
    conn.send(int(t.sum()))
    _wait_forever()
