"""One run: every scenario in turn, again per repeat; and what it ran on."""
from __future__ import annotations

import gc
import importlib
import os
import platform
import shutil
import sys
import time

from fastmq.bench import figures, impls as impls_mod, scenario
from fastmq.bench.config import SCENARIOS
from fastmq.bench.harness import BenchError, Env  # noqa: F401 (the command catches it)

# Imported once by the forkserver: a reader starts in milliseconds, not a torch import.
_PRELOAD = ["numpy", "zmq", "fastmq", "fastmq.bench.harness", "fastmq.bench.impls",
            "fastmq.bench.floors"] + [f"fastmq.bench.{s}" for s in SCENARIOS]
_VLLM_PRELOAD = ["vllm.distributed.device_communicators.shm_broadcast"]

TORCH_EXTRA = "pip install 'vllm-fastmq[torch]'"


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def skipped(scenarios: list[str]) -> dict[str, str]:
    return {} if have_torch() else {
        s: f"skipped: needs torch, which is not installed ({TORCH_EXTRA})"
        for s in scenarios if scenario.get(s).needs_torch}


class Progress:
    """One status line on a terminal; one line per run otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool = True):
        self.enabled, self.tty = enabled, enabled and sys.stderr.isatty()
        self.total, self.i, self.label, self.prefix = total, 0, "", ""
        self.t0, self._shown = time.monotonic(), False

    def _line(self, text: str | None) -> None:
        s = int(time.monotonic() - self.t0)
        line = "" if text is None else f"[{self.i}/{self.total} {s // 60}:{s % 60:02d}] {text}"
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stderr.write("\r" + line[:width].ljust(width) + ("\r" if text is None else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
        self._shown = text is not None

    def start(self, label: str) -> None:
        self.i += 1
        self.label = self.prefix + label
        if self.enabled:
            self._line(self.label)

    def detail(self, text: str) -> None:
        if self.tty:
            self._line(f"{self.label}  {text}")

    def note(self, text: str) -> None:
        if self.enabled:
            self.clear()
            print(text, file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.tty and self._shown:
            self._line(None)


def plan(scenarios: list[str], only: str | None) -> dict:
    """``{scenario: [Impl, ...]}`` in report order."""
    wanted = None
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in impls_mod.IMPLS]
        if unknown:
            raise ValueError(f"unknown implementation(s) {', '.join(unknown)}; choose from "
                             f"{', '.join(impls_mod.IMPLS)}")
    out = {}
    skip = skipped(scenarios)
    for s in scenarios:
        if s in skip:
            continue
        names = [n for n in scenario.get(s).impls if wanted is None or n in wanted]
        chosen = [impls_mod.IMPLS[n] for n in names]
        if chosen:
            out[s] = chosen
    if not out:
        why = "; ".join(f"{s}: {r}" for s, r in skip.items())
        raise ValueError("nothing to run: no selected implementation takes part in the "
                         "selected scenarios" + (f" ({why})" if why else ""))
    return out


def describe(plan_: dict, scenarios: list[str] | None = None) -> str:
    lines = []
    for s, why in skipped(scenarios or list(SCENARIOS)).items():
        lines.append(f"scenario {s}: {why}")
    lines.append("implementations (name: what it is; selected scenarios; runs here):")
    for impl in impls_mod.IMPLS.values():
        where = [s for s, lst in plan_.items() if impl in lst]
        if where:
            ok, why = impls_mod.availability(impl)
            state = "yes" if ok else "no: " + why
        else:
            state = "not checked"
        lines.append(f"  {impl.name:26s} {impl.description}; "
                     f"{', '.join(where) or 'not selected'}; {state}")
    return "\n".join(lines)


def run(plan_: dict, params, progress: bool = True, scenarios: list[str] | None = None) -> dict:
    load_start = loadavg()
    selected = {i.name: i for lst in plan_.values() for i in lst}
    with_vllm = any(i.family == "vllm" for i in selected.values())
    torch_ok = have_torch()
    env = Env((["torch"] if torch_ok else []) + _PRELOAD + (_VLLM_PRELOAD if with_vllm else []))
    notes: list[str] = []
    skip = skipped(scenarios or list(plan_))
    for s, why in skip.items():
        notes.append(f"Scenario {s} {why}.")
    available = {}
    for name, impl in selected.items():
        ok, why = impls_mod.availability(impl)  # imports vLLM here, once
        available[name] = {"available": ok, "reason": why, "description": impl.description}
        if not ok:
            notes.append(f"{name} not measured: {why}.")
    if with_vllm and not any(v["available"] for n, v in available.items()
                             if selected[n].family == "vllm"):
        notes.append("No vLLM figures, so no ratios against vLLM.")
    # torch and vLLM are imported now and stay: keep their objects out of
    # the collections that closing each run's queues makes.
    gc.freeze()
    plan_ = {s: [i for i in lst if available[i.name]["available"]] for s, lst in plan_.items()}
    plan_ = {s: lst for s, lst in plan_.items() if lst}

    repeats = params.repeats
    prog = Progress(repeats * sum(len(lst) * len(params.readers.get(s, []))
                                  for s, lst in plan_.items()), enabled=progress)
    runs: list[list[dict]] = []
    seconds: dict = {}
    try:
        for rep in range(repeats):
            records: list[dict] = []
            for s, lst in plan_.items():
                t0 = time.monotonic()
                if repeats > 1:
                    prog.prefix = f"run {rep + 1}/{repeats}  "
                records += importlib.import_module(f"fastmq.bench.{s}").run(env, lst, params, prog)
                seconds[s] = round(seconds.get(s, 0.0) + time.monotonic() - t0, 1)
            runs.append(records)
    finally:
        prog.clear()

    for records in runs:
        figures.annotate(records)
    records = figures.merge(runs)
    floor_notes = figures.check_floors(records)
    load_end = loadavg()
    notes += floor_notes
    notes += _notes(records, params, env, load_start, load_end)
    cfg = {k: v for k, v in vars(params).items()}
    cfg["scenarios"] = list(plan_)
    cfg["implementations"] = {s: [i.name for i in lst] for s, lst in plan_.items()}
    m = _machine()
    m["loadavg_start"], m["loadavg_end"] = load_start, load_end
    return {
        "schema": figures.SCHEMA,
        "machine": m,
        "versions": versions(with_vllm and any(
            v["available"] for n, v in available.items() if selected[n].family == "vllm")),
        "config": cfg,
        "implementations": available,
        "skipped_scenarios": skip,
        "notes": notes,
        "floor_notes": floor_notes,
        "scenario_seconds": seconds,
        "records": records,
    }


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
    busy = figures.busy_note(load_start, load_end, cpus)
    if busy:
        notes.append(busy)
    if params.preset == "quick":
        notes.append("--quick is a smoke run: too few samples for figures to quote.")
    if params.repeats > 1:
        notes.append(f"Every figure is the median of {params.repeats} runs (each run measures "
                     "every implementation once, in turn); runs' p50 = the lowest and the "
                     "highest run's value.")
    else:
        notes.append("One run: figures are not medians of repeated runs (--repeat 3 or "
                     "--full for those).")
    fake_arena = sorted({r["impl"] for r in records
                         if r["impl"].startswith("fastmq") and r["impl"].endswith("+arena")
                         and r.get("arena_active") is False})
    if fake_arena:
        notes.append(f"{', '.join(fake_arena)} ran without a tensor arena: this fastmq build "
                     "has none (enable_shm_tensor_arena had no effect), so it measures the "
                     "same path as fastmq-futex.")
    notes.append(f"Ratios: {scenario.RATIO_RULE}. vs vLLM compares with vLLM on the same path (arena "
                 "with arena, arena off with arena off, remote with remote of the same "
                 "shape); vs floor with the scenario's floor. Warm-up rounds are excluded; "
                 "every reader verifies every message (number and content) and the run "
                 "fails otherwise.")
    return notes


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith(key)), None)
    except OSError:
        return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _machine() -> dict:
    mem = _proc_field("/proc/meminfo", "MemTotal:")
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor()
        or "unknown",
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "memory_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "python": platform.python_version(),
    }


def versions(with_vllm: bool) -> dict:
    """What was measured; ``torch`` None when not installed."""
    import numpy
    import zmq

    import fastmq

    out = {"fastmq": fastmq.__version__, "torch": None, "pyzmq": zmq.__version__,
           "libzmq": zmq.zmq_version(), "numpy": numpy.__version__}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    if with_vllm:
        try:
            import vllm

            out["vllm"] = vllm.__version__
        except Exception:
            out["vllm"] = None
    return out
