"""Child-process targets for the fault, cleanup and soak tests (spawned;
every function is module level so that the spawn start method can find it)."""
from __future__ import annotations

import os
import random
import time


def _sleep_forever():
    while True:  # until the test kills us
        time.sleep(60)


def reader_stall(handle, rank, ready):
    """Attach as reader ``rank``, take part in the handshake, never read."""
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    ready.set()
    _sleep_forever()


def writer_stall(conn, n_reader, wait_mode, messages, overflow_mark_only=False):
    """Create a writer for ``n_reader`` local readers, send its handle over
    ``conn``, enqueue ``messages`` after the handshake, then stall.

    ``overflow_mark_only``: afterwards also publish an overflow mark whose
    payload is never sent (a writer that dies between the two)."""
    from fastmq import MessageQueue

    mq = MessageQueue(n_reader, n_reader, wait_mode=wait_mode, max_chunks=4,
                      max_chunk_bytes=1 << 16)
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    for m in messages:
        mq.enqueue(m)
    if overflow_mark_only:
        mq._ring.wait_next(None)
        mq._ring.send_overflow_mark(10**6)
    conn.send("sent")
    _sleep_forever()


def queue_owner(conn, wait_mode):
    """Create a queue (ring + ipc files) and stall: a process that will be
    killed and leave them behind."""
    from fastmq import MessageQueue

    mq = MessageQueue(1, 1, wait_mode=wait_mode, max_chunks=2, max_chunk_bytes=4096)
    conn.send(mq.export_handle())
    _sleep_forever()


# -- soak ---------------------------------------------------------------------
SOAK_CHUNK = 1 << 16


def soak_message(seq: int):
    """Message ``seq`` of the soak: deterministic from ``seq`` so that every
    reader can rebuild what it must have received."""
    import numpy as np
    import torch

    rng = random.Random(seq)
    kind = seq % 5
    if kind == 0:
        return {"seq": seq, "kind": "small", "text": "x" * rng.randrange(64),
                "ints": [rng.randrange(1 << 30) for _ in range(rng.randrange(8))]}
    if kind == 1:
        n = rng.randrange(1, 2000)
        return {"seq": seq, "kind": "numpy",
                "a": np.random.default_rng(seq).standard_normal(n).astype(np.float32)}
    if kind == 2:
        n = rng.randrange(1, 4000)
        g = torch.Generator().manual_seed(seq)
        return {"seq": seq, "kind": "tensor",
                "t": torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32)}
    if kind == 3:
        # Bigger than a chunk: in parts through the ring when they fit the
        # free chunks, else the overflow socket.
        n = SOAK_CHUNK // 4 + rng.randrange(1, 4 * SOAK_CHUNK)
        return {"seq": seq, "kind": "over",
                "a": np.random.default_rng(seq).integers(0, 255, n, dtype=np.uint8)}
    # Several tensors, one big enough for an out-of-band buffer.
    g = torch.Generator().manual_seed(seq)
    return {"seq": seq, "kind": "mixed",
            "ts": [torch.rand(rng.randrange(1, 64), generator=g) for _ in range(3)],
            "big": torch.arange(rng.randrange(1, 300_000), dtype=torch.int32)}


def soak_equal(got, want) -> bool:
    import numpy as np
    import torch

    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(soak_equal(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(soak_equal(a, b) for a, b in zip(got, want))
    if isinstance(want, np.ndarray):
        return got.dtype == want.dtype and np.array_equal(got, want)
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and torch.equal(got, want)
    return got == want


def soak_reader(handle, rank, n_messages, seed, result):
    """Read ``n_messages``, with random pauses, checking each by content."""
    from fastmq import MessageQueue

    import collections

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    rng = random.Random(seed)
    # Keep a few recent messages alive: their arena slots stay taken, so
    # the writer also runs out of slots and falls back.
    held = collections.deque(maxlen=rng.randrange(0, 6) or None)
    bad = []
    for seq in range(n_messages):
        got = mq.dequeue(timeout=60)
        if not soak_equal(got, soak_message(seq)):
            bad.append(seq)
        if held.maxlen:
            held.append(got)
        del got
        if rng.random() < 0.03:
            time.sleep(rng.uniform(0.005, 0.05))
    # Everything held is still intact after later traffic.
    bad += [m["seq"] for m in held if not soak_equal(m, soak_message(m["seq"]))]
    result.put((rank, os.getpid(), bad))
