"""The child of tests/test_run_ahead.py: a writer that enqueues a few
messages before its readers read any, on one class, fastmq's or vLLM's own.

Run as ``python _run_ahead_children.py fastmq|vllm``, with ``FASTMQ_VLLM=0``
for vLLM's class (so that fastmq does not take its place).  Each case of
``CASES`` builds a queue of its geometry in this process, handshakes its
readers (in this process too: the readers' ends need no process of their
own to hold messages), enqueues the case's messages with a deadline, then
lets every reader dequeue them all.  Prints ``RESULT <json>`` as its last
line: per case, how many enqueue() calls returned, the error of the first
that did not, whether every reader received every message in order and
intact, and (fastmq) the writer's path counters.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import traceback

KiB, MiB = 1 << 10, 1 << 20
# Long enough for any send that does not wait for a reader (the socket
# moves a few MiB here in milliseconds), short enough to fail quickly.
ENQUEUE_TIMEOUT = 5.0

# name: (readers, arena, fastmq-only arena options, max_chunk_bytes,
# max_chunks, messages as (kind, size)[, True: each reader is waiting in
# dequeue() for the first message, and reads no other]).  Every case
# enqueues at most max_chunks messages that no reader reads: vLLM's writer
# returns from each (one chunk a message, whatever its size).
_SEEN = [("bytes", 100), ("bytes", 128 * KiB), ("tensor", 2 * MiB)]
_FULL = [("bytes", 128 * KiB), ("bytes", 100), ("tensor", 2 * MiB), ("bytes", 200 * KiB)]
CASES = {
    # The case seen: three unread messages on a 4-chunk ring of 64 KiB chunks.
    **{f"seen-n{n}-arena-{'on' if a else 'off'}": (n, a, {}, 64 * KiB, 4, _SEEN)
       for n in (1, 2) for a in (True, False)},
    # The ring filled: max_chunks unread messages, large ones first.
    **{f"full-n{n}-arena-{'on' if a else 'off'}": (n, a, {}, 64 * KiB, 4, _FULL)
       for n in (1, 2) for a in (True, False)},
    # fastmq's arena takes the 2 MiB tensor (the message itself is small).
    "seen-n1-arena-takes-it": (1, True, {"arena_min_mb": 1}, 64 * KiB, 4, _SEEN),
    # A message that fits a chunk but is large enough for parts, then one more.
    **{f"fits-a-chunk-n{n}": (n, False, {}, 8 * MiB, 2,
                              [("tensor", 6 * MiB), ("bytes", 100)]) for n in (1, 2)},
    # The readers wait for the first message, take it and read no more: the
    # large one right behind it finds them still marked waiting.
    **{f"first-read-n{n}": (n, False, {}, 64 * KiB, 4,
                            [("bytes", 100), ("bytes", 128 * KiB)] + [("bytes", 100)] * 3, True)
       for n in (1, 2)},
}


def message(kind: str, size: int, seq: int):
    if kind == "bytes":
        return bytes([seq % 251]) * size
    import torch
    t = torch.arange(size // 8, dtype=torch.int64)
    t[0] = seq
    return t


def same(got, want) -> bool:
    if isinstance(want, bytes):
        return type(got) is bytes and got == want
    import torch
    return isinstance(got, torch.Tensor) and torch.equal(got, want)


def _first_readers(w, rs, is_fastmq: bool) -> list:
    """A thread per reader, each in dequeue() for one message."""
    import time

    firsts = [None] * len(rs)

    def read(k):
        firsts[k] = rs[k].dequeue(timeout=30)

    ts = [threading.Thread(target=read, args=(k,), daemon=True) for k in range(len(rs))]
    for t in ts:
        t.start()
    if is_fastmq:
        deadline = time.monotonic() + 30
        while not w._end.ring.readers_waiting() and time.monotonic() < deadline:
            time.sleep(0.001)
    else:
        time.sleep(0.5)     # vLLM's ring shows no waiting reader: time to get there
    return ts, firsts


def run_case(MessageQueue, is_fastmq: bool, case) -> dict:
    n, arena, fastmq_opts, chunk, chunks, spec, *first_read = case
    kw = dict(max_chunk_bytes=chunk, max_chunks=chunks, enable_shm_tensor_arena=arena)
    if is_fastmq:
        kw.update(fastmq_opts)
    w = MessageQueue(n, n, **kw)
    handle = w.export_handle()
    rs = [MessageQueue.create_from_handle(handle, r) for r in range(n)]
    t = threading.Thread(target=w.wait_until_ready, daemon=True)
    t.start()
    for r in rs:
        r.wait_until_ready()
    t.join(30)
    msgs = [message(kind, size, seq) for seq, (kind, size) in enumerate(spec)]
    out = {"returned": 0, "error": None, "delivered": None}
    firsts = None
    if first_read and first_read[0]:
        threads, firsts = _first_readers(w, rs, is_fastmq)
    for m in msgs:
        try:
            w.enqueue(m, timeout=ENQUEUE_TIMEOUT)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
            break
        out["returned"] += 1
    if firsts is not None:
        for t in threads:
            t.join(30)
        first_ok = all(same(got, msgs[0]) for got in firsts)
        msgs = msgs[1:]
    else:
        first_ok = True
    if out["returned"] == len(spec):
        # Every reader, every message, in order and intact.
        out["delivered"] = first_ok and all(same(r.dequeue(timeout=30), m)
                                            for r in rs for m in msgs)
    if is_fastmq:
        st = w.stats()
        out["paths"] = {k: st.get(k, 0) for k in ("ring_messages", "parts_messages",
                                                  "overflow_messages", "arena_hits")}
    for q in (w, *rs):
        if hasattr(q, "shutdown"):
            q.shutdown()
    return out


def main(which: str) -> None:
    if which == "vllm":
        assert os.environ.get("FASTMQ_VLLM") == "0", "vLLM's own class needs FASTMQ_VLLM=0"
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        assert MessageQueue.__module__.startswith("vllm."), MessageQueue.__module__
    else:
        from fastmq import MessageQueue
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = run_case(MessageQueue, which == "fastmq", case)
        except Exception:
            results[name] = {"returned": 0, "error": traceback.format_exc(), "delivered": None}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
