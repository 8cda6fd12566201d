"""The ``fastmq`` command.

    fastmq ls [--json] [-w SECONDS]

lists every fastmq queue on this host from its shared-memory segments (see
``fastmq.listing``); ``-w`` refreshes it like ``watch``.

    fastmq cleanup [--dry-run]

says that there is nothing to remove: fastmq keeps no files, and the kernel
frees a queue's memory with its last process (see ``fastmq.cleanup``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _ls(args) -> int:
    from fastmq.listing import format_text, list_queues

    def once():
        listing = list_queues()
        if args.json:
            # One document per line, so that a watched stream stays parseable.
            return json.dumps(listing, indent=None if args.watch else 2)
        return format_text(listing)

    if not args.watch:
        print(once())
        return 0
    try:
        while True:
            text = once()
            if args.json:
                print(text, flush=True)
            else:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                # Clear the screen and home the cursor, as watch(1) does.
                sys.stdout.write(f"\033[H\033[2JEvery {args.watch:g}s: fastmq ls"
                                 f"    {stamp}\n\n{text}\n")
                sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _interval(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    if not 0 < v < 86400:
        raise argparse.ArgumentTypeError(f"the interval must be in (0, 86400) seconds, got {text}")
    return v


def _cleanup(args) -> int:
    from fastmq.cleanup import NOTHING_LEFT

    print(f"fastmq cleanup: nothing to remove. {NOTHING_LEFT}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastmq", description="fastmq utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "ls",
        help="list every fastmq queue on this host: writer, readers, positions, arena",
        description="List every fastmq queue on this host from its shared-memory "
                    "segments (mapped read-only: listing never changes a queue): the "
                    "creating process, the ring's geometry and wait mode, each reader "
                    "(pid, alive or dead, the chunk it is on, how many messages it is "
                    "behind), parked readers, the tensor arena's slots in use and by whom, "
                    "and the shared memory each holds.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("-w", "--watch", type=_interval, metavar="SECONDS",
                   help="refresh every SECONDS until interrupted (with --json: one "
                        "document per line)")
    p.set_defaults(func=_ls)
    p = sub.add_parser(
        "cleanup",
        help="nothing to remove: fastmq keeps no files",
        description="fastmq keeps no files (its shared memory is anonymous and freed by "
                    "the kernel with the last process holding it), so there is nothing "
                    "to remove; kept for scripts that call it.")
    p.add_argument("--dry-run", action="store_true", help="accepted; changes nothing")
    p.set_defaults(func=_cleanup)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
