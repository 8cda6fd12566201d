"""``throughput``: small messages, pipelined, one writer to N readers.

The writer sends ``("tp", seq, payload)`` as fast as the implementation
takes them for a time budget, then ``("end", last_seq, count)``; each reader
checks every number and payload and answers the end message with how many
it received.  The figure is messages per second delivered to every reader,
from the first send to the last reader's answer (so it includes draining).
"""
from __future__ import annotations

import statistics
import time

from fastmq.bench.harness import ReaderGroup, receive
from fastmq.bench.scenario import Line, Scenario, rate, ratio
from fastmq.bench.verify import VerifyError, expect_seq, pattern

NAME = "throughput"
SPEC = Scenario(
    NAME, "throughput: small messages pipelined, 1 writer to N readers; messages per "
    "second delivered to every reader",
    impls=("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", "pyzmq"),
    rows={"fastmq-futex": "vllm", "fastmq-zmq": "vllm", "fastmq-spin": "vllm", "vllm": None,
          "pyzmq": "vllm"},
    columns=(("msgs/s", lambda r: rate(r["rate"])),
             ("min .. max", lambda r: f"{rate(r['rate_min'])} .. {rate(r['rate_max'])}"),
             ("vs vLLM", lambda r: ratio(r.get("vs_vllm"))),
             ("messages", lambda r: str(r["messages"]))),
    size_header="payload", rate=True,
    summary=(Line("throughput, small messages", "fastmq-futex", "vllm", unit="",
                  readme=True),))


def run(env, impls, params, progress) -> list[dict]:
    records = []
    payload = pattern(params.tp_payload)
    for n in params.readers[NAME]:
        for impl in impls:
            progress.start(f"throughput  {impl.name}  N={n}")
            rates, counts = [], []
            with ReaderGroup(env, impl, n, NAME, params) as g:
                send, ack = g.send, g.ack
                seq = 0
                for rep in range(params.tp_warmup_reps + params.tp_reps):
                    count = 0
                    t0 = time.perf_counter_ns()
                    stop = t0 + int(params.tp_budget_s * 1e9)
                    while count < params.tp_max_msgs:
                        seq += 1
                        send(("tp", seq, payload))
                        count += 1
                        if (count & 255) == 0 and time.perf_counter_ns() >= stop:
                            break
                    send(("end", seq, count))
                    acks = [ack(r) for r in range(n)]
                    dt = time.perf_counter_ns() - t0
                    for r, a in enumerate(acks):
                        if a != ("ok", seq, r, count):
                            raise g.bad_ack(r, a, ("ok", seq, r, count))
                    if rep >= params.tp_warmup_reps:
                        rates.append(count / dt * 1e9)
                        counts.append(count)
            rate = statistics.median(rates)
            records.append({
                "scenario": NAME, "impl": impl.name, "n_readers": n,
                "size_bytes": params.tp_payload, "unit": "msg/s",
                "oversubscribed": env.oversubscribed(n),
                "rate": rate, "rate_min": min(rates), "rate_max": max(rates),
                "reps": len(rates), "messages": sum(counts),
            })
    return records


def reader_loop(end, rank: int, params):
    recv, reply, timeout = end.recv, end.reply, params.timeout_s
    payload = pattern(params.tp_payload)
    expect, got, ends = 1, 0, 0
    while True:
        m = receive(recv, timeout, expect)
        if m is None:
            return {"received": expect - 1 + ends}
        kind = m[0] if type(m) is tuple and len(m) == 3 else None
        if kind == "tp":
            expect_seq(expect, m[1])
            if m[2] != payload:
                raise VerifyError(f"message {m[1]}: payload differs from what was sent")
            expect += 1
            got += 1
        elif kind == "end":
            expect_seq(expect - 1, m[1])
            if m[2] != got:
                raise VerifyError(f"the writer sent {m[2]} messages, this reader got {got}")
            reply(("ok", m[1], rank, got), timeout)
            got = 0
            ends += 1
        else:
            raise VerifyError(f"unexpected message {m!r:.80}")
