"""Child-process targets for the lifecycle tests (module level: spawnable)."""
from __future__ import annotations

import os
import signal
import sys
import time


def reader_then_raise(handle, rank, conn):
    """Attach, finish the handshake, then fail without reading: the worker
    raised, and its process ends with exit code 1."""
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    conn.send(os.getpid())
    conn.recv()                      # the writer has queued messages
    raise RuntimeError("the worker failed")


def reader_attach_and_wait(handle, rank, conn):
    """Attach and subscribe, then wait (to be SIGKILLed) without ever
    finishing the handshake."""
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    conn.send(os.getpid())
    time.sleep(600)
    del mq


def reader_collect(handle, rank, n, conn):
    """Attach, handshake, read ``n`` messages and send them back."""
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    conn.send([mq.dequeue(timeout=60) for _ in range(n)])


def reader_collect_until_closed(handle, rank, conn):
    """Attach, handshake, read until the queue is shut down; send back
    everything read."""
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    got = []
    while True:
        try:
            got.append(mq.dequeue(timeout=60))
        except RuntimeError:
            break
    conn.send(got)


def writer_killed_in_handshake(conn, remote):
    """Create a queue, hand its handle over, and once the reader has
    attached, die (SIGKILL) without finishing the handshake."""
    from fastmq import MessageQueue

    mq = (MessageQueue(1, 0, connect_ip="127.0.0.1") if remote else
          MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2))
    conn.send(mq.export_handle())
    conn.recv()
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


_kept = []


def create_queue_and_return(kind):
    """Create a queue (ring, ipc socket and arena) that stays referenced,
    as an engine's executor holds its queues, and return: in a
    multiprocessing fork child, the process then ends with os._exit; with
    ``kind == "raise"`` the target raises first."""
    from fastmq import MessageQueue

    _kept.append(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, arena_slots=2,
                              arena_slot_mb=16, arena_min_mb=1))
    if kind == "raise":
        raise RuntimeError("the engine failed while starting")


def create_queue_then_os_exit(conn):
    """Create a queue and leave through os._exit (no exit hook runs)."""
    from fastmq import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2,
                      enable_shm_tensor_arena=False)
    conn.send(mq.export_handle().buffer_handle.name)
    conn.recv()
    os._exit(0)


def claim_race(name, n_reader, chunk, chunks, rank, start_at, conn):
    """Claim reader ``rank`` of the ring ``name`` at ``start_at`` (a
    time.time() moment shared by all racers); report whether this process
    won.  Hold the claim until told to go."""
    from fastmq import _proc
    from fastmq.ring import ShmRingBuffer

    buf = ShmRingBuffer(n_reader, chunk, chunks, name)
    ring = buf.attach_reader(rank)
    me = _proc.me()
    while time.time() < start_at:
        pass
    conn.send(ring.claim_reader(*me) == 0)
    conn.recv()
    os._exit(0)


if __name__ == "__main__":   # pragma: no cover
    sys.exit("spawn targets only")
