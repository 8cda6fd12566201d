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

from fastmq.bench import floors
from fastmq.bench.harness import ReaderGroup, receive, sample_loop, summarize
from fastmq.bench.verify import VerifyError, check_step_payload, expect_seq, step_payload

NAME = "step"
IMPLS = ("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm",
         # every reader remote, answers local
         "fastmq-remote", "fastmq-remote+encrypt", "fastmq-remote+plain", "vllm-remote",
         # remote both ways (vLLM's multi-node executor)
         "fastmq-remote-both", "fastmq-remote-both+encrypt", "fastmq-remote-both+plain",
         "vllm-remote-both",
         "pyzmq", "floor")


def groups(impls, params) -> int:
    floor_memcpy = any(impl.family == "floor" for impl in impls)
    return len(impls) * len(params.readers[NAME]) + floor_memcpy


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
                    progress.detail(_size(size))
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
        progress.start("step  floor: one memcpy of the payload")
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


def _size(n: int) -> str:
    from fastmq.bench.config import fmt_size

    return fmt_size(n)
