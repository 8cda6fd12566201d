"""Records into figures: ratios, merged repeats, the floor check, the JSON file."""
from __future__ import annotations

import json
import os
import statistics

from fastmq.bench import scenario
from fastmq.bench.scenario import num, quotient

SCHEMA = "fastmq-bench/3"  # the JSON files' format


def key(r: dict) -> tuple:
    return (r["scenario"], r["impl"], r["n_readers"], r["size_bytes"])


def annotate(records: list[dict]) -> None:
    """Ratios from the figures themselves: a printed ratio is their quotient."""
    idx = {key(r): r for r in records}
    for r in records:
        spec = scenario.get(r["scenario"])

        def other(impl):
            return idx.get((r["scenario"], impl, r["n_readers"], r["size_bytes"]))

        v = other(spec.rows.get(r["impl"], "vllm"))  # None: vLLM compared with nothing
        r["vs_vllm"] = quotient(r, v, "p50", spec)
        r["first_vs_vllm"] = quotient(r, v, "first_ms", spec)  # None where not measured
        r["vs_floor"] = quotient(r, other(spec.floor), "p50", spec)
        for name, field in spec.extra_ratios.items():
            r[name] = quotient(r, v, field, spec)
        for name, (ref_field, field) in spec.self_ratios.items():
            a, b = r.get(ref_field), r.get(field)
            r[name] = a / b if a and b else None


# How repeated runs combine (else: a float's median); each run's own _RUNS are kept too.
_COMBINE = {"samples": sum, "messages": sum, "reps": sum, "min": min, "rate_min": min,
            "max": max, "rate_max": max}
_RUNS = ("p50", "rate", "vs_vllm", "vs_floor")


def merge(runs: list[list[dict]]) -> list[dict]:
    """Repeated runs: medians with each run's value kept (the spread); ratios of medians."""
    groups: dict[tuple, list[dict]] = {}
    for r in (r for run in runs for r in run):
        groups.setdefault(key(r), []).append(r)
    out = []
    for rs in groups.values():
        m = dict(rs[0], runs=len(rs))
        for k, v in rs[0].items():
            vals = [r.get(k) for r in rs]
            if k in _RUNS:
                m[f"{k}_runs"] = None if None in vals else vals
            if None not in vals and (k in _COMBINE or isinstance(v, float)):
                m[k] = _COMBINE.get(k, statistics.median)(vals)
        out.append(m)
    annotate(out)
    return out


def check_floors(records: list[dict]) -> list[str]:
    """Mark a floor slower than a row it bounds: the load changed under the run."""
    notes = []
    for f in records:
        spec = scenario.get(f["scenario"])
        bounds = spec.bounds.get(f["impl"])
        if bounds is None:
            continue
        slower_than = sorted(r["impl"] for r in records if key(r)[::2] == key(f)[::2]
                             and key(r)[3] == key(f)[3] and bounds(r["impl"])
                             and r["p50"] < f["p50"])
        if slower_than:
            f["not_a_floor"] = slower_than
            size = f" {spec.size_text(f['size_bytes'])}" if f["size_bytes"] else ""
            notes.append(
                f"NOT A FLOOR: {f['impl']} ({f['scenario']}{size}, N={f['n_readers']}) measured "
                f"{num(f['p50'])} {f['unit']}, slower than {', '.join(slower_than)}: the "
                "machine's load changed during the run (the floor does a subset of their "
                "work). Rerun on a quiet machine.")
    return notes


def busy_note(load_start, load_end, cpus: int) -> str | None:
    """By the load at the start: the load at the end is mostly the run itself."""
    if not load_start or load_start[0] <= 0.5 * cpus:
        return None
    return (f"The machine was busy (1-minute load average {load_start[0]} when the run "
            f"started, {load_end and load_end[0]} at its end, {cpus} cores): other work "
            "competed for the cores, so these are not final figures.")


def load_results(path: str) -> dict:
    """A ``--json`` file, its ratios and busy note derived under today's rules; rows of
    scenarios and implementations the benchmark no longer has are left out."""
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result.get("records"), list) or result.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} JSON file")
    specs = {s.name: s for s in scenario.every()}
    result["records"] = [r for r in result["records"]
                         if r["scenario"] in specs and r["impl"] in specs[r["scenario"]].rows]
    annotate(result["records"])
    m = result.get("machine", {})
    notes = [n for n in result.get("notes", []) if not n.startswith("The machine was busy")]
    busy = busy_note(m.get("loadavg_start"), m.get("loadavg_end"), m.get("usable_cpus") or 1)
    result["notes"] = ([busy] if busy else []) + notes
    return result


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(path + ".tmp", path)
