"""What a scenario declares, so that the report is generic; the number formats."""
from __future__ import annotations

import importlib
import math
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Callable

from fastmq.bench.config import SCENARIOS, fmt_size

RATIO_RULE = ("ratio = the reference's time / this row's time (for rates: this row's rate / "
              "the reference's rate): above 1x this row is faster than the reference")


# A summary line: ``impl``'s ``field`` against ``ref``'s; ``readme``: in the README's table.
Line = namedtuple("Line", "label impl ref field unit readme", defaults=("p50", "us", False))


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    # Every row reported, in order (the implementations among them run in this order),
    # with the vLLM row it is compared with (None: none).
    rows: dict
    columns: tuple                # (header, cell(record) -> str) after N, size, row
    floor: str | None = None      # the "vs floor" reference
    # floor -> which rows it must come out at or below (``figures.check_floors``)
    bounds: dict = field(default_factory=dict)
    size_header: str | None = None
    size_text: Callable = fmt_size
    n_header: str = "N"
    rate: bool = False            # figures are rates (higher is better)
    summary: tuple = ()           # Line, ...
    summary_size: int | None = None   # the size the summary quotes (nearest); None: every size
    grids: tuple = ()             # (title, note, column, ((label, impl, ref), ...)[, field]): report.grid
    extra_ratios: dict = field(default_factory=dict)  # name -> field compared with vLLM's
    # name -> (reference field, field) of the same row (RATIO_RULE: reference / field)
    self_ratios: dict = field(default_factory=dict)
    needs_torch: bool = False
    notes: Callable = lambda rs, records: []


def get(name: str) -> Scenario:
    return importlib.import_module(f"fastmq.bench.{name}").SPEC


def every() -> list[Scenario]:
    return [get(s) for s in SCENARIOS]


def value(r: dict, field_: str, spec: Scenario) -> float | None:
    return r.get("rate" if field_ == "p50" and spec.rate else field_)


def quotient(mine: dict | None, ref: dict | None, field_: str, spec: Scenario):
    """RATIO_RULE for ``field_`` of two records (None if either is missing)."""
    if mine is None or ref is None or mine is ref:
        return None
    a, b = value(mine, field_, spec), value(ref, field_, spec)
    if not a or not b:
        return None
    return a / b if spec.rate and field_ == "p50" else b / a


# -- number formats --------------------------------------------------------------

def num(x, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    a = abs(x)
    # At least three significant digits: a ratio recomputed from two printed
    # figures is then within about 1% of the printed ratio.
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
    return f"{x / 1e3:.1f} k" if x >= 1e3 else f"{x:.0f}"


def spread(r: dict, field_: str = "p50", fmt=num) -> str:
    """``min..max`` of the runs' values ("-" for a single run)."""
    vals = r.get(f"{field_}_runs")
    return f"{fmt(min(vals))}..{fmt(max(vals))}" if vals and len(vals) > 1 else "-"


def fig(r: dict, field_: str, unit: str, spec: Scenario, with_spread: bool = True) -> str:
    """A figure with its unit, and the runs' spread where there are several."""
    v = value(r, field_, spec)
    if spec.rate and field_ == "p50":
        text, sp = rate(v) + " msg/s", spread(r, "rate", rate)
    else:
        text, sp = num(v, " " + unit), spread(r, field_)
    return text if sp == "-" or not with_spread else f"{text} ({sp})"


def latency_columns(unit: str, floor: str = "vs floor") -> tuple:
    """The table columns of a scenario of p50/p90/p99 times in ``unit``."""
    return (("{p50} " + unit, lambda r: num(r["p50"])), ("runs' p50", spread),
            ("p90 " + unit, lambda r: num(r.get("p90"))),
            ("p99 " + unit, lambda r: num(r.get("p99"))),
            ("vs vLLM", lambda r: ratio(r.get("vs_vllm"))),
            (floor, lambda r: ratio(r.get("vs_floor"))), ("samples", lambda r: str(r["samples"])))
