"""Child-process body and messages for test_parts."""
from __future__ import annotations

import numpy as np

from fastmq import MessageQueue


def big_message(seed: int, nbytes: int):
    """Deterministic: a pickle stream, an in-band bytes object and two
    out-of-band arrays, so the parts cross buffer boundaries."""
    rng = np.random.default_rng(seed)
    return {"seed": seed, "inband": bytes([seed % 251]) * (nbytes // 4),
            "a": rng.integers(0, 1 << 40, nbytes // 16, dtype=np.int64),
            "b": rng.standard_normal(nbytes // 32)}


def partial_writer_main(q, chunk: int):
    """Publishes the first part of a two-part message (raw, as a writer
    killed between its parts leaves the ring), then waits to be killed."""
    import struct
    import time

    from fastmq._ring import PART_HEAD_BYTES

    w = MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=4, enable_shm_tensor_arena=False)
    q.put(w.export_handle())
    w.wait_until_ready()
    payload = chunk - PART_HEAD_BYTES
    with w.acquire_write(timeout=10) as buf:
        struct.pack_into("<B3xIQQQQQ", buf, 0, 2, 0, 2 * payload, 0, payload, 1,
                         2 * payload - 16)
    q.put("part 0 out")
    time.sleep(120)


def heap_bytes() -> int:
    """The bytes of glibc's main heap (``mallinfo2().arena``): what the
    process has from the kernel for its small objects right now."""
    import ctypes

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().arena


def heap_reader_main(q, handle, rounds: int, deadline: bool = False):
    """A worker that takes ``rounds`` large lists as vLLM's do (or with a
    deadline: reassembled first) and drops each: puts the main heap's size
    before the first and after each one is freed."""
    import gc

    r = MessageQueue.create_from_handle(handle, 0)
    r.wait_until_ready()
    sizes = [heap_bytes()]
    for _ in range(rounds):
        got = r.dequeue(timeout=60) if deadline else r.dequeue(indefinite=True)
        n = sum(map(len, got))
        del got
        gc.collect()
        sizes.append(heap_bytes())
    q.put((n, sizes))
    r.shutdown()
