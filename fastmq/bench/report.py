"""What people read, generic over the scenarios' declarations."""
from __future__ import annotations

import os

from fastmq.bench import scenario
from fastmq.bench.figures import key
from fastmq.bench.scenario import RATIO_RULE, fig, num, quotient, ratio, value

_RULE = RATIO_RULE[0].upper() + RATIO_RULE[1:] + "."


def render(headers: list[str], rows: list[list[str]], align: str, md: bool) -> str:
    """A table; ``align``: one ``l`` or ``r`` per column."""
    if md:
        sep = ["---:" if a == "r" else ":---" for a in align]
        return "\n".join("| " + " | ".join(r) + " |" for r in [headers, sep, *rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    return "\n".join("  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                               for c, w, a in zip(cells, widths, align)).rstrip()
                     for cells in [headers, ["-" * w for w in widths], *rows])


def n_cell(r: dict) -> str:
    return f"{r['n_readers']}*" if r.get("oversubscribed") else str(r["n_readers"])


def _head(title: str, text: str, md: bool) -> str:
    return f"### {title}\n\n{text}\n\n" if md else f"{title}\n{text}\n"


def how(records: list[dict]) -> str:
    runs = max((r.get("runs", 1) for r in records), default=1)
    return (f"median of {runs} runs, (min..max) over the runs; ratio = quotient of the "
            "medians" if runs > 1 else "one run (not a median of repeated runs)")


def section(records: list[dict], spec) -> str | None:
    """A scenario's full table in Markdown, then its notes."""
    order = {name: i for i, name in enumerate(spec.rows)}
    rs = sorted((r for r in records if r["scenario"] == spec.name),
                key=lambda r: (r["n_readers"], r["size_bytes"] or 0,
                               order.get(r["impl"], 99), r["impl"]))
    if not rs:
        return None
    runs = max(r.get("runs", 1) for r in rs)
    size_h = [spec.size_header] if spec.size_header else []
    headers = [spec.n_header, *size_h, "implementation"] + [
        h.replace("{p50}", "p50" if runs == 1 else f"p50 (median of {runs} runs)")
        for h, _ in spec.columns]
    rows = [[n_cell(r), *([spec.size_text(r["size_bytes"])] if size_h else []),
             r["impl"] + (" (!)" if r.get("not_a_floor") else "")]
            + [cell(r) for _, cell in spec.columns] for r in rs]
    notes = (["(!): a floor measured slower than a row it bounds: not a floor in this run "
              "(see the notes)."] if any(r.get("not_a_floor") for r in rs) else [])
    notes += spec.notes(rs, records)
    table = render(headers, rows, "l" * (2 + len(size_h)) + "r" * len(spec.columns), True)
    return f"### {spec.title}\n\n{table}" + ("\n\n" + "\n".join("- " + n for n in notes)
                                               if notes else "")


def summary_rows(records: list[dict], readme: bool = False) -> list[list[str]]:
    """``[figure, fastmq, compared with, ratio]`` per summary line; ``readme``: the headline."""
    idx = {key(r): r for r in records}
    rows = []
    for spec in scenario.every():
        rs = [r for r in records if r["scenario"] == spec.name]
        ns = sorted({r["n_readers"] for r in rs})[:1 if readme else None]
        sizes = sorted({r["size_bytes"] or 0 for r in rs})
        if spec.summary_size and sizes:  # the size nearest to the one it quotes
            sizes = [min(sizes, key=lambda s: abs(s - spec.summary_size))]
        for line in spec.summary:
            if readme and not line.readme:
                continue
            for n in ns:
                for size in sizes[:1 if readme else None]:
                    size = size or None
                    f = idx.get((spec.name, line.impl, n, size))
                    ref = idx.get((spec.name, line.ref, n, size))
                    if not f or not ref or None in (value(f, line.field, spec),
                                                    value(ref, line.field, spec)):
                        continue
                    where = (f", {spec.size_text(size)}" if size else "") + \
                        f", {spec.n_header}={n_cell(f)}"
                    mine, theirs = (fig(r, line.field, line.unit, spec, not readme)
                                    for r in (f, ref))
                    if not readme:
                        mine += f" ({line.impl})"
                        theirs += f" ({line.ref})" + (" (!)" if ref.get("not_a_floor")
                                                      else "")
                    rows.append([line.label + where, mine, theirs,
                                 ratio(quotient(f, ref, line.field, spec))])
    return rows


def grid(records: list[dict], spec, pairs, column: str, field_: str = "p50"):
    """A row per (path, size), a column per N: reference / impl = ratio of
    ``field_`` (a row with no reference: the impl's figure).  Also the
    cells where fastmq is slower than vLLM, as text."""
    rs = [r for r in records if r["scenario"] == spec.name]
    ns = sorted({r["n_readers"] for r in rs})
    idx = {key(r): r for r in rs}
    n_text = {n: n_cell(next(r for r in rs if r["n_readers"] == n)) for n in ns}
    headers = ["path", spec.size_header or "size"] + [f"N={n_text[n]}: {column}" for n in ns]
    rows, slower = [], []
    for label, mine, ref in pairs:
        for size in sorted({r["size_bytes"] for r in rs}):
            cells = []
            for n in ns:
                f, v = idx.get((spec.name, mine, n, size)), idx.get((spec.name, ref, n, size))
                a, b = (value(r, field_, spec) if r else None for r in (f, v))
                q = quotient(f, v, field_, spec)
                cells.append(f"{num(b)} / {num(a)} = {ratio(q)}" if q is not None else
                             num(a) if ref is None else "-")
                if q is not None and q < 1 and ref.startswith("vllm"):
                    slower.append(f"{label} {spec.size_text(size)} at N={n_text[n]} "
                                  f"({ratio(q)})")
            if any(c != "-" for c in cells):
                rows.append([label, spec.size_text(size)] + cells)
    return headers, rows, slower


def slower_text(slower: list[str]) -> str:
    return ("Where fastmq is slower than vLLM in this table: " + "; ".join(slower) + "."
            if slower else "fastmq is at or ahead of vLLM in every cell of this table.")


def summary(result: dict, md: bool) -> str:
    """The summary lines, then every scenario's grids."""
    recs = result["records"]
    parts = []
    rows = summary_rows(recs)
    if rows:
        parts.append(_head(f"summary: fastmq against vLLM 0.33.0 and the floors "
                           f"({how(recs)})", _RULE, md)
                     + render(["figure", "fastmq", "compared with", "ratio"], rows,
                              "lrrr", md))
    rate = (result.get("link") or {}).get("rate")
    link = f"loopback shaped to {rate}, a link slower than memory" if rate else "loopback"
    for spec in scenario.every():
        for title, note, column, pairs, *field_ in spec.grids:
            headers, rows, slower = grid(recs, spec, pairs, column, *field_)
            if rows:
                vs_vllm = any(ref and ref.startswith("vllm") for _, _, ref in pairs)
                parts.append(_head(f"{title} ({how(recs)})", note.format(link=link), md)
                             + render(headers, rows, "ll" + "r" * (len(headers) - 2), md)
                             + ("\n\n" + slower_text(slower) if vs_vllm else ""))
    return "\n\n".join(parts)


def machine_line(result: dict) -> str:
    m, v = result["machine"], result["versions"]
    mem = f", {m['memory_bytes'] / (1 << 30):.0f} GiB" if m.get("memory_bytes") else ""
    vers = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    return (f"{m['cpu_model']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical "
            f"CPUs{mem}, Linux {m['kernel']}, Python {m['python']}; {vers}")


def terminal(result: dict) -> str:
    """The summary and the notes; every scenario's table is in the Markdown report."""
    return "\n\n".join([
        f"fastmq-bench ({result['config']['preset']}): {machine_line(result)}",
        summary(result, md=False),
        "notes:\n" + "\n".join("* " + n for n in result["notes"]),
        "Every scenario's table (p90, p99, the floors): write them with --results-md FILE."])


def write_markdown(path: str, result: dict) -> None:
    rendered = ([f"(Rendered again from that run's JSON by `{result['rendered_by']}`.)", ""]
                if result.get("rendered_by") else [])
    sections = [s for s in (section(result["records"], spec) for spec in scenario.every())
                if s]
    lines = ["# fastmq benchmark results", "",
             "Generated by this command (rerun it to regenerate this file):", "",
             "```", result["command"], "```", "", *rendered,
             f"Run {result['started']} ({result['duration_s']:.0f} s), preset "
             f"`{result['config']['preset']}`.", "",
             f"Machine: {machine_line(result)}.", "",
             "\n".join("- " + n for n in result["notes"]), "",
             summary(result, md=True), "", "\n\n".join(sections), "",
             f"Every figure, with the machine details, is in the JSON file written by "
             f"`--json`. {_RULE}", ""]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))
