"""The ``fastmq`` command.

    fastmq ls [--json] [-w SECONDS]

lists every fastmq queue on this host from its shared-memory segments (see
``fastmq.listing``); ``-w`` refreshes it like ``watch``.

    fastmq cleanup [--dry-run]

removes the shared-memory segments and ipc socket files of fastmq
processes that died without removing them (see ``fastmq.cleanup``), one
removed path per line on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def cleanup_hint(listing: dict) -> str | None:
    """The line ``fastmq ls`` ends with when some queue's writer is dead:
    its files stay until ``fastmq cleanup`` removes them."""
    dead = [q["name"] for q in listing["queues"] if q["writer"]["state"] == "dead"]
    if not dead:
        return None
    which, its = (("1 queue has", "its") if len(dead) == 1 else
                  (f"{len(dead)} queues have", "their"))
    return (f"{which} a dead writer: `fastmq cleanup` removes {its} files "
            "(`fastmq cleanup --dry-run` lists them first).")


def _ls(args) -> int:
    from fastmq.listing import format_text, list_queues

    def once():
        listing = list_queues()
        if args.json:
            # One document per line, so that a watched stream stays parseable.
            return json.dumps(listing, indent=None if args.watch else 2)
        hint = cleanup_hint(listing)
        return format_text(listing) + (f"\n{hint}" if hint else "")

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
    from fastmq.cleanup import cleanup

    paths = cleanup(dry_run=args.dry_run)
    for p in paths:
        print(p)
    verb = "would remove" if args.dry_run else "removed"
    print(f"fastmq cleanup: {verb} {len(paths)} file(s) of dead processes", file=sys.stderr)
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
                    "and the /dev/shm bytes used.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("-w", "--watch", type=_interval, metavar="SECONDS",
                   help="refresh every SECONDS until interrupted (with --json: one "
                        "document per line)")
    p.set_defaults(func=_ls)
    p = sub.add_parser(
        "cleanup",
        help="remove shared-memory segments and ipc files left by dead fastmq processes",
        description="Remove /dev/shm/fastmq_* segments and fastmq_*.ipc socket files "
                    "whose creating process is dead; files of live queues are never "
                    "touched. Prints each removed path.")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be removed and remove nothing")
    p.set_defaults(func=_cleanup)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
