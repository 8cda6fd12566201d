"""``step``: the executor round trip, broadcast out and every reader's answer back."""
from __future__ import annotations

import pickle
import time
from functools import partial

import numpy as np

from fastmq import _floor
from fastmq.bench import impls
from fastmq.bench.config import KiB
from fastmq.bench.harness import (BenchError, attached, bench_segment, check_step_payload,
                                  groups, pattern, record, sample_loop, serve, step_payload)
from fastmq.bench.scenario import Line, Scenario, latency_columns

NAME = "step"
# The C floor spins this long before yielding the core: longer than a round trip with a
# core each, short enough to hand one shared core over quickly (0 when oversubscribed).
SPIN_NS = 2_000


def _notes(rs, records) -> list[str]:
    names = {r["impl"] for r in rs}
    return (["floor: the same round trip over bare shared memory in C (payload copied in, "
             "each reader copies it out and answers on its own cache line); floor+pickle, "
             "the step's floor (vs floor): floor plus pickle.dumps and pickle.loads of the "
             "same message and of one answer, timed in the same run."]
            if "floor" in names else []) + impls.remote_notes(names)


_REMOTE = (("remote readers (TCP)", "fastmq-remote"),
           ("remote both ways (vLLM's multi-node executor shape)", "fastmq-remote-both"))
SPEC = Scenario(
    NAME, "step: executor round trip (1 writer broadcasts, each of N readers answers on its "
    "own 1:1 queue); microseconds",
    rows={"fastmq-futex": "vllm", "vllm": None, **impls.REMOTE_ROWS, "floor+pickle": "vllm",
          "floor": "vllm"},
    columns=latency_columns("us"), floor="floor+pickle", size_header="payload",
    bounds={"floor+pickle": lambda i: not i.startswith("floor"),
            "floor": lambda i: not i.startswith("floor")},
    summary=(Line("step round trip", "fastmq-futex", "vllm", readme=True),
             Line("step round trip against its floor (pickling + a C round trip)",
                  "fastmq-futex", "floor+pickle"),
             *(Line(f"step round trip, {what}{tag and ', ' + tag}", row + tag,
                    impls.REMOTE_ROWS[row], readme=row + tag == "fastmq-remote")
               for what, row in _REMOTE for tag in ("", "+encrypt", "+plain")),
             # What the default security costs: against plain TCP, same shape.
             *(Line(f"security cost: {row} against {row}+plain, step round trip", row,
                    row + "+plain") for _, row in _REMOTE)),
    summary_size=KiB, notes=_notes)


def run(env, impls, params, progress) -> list[dict]:
    def measure(g):
        if g.impl.family == "floor":
            return floor(g, env, params)
        out, seq = [], 0
        for size in params.step_sizes:
            def one() -> int:
                nonlocal seq
                seq += 1
                return g.round_trip(("step", seq, step_payload(seq, size)))[0]

            out.append(record(NAME, g.impl.name, g.n, size, "us", env, sample_loop(
                one, params.step_warmup, params.step_min, params.step_max,
                params.step_budget_s), 1e3, warmup=params.step_warmup))
        return out

    return groups(env, impls, params, progress, NAME, measure)


def reader_loop(recv, reply, rank: int, params):
    def answer(seq, payload, t):
        if type(payload) is tuple:  # a batch of the C floor's rounds
            name, n, size, first, count, spin_ns = payload
            _floor.pingpong_reader(attached(name), n, rank, np.zeros(size, dtype=np.uint8),
                                   first, count, params.timeout_s, spin_ns)
        else:
            check_step_payload(seq, payload)
        return ()

    return serve(recv, reply, rank, params, NAME, answer)


def floor(g, env, params) -> list[dict]:
    """The ``floor`` and ``floor+pickle`` rows: the round trip over bare shared memory in C,
    each batch of rounds announced to the readers through the queue."""
    sizes, n = params.step_sizes, g.n
    spin_ns = 0 if env.oversubscribed(n) else SPIN_NS
    records, first = [], 1
    with bench_segment(_floor.segment_size(n, max(sizes))) as seg:
        def rounds(src, count):
            nonlocal first
            out = np.zeros(count, dtype=np.int64)
            g.command((seg.locator, n, src.size, first, count, spin_ns), partial(
                _floor.pingpong_writer, seg, n, src, first, out, params.timeout_s, spin_ns))
            first += count
            return out

        for size in sizes:
            src = np.frombuffer(pattern(size), dtype=np.uint8)
            # The warm-up's median sizes the counted run to the queues' time budget.
            est = max(float(np.median(rounds(src, params.step_warmup))), 1.0)
            count = int(min(params.step_max, max(params.step_min,
                                                 params.step_budget_s * 1e9 / est)))
            samples = rounds(src, count)
            pickling = pickle_rounds(size, params.step_warmup, count)
            for name, s in (("floor", samples), ("floor+pickle", samples + pickling)):
                records.append(record(NAME, name, n, size, "us", env, s.tolist(), 1e3,
                                      warmup=params.step_warmup))
    return records


def pickle_rounds(size: int, warmup: int, count: int) -> np.ndarray:
    """Nanoseconds per round of pickling a step message and its answer both ways."""
    dumps, loads, now, out = pickle.dumps, pickle.loads, time.perf_counter_ns, []
    for seq in range(1, warmup + count + 1):
        msg, ack = ("step", seq, step_payload(seq, size)), ("ok", seq, 0)
        t0 = now()
        got, answer = loads(dumps(msg, protocol=5)), loads(dumps(ack, protocol=5))
        out.append(now() - t0)
        if got[1] != seq or answer != ack:
            raise BenchError("floor+pickle: a message changed in pickling")
    return np.array(out[warmup:], dtype=np.int64)
