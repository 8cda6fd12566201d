"""``step``: the executor round trip, broadcast out and every reader's answer back."""
from __future__ import annotations

from fastmq.bench import floors, impls
from fastmq.bench.config import KiB, fmt_size
from fastmq.bench.harness import (check_step_payload, groups, record, sample_loop, serve,
                                  step_payload)
from fastmq.bench.scenario import Line, Scenario, latency_columns, num

NAME = "step"
_BOTH = "remote both ways (vLLM's multi-node executor shape)"


def _notes(rs, records) -> list[str]:
    names = {r["impl"] for r in rs}
    mc = [r for r in records if r["impl"] == "floor-memcpy"]
    return (["floor-memcpy (one memcpy of the payload, p50): " + ", ".join(
                f"{fmt_size(r['size_bytes'])} {num(r['p50'])} us" for r in mc)] if mc else []) \
        + (["floor: the same round trip over bare shared memory in C (payload copied in, "
            "each reader copies it out and answers on its own cache line); floor+pickle, "
            "the step's floor (vs floor): floor plus pickle.dumps and pickle.loads of the "
            "same message and of one answer, timed in the same run."]
           if "floor" in names else []) + impls.remote_notes(names)


SPEC = Scenario(
    NAME, "step: executor round trip (1 writer broadcasts, each of N readers answers on its "
    "own 1:1 queue); microseconds",
    impls=("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", *impls.REMOTE_ROWS,
           "pyzmq", "floor"),
    rows={"fastmq-futex": "vllm", "fastmq-zmq": "vllm", "fastmq-spin": "vllm", "vllm": None,
          **impls.REMOTE_ROWS, "pyzmq": "vllm", "floor+pickle": "vllm", "floor": "vllm"},
    columns=latency_columns("us"), floor="floor+pickle", size_header="payload",
    bounds={"floor+pickle": lambda i: not i.startswith("floor"),
            "floor": lambda i: not i.startswith("floor")},
    summary=(Line("step round trip", "fastmq-futex", "vllm", readme=True),
             Line("step round trip against its floor (pickling + a C round trip)",
                  "fastmq-futex", "floor+pickle"),
             Line("step round trip, remote readers (TCP)", "fastmq-remote", "vllm-remote",
                  readme=True),
             Line("step round trip, remote readers (TCP), +encrypt", "fastmq-remote+encrypt",
                  "vllm-remote"),
             Line("step round trip, remote readers (TCP), +plain", "fastmq-remote+plain",
                  "vllm-remote"),
             Line(f"step round trip, {_BOTH}", "fastmq-remote-both", "vllm-remote-both"),
             Line(f"step round trip, {_BOTH}, +encrypt", "fastmq-remote-both+encrypt",
                  "vllm-remote-both"),
             Line(f"step round trip, {_BOTH}, +plain", "fastmq-remote-both+plain",
                  "vllm-remote-both"),
             # What the default security costs: against plain TCP, same shape.
             Line("security cost: fastmq-remote against fastmq-remote+plain, step round "
                  "trip", "fastmq-remote", "fastmq-remote+plain"),
             Line("security cost: fastmq-remote-both against fastmq-remote-both+plain, step "
                  "round trip", "fastmq-remote-both", "fastmq-remote-both+plain")),
    summary_size=KiB, hidden=("floor-memcpy",), notes=_notes)


def run(env, impls, params, progress) -> list[dict]:
    def measure(g):
        out, seq = [], 0
        for size in params.step_sizes:
            progress.detail(fmt_size(size))

            def one() -> int:
                nonlocal seq
                seq += 1
                return g.round_trip(("step", seq, step_payload(seq, size)))[0]

            out.append(record(NAME, g.impl.name, g.n, size, "us", env, sample_loop(
                one, params.step_warmup, params.step_min, params.step_max,
                params.step_budget_s), 1e3, warmup=params.step_warmup))
        return out

    records = groups(env, impls, params, progress, NAME, measure,
                     lambda impl, n: floors.step_floor(env, n, params, progress))
    if any(impl.family == "floor" for impl in impls):
        progress.detail("floor: one memcpy of the payload")
        records += floors.memcpy_floor(params.step_sizes)
    return records


def reader_loop(end, rank: int, params):
    return serve(end, rank, params, "step", lambda seq, payload, t: check_step_payload(
        seq, payload) or ())
