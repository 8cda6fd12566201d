"""Where a writer's first message after an idle period spends its time.

``python -m fastmq.bench.coldpath`` (about 20 s) times, in one process,
each step of the writer's side of a wake-up twice: *cold*, right after
sleeping as long as the ``wake`` scenario's writer does (so caches and
branch predictors have been lost to other work, as in a real idle period),
and *warm*, immediately again.  The steps are what the writer runs between
its clock stamp and the reader's wake-up:

* a no-op Python function call (the interpreter's own cold cost);
* ``os.write`` of 8 bytes to a pipe (what the Python pipe floor's writer does);
* ``pickle.dumps`` of the wake message;
* fastmq's ``Encoder.encode`` of it (the pickler fastmq keeps per queue);
* fastmq's whole ``enqueue()`` of it into a ring with one reader;
* vLLM's whole ``enqueue()`` where vLLM is installed.

It prints a Markdown table (medians of ``--samples`` samples, in us) headed
by the command, for ``bench/COLD-PATH.md``.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import threading
import time

MSG = ("wake", 1, 123456789)


def _noop():
    return None


def _measure(fn, samples: int, idle_s: float) -> tuple[float, float]:
    cold, warm = [], []
    for _ in range(samples):
        time.sleep(idle_s)
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        fn()
        t2 = time.perf_counter_ns()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    return statistics.median(cold) / 1e3, statistics.median(warm) / 1e3


def queue_pair(cls, *args, **kw):
    """A writer and one handshaken in-process reader of ``cls`` (fastmq's
    or vLLM's ``MessageQueue``), made with ``cls(1, 1, *args, **kw)``."""
    w = cls(1, 1, *args, **kw)
    r = cls.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join()
    return w, r


def _enqueue_step(w, r):
    def step():
        w.enqueue(MSG)
        r.dequeue()          # drains, so the ring never fills
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmq.bench.coldpath")
    p.add_argument("--samples", type=int, default=25)
    p.add_argument("--idle", type=float, default=0.1, help="seconds of sleep before each cold sample")
    args = p.parse_args(argv)
    os.environ.setdefault("FASTMQ_VLLM", "0")   # vLLM's row must be vLLM's own class
    from fastmq import MessageQueue
    from fastmq._serde import Encoder

    rfd, wfd = os.pipe()
    enc = Encoder()
    rows = [
        ("no-op Python call", _noop),
        ("os.write of 8 bytes to a pipe", lambda: (os.write(wfd, b"12345678"), os.read(rfd, 8))),
        ("pickle.dumps(message)", lambda: pickle.dumps(MSG, protocol=5)),
        ("fastmq Encoder.encode(message)", lambda: enc.encode(MSG)),
    ]
    fw, fr = queue_pair(MessageQueue, max_chunk_bytes=1 << 16, max_chunks=4)
    rows.append(("fastmq enqueue() + reader's dequeue(), same process", _enqueue_step(fw, fr)))
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VMQ
    except Exception as e:                    # vLLM is optional
        print(f"(vLLM not measured: {type(e).__name__}: {e})", file=sys.stderr)
    else:
        vw, vr = queue_pair(VMQ, max_chunk_bytes=1 << 16, max_chunks=4)
        rows.append(("vLLM enqueue() + reader's dequeue(), same process", _enqueue_step(vw, vr)))
    out = [f"Command: `python -m fastmq.bench.coldpath --samples {args.samples} --idle {args.idle}` "
           f"({time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.2f}); medians in us.",
           "",
           "| step | cold (after the idle sleep) | warm (right after) | cold / warm |",
           "|---|---|---|---|"]
    for name, fn in rows:
        fn()                                   # import and first-use costs out of the way
        cold, warm = _measure(fn, args.samples, args.idle)
        out.append(f"| {name} | {cold:.1f} | {warm:.1f} | {cold / warm:.0f}x |")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
