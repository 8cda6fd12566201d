"""What the vLLM tests build: a tiny Llama config (no weights), vLLM's
``MultiprocExecutor`` over it, and vLLM's CPU build's ``LLM`` with dummy
weights, seeded sampling and token-id prompts.  (The benchmark builds its
own; the tests do not import it.)"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# vLLM on a CPU-only machine: its CPU platform (which starts workers with
# spawn), no NUMA binding (its binding asserts on small VMs), one OpenMP
# thread per process.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "OMP_NUM_THREADS": "1"}
# vLLM's CPU build (real generation) also needs a small KV cache (GiB).
GEN_ENGINE_ENV = {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
# Dummy weights (seeded), no tokenizer, eager mode, a short context; a
# headless node of a multi-node run passes the same to its EngineArgs.
ENGINE_ARGS = {"load_format": "dummy", "skip_tokenizer_init": True,
               "distributed_executor_backend": "mp", "dtype": "float32",
               "enforce_eager": True, "max_model_len": 256, "seed": 0}
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 30], [100, 200, 300, 400, 500], [7] * 12)


def _llama(directory: str, **sizes) -> str:
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                **sizes).save_pretrained(directory)
    return directory


def tiny_model(directory: str) -> str:
    """A 2-layer Llama config for an executor whose workers load nothing."""
    return _llama(directory, hidden_size=64, intermediate_size=128, vocab_size=256,
                  max_position_embeddings=256)


def tiny_llama(directory: str) -> str:
    """A 2-layer Llama config vLLM's CPU build generates with (its CPU
    attention needs a head size of 32 or more: 256 / 4 = 64)."""
    return _llama(directory, hidden_size=256, intermediate_size=512, vocab_size=1024,
                  max_position_embeddings=512)


def _need(env: dict) -> None:
    missing = {k: v for k, v in env.items() if os.environ.get(k) is None}
    if missing:
        raise RuntimeError(f"set {missing} before importing vLLM")


def make_executor(model_dir: str, tp: int, worker_cls: str, **engine_args):
    """vLLM's ``MultiprocExecutor`` over ``tp`` workers of ``worker_cls``,
    configured as ``EngineArgs`` configures it (so fastmq's engine argument
    defaults apply).  Returns ``(executor, vllm_config)``."""
    _need(ENGINE_ENV)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=tp,
                      distributed_executor_backend="mp", worker_cls=worker_cls,
                      enforce_eager=True, max_model_len=256, **engine_args)
    config = args.create_engine_config()
    return MultiprocExecutor(config), config


def make_llm(model_dir: str, tp: int = 2, **kwargs):
    """``vllm.LLM`` on ``model_dir`` with dummy weights and ``tp`` workers."""
    _need(GEN_ENGINE_ENV)
    from vllm import LLM

    return LLM(model=model_dir, tensor_parallel_size=tp, **ENGINE_ARGS, **kwargs)


def generate(llm, prompts, max_tokens: int, seed: int = 1234) -> list[list[int]]:
    """Each prompt's token ids, sampled with a seed of its own."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95,
                             seed=seed + i, ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Boxed:
    """A tensor in an object vLLM's front-to-engine encoding does not know,
    so that it travels pickled (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) and
    arrives a tensor; bare, it would arrive a list."""

    def __init__(self, t):
        self.t = t


def arena_probe(worker, boxed: Boxed) -> dict:
    """Run in each worker by ``collective_rpc``: whether the tensor it was
    sent lies in a fastmq tensor arena this worker maps, and its sum."""
    from fastmq import arena

    t = boxed.t
    ptr = t.data_ptr()
    return {"in_arena": any(a.contains(ptr) for a in list(arena._ARENAS.values())),
            "nbytes": t.numel() * t.element_size(), "sum": float(t.sum())}


def _cmd(p) -> str:
    try:
        return " ".join(p.cmdline())
    except Exception:
        return "?"


def engine_pids(front_pid: int | None = None) -> dict:
    """``{"engine": pid, "workers": [pid, ...]}``: vLLM's engine core (a
    child of the front process) and its workers (its children), not
    multiprocessing's resource tracker."""
    import psutil

    def ours(p):
        return "multiprocessing.resource_tracker" not in _cmd(p)

    front = psutil.Process(front_pid or os.getpid())
    procs = [p for p in front.children() if ours(p)]
    if len(procs) != 1:
        raise RuntimeError(f"expected one engine core process under {front.pid}, got "
                           f"{[(p.pid, _cmd(p)[:80]) for p in procs]}")
    return {"engine": procs[0].pid,
            "workers": sorted(p.pid for p in procs[0].children() if ours(p))}


def queue_class() -> str:
    from vllm.distributed.device_communicators import shm_broadcast

    return shm_broadcast.MessageQueue.__module__


def vllm_cpu_python() -> str | None:
    """The Python of vLLM's CPU build: ``FASTMQ_VLLM_CPU_PYTHON``, else
    ``.venv-vllm-cpu`` in the checkout, else this one if it has vllm-cpu."""
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
