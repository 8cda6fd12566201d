"""Child-process bodies and deterministic messages for test_core.

Message ``i`` is a pure function of ``i`` so that every reader can rebuild
what it should have received and compare by content."""
from __future__ import annotations

import sys

import numpy as np
import torch

CHUNK = 2 << 20          # 2 MiB chunks: 1.5 MiB tensors go out of band in the chunk


def make_message(i: int):
    kind = i % 9
    rng = np.random.default_rng(i)
    if kind == 0:
        return {"i": i, "s": "x" * (i % 50), "t": (i, -i, None, True)}
    if kind == 1:
        return ("execute_model", (i, [1, 2, 3]), {"k": i}, i % 3)
    if kind == 2:
        return rng.standard_normal(100 + i % 900)
    if kind == 3:   # oob buffer (>= 1 MiB) inside the chunk
        return torch.from_numpy(rng.integers(0, 1 << 30, (3 << 20) // 16, dtype=np.int64))
    if kind == 4:   # just under the chunk: in-band bytes, framed size < chunk
        return bytes([i % 251]) * (CHUNK - 4096)
    if kind == 5:   # just over the chunk: overflow path
        return bytes([i % 241]) * (CHUNK + 1)
    if kind == 6:   # big tensor: overflow path with an out-of-band frame
        return torch.full((CHUNK // 4 + 1024,), float(i), dtype=torch.float32)
    if kind == 7:
        dts = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16,
               torch.int8, torch.bool, torch.complex64, torch.uint8]
        dt = dts[i % len(dts)]
        t = torch.from_numpy(rng.standard_normal((7, 5)).astype(np.float32)).to(dt)
        return {"t": t, "scalar": torch.tensor(float(i)), "empty": torch.empty(0, 3, dtype=dt)}
    return [torch.arange(i % 64, dtype=torch.int64).reshape(-1, 1)[::2], np.arange(i % 17)]


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        def raw(t):
            return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def reader_main(handle, rank, count, result_q):
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    bad = []
    for i in range(count):
        got = mq.dequeue(timeout=60)
        if not same(got, make_message(i)):
            bad.append(i)
    result_q.put((rank, bad))


def slow_reader(handle, rank, pause, count, result_q):
    import time

    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    time.sleep(pause)
    got = [mq.dequeue(timeout=30) for _ in range(count)]
    result_q.put(got)


def gloo_subgroup_single_reader(rank, world, init_file, result_q):
    """Ranks 1 and 2 form a subgroup; its reader is named by *global* rank 1,
    as vLLM's parallel_state does."""
    import torch.distributed as dist

    from fastmq import MessageQueue

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            mq, handles = MessageQueue.create_from_process_group_single_reader(
                sub, 1 << 20, 4, reader_rank=1)
            if rank == 1:
                # handles[0] is the reader's own queue; read rank 2's.
                r = MessageQueue.create_from_handle(handles[1], 0)
                r.wait_until_ready()
                result_q.put((rank, (len(handles), r.dequeue(timeout=30))))
            else:
                mq.wait_until_ready()
                mq.enqueue("from global rank 2")
                result_q.put((rank, (len(handles), None)))
        else:
            result_q.put((rank, None))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_main(rank, world, init_file, result_q, single_reader):
    import torch.distributed as dist

    from fastmq import MessageQueue

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        if single_reader:
            mq, handles = MessageQueue.create_from_process_group_single_reader(
                dist.group.WORLD, 1 << 20, 4, reader_rank=0)
            if rank == 0:
                # Handle 0 is the reader's own queue: nobody writes to it.
                readers = [MessageQueue.create_from_handle(h, 0) for h in handles[1:]]
                for r in readers:
                    r.wait_until_ready()
                got = sorted(r.dequeue(timeout=30) for r in readers)
                result_q.put((rank, got))
            else:
                mq.wait_until_ready()
                mq.enqueue(("from", rank))
                result_q.put((rank, None))
            dist.barrier()
        else:
            mq = MessageQueue.create_from_process_group(dist.group.WORLD, 1 << 20, 4,
                                                        writer_rank=1)
            out = [mq.broadcast_object({"n": n} if rank == 1 else None) for n in range(5)]
            result_q.put((rank, (out, mq.n_local_reader if rank == 1 else None)))
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
