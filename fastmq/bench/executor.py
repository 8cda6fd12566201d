"""``executor``: collective_rpc round trips in vLLM's own MultiprocExecutor."""
from __future__ import annotations

import time

from fastmq.bench.harness import engine_child, expect_queue, record, run_engine, summarize
from fastmq.bench.scenario import Line, Scenario, latency_columns, num, ratio

NAME = "executor"
SPEC = Scenario(
    NAME, "executor: collective_rpc round trip in vLLM's MultiprocExecutor with N workers, "
    "every worker answering; microseconds",
    impls=("fastmq-futex", "vllm"), rows={"fastmq-futex": "vllm", "vllm": None},
    columns=latency_columns("us", None)[:-1] + (
        ("rank 0 only p50 us", lambda r: num(r.get("rank0_p50"))),
        ("rank 0 only vs vLLM", lambda r: ratio(r.get("rank0_vs_vllm"))),
        ("samples", lambda r: str(r["samples"]))),
    size_header="payload", extra_ratios={"rank0_vs_vllm": "rank0_p50"},
    summary=(Line("vLLM's executor, collective_rpc round trip", "fastmq-futex", "vllm"),))

def _child(a: dict, model: str) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    n, size = int(a["--workers"]), int(a["--size"])
    warmup, count = int(a["--warmup"]), int(a["--count"])
    executor = MultiprocExecutor(EngineArgs(
        model=model, skip_tokenizer_init=True, tensor_parallel_size=n,
        distributed_executor_backend="mp", enforce_eager=True, max_model_len=256,
        worker_cls="fastmq.bench._executor_worker.EchoWorker").create_engine_config())
    try:
        result = {"queue": expect_queue(type(executor.rpc_broadcast_mq), a)}
        payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
        for reply, rank in (("all", None), ("rank0", 0)):
            ns = []
            for i in range(warmup + count):
                msg = (i, payload)
                t0 = time.perf_counter_ns()
                back = executor.collective_rpc("echo", args=(msg,), unique_reply_rank=rank)
                dt = time.perf_counter_ns() - t0
                if back != (msg if rank is not None else [msg] * n):
                    raise RuntimeError(f"echo {i} of {size} bytes came back wrong")
                if i >= warmup:
                    ns.append(dt)
            result[reply] = ns
    finally:
        executor.shutdown()
    return result


def run(env, impls, params, progress) -> list[dict]:
    records = []
    if not params.readers.get(NAME):
        progress.note("executor: not run (vLLM's start-up takes minutes); run it with "
                      "--scenario executor --readers 2, or --full")
    size = params.step_sizes[0]
    for n in params.readers.get(NAME, []):
        for impl in impls:
            progress.start(f"executor  {impl.name}  N={n} workers")
            # Start-up imports vLLM in three processes: minutes on a busy machine.
            result = run_engine(
                "fastmq.bench.executor", impl,
                ["--workers", n, "--size", size, "--warmup", params.step_warmup, "--count",
                 max(params.step_min, min(params.step_max, 2000))], params.timeout_s + 600)
            # One record (the report pairs rows by size): the rank-0-only
            # figures ride along under their own keys.
            records.append(record(NAME, impl.name, n, size, "us", env, result["all"], 1e3,
                                  **{f"rank0_{k}": v for k, v in
                                     summarize(result["rank0"], 1e3).items()}))
    return records


if __name__ == "__main__":
    engine_child(_child, hidden_size=64, intermediate_size=128, vocab_size=256,
                 max_position_embeddings=256)
