"""``wake``: one-way latency to readers parked while idle, and their idle CPU."""
from __future__ import annotations

import os
import time

from fastmq.bench.impls import IMPLS
from fastmq.bench.harness import VerifyError, groups, record, serve
from fastmq.bench.scenario import Line, Scenario, latency_columns

NAME = "wake"


def _notes(rs, records) -> list[str]:
    w = next((r for r in rs if not r["impl"].startswith("floor")), None)
    return ([f"idle before = the implementation's spin phase plus "
             f"{w['idle_before_s'] - (w['spin_s'] or 0):.3g} s parked (fastmq-spin never "
             "parks); the floors' writers sleep as long as fastmq-futex's writer; idle CPU % "
             f"= utime+stime from /proc over {w['cpu_window_s']:.1f} s after the last "
             "message, % of one core."] if w else []) + \
        (["floor-futex: a C reader parked in FUTEX_WAIT, the writer in C; floor-pipe: a "
          "Python reader blocked in os.read() on a pipe, the Python writer writing its "
          "clock reading after time.sleep(). vs pipe floor = floor-pipe p50 / this p50."]
         if any(r["impl"].startswith("floor-") for r in rs) else []) + \
        (["few samples: p99 is close to the maximum; --full takes more."]
         if any(r["samples"] < 100 for r in rs) else [])


_COLS = latency_columns("us", "vs pipe floor")
SPEC = Scenario(
    NAME, "wake: one-way latency of one message to readers parked while idle "
    "(microseconds), and CPU used by an idle reader",
    impls=("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", "pyzmq", "floor-futex",
           "floor-pipe"),
    rows={"fastmq-futex": "vllm", "fastmq-zmq": "vllm", "fastmq-spin": "vllm", "vllm": None,
          "pyzmq": "vllm", "floor-pipe": "vllm", "floor-futex": "vllm"},
    columns=(("idle before", lambda r: f"{r['idle_before_s']:.3g} s"), *_COLS[:-1],
             ("idle CPU %", lambda r: "-" if r.get("cpu_pct") is None
              else f"{r['cpu_pct']:.2f}"), _COLS[-1]),
    floor="floor-pipe",
    # A reader that never sleeps (spin) is no parked reader.
    bounds={"floor-pipe": lambda i: i != "fastmq-spin" and not i.startswith("floor"),
            "floor-futex": lambda i: i != "fastmq-spin" and i != "floor-futex"},
    summary=(Line("wake from idle, one-way", "fastmq-futex", "vllm", readme=True),
             Line("wake from idle against the Python pipe floor", "fastmq-futex",
                  "floor-pipe"),
             Line("wake from idle against the C futex floor", "fastmq-futex", "floor-futex"),
             Line("CPU of an idle reader after its last message", "fastmq-futex", "vllm",
                  field="cpu_pct", unit="% of a core", readme=True)),
    notes=_notes)

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid``'s threads, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    # Split after the command name, which may contain spaces.
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def cpu_ns(pid: int) -> int | None:
    """Nanoseconds on CPU of ``pid``'s live threads (schedstat, finer than ticks), or None."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total


def run(env, impls, params, progress) -> list[dict]:
    from fastmq.bench import floors

    def rec(impl, n, spin, idle, latencies, window=None, pct=None, fine=None):
        return [record(NAME, impl.name, n, None, "us", env, latencies, 1e3,
                       warmup=params.wake_warmup, spin_s=spin, idle_before_s=idle,
                       cpu_window_s=window, cpu_pct=pct and sum(pct) / len(pct),
                       cpu_pct_max=pct and max(pct),
                       cpu_pct_schedstat=fine and sum(fine) / len(fine))]

    def floor(impl, n):
        # As long as fastmq's futex-mode writer sleeps: its spin phase plus the gap.
        idle = IMPLS["fastmq-futex"].spin_s + params.wake_gap_s
        wake = floors.wake_futex if impl.name == "floor-futex" else floors.wake_pipe
        return rec(impl, n, 0.0, idle, wake(env, n, idle, params, progress))

    def measure(g):
        spin = g.impl.spin_s
        idle = (spin or 0.0) + params.wake_gap_s
        latencies: list[int] = []
        for i in range(params.wake_warmup + params.wake_samples):
            if i >= params.wake_warmup:
                progress.detail(f"sample {i - params.wake_warmup + 1}/{params.wake_samples}")
                time.sleep(idle)
            acks = g.round_trip(("wake", i + 1, _now()), free=1)[1]
            if i >= params.wake_warmup:
                latencies += [a[3] for a in acks]
        progress.detail(f"idle CPU over {params.idle_window_s:g} s")
        ticks0, ns0 = [cpu_ticks(p) for p in g.pids], [cpu_ns(p) for p in g.pids]
        t_a = time.monotonic()
        time.sleep(params.idle_window_s)
        ticks1, ns1 = [cpu_ticks(p) for p in g.pids], [cpu_ns(p) for p in g.pids]
        window = time.monotonic() - t_a
        return rec(g.impl, g.n, spin, idle, latencies, window,
                   [(b - a) / _CLK_TCK / window * 100 for a, b in zip(ticks0, ticks1)],
                   None if None in ns0 + ns1 else
                   [(b - a) / 1e9 / window * 100 for a, b in zip(ns0, ns1)])

    return groups(env, impls, params, progress, NAME, measure, floor)


def _answer(seq, stamp, t1):
    if t1 - stamp <= 0:
        raise VerifyError(f"message {seq}: received before it was sent "
                          f"({t1 - stamp} ns): not the message that was sent")
    return (t1 - stamp,)


def reader_loop(end, rank: int, params):
    # Readers sit idle through the gaps and the idle-CPU window by design.
    return serve(end, rank, params, "wake", _answer, stamp=True, timeout=max(
        params.timeout_s, params.idle_window_s + params.wake_gap_s + 5.0))
