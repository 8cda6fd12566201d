"""Run by tests/test_small_shm.py inside a private mount namespace whose
/dev/shm is a 64 MiB tmpfs (Docker's default)."""
from __future__ import annotations

import os

from fastmq import MessageQueue

from _queues import local_pair

MiB = 1 << 20


def main() -> None:
    import torch

    # /dev/shm full before anything starts: it must not matter.
    with open("/dev/shm/filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * MiB)
                f.flush()
        except OSError:
            pass
    # vLLM's scheduler broadcast ring (16 MiB x 10) with the tensor arena at
    # its default sizing (8 x 256 MiB), and a worker's answer ring (24 MiB x
    # 10): over 2 GiB in a full 64 MiB /dev/shm.
    w, (r,) = local_pair(1, max_chunk_bytes=16 * MiB, max_chunks=10)
    other = MessageQueue(1, 1, max_chunk_bytes=24 * MiB, max_chunks=10)
    assert w.tensor_arena is not None
    assert (w.tensor_arena.n_slots, w.tensor_arena.slot_bytes) == (8, 256 * MiB)
    for step in range(200):
        w.enqueue({"step": step, "tokens": list(range(64))})
        assert r.dequeue(timeout=10)["step"] == step
    print("small steps OK")
    big = torch.arange(16 * MiB, dtype=torch.float32)       # 64 MiB: multimodal-sized
    for _ in range(3):
        w.enqueue({"embeds": big})
        got = r.dequeue(timeout=30)["embeds"]
        assert torch.equal(got, big)
        assert r.tensor_arena.contains(got.data_ptr())
        del got
    assert w.stats()["arena_hits"] == 3, w.stats()
    print("arena OK")
    w.enqueue(b"y" * (40 * MiB))                             # the overflow socket
    assert len(r.dequeue(timeout=30)) == 40 * MiB
    print("overflow OK")
    os.unlink("/dev/shm/filler")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("fastmq")]
    for q in (r, w, other):
        q.shutdown()
    print("OK")


if __name__ == "__main__":
    main()
