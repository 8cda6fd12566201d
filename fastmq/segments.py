"""Shared-memory segments: naming, space checks, and the files this
process must remove when it exits.

How `/dev/shm` is budgeted and reserved: docs/operations.md.

Every segment fastmq creates is named ``fastmq_<creator pid>_<kind>_<random>``
so that ``fastmq cleanup`` can tell whose it is and whether that process is
gone.
"""
from __future__ import annotations

import atexit
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

    Checked before a segment is created: tmpfs allocates pages lazily, so an
    undersized ``/dev/shm`` would otherwise surface later as a SIGBUS in
    the middle of a copy.
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
                "--shm-size or --ipc=host) or "
                "lower FASTMQ_MAX_CHUNK_MB / FASTMQ_MAX_CHUNKS."
            )


# What this process created and must remove, even when it exits with queues
# still alive (finalizers do not run at exit): segment names and ipc paths.
# Values are the creating pid: a forked child inherits these dicts but must
# not remove its parent's files.
_owned_segments: dict[str, int] = {}
_owned_paths: dict[str, int] = {}
_exit_hook_pid = 0


def _hook_exit() -> None:
    """Make sure ``_remove_leftovers`` runs when this process exits.

    ``atexit`` covers an interpreter that exits normally.  A
    ``multiprocessing`` child (fork start method, vLLM's default for its
    workers; and any child whose target raised) ends with ``os._exit``,
    which runs no ``atexit`` hook -- but multiprocessing runs its own exit
    finalizers first.  The child starts with none of its parent's, so
    each process that owns files registers one."""
    global _exit_hook_pid
    me = os.getpid()
    if _exit_hook_pid == me:
        return
    _exit_hook_pid = me
    from multiprocessing import util

    util.Finalize(None, _remove_leftovers, exitpriority=0)


def remove_at_exit(paths) -> None:
    _hook_exit()
    for p in paths:
        _owned_paths[p] = os.getpid()


def remove_now(paths) -> None:
    """Remove these ipc files if this process created them: a forked child
    that drops an inherited queue must not unlink its parent's live
    sockets (a reader attaching later would hang on a missing file)."""
    me = os.getpid()
    for p in paths:
        if _owned_paths.get(p) != me:
            continue
        del _owned_paths[p]
        try:
            os.unlink(p)
        except OSError:
            pass


@atexit.register
def _remove_leftovers() -> None:
    me = os.getpid()
    remove_now([p for p, pid in list(_owned_paths.items()) if pid == me])
    for name, pid in list(_owned_segments.items()):
        if pid == me:
            forget_segment(name)
            try:
                os.unlink(os.path.join(SHM_PATH, name))
            except OSError:
                pass


def forget_segment(name: str) -> None:
    _owned_segments.pop(name, None)


def new_segment_name(kind: str) -> str:
    return f"{SEGMENT_PREFIX}{os.getpid()}_{kind}_{secrets.token_hex(6)}"


def create_segment(kind: str, size: int, what: str, required: int | None = None) -> Segment:
    # ``required``: what must fit now, when the segment reserves its pages as
    # they are first used (the ring), instead of its whole size.
    check_shm_free_space(size if required is None else required, allocation_name=what)
    _hook_exit()
    seg = Segment.create(new_segment_name(kind), size)
    _owned_segments[seg.name] = os.getpid()
    return seg
