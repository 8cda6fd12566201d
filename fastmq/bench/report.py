"""From records to what people read: ratios against vLLM, the terminal
tables, ``RESULTS.md``, the JSON file, and the targets the issues set.

A record is one figure set: ``scenario``, ``impl``, ``n_readers``,
``size_bytes`` and the statistics (see the scenario modules).  Ratios are
"times faster than vLLM": vLLM's time divided by the implementation's (or
the implementation's rate divided by vLLM's), so > 1 is faster.
"""
from __future__ import annotations

import json
import math
import os

from fastmq.bench import config
from fastmq.bench.config import fmt_size

ORDER = {"step": ("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", "pyzmq", "floor"),
         "throughput": ("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", "pyzmq"),
         "tensor": ("fastmq-futex+arena", "fastmq-futex", "vllm+arena", "vllm", "pyzmq",
                    "floor"),
         "wake": ("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", "pyzmq"),
         "executor": ("fastmq-futex", "vllm")}

TITLES = {
    "step": "step: executor round trip (1 writer broadcasts, each of N readers answers "
            "on its own 1:1 queue); microseconds",
    "throughput": "throughput: small messages pipelined, 1 writer to N readers; "
                  "messages per second delivered to every reader",
    "tensor": "tensor: CPU tensor broadcast, every reader reads every byte; "
              "milliseconds per message (enqueue to the last reader's answer)",
    "wake": "wake: one-way latency of one message to readers parked while idle "
            "(microseconds), and CPU used by an idle reader",
    "executor": "executor: collective_rpc round trip in vLLM's MultiprocExecutor with N "
                "workers, every worker answering; microseconds",
}


# ---------------------------------------------------------------------------
# ratios

def _key(r: dict) -> tuple:
    return (r["scenario"], r["impl"], r["n_readers"], r["size_bytes"])


def annotate(records: list[dict]) -> None:
    """Add ``vs_vllm`` (and for tensors ``vs_vllm_arena``, ``x_floor``)."""
    idx = {_key(r): r for r in records}

    def other(r, impl):
        return idx.get((r["scenario"], impl, r["n_readers"], r["size_bytes"]))

    for r in records:
        if r["impl"] == "floor-memcpy":
            continue
        if r["scenario"] == "throughput":
            v = other(r, "vllm")
            r["vs_vllm"] = r["rate"] / v["rate"] if v else None
            continue
        v = other(r, "vllm")
        r["vs_vllm"] = v["p50"] / r["p50"] if v and r["p50"] > 0 else None
        if r["scenario"] == "tensor":
            va, fl = other(r, "vllm+arena"), other(r, "floor")
            r["vs_vllm_arena"] = va["p50"] / r["p50"] if va and r["p50"] > 0 else None
            r["x_floor"] = r["p50"] / fl["p50"] if fl and fl["p50"] > 0 else None
            r["gb_per_s"] = r["size_bytes"] / (r["p50"] / 1e3) / 1e9 if r["p50"] > 0 else None


# ---------------------------------------------------------------------------
# targets the issues set (informational: the figures decide)

def targets(records: list[dict]) -> list[dict]:
    idx = {_key(r): r for r in records}
    out = []

    def add(issue, what, value, target, met):
        out.append({"issue": issue, "what": what, "value": value, "target": target,
                    "met": bool(met)})

    def get(s, impl, n, size):
        return idx.get((s, impl, n, size))

    step_size = config.KiB
    for n in sorted({r["n_readers"] for r in records if r["scenario"] == "step"}):
        f, v = get("step", "fastmq-futex", n, step_size), get("step", "vllm", n, step_size)
        if f and v and n >= 1:
            ratio = f["p50"] / v["p50"]
            if n == 1:
                add(2, f"step 1 KiB N=1: fastmq p50 / vLLM p50", f"{ratio:.2f}",
                    "<= 0.25", ratio <= 0.25)
            else:
                add(2, f"step 1 KiB N={n}: fastmq p50 / vLLM p50", f"{ratio:.2f}",
                    "< 1", ratio < 1)
        s = get("step", "fastmq-spin", n, step_size)
        if f and s and n >= 1:
            ratio = f["p50"] / s["p50"]
            add(4, f"step 1 KiB N={n}: fastmq futex p50 / pure spinning p50", f"{ratio:.2f}",
                "<= 1.10", ratio <= 1.10)
    size = 128 * config.MiB
    for n in sorted({r["n_readers"] for r in records if r["scenario"] == "tensor"}):
        a, fl = get("tensor", "fastmq-futex+arena", n, size), get("tensor", "floor", n, size)
        if a and fl:
            ratio = a["p50"] / fl["p50"]
            add(3, f"tensor 128 MiB N={n}: fastmq+arena / floor", f"{ratio:.2f}",
                "<= 1.3", ratio <= 1.3)
        if a and n == 4:
            for base in ("vllm", "vllm+arena"):
                b = get("tensor", base, n, size)
                if b:
                    ratio = b["p50"] / a["p50"]
                    add(3, f"tensor 128 MiB N=4: {base} / fastmq+arena", f"{ratio:.1f}x",
                        ">= 3x", ratio >= 3)
    for n in sorted({r["n_readers"] for r in records if r["scenario"] == "wake"}):
        f, v = get("wake", "fastmq-futex", n, None), get("wake", "vllm", n, None)
        if f:
            add(4, f"wake N={n}: fastmq futex p50 one-way", f"{f['p50']:.1f} us",
                "<= 30 us", f["p50"] <= 30)
            add(4, f"wake N={n}: fastmq futex idle reader CPU over "
                f"{f['cpu_window_s']:.1f} s", f"{f['cpu_pct']:.2f} %", "< 1 %",
                f["cpu_pct"] < 1)
        if f and v:
            ratio = f["p50"] / v["p50"]
            add(4, f"wake N={n}: fastmq futex p50 / vLLM p50", f"{ratio:.2f}", "<= 0.33",
                ratio <= 1 / 3)
    return sorted(out, key=lambda t: t["issue"])  # stable: by issue, then as added


# ---------------------------------------------------------------------------
# formatting

def num(x, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    a = abs(x)
    s = (f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else
         f"{x:.2f}" if a >= 0.1 else f"{x:.3f}")
    return s + unit


def ratio(x) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def rate(x) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


def render(headers: list[str], rows: list[list[str]], align: str, md: bool,
           group: bool = True) -> str:
    """A table: ``align`` has one ``l`` or ``r`` per column; ``group``: a
    blank line where the first column changes (terminal only)."""
    if md:
        sep = ["---:" if a == "r" else ":---" for a in align]
        lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                         for c, w, a in zip(cells, widths, align)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    prev = None
    for r in rows:
        if group and prev is not None and r[0] != prev[0]:
            out.append("")
        out.append(line(r))
        prev = r
    return "\n".join(out)


def _ncell(r: dict) -> str:
    return f"{r['n_readers']}*" if r.get("oversubscribed") else str(r["n_readers"])


def _sorted(records: list[dict], scenario: str) -> list[dict]:
    order = {name: i for i, name in enumerate(ORDER[scenario])}
    rs = [r for r in records if r["scenario"] == scenario and r["impl"] != "floor-memcpy"]
    return sorted(rs, key=lambda r: (r["n_readers"], r["size_bytes"] or 0,
                                     order.get(r["impl"], -1), r["impl"]))


def section(records: list[dict], scenario: str, md: bool) -> str | None:
    rs = _sorted(records, scenario)
    if not rs:
        return None
    if scenario in ("step", "executor"):
        headers = ["N", "payload", "implementation", "p50 us", "p90 us", "p99 us",
                   "vs vLLM (p50)", "samples"]
        rows = [[_ncell(r), fmt_size(r["size_bytes"]), r["impl"], num(r["p50"]),
                 num(r["p90"]), num(r["p99"]), ratio(r.get("vs_vllm")), str(r["samples"])]
                for r in rs]
        align = "lllrrrrr"
    elif scenario == "throughput":
        headers = ["N", "implementation", "msgs/s (median)", "min .. max", "vs vLLM",
                   "messages"]
        rows = [[_ncell(r), r["impl"], rate(r["rate"]),
                 f"{rate(r['rate_min'])} .. {rate(r['rate_max'])}", ratio(r.get("vs_vllm")),
                 str(r["messages"])] for r in rs]
        align = "llrrrr"
    elif scenario == "tensor":
        headers = ["N", "tensor", "implementation", "p50 ms", "min ms", "max ms", "GB/s",
                   "vs vLLM", "vs vLLM+arena", "x floor", "first ms", "reps"]
        rows = [[_ncell(r), fmt_size(r["size_bytes"]), r["impl"], num(r["p50"]),
                 num(r["min"]), num(r["max"]), num(r.get("gb_per_s")),
                 ratio(r.get("vs_vllm")), ratio(r.get("vs_vllm_arena")),
                 num(r.get("x_floor")), num(r.get("first_ms")), str(r["samples"])]
                for r in rs]
        align = "lllrrrrrrrrr"
    else:
        headers = ["N", "implementation", "idle before", "p50 us", "p90 us", "p99 us",
                   "vs vLLM (p50)", "idle CPU %", "samples"]
        rows = [[_ncell(r), r["impl"], f"{r['idle_before_s']:.3g} s", num(r["p50"]),
                 num(r["p90"]), num(r["p99"]), ratio(r.get("vs_vllm")),
                 f"{r['cpu_pct']:.2f}", str(r["samples"])] for r in rs]
        align = "llrrrrrrr"
    title = TITLES[scenario]
    head = f"### {title}\n" if md else f"{title}\n"
    text = head + ("\n" if md else "") + render(headers, rows, align, md)
    extra = _section_notes(records, rs, scenario)
    if extra:
        text += "\n\n" + "\n".join(("- " if md else "  ") + e for e in extra)
    return text


def _section_notes(records, rs, scenario) -> list[str]:
    notes = []
    if scenario == "step":
        mc = [r for r in records if r["impl"] == "floor-memcpy"]
        if mc:
            notes.append("floor-memcpy (one memcpy of the payload, p50): " + ", ".join(
                f"{fmt_size(r['size_bytes'])} {num(r['p50'])} us" for r in mc))
        if any(r["impl"] == "floor" for r in rs):
            notes.append("floor: the same round trip over bare shared memory in C (payload "
                         "copied in, each reader copies it out and answers on its own cache "
                         "line); no queue, no pickling.")
    if scenario == "tensor" and any(r["impl"] == "floor" for r in rs):
        notes.append("floor: one single-threaded memcpy into a pre-faulted shared segment plus "
                     "every reader's read of every byte; x floor = p50 / floor p50 (lower is "
                     "better; below 1 where a copy uses several threads).")
        w = rs[0]
        notes.append(f"p50/min/max over {w['samples']} messages after {w['warmup']} warm-up "
                     "messages; first ms = the very first message, which also pays for "
                     "touching fresh shared-memory pages (the default and --full warm-ups "
                     "cover a cycle of ring chunks and arena slots).")
    if scenario == "wake":
        w = next(iter(rs), None)
        if w:
            notes.append(f"idle before = the implementation's spin phase plus "
                         f"{w['idle_before_s'] - (w['spin_s'] or 0):.3g} s parked (fastmq-spin "
                         "never parks); idle CPU % = utime+stime from /proc over "
                         f"{w['cpu_window_s']:.1f} s after the last message, % of one core.")
        if any(r["samples"] < 100 for r in rs):
            notes.append("few samples: p99 is close to the maximum; --full takes more.")
    return notes


def tables(result: dict, md: bool = False) -> str:
    parts = [s for s in (section(result["records"], sc, md) for sc in config.SCENARIOS) if s]
    tg = result.get("targets") or []
    if tg:
        rows = [[f"#{t['issue']}", t["what"], t["value"], t["target"],
                 "met" if t["met"] else "NOT met"] for t in tg]
        title = "targets set by the issues (computed from the figures above)"
        parts.append((f"### {title}\n\n" if md else f"{title}\n")
                     + render(["issue", "figure", "value", "target", "status"], rows, "lllll", md,
                                group=False))
    return "\n\n".join(parts)


def notes_text(result: dict, md: bool) -> str:
    bullet = "- " if md else "* "
    return "\n".join(bullet + n for n in result["notes"])


def machine_line(result: dict) -> str:
    m, v = result["machine"], result["versions"]
    mem = f", {m['memory_bytes'] / (1 << 30):.0f} GiB" if m.get("memory_bytes") else ""
    vers = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    return (f"{m['cpu_model']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical "
            f"CPUs{mem}, Linux {m['kernel']}, Python {m['python']}; {vers}")


def terminal(result: dict) -> str:
    return "\n\n".join([
        f"fastmq-bench ({result['config']['preset']}): {machine_line(result)}",
        tables(result, md=False),
        "notes:\n" + notes_text(result, md=False),
    ])


# ---------------------------------------------------------------------------
# files

def write_json(path: str, result: dict, raw: bool) -> None:
    out = dict(result)
    if not raw:
        out["records"] = [{k: v for k, v in r.items() if k != "samples_ns"}
                          for r in result["records"]]
    _mkdirs(path)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def write_markdown(path: str, result: dict, plots: list[str]) -> None:
    lines = [
        "# fastmq benchmark results",
        "",
        "Generated by this command (rerun it to regenerate this file):",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Run {result['started']} ({result['duration_s']:.0f} s), preset "
        f"`{result['config']['preset']}`.",
        "",
        f"Machine: {machine_line(result)}.",
        "",
        notes_text(result, md=True),
        "",
        tables(result, md=True),
        "",
    ]
    if plots:
        base = os.path.dirname(os.path.abspath(path))
        lines += ["### plots", ""]
        for p in plots:
            rel = os.path.relpath(os.path.abspath(p), base)
            lines += [f"![{os.path.basename(p)}]({rel})", ""]
    lines += ["Every figure, with the machine details, is in the JSON file written by "
              "`--json`. Ratios are vLLM's time divided by the implementation's "
              "(> 1: faster than vLLM).", ""]
    _mkdirs(path)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _mkdirs(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
