"""``wake``: one-way latency to readers parked while idle, and their idle CPU."""
from __future__ import annotations

import os
import select
import time
from contextlib import suppress
from functools import partial

import numpy as np

from fastmq import _floor
from fastmq.bench.harness import (BenchError, VerifyError, attached, bench_segment, groups,
                                  record, serve, summarize)
from fastmq.bench.impls import IMPLS
from fastmq.bench.scenario import Line, Scenario, latency_columns, num, ratio

NAME = "wake"


def _notes(rs, records) -> list[str]:
    w = next((r for r in rs if not r["impl"].startswith("floor")), None)
    return ([f"idle before = the implementation's spin phase plus "
             f"{w['idle_before_s'] - w['spin_s']:.3g} s parked; the floors' writers sleep "
             "as long as fastmq-futex's writer; idle CPU % "
             f"= utime+stime from /proc over {w['cpu_window_s']:.1f} s after the last "
             "message, % of one core."] if w else []) + \
        (["floor-futex: a C reader parked in FUTEX_WAIT, the writer in C; floor-pipe: a "
          "Python reader blocked in os.read() on a pipe, the Python writer writing its "
          "clock reading after time.sleep(). vs pipe floor = floor-pipe p50 / this p50."]
         if any(r["impl"].startswith("floor-") for r in rs) else []) + \
        ([f"first {w['first_messages']}: p50 of the one-way latency of the fresh queue's "
          f"first {w['first_messages']} messages (one pass over the ring's chunks: vLLM's "
          "default 10, fastmq's too), each after the same idle gap, before the warm-up; "
          "later / first: this row's p50 over that figure (at or above 1x the first "
          "messages of a queue cost no more than later ones)."]
         if w and w.get("first_messages") else []) + \
        (["few samples: p99 is close to the maximum; --full takes more."]
         if any(r["samples"] < 100 for r in rs) else [])


_COLS = latency_columns("us", "vs pipe floor")
SPEC = Scenario(
    NAME, "wake: one-way latency of one message to readers parked while idle "
    "(microseconds), and CPU used by an idle reader",
    rows={"fastmq-futex": "vllm", "vllm": None, "floor-pipe": "vllm", "floor-futex": "vllm"},
    columns=(("idle before", lambda r: f"{r['idle_before_s']:.3g} s"), *_COLS[:-1],
             ("first p50 us", lambda r: num(r.get("first_us"))),
             ("first vs vLLM", lambda r: ratio(r.get("first_vs_vllm"))),
             ("later / first", lambda r: ratio(r.get("first_vs_later"))),
             ("idle CPU %", lambda r: "-" if r.get("cpu_pct") is None
              else f"{r['cpu_pct']:.2f}"), _COLS[-1]),
    floor="floor-pipe",
    # The C futex floor bounds the pipe floor too; the pipe floor only the queues.
    bounds={"floor-pipe": lambda i: not i.startswith("floor"),
            "floor-futex": lambda i: i != "floor-futex"},
    extra_ratios={"first_vs_vllm": "first_us"},
    self_ratios={"first_vs_later": ("p50", "first_us")},
    summary=(Line("wake from idle, one-way", "fastmq-futex", "vllm", readme=True),
             Line("wake from idle, the first messages of a fresh queue", "fastmq-futex",
                  "vllm", field="first_us", readme=True),
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


def run(env, impls, params, progress) -> list[dict]:
    def measure(g):
        rec = dict(warmup=params.wake_warmup, spin_s=0.0, cpu_window_s=None, cpu_pct=None,
                   first_messages=0, first_us=None)
        if g.impl.family == "floor":
            # As long as fastmq's futex-mode writer sleeps: its spin phase plus the gap.
            idle = IMPLS["fastmq-futex"].spin_s + params.wake_gap_s
            wake = futex_floor if g.impl.name == "floor-futex" else pipe_floor
            latencies = wake(g, idle, params)
        else:
            rec["spin_s"] = g.impl.spin_s
            idle, latencies, first = rec["spin_s"] + params.wake_gap_s, [], []
            # The fresh queue's first messages (nothing went through it
            # yet), then the warm-up back to back, then the counted ones.
            k, w = params.wake_first, params.wake_warmup
            for i in range(k + w + params.wake_samples):
                if not k <= i < k + w:
                    time.sleep(idle)
                acks = g.round_trip(("wake", i + 1, _now()), free=1)[1]
                if i < k:
                    first += [a[3] for a in acks]
                elif i >= k + w:
                    latencies += [a[3] for a in acks]
            if first:
                rec.update(first_messages=k, first_us=summarize(first, 1e3)["p50"])
            ticks0, t0 = [cpu_ticks(p.pid) for p in g.procs], time.monotonic()
            time.sleep(params.idle_window_s)
            ticks1, window = [cpu_ticks(p.pid) for p in g.procs], time.monotonic() - t0
            pct = [(b - a) / _CLK_TCK / window * 100 for a, b in zip(ticks0, ticks1)]
            rec.update(cpu_window_s=window, cpu_pct=sum(pct) / len(pct))
        return [record(NAME, g.impl.name, g.n, None, "us", env, latencies, 1e3,
                       idle_before_s=idle, **rec)]

    return groups(env, impls, params, progress, NAME, measure)


def reader_loop(recv, reply, rank: int, params):
    def answer(seq, stamp, t1):
        if type(stamp) is tuple:  # a floor's rounds
            return _floor_reader(rank, params, *stamp)
        if t1 - stamp <= 0:
            raise VerifyError(f"message {seq}: received before it was sent "
                              f"({t1 - stamp} ns): not the message that was sent")
        return (t1 - stamp,)

    # Readers sit idle through the gaps and the idle-CPU window by design.
    return serve(recv, reply, rank, params, NAME, answer, stamp=True, timeout=max(
        params.timeout_s, params.idle_window_s + params.wake_gap_s + 5.0))


def futex_floor(g, idle_s, params) -> list[int]:
    """One-way latencies (ns) to C readers parked in FUTEX_WAIT, after ``idle_s`` asleep."""
    with bench_segment(_floor.wake_segment_size(g.n)) as seg:
        first = 1
        for rounds, idle in ((params.wake_warmup, 0.0), (params.wake_samples, idle_s)):
            lat = np.zeros((rounds, g.n), dtype=np.int64)
            if rounds:
                g.command(("futex", seg.locator, g.n, first, rounds), partial(
                    _floor.wake_writer, seg, g.n, first, int(idle * 1e9), lat,
                    params.timeout_s + idle))
            first += rounds
    return lat.reshape(-1).tolist()


def pipe_floor(g, idle_s, params) -> list[int]:
    """One-way latencies (ns) to Python readers blocked in os.read() on a pipe."""
    stamps, answers = [os.pipe() for _ in range(g.n)], [os.pipe() for _ in range(g.n)]
    out: list[int] = []

    def rounds():
        for i in range(params.wake_warmup + params.wake_samples):
            if i >= params.wake_warmup:
                time.sleep(idle_s)
            stamp = _now().to_bytes(8, "little")
            for _, w in stamps:
                os.write(w, stamp)
            for rank, (r, _) in enumerate(answers):
                if not select.select([r], [], [], params.timeout_s)[0]:
                    raise TimeoutError(f"floor-pipe: no answer from reader {rank}")
                data = os.read(r, 8)
                if i >= params.wake_warmup:
                    out.append(int.from_bytes(data, "little", signed=True))
        for _, w in stamps:  # the readers see the end of their stamps
            os.close(w)

    try:
        # Each reader opens its ends through /proc: the writer's own pipes.
        g.command(("pipe", os.getpid(), [(s[0], a[1]) for s, a in zip(stamps, answers)]),
                  rounds)
    finally:
        for fd in {fd for pair in stamps + answers for fd in pair}:
            with suppress(OSError):
                os.close(fd)
    if any(x <= 0 for x in out):
        raise BenchError("floor-pipe: a reader saw a stamp from its future")
    return out


def _floor_reader(rank: int, params, kind: str, *args) -> tuple:
    """A floor's reader side: the C futex floor's rounds, or the pipe floor's."""
    if kind == "futex":
        name, n, first, rounds = args
        _floor.wake_reader(attached(name), n, rank, first, rounds, params.timeout_s)
        return ()
    now, read, write = _now, os.read, os.write
    pid, (r, w) = args[0], args[1][rank]
    rfd, wfd = os.open(f"/proc/{pid}/fd/{r}", os.O_RDONLY), os.open(f"/proc/{pid}/fd/{w}",
                                                                   os.O_WRONLY)
    while len(data := read(rfd, 8)) == 8:  # short: the writer closed its end
        t1 = now()
        write(wfd, (t1 - int.from_bytes(data, "little")).to_bytes(8, "little", signed=True))
    os.close(rfd)
    os.close(wfd)
    return ()
