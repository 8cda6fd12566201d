"""Child-process bodies and deterministic messages for test_arena.

Message ``i`` is a pure function of ``i``: every reader rebuilds what it
should have received and compares bytes."""
from __future__ import annotations

import numpy as np
import torch

MiB = 1 << 20


def make_message(i: int):
    g = torch.Generator().manual_seed(i)
    return {
        "i": i,
        "f32": torch.randn(512, 1024, generator=g),                             # 2 MiB
        "bf16": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),        # 2 MiB
        "np": np.random.default_rng(i).standard_normal(300_000),                # 2.3 MiB
        "param": torch.nn.Parameter(torch.full((1 << 19,), float(i)), requires_grad=i % 2 == 0),
        "small": torch.arange(i + 3),
    }


ARENA_KEYS = ("f32", "bf16", "np", "param")


def _addr(x) -> int:
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def check_message(msg, i: int, arena) -> list[str]:
    """What is wrong with ``msg`` as message ``i`` (empty if nothing)."""
    want = make_message(i)
    errors = []
    if msg["i"] != i:
        errors.append(f"message {i}: got index {msg['i']}")
    for k in ("f32", "bf16", "small"):
        if not (msg[k].dtype == want[k].dtype and torch.equal(msg[k], want[k])):
            errors.append(f"message {i}: {k} differs")
    if not np.array_equal(msg["np"], want["np"]):
        errors.append(f"message {i}: np differs")
    p = msg["param"]
    if type(p) is not torch.nn.Parameter or p.requires_grad != want["param"].requires_grad \
            or not torch.equal(p.data, want["param"].data):
        errors.append(f"message {i}: param differs ({type(p).__name__})")
    for k in ARENA_KEYS:
        if not arena.contains(_addr(msg[k])):
            errors.append(f"message {i}: {k} is not a view of the arena")
    return errors


def _attach_with_response_queue(handle, rank: int, handles_q):
    """Reader ``rank`` of the writer's queue, a response queue whose handle
    goes back on ``handles_q``, both past their handshake, and this
    process's end of the writer's arena."""
    from fastmq import MessageQueue, arena

    r = MessageQueue.create_from_handle(handle, rank)
    resp = MessageQueue(1, 1, enable_shm_tensor_arena=False)
    handles_q.put((rank, resp.export_handle()))
    r.wait_until_ready()
    resp.wait_until_ready()
    return r, resp, arena.attached(handle.tensor_arena_handle[3])


def reader_main(handle, rank: int, n_msgs: int, handles_q) -> None:
    """Read ``n_msgs`` messages, keep message 0 alive until told, ack each
    message on a response queue after dropping it, then report."""
    r, resp, ar = _attach_with_response_queue(handle, rank, handles_q)
    errors: list[str] = []
    held = None
    for i in range(n_msgs):
        msg = r.dequeue(timeout=60)
        errors += check_message(msg, i, ar)
        if i == 0:
            held = msg
        del msg
        resp.enqueue(("ack", rank, i))
    # The in-place message (written by the writer inside a slot).
    msg = r.dequeue(timeout=60)
    if not (ar.contains(msg.data_ptr()) and torch.equal(msg, torch.full((1 << 18,), 7.0))):
        errors.append("empty_tensor message wrong or not zero-copy")
    del msg
    resp.enqueue(("ack", rank, "inplace"))
    errors += [f"held {e}" for e in check_message(held, 0, ar)]
    assert r.dequeue(timeout=60) == "drop"
    del held
    resp.enqueue(("done", rank, errors, r.stats()))
    assert r.dequeue(timeout=60) == "bye"


def inplace_tensor(i: int):
    """Message ``i`` of the in-place test: 2 MiB of int64, distinct per ``i``."""
    return torch.arange(1 << 18, dtype=torch.int64) * (i + 1)


def inplace_reader_main(handle, rank: int, n_msgs: int, shared: bool, handles_q) -> None:
    """Rank 0 adds 1 in place to every tensor it receives and keeps it;
    after the writer's ``"check"`` every rank compares what it holds with
    what it should see, then drops it and reports."""
    r, resp, ar = _attach_with_response_queue(handle, rank, handles_q)
    for i in range(n_msgs):
        t = r.dequeue(timeout=60)
        want = inplace_tensor(i)
        fresh = bool(torch.equal(t, want))       # before anyone's write: no earlier write shows
        zero_copy = ar.contains(t.data_ptr())
        if rank == 0:
            t.add_(1)
        resp.enqueue(("got", rank, i))
        assert r.dequeue(timeout=60) == "check"
        if rank == 0 or shared:
            want = want + 1
        seen = bool(torch.equal(t, want))
        del t
        resp.enqueue(("checked", rank, i, fresh, zero_copy, seen, r.stats()))
    assert r.dequeue(timeout=60) == "bye"


def locked_reader_main(handle, q) -> None:
    """A reader whose process locks all its memory, present and future
    (``mlockall``), before it attaches: puts what each of three messages
    showed (after writing into it, and dropping it), or the error."""
    import ctypes
    import os

    from fastmq import MessageQueue

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlockall(1 | 2) != 0:                       # MCL_CURRENT | MCL_FUTURE
        q.put(("mlockall", os.strerror(ctypes.get_errno())))
        return
    r = MessageQueue.create_from_handle(handle, 0)
    r.wait_until_ready()
    try:
        for _ in range(3):
            t = r.dequeue(timeout=30)
            seen = (t[0].item(), t[-1].item(), r.tensor_arena.contains(t.data_ptr()))
            t.add_(100)                                  # a private copy of every page
            del t
            q.put(("seen", seen))
    except Exception as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
