"""One run: every scenario in turn, again per repeat; and what it ran on."""
from __future__ import annotations

import gc
import importlib
import os
import platform
import sys
import time
from contextlib import suppress

from fastmq.bench import figures, impls as impls_mod, scenario
from fastmq.bench.config import SCENARIOS
from fastmq.bench.harness import BenchError, Env  # noqa: F401 (the command catches it)

# Imported once by the forkserver: a reader starts in milliseconds, not a torch import.
_PRELOAD = ["numpy", "zmq", "fastmq", "fastmq.bench.harness", "fastmq.bench.impls",
            *(f"fastmq.bench.{s}" for s in SCENARIOS)]
_VLLM = "vllm.distributed.device_communicators.shm_broadcast"


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def skipped(scenarios: list[str]) -> dict[str, str]:
    return {} if have_torch() else {
        s: "skipped: needs torch, which is not installed (pip install 'vllm-fastmq[torch]')"
        for s in scenarios if scenario.get(s).needs_torch}


class Progress:
    """A line per run on stderr: how far the run is, and since when."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.i, self.prefix, self.enabled = total, 0, "", enabled
        self.t0 = time.monotonic()

    def start(self, label: str) -> None:
        self.i += 1
        s = int(time.monotonic() - self.t0)
        self.note(f"[{self.i}/{self.total} {s // 60}:{s % 60:02d}] {self.prefix}{label}")

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr, flush=True)


def plan(scenarios: list[str], only: str | None) -> dict:
    """``{scenario: [Impl, ...]}`` in report order."""
    wanted = [n.strip() for n in (only or "").split(",") if n.strip()] or None
    unknown = [n for n in wanted or [] if n not in impls_mod.IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(impls_mod.IMPLS)}")
    skip = skipped(scenarios)
    out = {s: [impls_mod.IMPLS[n] for n in scenario.get(s).rows
               if n in impls_mod.IMPLS and (wanted is None or n in wanted)]
           for s in scenarios if s not in skip}
    out = {s: lst for s, lst in out.items() if lst}
    if not out:
        why = "; ".join(f"{s}: {r}" for s, r in skip.items())
        raise ValueError("nothing to run: no selected implementation takes part in the "
                         "selected scenarios" + (f" ({why})" if why else ""))
    return out


def describe(plan_: dict, scenarios: list[str] | None = None) -> str:
    lines = [f"scenario {s}: {why}" for s, why in skipped(scenarios or SCENARIOS).items()]
    lines.append("implementations (name: what it is; selected scenarios; runs here):")
    for impl in impls_mod.IMPLS.values():
        where = [s for s, lst in plan_.items() if impl in lst]
        ok, why = impls_mod.availability(impl) if where else (None, "")
        state = "not checked" if ok is None else "yes" if ok else "no: " + why
        lines.append(f"  {impl.name:26s} {impl.description}; "
                     f"{', '.join(where) or 'not selected'}; {state}")
    return "\n".join(lines)


def run(plan_: dict, params, progress: bool = True, scenarios: list[str] | None = None) -> dict:
    load_start = loadavg()
    selected = {i.name: i for lst in plan_.values() for i in lst}
    skip = skipped(scenarios or list(plan_))
    notes = [f"Scenario {s} {why}." for s, why in skip.items()]
    available = {}
    for name, impl in selected.items():
        ok, why = impls_mod.availability(impl)  # imports vLLM here, once
        available[name] = {"available": ok, "reason": why, "description": impl.description}
        if not ok:
            notes.append(f"{name} not measured: {why}.")
    vllm = [available[n]["available"] for n, i in selected.items() if i.family == "vllm"]
    if vllm and not any(vllm):
        notes.append("No vLLM figures, so no ratios against vLLM.")
    env = Env((["torch"] if have_torch() else []) + _PRELOAD + ([_VLLM] if any(vllm) else []))
    # torch and vLLM are imported now and stay: keep their objects out of
    # the collections that closing each run's queues makes.
    gc.freeze()
    plan_ = {s: [i for i in lst if available[i.name]["available"]] for s, lst in plan_.items()}
    plan_ = {s: lst for s, lst in plan_.items() if lst}

    repeats = params.repeats
    # The tensor scenario opens more fresh queues for its first-use figures.
    prog = Progress(repeats * sum(len(lst) * len(params.readers.get(s, []))
                                  * (params.tensor_first_queues if s == "tensor" else 1)
                                  for s, lst in plan_.items()), enabled=progress)
    runs: list[list[dict]] = []
    for rep in range(repeats):
        records: list[dict] = []
        prog.prefix = f"run {rep + 1}/{repeats}  " if repeats > 1 else ""
        for s, lst in plan_.items():
            # Every other run in the reverse order: what one implementation
            # leaves behind (memory the machine must provision again, a
            # warm cache) does not always fall to the same next one.
            order = lst if rep % 2 == 0 else lst[::-1]
            records += importlib.import_module(f"fastmq.bench.{s}").run(env, order, params, prog)
        figures.annotate(records)
        runs.append(records)

    records = figures.merge(runs)
    load_end = loadavg()
    notes += figures.check_floors(records) + _notes(records, params, env, load_start, load_end)
    machine = dict(_machine(), loadavg_start=load_start, loadavg_end=load_end)
    config = dict(vars(params), scenarios=list(plan_),
                  implementations={s: [i.name for i in lst] for s, lst in plan_.items()})
    return {"schema": figures.SCHEMA, "machine": machine, "versions": versions(any(vllm)),
            "config": config, "implementations": available, "skipped_scenarios": skip,
            "notes": notes, "records": records}


def _notes(records, params, env, load_start, load_end) -> list[str]:
    notes = []
    cpus = env.usable_cpus
    over = sorted({r["n_readers"] for r in records if r.get("oversubscribed")})
    if over:
        notes.append(
            f"This machine has {cpus} usable cores: runs marked * (N = "
            f"{', '.join(map(str, over))}) have more busy processes (1 writer + N readers) "
            f"than cores, so their figures include waiting for a core. N=1 (TP=1) is the "
            f"clean figure.")
    pinned = sorted({(r["n_readers"], tuple(r["reader_cpus"])) for r in records
                     if r.get("reader_cpus")})
    if pinned:
        notes.append(
            "In those runs each reader process is pinned to one core, the same way for every "
            "implementation and floor (" + "; ".join(
                f"N={n}: cores {', '.join(map(str, c))}" for n, c in pinned) + "); the "
            "writer is not pinned, and no reader is pinned to the first core. Left to the "
            "scheduler, where the processes land decides these figures (by up to about 2x), "
            "so that a run's figure is a draw of placements."
            + (" Real generation (vLLM's own workers) is not pinned."
               if any(r["scenario"] == "generate" for r in records) else ""))
    busy = figures.busy_note(load_start, load_end, cpus)
    notes += [busy] if busy else []
    if params.preset == "quick":
        notes.append("--quick is a smoke run: too few samples for figures to quote.")
    notes.append(f"Every figure is the median of {params.repeats} runs (each run measures "
                 "every implementation once, in turn, every other run in the reverse "
                 "order); runs' p50 = the lowest and the highest run's value."
                 if params.repeats > 1 else
                 "One run: figures are not medians of repeated runs (--repeat 3 or --full "
                 "for those).")
    no_arena = sorted({r["impl"] for r in records if r["impl"].startswith("fastmq")
                       and r["impl"].endswith("+arena") and r.get("arena_active") is False})
    if no_arena:
        notes.append(f"{', '.join(no_arena)} ran without a tensor arena (FASTMQ_ARENA=0 "
                     "turns it off), so it measures the same path as fastmq-futex.")
    notes.append(f"Ratios: {scenario.RATIO_RULE}. vs vLLM compares with vLLM on the same path "
                 "(arena with arena, arena off with arena off, remote with remote of the same "
                 "shape); vs floor with the scenario's floor. Warm-up rounds are excluded; "
                 "every reader verifies every message (number and content) and the run "
                 "fails otherwise.")
    return notes


def _proc_field(path: str, key: str) -> str | None:
    with open(path) as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(key)), None)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _machine() -> dict:
    return {"cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor()
            or "unknown", "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)), "kernel": platform.release(),
            "os": platform.platform(), "machine": platform.machine(),
            "memory_bytes": int(_proc_field("/proc/meminfo", "MemTotal:").split()[0]) * 1024,
            "python": platform.python_version()}


def versions(with_vllm: bool) -> dict:
    """What was measured; ``torch`` None when not installed."""
    import numpy
    import zmq

    import fastmq

    out = {"fastmq": fastmq.__version__, "torch": None, "pyzmq": zmq.__version__,
           "libzmq": zmq.zmq_version(), "numpy": numpy.__version__}
    for name in ("torch", "vllm") if with_vllm else ("torch",):
        with suppress(Exception):  # vLLM: failing at import time too
            out[name] = importlib.import_module(name).__version__
    return out
