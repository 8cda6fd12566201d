"""``fastmq cleanup``: there is nothing left for it to remove.

A fastmq segment is an anonymous memory file and an ipc endpoint an
abstract socket (fastmq/_segment.pyx, fastmq/_net.py): neither has a
path.  The kernel frees a segment's memory the moment the last process
that maps it or holds its descriptor is gone, however it ended, and an
abstract socket goes with its last descriptor.  So a crash leaves nothing
for a later process to find; ``fastmq ls`` shows the memory that live
processes still hold.

The function stays so that scripts calling it keep working.
"""
from __future__ import annotations

NOTHING_LEFT = ("fastmq keeps no files: a queue's shared memory is freed by the kernel "
                "when the last process holding it exits, however it exits. "
                "`fastmq ls` shows what live processes hold now.")


def cleanup(dry_run: bool = False) -> list[str]:
    """Remove what dead fastmq processes left behind: always nothing
    (returns ``[]``)."""
    return []


__all__ = ["cleanup", "NOTHING_LEFT"]
