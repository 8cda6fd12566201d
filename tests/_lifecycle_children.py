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


# -- the lifecycle stress test -------------------------------------------------

def stress_message(seq: int, size: int) -> dict:
    return {"seq": seq, "body": bytes([seq % 251]) * size}


def stress_writer(conn, plan, sizes, seed):
    """The writer of one stress round.  ``plan``: ``normal`` (send every
    message, then None, then exit), ``signal`` (a signal handler calls
    shutdown() at a random moment), ``kill`` (SIGKILL itself right after
    a random enqueue() returned).  Reports (messages returned, error)."""
    import random

    from fastmq import MessageQueue

    rng = random.Random(seed)
    mq = MessageQueue(2, 2, max_chunk_bytes=64 * 1024, max_chunks=4,
                      enable_shm_tensor_arena=False)
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    kill_after = rng.randrange(len(sizes)) if plan == "kill" else -1
    if plan == "signal":
        signal.signal(signal.SIGALRM, lambda *_: mq.shutdown())
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.01, 0.3))
    returned, error = 0, None
    try:
        for seq, size in enumerate(sizes):
            mq.enqueue(stress_message(seq, size))
            returned += 1
            conn.send(("returned", returned))
            if seq == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        if plan == "normal":
            mq.enqueue(None)
    except RuntimeError as e:
        error = str(e)
    conn.send(("done", returned, error))


def stress_reader(handle, rank, plan, leave_at, conn):
    """A reader of one stress round.  ``plan``: ``all`` (read to the end),
    ``fork`` (fork a helper that drops everything it inherited and exits,
    then read to the end), ``raise`` (the worker raises after ``leave_at``
    messages), ``kill`` (SIGKILL itself after ``leave_at`` messages).
    Reports (seqs read, how it ended) unless killed."""
    import gc

    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    conn.send(("pid", os.getpid()))
    got, end = [], None
    while True:
        if plan in ("raise", "kill") and len(got) == leave_at:
            conn.send((got, plan))
            if plan == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("the worker failed")
        if plan == "fork" and len(got) == leave_at:
            pid = os.fork()
            if pid == 0:
                try:
                    mq = None
                    gc.collect()
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        try:
            msg = mq.dequeue(timeout=60)
        except RuntimeError as e:
            end = str(e)
            break
        if msg is None:
            end = "end"
            break
        assert msg["body"] == bytes([msg["seq"] % 251]) * len(msg["body"])
        got.append(msg["seq"])
    conn.send((got, end))
