"""``executor``: ``collective_rpc`` round trips in vLLM's real
``MultiprocExecutor``, fastmq against vLLM's own queue, in the same run.

vLLM's executor starts ``N`` real ``WorkerProc`` workers (tensor parallel
size ``N``, CPU platform, spawn), each running vLLM's RPC loop on vLLM's
scheduler broadcast queue and its own response queue.  The worker has no
device and no model (``fastmq.bench._executor_worker.EchoWorker``); the
model is a 2-layer Llama *config* written to a temporary directory (no
weights).  One round trip = ``executor.collective_rpc("echo", args=(payload,))``
with every worker answering, as vLLM's own calls do by default; a second
figure has only rank 0 answering (``unique_reply_rank=0``, as
``execute_model`` does).

Not in the default and ``--quick`` runs (vLLM's start-up takes minutes on
a small machine): ``fastmq-bench --scenario executor --readers 2``, or
``--full`` (N = 1, 2).  Each implementation runs in its own engine process (``python -m
fastmq.bench.executor``), started with ``FASTMQ_VLLM=1`` (fastmq active,
checked) or ``FASTMQ_VLLM=0`` (vLLM's own queue, checked), one after the
other.  Start-up (vLLM's import in the engine and each worker) takes
tens of seconds per implementation; it is not measured.

The builder (``tiny_model``, ``make_executor``) is also what the tests use.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

NAME = "executor"
IMPLS = ("fastmq-futex", "vllm")
REPLIES = ("all", "rank0")

# What vLLM needs on a CPU-only machine: its CPU platform (which starts
# workers with spawn), no NUMA binding (its binding asserts on small VMs),
# one OpenMP thread per process.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "OMP_NUM_THREADS": "1"}
WORKER_CLS = "fastmq.bench._executor_worker.EchoWorker"


def tiny_model(directory: str) -> str:
    """Write a 2-layer Llama config (no weights) to ``directory``."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                max_position_embeddings=256).save_pretrained(directory)
    return directory


def make_executor(model_dir: str, tp: int, worker_cls: str = WORKER_CLS, **engine_args):
    """vLLM's ``MultiprocExecutor`` over ``tp`` workers of ``worker_cls``,
    configured as ``EngineArgs`` would configure it (so fastmq's engine
    argument defaults apply).  ``ENGINE_ENV`` must be in the environment
    before vLLM is imported.  Returns ``(executor, vllm_config)``."""
    missing = {k: v for k, v in ENGINE_ENV.items() if os.environ.get(k) is None}
    if missing:
        raise RuntimeError(f"set {missing} before importing vLLM")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=tp,
                      distributed_executor_backend="mp", worker_cls=worker_cls,
                      enforce_eager=True, max_model_len=256, **engine_args)
    config = args.create_engine_config()
    return MultiprocExecutor(config), config


def queue_module(executor) -> str:
    return type(executor.rpc_broadcast_mq).__module__


# ---------------------------------------------------------------------------
# the engine process (python -m fastmq.bench.executor)

def _payload(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(range(size % 256))


def measure(executor, size: int, warmup: int, count: int, reply: str) -> list[int]:
    """Round-trip times (ns) of ``count`` echoes of ``size`` bytes, after
    ``warmup``; every answer is checked."""
    payload = _payload(size)
    rank = 0 if reply == "rank0" else None
    n = executor.parallel_config.world_size
    out = []
    for i in range(warmup + count):
        msg = (i, payload)
        t0 = time.perf_counter_ns()
        got = executor.collective_rpc("echo", args=(msg,), unique_reply_rank=rank)
        t1 = time.perf_counter_ns()
        want = msg if rank is not None else [msg] * n
        if got != want:
            raise RuntimeError(f"echo {i} of {size} bytes came back wrong")
        if i >= warmup:
            out.append(t1 - t0)
    return out


def _child(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--expect", choices=("fastmq", "vllm"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", help="write cProfile stats of the counted round trips here")
    a = ap.parse_args(argv)
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    with tempfile.TemporaryDirectory(prefix="fastmq-bench-model-") as d:
        executor, _ = make_executor(tiny_model(d), a.workers)
        try:
            got = queue_module(executor)
            if (got == "fastmq.queue") != (a.expect == "fastmq"):
                raise RuntimeError(f"expected {a.expect}'s queue in the executor, got {got}")
            result = {"queue": got, "records": []}
            prof = None
            if a.profile:
                import cProfile

                prof = cProfile.Profile()
            for size in [int(s) for s in a.sizes.split(",")]:
                for reply in REPLIES:
                    if prof:
                        prof.enable()
                    ns = measure(executor, size, a.warmup, a.count, reply)
                    if prof:
                        prof.disable()
                    result["records"].append({"size": size, "reply": reply, "ns": ns})
            if prof:
                prof.dump_stats(a.profile)
        finally:
            executor.shutdown()
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------------
# the scenario (called by fastmq.bench.runner)

def groups(impls, params) -> int:
    return len(impls) * len(params.readers.get(NAME, []))


def _sizes(params) -> list[int]:
    return [params.step_sizes[0]]


def run(env, impls, params, progress) -> list[dict]:
    from fastmq.bench.harness import run_child_scenario, summarize

    records = []
    count = max(params.step_min, min(params.step_max, 2000))
    warmup = params.step_warmup
    if not params.readers.get(NAME):
        progress.note("executor: not run (vLLM's start-up takes minutes); run it with "
                      "--scenario executor --readers 2, or --full")
    for n in params.readers.get(NAME, []):
        for impl in impls:
            progress.start(f"executor  {impl.name}  N={n} workers")
            expect = "fastmq" if impl.family == "fastmq" else "vllm"
            child_env = dict(os.environ, **ENGINE_ENV)
            child_env["FASTMQ_VLLM"] = "1" if expect == "fastmq" else "0"
            child_env["FASTMQ_WAIT"] = impl.wait_mode or child_env.get("FASTMQ_WAIT", "futex")
            # Start-up imports vLLM in three processes: minutes on a busy machine.
            result = run_child_scenario(
                "fastmq.bench.executor", ["--workers", n, "--sizes",
                                          ",".join(map(str, _sizes(params))), "--warmup",
                                          warmup, "--count", count, "--expect", expect],
                child_env, params.timeout_s + 600, f"executor {impl.name}")
            by_size: dict[int, dict] = {}
            for rec in result["records"]:
                r = by_size.setdefault(rec["size"], {
                    "scenario": NAME, "impl": impl.name, "n_readers": n,
                    "size_bytes": rec["size"], "oversubscribed": env.oversubscribed(n)})
                stats = summarize(rec["ns"], 1e3)
                if rec["reply"] == "all":
                    r.update(stats)
                else:
                    # Same record (the report pairs fastmq and vLLM by size):
                    # the rank-0-only figures ride along under their own keys.
                    r.update({f"rank0_{k}": v for k, v in stats.items()})
            records += by_size.values()
    vllm = {(r["n_readers"], r["size_bytes"]): r for r in records if r["impl"] == "vllm"}
    for r in records:
        v = vllm.get((r["n_readers"], r["size_bytes"]))
        r["rank0_vs_vllm"] = (v["rank0_p50"] / r["rank0_p50"]
                              if v and r.get("rank0_p50") else None)
    return records


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
