"""Run by tests/test_small_shm.py inside a private mount namespace whose
/dev/shm is a 64 MiB tmpfs (Docker's default)."""
from __future__ import annotations

import logging
import os
import threading

from fastmq import MessageQueue, ShmFullError

MiB = 1 << 20


def main() -> None:
    # vLLM's scheduler broadcast ring (16 MiB x 10) and a worker's answer
    # ring (24 MiB x 10): 400 MiB of rings in a 64 MiB /dev/shm.
    w = MessageQueue(1, 1, max_chunk_bytes=16 * MiB, max_chunks=10)
    other = MessageQueue(1, 1, max_chunk_bytes=24 * MiB, max_chunks=10)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=r.wait_until_ready)
    t.start()
    w.wait_until_ready()
    t.join()
    for step in range(200):
        w.enqueue({"step": step, "tokens": list(range(64))})
        assert r.dequeue(timeout=10)["step"] == step
    w.enqueue(b"x" * (8 * MiB))                     # fits what is left
    assert len(r.dequeue(timeout=10)) == 8 * MiB
    print("small steps OK")
    # Fill /dev/shm behind the queue's back: a message that no longer fits
    # raises ShmFullError, nothing is sent, and the queue keeps working.
    with open("/dev/shm/filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * MiB)
                f.flush()
        except OSError:
            pass
    try:
        for _ in range(10):
            w.enqueue(b"y" * (15 * MiB))
            r.dequeue(timeout=10)
        print("no ShmFullError")
    except ShmFullError as e:
        print("ShmFullError:", e)
    os.unlink("/dev/shm/filler")
    w.enqueue("after")
    assert r.dequeue(timeout=10) == "after"
    print("after OK")
    try:
        MessageQueue(1, 1, max_chunk_bytes=128 * MiB, max_chunks=2)
        print("no error for a 128 MiB chunk")
    except RuntimeError as e:
        print("RuntimeError:", e)
    for q in (r, w, other):
        q.shutdown()

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from fastmq.vllm import _arena_default

    print("arena default fits:", _arena_default.fits())


if __name__ == "__main__":
    main()
