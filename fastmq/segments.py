"""Shared-memory segments: naming, and the ``/dev/shm`` check that vLLM's
other modules import from the queue's module.

A fastmq segment is an anonymous memory file (fastmq/_segment.pyx): it has
no path, so there is nothing to remove when a process exits, however it
exits.  The name, ``fastmq_<creator pid>_<kind>_<random>``, is what
``/proc/<pid>/fd`` shows (``/memfd:fastmq_...``) and what ``fastmq ls``
lists.  Lifetimes and inspection: docs/operations.md.
"""
from __future__ import annotations

import os
import secrets
import shutil

from fastmq._segment import Segment

SHM_PATH = "/dev/shm"
SEGMENT_PREFIX = "fastmq_"


def check_shm_free_space(
    required_bytes: int,
    shm_path: str = SHM_PATH,
    *,
    allocation_name: str = "shared-memory allocation",
) -> None:
    """Raise ``RuntimeError`` if ``shm_path`` cannot hold ``required_bytes``.

    vLLM's modules that keep their own files in ``/dev/shm`` import this
    from the queue's module; fastmq's own segments are not in ``/dev/shm``
    and need no such check.
    """
    if os.path.isdir(shm_path):
        usage = shutil.disk_usage(shm_path)
        free = usage.free
        if required_bytes > free:
            mib = 1 << 20
            raise RuntimeError(
                f"Insufficient space in {shm_path} for {allocation_name}: "
                f"{required_bytes / mib:.0f} MiB required, {free / mib:.0f} MiB "
                f"free of {usage.total / mib:.0f} MiB. Increase {shm_path} (e.g. "
                "--shm-size or --ipc=host)."
            )


def new_segment_name(kind: str) -> str:
    return f"{SEGMENT_PREFIX}{os.getpid()}_{kind}_{secrets.token_hex(6)}"


def create_segment(kind: str, size: int) -> Segment:
    """A new segment of ``size`` bytes, which other processes of this host
    attach with its ``locator``."""
    return Segment.create(new_segment_name(kind), size)


def drop_inherited(ring_buffer, arena) -> None:
    """In a forked child that inherited a queue end: close the child's
    copies of the end's segment descriptors (the ring's, the arena's),
    keeping the mappings.  The child cannot use the end; its copies would
    only keep the memory attachable for as long as it runs."""
    for seg in (getattr(ring_buffer, "segment", None),
                getattr(getattr(arena, "core", None), "segment", None)):
        if seg is not None:
            seg.drop_descriptor()
