"""What reserving ring pages in /dev/shm costs: a MessageQueue(1, 1)
(vLLM's per-worker response queue: 10 chunks of 24 MiB) from fastmq and
from vLLM's own MessageQueue, side by side.

fastmq reserves a chunk's pages (posix_fallocate) the first time a message
reaches that far into the chunk, so that a full /dev/shm is an exception
rather than a SIGBUS; vLLM reserves nothing.

    FASTMQ_VLLM=0 python3 bench/reserve_cost.py     # ~20 s

Prints a Markdown table; every figure is measured by this run.
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time

os.environ["FASTMQ_VLLM"] = "0"      # vLLM's class must be vLLM's own

from fastmq.bench.coldpath import queue_pair  # noqa: E402


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _shm_kib(names) -> int:
    total = 0
    for n in names:
        try:
            total += os.stat(os.path.join("/dev/shm", n)).st_blocks * 512
        except OSError:
            pass
    return total // 1024


def _segment_names(w) -> list[str]:
    names = []
    buf = getattr(w, "buffer", None)
    if buf is not None:
        names.append(getattr(buf, "name", None) or buf.shared_memory.name)
    return [n.lstrip("/") for n in names if n]


def measure(cls, label: str, steps: int = 3000) -> dict:
    creates = []
    for _ in range(15):
        t0 = time.perf_counter_ns()
        w = cls(1, 1)
        creates.append(time.perf_counter_ns() - t0)
        del w
        gc.collect()
    rss0 = _rss_kib()
    w, r = queue_pair(cls)
    rss_created = _rss_kib() - rss0
    shm_created = _shm_kib(_segment_names(w))
    msg = b"x" * 1024
    first = []
    for _ in range(10):                      # the first message in each chunk
        t0 = time.perf_counter_ns()
        w.enqueue(msg)
        r.dequeue()
        first.append(time.perf_counter_ns() - t0)
    lat = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        w.enqueue(msg)
        r.dequeue()
        lat.append(time.perf_counter_ns() - t0)
    out = {
        "impl": label,
        "create_ms": statistics.median(creates) / 1e6,
        "rss_kib": rss_created,
        "shm_kib_after": _shm_kib(_segment_names(w)),
        "shm_kib_created": shm_created,
        "first_us": statistics.median(first) / 1e3,
        "step_us": statistics.median(lat) / 1e3,
    }
    del w, r
    gc.collect()
    return out


def main() -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VMQ

    import fastmq

    rows = [measure(fastmq.MessageQueue, "fastmq"), measure(VMQ, "vLLM")]
    print(f"Command: `FASTMQ_VLLM=0 python3 bench/reserve_cost.py` "
          f"({time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.2f})\n")
    print("| queue `MessageQueue(1, 1)` | create (median ms) | RSS after create+attach (KiB) "
          "| /dev/shm used after create (KiB) | after 3,010 1 KiB messages (KiB) "
          "| first message per chunk (median us) | 1 KiB step, same process (median us) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['create_ms']:.2f} | {r['rss_kib']} | {r['shm_kib_created']} "
              f"| {r['shm_kib_after']} | {r['first_us']:.1f} | {r['step_us']:.1f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
