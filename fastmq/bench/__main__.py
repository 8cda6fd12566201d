"""``fastmq-bench`` / ``python -m fastmq.bench``: the command line."""
from __future__ import annotations

import argparse
import atexit
import datetime
import os
import shlex
import sys
import time

from fastmq.bench import config, link

EXIT_FAILED = 1
EXIT_USAGE = 2


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


_DESCRIPTION = (
    "Measure fastmq against vLLM 0.33.0's MessageQueue, plain pyzmq and the hardware floors, "
    "side by side in one run. Scenarios: step (executor round trip), throughput (small "
    "messages, pipelined), tensor (large CPU tensors, every byte read), wake (latency from "
    "idle, idle CPU); executor and generate (vLLM's executor and real token generation, on "
    "request). Every ratio is the reference's time / this row's time: above 1x, faster than "
    "the reference.")
_LIST = "NAME[,NAME]"
# (flag, argparse keywords): the options after the --quick/--full presets.
_OPTIONS = (
    ("names", dict(nargs="*", metavar="SCENARIO",
                   help="scenarios to run, as with --scenario (fastmq-bench generate)")),
    ("--scenario", dict(action="append", metavar=_LIST, help="scenarios to run: "
                        f"{', '.join(config.SCENARIOS)} or all (default all)")),
    ("--readers", dict(metavar="N[,N]",
                       help="reader counts for every scenario (default: preset's, e.g. 1,2)")),
    ("--impl", dict(metavar=_LIST,
                    help="only these implementations (see --list; default all available)")),
    ("--sizes", dict(metavar="SIZE[,SIZE]", help="step payload sizes, e.g. 100,1K,64K,1M")),
    ("--tensor-sizes", dict(metavar="SIZE[,SIZE]", help="tensor sizes, e.g. 16M,128M,256M")),
    ("--tensor-reps", dict(type=int, metavar="K", help="tensor: counted messages per size "
                           "and reader count (full: 5)")),
    ("--idle-window", dict(type=float, metavar="SECONDS", help="wake: idle-CPU window after "
                           "the last message (full: 5 s)")),
    ("--repeat", dict(type=int, metavar="R", help="run everything R times in turn; each "
                      "figure is the median of the R runs, with their spread (full: 3)")),
    ("--json", dict(metavar="PATH", help="write every figure and machine details")),
    ("--results-md", dict(metavar="PATH", help="write a Markdown report (bench/RESULTS.md)")),
    ("--link-rate", dict(metavar="RATE", help="run in a network namespace of its own whose "
                         "loopback is shaped to RATE (e.g. 25gbit): the remote (TCP) paths as "
                         "over a link slower than memory, as between nodes (root, iproute2)")),
    ("--timeout", dict(type=float, metavar="SECONDS", help="give up on any blocking "
                       "operation after this long (default 60)")),
    ("--no-progress", dict(action="store_true", help="no progress display")),
    ("--tables", dict(action="store_true", help="print every scenario's full table too, not "
                      "only the summary (--results-md always writes them)")),
    ("--list", dict(action="store_true", help="list the implementations and whether they run "
                    "here, then exit")),
    ("--from-json", dict(metavar="JSON", help="measure nothing: print (and write with --json "
                         "/ --results-md) the report of the run saved in JSON")),
    ("--readme", dict(metavar="JSON", action="append", help="print the README's figures "
                      "block generated from JSON (a file written by --json, e.g. "
                      "bench/results.json; again for runs over a shaped link, whose figures "
                      "follow), then exit")),
    ("--update-readme", dict(metavar="README", help="with --readme: replace the generated "
                             "block in README instead of printing it")),
)
# Numeric options: (option, Params field, lowest, highest or None).
_BOUNDS = (("tensor_reps", "tensor_reps", 1, 1000), ("repeat", "repeats", 1, 100),
           ("idle_window", "idle_window_s", 0.05, None),
           ("timeout", "timeout_s", 1.0, None))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastmq-bench", description=_DESCRIPTION)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true",
                        help="smoke run: every scenario and implementation once, few "
                             "samples (CI)")
    preset.add_argument("--full", action="store_true",
                        help="every figure, each the median of 3 runs: N=1,2,4, payloads "
                             "100 B to 1 MiB, tensors 16/64/256 MiB, a 5 s idle window")
    for flag, kw in _OPTIONS:
        p.add_argument(flag, **kw)
    return p


def params_from_args(args) -> tuple[config.Params, list[str]]:
    params = config.preset("quick" if args.quick else "full" if args.full else "default")
    scenarios: list[str] = []
    named = list(args.scenario or []) + list(args.names or [])
    for item in named or ["all"]:
        for name in _csv(item):
            if name == "all":
                scenarios += list(config.SCENARIOS)
            elif name in config.SCENARIOS:
                scenarios.append(name)
            else:
                raise ValueError(f"unknown scenario {name!r} (choose from "
                                 f"{', '.join(config.SCENARIOS)}, all)")
    scenarios = [s for s in config.SCENARIOS if s in scenarios]
    kw: dict = {}
    if args.readers:
        try:
            ns = sorted({int(x) for x in _csv(args.readers)})
        except ValueError:
            raise ValueError(f"--readers {args.readers!r}: expected numbers like 1,2,4") from None
        if not ns or ns[0] < 1 or ns[-1] > 32:
            raise ValueError("--readers: each N must be in 1..32")
        kw["readers"] = {s: ns for s in config.SCENARIOS}
    elif "generate" in scenarios and any("generate" in _csv(i) for i in named):
        # Asked for by name: run it (tensor parallel size 2) rather than
        # leaving it out as the presets do.
        kw["readers"] = {**params.readers, "generate": params.readers["generate"] or [2]}
    if args.sizes:
        sizes = sorted({config.parse_size(x) for x in _csv(args.sizes)})
        if sizes[0] < 16:
            raise ValueError("--sizes: payloads must be at least 16 bytes")
        kw["step_sizes"] = sizes
    if args.tensor_sizes:
        sizes = sorted({config.parse_size(x) for x in _csv(args.tensor_sizes)})
        if sizes[0] < 16 or any(s % 8 for s in sizes):
            raise ValueError("--tensor-sizes: tensors must be at least 16 bytes, "
                             "a multiple of 8")
        kw["tensor_sizes"] = sizes
    for flag, field, low, high in _BOUNDS:
        value = getattr(args, flag)
        if value is not None:
            name = "--" + flag.replace("_", "-")
            if high is not None and not low <= value <= high:
                raise ValueError(f"{name} must be in {low}..{high}")
            if not value >= low:
                raise ValueError(f"{name} must be at least {low}")
            kw[field] = value
    return params.replace(**kw), scenarios


def command_line(argv: list[str], from_module: bool) -> str:
    prog = "python -m fastmq.bench" if from_module else "fastmq-bench"
    return " ".join([prog] + [shlex.quote(a) for a in argv])


def main(argv: list[str] | None = None) -> int:
    """The command; run as a program (``argv`` None) the process exits here."""
    if argv is not None:
        return _main(argv, from_module=False)
    rc = _main(sys.argv[1:], from_module=sys.argv[0].endswith("__main__.py"))
    # No module teardown, where triton's bindings (imported by vLLM) print dozens of lines.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _main(argv: list[str], from_module: bool) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.readme or args.update_readme:
        return _readme(parser, args)
    if args.from_json:
        return _render(args, argv, from_module)
    try:
        params, scenarios = params_from_args(args)
        rate = link.parse_rate(args.link_rate) if args.link_rate else None
    except ValueError as e:
        return _error(e, parser)
    if rate and link.inside() != rate:
        # The run itself happens in a child that has the namespace.
        try:
            return link.enter(rate, argv)
        except RuntimeError as e:
            return _error(e)
    # vLLM logs at INFO to stdout on import (the readers inherit this).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The baseline must be vLLM's own MessageQueue, not fastmq's .pth hook.
    os.environ["FASTMQ_VLLM"] = "0"

    from fastmq.bench import runner

    try:
        plan = runner.plan(scenarios, args.impl)
    except ValueError as e:
        return _error(e)
    if args.list:
        print(runner.describe(plan, scenarios))
        return 0
    qdisc = link.shape(rate) if rate else None
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    try:
        result = runner.run(plan, params, progress=not args.no_progress, scenarios=scenarios)
    except runner.BenchError as e:
        print(f"fastmq-bench: FAILED: {e}", file=sys.stderr)
        print("fastmq-bench: no figures reported: a run that cannot verify what its "
              "readers received does not count.", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("fastmq-bench: interrupted", file=sys.stderr)
        return 130
    result["command"] = command_line(argv, from_module)
    result["argv"] = list(argv)
    result["started"] = started
    result["duration_s"] = time.monotonic() - t0
    if rate:
        result["link"] = {"rate": rate, "qdisc": qdisc, "sent_bytes": link.sent_bytes()}
        result["notes"].append(
            f"Remote (TCP) paths ran over loopback shaped to {rate} (a token bucket, in a "
            f"network namespace of this run's own): a link slower than memory, as between "
            f"nodes. Local paths are unaffected. tc: {qdisc}")

    return _write(args, result)


def _render(args, argv, from_module) -> int:
    from fastmq.bench import figures

    try:
        result = figures.load_results(args.from_json)
    except (OSError, ValueError) as e:
        return _error(e)
    result["rendered_by"] = command_line(argv, from_module)
    return _write(args, result)


def _write(args, result: dict) -> int:
    from fastmq.bench import figures, report

    print(report.terminal(result, tables=args.tables))
    if args.json:
        figures.write_json(args.json, result)
        print(f"\nwrote {args.json}")
    if args.results_md:
        report.write_markdown(args.results_md, result)
        print(f"wrote {args.results_md}")
    return 0


def _readme(parser, args) -> int:
    from fastmq.bench import figures, readme

    if not args.readme:
        return _error("--update-readme needs --readme JSON", parser)
    try:
        main_path, *more = args.readme
        result = figures.load_results(main_path)
        block = readme.block(result, main_path,
                             tuple((figures.load_results(p), p) for p in more))
        if args.update_readme:
            changed = readme.update(args.update_readme, block)
            print(f"{'updated' if changed else 'unchanged'}: {args.update_readme}")
        else:
            print(block)
    except (OSError, ValueError, KeyError) as e:
        return _error(e)
    return 0


def _error(e, parser=None) -> int:
    if parser is not None:
        parser.print_usage(sys.stderr)
    print(f"fastmq-bench: error: {e}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
