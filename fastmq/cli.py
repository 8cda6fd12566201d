"""The ``fastmq`` command.

    fastmq cleanup [--dry-run]

removes the shared-memory segments and ipc socket files of fastmq
processes that died without removing them (see ``fastmq.cleanup``), one
removed path per line on stdout.
"""
from __future__ import annotations

import argparse
import sys


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
