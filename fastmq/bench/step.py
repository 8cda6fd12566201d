"""``step``: the executor round trip.

One writer broadcasts ``("step", seq, payload)`` to N readers; each reader
checks the number and every byte of the payload and answers ``("ok", seq,
rank)`` on its own 1:1 queue; the writer's clock stops when all N answers
are in.  This is what vLLM's engine pays per scheduler step to reach its
workers and hear back from them.  The ``-remote`` rows make the broadcast's
readers remote; the ``-remote-both`` rows the answer queues' reader too, as
vLLM's multi-node executor does (see impls.py).
"""
from __future__ import annotations

import time

from fastmq.bench import floors, impls
from fastmq.bench.config import KiB, fmt_size
from fastmq.bench.harness import ReaderGroup, receive, sample_loop, summarize
from fastmq.bench.scenario import Line, Scenario, latency_columns, num
from fastmq.bench.verify import VerifyError, check_step_payload, expect_seq, step_payload

NAME = "step"
_BOTH = "remote both ways (vLLM's multi-node executor shape)"


def _notes(rs, records) -> list[str]:
    names = {r["impl"] for r in rs}
    mc = [r for r in records if r["impl"] == "floor-memcpy"]
    return ([f"floor-memcpy (one memcpy of the payload, p50): " + ", ".join(
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
    records: list[dict] = []
    for n in params.readers[NAME]:
        for impl in impls:
            progress.start(f"step  {impl.name}  N={n}")
            if impl.family == "floor":
                records += floors.step_floor(env, n, params, progress)
                continue
            with ReaderGroup(env, impl, n, NAME, params) as g:
                seq = 0
                for size in params.step_sizes:
                    progress.detail(fmt_size(size))
                    send, ack = g.send, g.ack
                    readers = range(n)

                    def one() -> int:
                        nonlocal seq
                        seq += 1
                        msg = ("step", seq, step_payload(seq, size))
                        t0 = time.perf_counter_ns()
                        send(msg)
                        acks = [ack(r) for r in readers]
                        dt = time.perf_counter_ns() - t0
                        for r, a in enumerate(acks):
                            if a != ("ok", seq, r):
                                raise g.bad_ack(r, a, ("ok", seq, r))
                        return dt

                    samples = sample_loop(one, params.step_warmup, params.step_min,
                                          params.step_max, params.step_budget_s)
                    records.append(record(impl.name, n, size, samples, params.step_warmup,
                                          env.oversubscribed(n)))
    if any(impl.family == "floor" for impl in impls):
        progress.detail("floor: one memcpy of the payload")
        records += floors.memcpy_floor(params.step_sizes)
    return records


def record(impl: str, n: int, size: int, samples_ns: list, warmup: int,
           oversubscribed: bool) -> dict:
    return {"scenario": NAME, "impl": impl, "n_readers": n, "size_bytes": size,
            "unit": "us", "warmup": warmup, "oversubscribed": oversubscribed,
            **summarize(samples_ns, 1e3), "samples_ns": samples_ns}


def reader_loop(end, rank: int, params):
    recv, reply, timeout = end.recv, end.reply, params.timeout_s
    expect = 1
    while True:
        m = receive(recv, timeout, expect)
        if m is None:
            return {"received": expect - 1}
        if type(m) is not tuple or len(m) != 3 or m[0] != "step":
            raise VerifyError(f"expected a step message, received {type(m).__name__}")
        expect_seq(expect, m[1])
        check_step_payload(m[1], m[2])
        reply(("ok", m[1], rank), timeout)
        expect += 1

