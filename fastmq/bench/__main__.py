"""``fastmq-bench`` / ``python -m fastmq.bench``: the command line."""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import os
import shlex
import sys
import time

from fastmq.bench import config, link

_DESCRIPTION = (
    "Measure fastmq against vLLM 0.33.0's MessageQueue and the hardware floors, side by "
    "side in one run: step, throughput, tensor, wake; generate (real token generation in "
    "vLLM) on request. Every ratio is the reference's time / this row's time: above 1x, "
    "faster than the reference.")
_LIST = "NAME[,NAME]"
# (flag, argparse keywords): the options after the --quick/--full presets.
_OPTIONS = (
    ("names", dict(nargs="*", metavar="SCENARIO", help="as --scenario (fastmq-bench generate)")),
    ("--scenario", dict(action="append", metavar=_LIST, help="scenarios to run: "
                        f"{', '.join(config.SCENARIOS)} or all (default all)")),
    ("--readers", dict(metavar="N[,N]", help="reader counts (default: the preset's, 1,2)")),
    ("--impl", dict(metavar=_LIST, help="only these implementations (see --list)")),
    ("--sizes", dict(metavar="SIZE[,SIZE]", help="step payload sizes, e.g. 100,1K,64K,1M")),
    ("--tensor-sizes", dict(metavar="SIZE[,SIZE]", help="tensor sizes, e.g. 16M,128M,256M")),
    ("--tensor-reps", dict(type=int, metavar="K", help="tensor: counted messages per size "
                           "and N from 64 MiB up, proportionally more below (16M: 4K; "
                           "full: K=5)")),
    ("--first-queues", dict(type=int, metavar="Q", help="tensor: fresh queues per "
                            "implementation, N and run whose first message of each size "
                            "is the first-use figure (the measured queue and Q-1 more that "
                            "send one message of each size; full: Q=5)")),
    ("--idle-window", dict(type=float, metavar="SECONDS", help="wake: idle-CPU window after "
                           "the last message (full: 5 s)")),
    ("--repeat", dict(type=int, metavar="R", help="run everything R times in turn; each "
                      "figure is the median of the R runs, with their spread (full: 3)")),
    ("--json", dict(metavar="PATH", help="write every figure and machine details")),
    ("--results-md", dict(metavar="PATH", help="write the Markdown report, every table")),
    ("--link-rate", dict(metavar="RATE", help="run in a network namespace of its own whose "
                         "loopback is shaped to RATE (e.g. 25gbit): the remote (TCP) paths as "
                         "over a link slower than memory, as between nodes (root, iproute2)")),
    ("--timeout", dict(type=float, metavar="SECONDS", help="give up on any blocking "
                       "operation after this long (default 60)")),
    ("--no-progress", dict(action="store_true", help="no progress lines")),
    ("--list", dict(action="store_true", help="list the implementations, whether they run "
                    "here, then exit")),
    ("--from-json", dict(metavar="JSON", help="measure nothing: the report of the run saved "
                         "in JSON (written with --json / --results-md too)")),
    ("--readme", dict(metavar="JSON", action="append", help="print the README's figures "
                      "block generated from JSON (again for runs over a shaped link)")),
    ("--update-readme", dict(metavar="README", help="with --readme: replace the block in "
                             "README instead of printing it")),
)
# Numeric options: (option, Params field, lowest, highest or None).
_BOUNDS = (("tensor_reps", "tensor_reps", 1, 1000), ("first_queues", "tensor_first_queues", 1, 20),
           ("repeat", "repeats", 1, 100),
           ("idle_window", "idle_window_s", 0.05, None), ("timeout", "timeout_s", 1.0, None))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastmq-bench", description=_DESCRIPTION)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="smoke run: every scenario and "
                        "implementation once, few samples (CI)")
    preset.add_argument("--full", action="store_true", help="every figure, each the median "
                        "of 3 runs: N=1,2,4, payloads 100 B to 1 MiB, tensors 16/64/256 MiB, "
                        "a 5 s idle window")
    for flag, kw in _OPTIONS:
        p.add_argument(flag, **kw)
    return p


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _sizes(text: str, what: str, multiple: int = 1) -> list[int]:
    sizes = sorted({config.parse_size(x) for x in _csv(text)})
    if not sizes or sizes[0] < 16 or any(s % multiple for s in sizes):
        raise ValueError(f"{what} must be at least 16 bytes"
                         + (f", a multiple of {multiple}" if multiple > 1 else ""))
    return sizes


def params_from_args(args) -> tuple[config.Params, list[str]]:
    params = config.preset("quick" if args.quick else "full" if args.full else "default")
    named = [n for item in (args.scenario or []) + (args.names or []) for n in _csv(item)]
    for name in named:
        if name != "all" and name not in config.SCENARIOS:
            raise ValueError(f"unknown scenario {name!r} (choose from "
                             f"{', '.join(config.SCENARIOS)}, all)")
    scenarios = [s for s in config.SCENARIOS if not named or s in named or "all" in named]
    kw: dict = {}
    if args.readers:
        try:
            ns = sorted({int(x) for x in _csv(args.readers)})
        except ValueError:
            raise ValueError(f"--readers {args.readers!r}: expected numbers like 1,2,4") from None
        if not ns or ns[0] < 1 or ns[-1] > 32:
            raise ValueError("--readers: each N must be in 1..32")
        kw["readers"] = {s: ns for s in config.SCENARIOS}
    elif "generate" in named:
        # Asked for by name: run it (tensor parallel size 2) rather than
        # leaving it out as the presets do.
        kw["readers"] = {**params.readers, "generate": params.readers["generate"] or [2]}
    if args.sizes:
        kw["step_sizes"] = _sizes(args.sizes, "--sizes: payloads")
    if args.tensor_sizes:
        kw["tensor_sizes"] = _sizes(args.tensor_sizes, "--tensor-sizes: tensors", 8)
    for flag, field, low, high in _BOUNDS:
        value = getattr(args, flag)
        if value is not None:
            if not low <= value <= (high or value):
                raise ValueError(f"--{flag.replace('_', '-')} must be "
                                 + (f"in {low}..{high}" if high else f"at least {low}"))
            kw[field] = value
    return dataclasses.replace(params, **kw), scenarios


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
        from fastmq.bench import figures

        try:
            result = figures.load_results(args.from_json)
        except (OSError, ValueError) as e:
            return _error(e)
        result["rendered_by"] = command_line(argv, from_module)
        return _write(args, result)
    try:
        params, scenarios = params_from_args(args)
        rate = link.parse_rate(args.link_rate) if args.link_rate else None
    except ValueError as e:
        return _error(e, parser)
    if rate and os.environ.get(link.ENV) != rate:
        # The run itself happens in a child that has the namespace (ENV: its rate).
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
        return 1
    except KeyboardInterrupt:
        print("fastmq-bench: interrupted", file=sys.stderr)
        return 130
    result.update(command=command_line(argv, from_module), argv=list(argv), started=started,
                  duration_s=time.monotonic() - t0)
    if rate:
        result["link"] = {"rate": rate, "qdisc": qdisc, "sent_bytes": link.sent_bytes()}
        result["notes"].append(
            f"Remote (TCP) paths ran over loopback shaped to {rate} (a token bucket, in a "
            f"network namespace of this run's own): a link slower than memory, as between "
            f"nodes. Local paths are unaffected. tc: {qdisc}")
    return _write(args, result)


def _write(args, result: dict) -> int:
    from fastmq.bench import figures, report

    print(report.terminal(result))
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
        results = [(figures.load_results(p), p) for p in args.readme]
        block = readme.block(*results[0], tuple(results[1:]))
        if not args.update_readme:
            print(block)
        elif readme.update(args.update_readme, block):
            print(f"updated: {args.update_readme}")
        else:
            print(f"unchanged: {args.update_readme}")
    except (OSError, ValueError, KeyError) as e:
        return _error(e)
    return 0


def _error(e, parser=None) -> int:
    if parser is not None:
        parser.print_usage(sys.stderr)
    print(f"fastmq-bench: error: {e}", file=sys.stderr)
    return 2  # a usage error


if __name__ == "__main__":
    sys.exit(main())
