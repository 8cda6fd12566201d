"""``throughput``: small messages pipelined, delivered to every reader per second."""
from __future__ import annotations

import statistics
import time

from fastmq.bench.harness import VerifyError, expect_seq, groups, pattern, receive, record
from fastmq.bench.scenario import Line, Scenario, rate, ratio

NAME = "throughput"
SPEC = Scenario(
    NAME, "throughput: small messages pipelined, 1 writer to N readers; messages per "
    "second delivered to every reader",
    rows={"fastmq-futex": "vllm", "vllm": None},
    columns=(("msgs/s", lambda r: rate(r["rate"])),
             ("min .. max", lambda r: f"{rate(r['rate_min'])} .. {rate(r['rate_max'])}"),
             ("vs vLLM", lambda r: ratio(r.get("vs_vllm"))),
             ("messages", lambda r: str(r["messages"]))),
    size_header="payload", rate=True,
    summary=(Line("throughput, small messages", "fastmq-futex", "vllm", unit="",
                  readme=True),))


def run(env, impls, params, progress) -> list[dict]:
    payload = pattern(params.tp_payload)

    def measure(g):
        rates, counts, send, seq = [], [], g.send, 0
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
            # Until every reader answered the end message: draining included.
            dt = time.perf_counter_ns() - t0 + g.round_trip(("end", seq, count), count)[0]
            if rep >= params.tp_warmup_reps:
                rates.append(count / dt * 1e9)
                counts.append(count)
        return [record(NAME, g.impl.name, g.n, params.tp_payload, "msg/s", env,
                       rate=statistics.median(rates), rate_min=min(rates),
                       rate_max=max(rates), reps=len(rates), messages=sum(counts))]

    return groups(env, impls, params, progress, NAME, measure)


def reader_loop(recv, reply, rank: int, params):
    timeout = params.timeout_s
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
