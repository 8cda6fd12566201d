"""``executor``: ``collective_rpc`` round trips in vLLM's real
``MultiprocExecutor`` (N ``WorkerProc`` on the CPU platform, an echo worker
and no model), fastmq against vLLM's own queue; all ranks answering, and
rank 0 only, as ``execute_model`` does.  On request only: vLLM's start-up
takes minutes (``--scenario executor --readers 2``, ``--full``).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

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

# vLLM on a CPU-only machine: its CPU platform (which starts workers with
# spawn), no NUMA binding (it asserts on small VMs), one OpenMP thread each.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "OMP_NUM_THREADS": "1"}


def _child(argv: list[str]) -> int:
    """The engine process: ``--workers N --size B --warmup W --count C
    --expect fastmq|vllm --out FILE``."""
    a = dict(zip(argv[::2], argv[1::2]))
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    from transformers import LlamaConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    n, size = int(a["--workers"]), int(a["--size"])
    warmup, count = int(a["--warmup"]), int(a["--count"])
    with tempfile.TemporaryDirectory(prefix="fastmq-bench-model-") as d:
        LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                    max_position_embeddings=256).save_pretrained(d)
        executor = MultiprocExecutor(EngineArgs(
            model=d, skip_tokenizer_init=True, tensor_parallel_size=n,
            distributed_executor_backend="mp", enforce_eager=True, max_model_len=256,
            worker_cls="fastmq.bench._executor_worker.EchoWorker").create_engine_config())
        try:
            got = type(executor.rpc_broadcast_mq).__module__
            if (got == "fastmq.queue") != (a["--expect"] == "fastmq"):
                raise RuntimeError(f"expected {a['--expect']}'s queue in the executor, got {got}")
            payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
            result = {"queue": got}
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
    with open(a["--out"], "w") as f:
        json.dump(result, f)
    return 0


def run(env, impls, params, progress) -> list[dict]:
    from fastmq.bench.harness import run_child_scenario, summarize

    records = []
    if not params.readers.get(NAME):
        progress.note("executor: not run (vLLM's start-up takes minutes); run it with "
                      "--scenario executor --readers 2, or --full")
    size = params.step_sizes[0]
    for n in params.readers.get(NAME, []):
        for impl in impls:
            progress.start(f"executor  {impl.name}  N={n} workers")
            expect = "fastmq" if impl.family == "fastmq" else "vllm"
            child_env = dict(os.environ, **ENGINE_ENV, FASTMQ_VLLM=str(int(expect == "fastmq")))
            child_env["FASTMQ_WAIT"] = impl.wait_mode or child_env.get("FASTMQ_WAIT", "futex")
            # Start-up imports vLLM in three processes: minutes on a busy machine.
            result = run_child_scenario(
                "fastmq.bench.executor",
                ["--workers", n, "--size", size, "--warmup", params.step_warmup, "--count",
                 max(params.step_min, min(params.step_max, 2000)), "--expect", expect],
                child_env, params.timeout_s + 600, f"executor {impl.name}")
            # One record (the report pairs rows by size): the rank-0-only
            # figures ride along under their own keys.
            records.append({"scenario": NAME, "impl": impl.name, "n_readers": n,
                            "size_bytes": size, "oversubscribed": env.oversubscribed(n),
                            "unit": "us", **summarize(result["all"], 1e3),
                            **{f"rank0_{k}": v
                               for k, v in summarize(result["rank0"], 1e3).items()}})
    return records


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
