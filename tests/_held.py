"""What fastmq leaves, seen through /proc: the segments a process holds a
descriptor of or maps, and Shmem.  No pytest here: vLLM's CPU build's
Python runs it too."""
from __future__ import annotations

import os


def _creator(name: str) -> int:
    try:
        return int(os.path.basename(name).split("_")[1])
    except (IndexError, ValueError):
        return -1


def held_segments(pid: int | str = "self") -> set[str]:
    """The fastmq segments process ``pid`` holds a descriptor of or maps."""
    out = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        fds = []
    for fd in fds:
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:fastmq_"):
            out.add(link.split(":", 1)[1].split()[0])
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/memfd:fastmq_" in line:
                    out.add(line.split("/memfd:", 1)[1].split()[0])
    except OSError:
        pass
    return out


def segments_made_by(pids) -> dict[int, set[str]]:
    """pid -> the fastmq segments made by one of ``pids`` that it holds or
    maps, over every process of the host."""
    pids = set(pids)
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        mine = {n for n in held_segments(entry) if _creator(n) in pids}
        if mine:
            out[int(entry)] = mine
    return out


def holders_of(names) -> dict[int, set[str]]:
    """pid -> which of the segments ``names`` it holds or maps."""
    names = set(names)
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        mine = held_segments(entry) & names
        if mine:
            out[int(entry)] = mine
    return out


def shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Shmem line in /proc/meminfo")
