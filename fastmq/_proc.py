"""Process identity: a pid plus its start time, so a reused pid is not
mistaken for the process that wrote it into a segment."""
from __future__ import annotations

import os


def start_time(pid: int | str) -> int:
    """Start time of ``pid`` (or ``"self"``) in clock ticks since boot (0
    if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split
    # after the last ')'.  starttime is field 22, i.e. index 19 after it.
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return 0


# A ring's reader slot keeps the low 31 bits of its holder's start time
# beside the pid, in one 64-bit word (see fastmq/_ring_layout.pxd).
START_TAG_MASK = 0x7FFFFFFF


def is_alive(pid: int, started: int = 0, mask: int = -1) -> bool:
    """True if ``pid`` runs (not once every thread of it has exited, even
    before it is reaped) and, when ``started`` is known, is the same
    process; ``mask`` compares only those bits of the start time."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if started:
        now = start_time(pid)
        if now and (now & mask) != started:
            return False
    return not _exited(pid)


def _state(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2 :].split()[0]


def _exited(pid: int) -> bool:
    """Whether ``pid`` is a zombie, exited but not reaped yet (its pid
    still answers signals).  Its first thread shows as a zombie as soon as
    that thread has exited, while the process's other threads may still
    run, or, after a SIGKILL, still be tearing down with its files open:
    the process has exited once every thread has."""
    try:
        if _state(f"/proc/{pid}/stat") not in (b"Z", b"X"):
            return False
    except (OSError, ValueError):
        return False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True    # reaped meanwhile
    except OSError:
        return False
    for tid in tasks:
        try:
            if _state(f"/proc/{pid}/task/{tid}/stat") not in (b"Z", b"X"):
                return False
        except (OSError, ValueError):
            pass   # that thread is gone
    return True


def me() -> tuple[int, int]:
    # /proc/self, not /proc/<getpid()>: in a child pid namespace that sees
    # its parent's /proc, getpid()'s number names another process there.
    return os.getpid(), start_time("self")


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 if unknown).  Pids mean
    something only inside one namespace: a process that finds another
    namespace's queue must not judge its pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
