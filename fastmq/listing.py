"""``fastmq ls``: every fastmq queue on this host, read from its segments.

The user's side: docs/operations.md, "Inspecting".

Segments have no path (fastmq/_segment.pyx): they are found through
``/proc``, as the descriptors (``/proc/<pid>/fd``, ``memfd:fastmq_...``)
and mappings (``/proc/<pid>/maps``) of the processes the caller may
inspect.  A segment is opened through its creator's descriptor, or, once
the creator is gone, through a mapping (``/proc/<pid>/map_files``, which
the kernel opens only for a caller with ``CAP_SYS_ADMIN``; for others such
a segment is listed with the reason it cannot be read).  Everything else
comes from the shared-memory headers (``fastmq._snapshot``).  Segments are
opened ``O_RDONLY`` and mapped ``PROT_READ``: looking at a live queue never
writes to it, so it cannot disturb the queue.

Where each reader is comes from two counters in the ring header: the
messages the writer has published and, in each reader slot, the messages
that reader has read.  Message ``k`` goes into chunk ``k % max_chunks``, so
a reader that has read ``n`` messages waits on chunk ``n % max_chunks`` and
is ``published - n`` messages behind.  The counters are read one after the
other while the queue runs: a moment's view, not an atomic one.

Run it in the pid namespace of the processes that use the queues: from
another one they are not visible.
"""
from __future__ import annotations

import mmap
import os
import re
import time

from fastmq import _arena, _proc, _ring, _snapshot
from fastmq.segments import SEGMENT_PREFIX

_SEGMENT = re.compile(
    rf"^/memfd:({SEGMENT_PREFIX}(\d+)_([A-Za-z0-9]+)_[0-9a-f]+)(?: \(deleted\))?$")
_MARK = f"/memfd:{SEGMENT_PREFIX}"
WAIT_MODES = {_ring.WAIT_SPIN: "spin", _ring.WAIT_FUTEX: "futex", _ring.WAIT_ZMQ: "zmq"}


# -- positions from the counters ----------------------------------------------

def positions(published: int, reads: list[int], max_chunks: int
              ) -> tuple[int, list[dict]]:
    """The writer's next chunk and, per reader, ``{"chunk", "behind"}``."""
    out = [{"chunk": n % max_chunks, "behind": max(0, published - n)} for n in reads]
    return published % max_chunks, out


# -- reading segments ----------------------------------------------------------

def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _process(pid: int, started: int = 0) -> dict:
    alive = _proc.is_alive(pid, started)
    return {"pid": pid, "name": _comm(pid) if alive else None, "alive": alive}


class _Seen:
    """One segment as /proc shows it: its name, and the ways to open it."""

    def __init__(self, name: str, pid: int, kind: str):
        self.name, self.name_pid, self.kind = name, pid, kind
        self.paths: list[str] = []      # /proc/<pid>/fd/<n> first, then map_files
        self.mappers: set[int] = set()
        self.holders: set[int] = set()


def _scan() -> dict[int, _Seen]:
    """Every fastmq segment that a process this caller may inspect holds
    (a descriptor) or maps, by inode."""
    seen: dict[int, _Seen] = {}

    def entry(link: str) -> _Seen | None:
        m = _SEGMENT.match(link)
        return None if m is None else _Seen(m[1], int(m[2]), m[3])

    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            fds = []
        for fd in fds:
            path = f"{fd_dir}/{fd}"
            try:
                link = os.readlink(path)
                if not link.startswith(_MARK):
                    continue
                ino = os.stat(path).st_ino
            except OSError:
                continue
            e = entry(link)
            if e is not None:
                s = seen.setdefault(ino, e)
                s.paths.insert(0, path)
                s.holders.add(int(pid))
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = [ln for ln in f if _MARK in ln]
        except OSError:
            continue
        for ln in lines:
            # range perms offset dev inode path
            parts = ln.split(None, 5)
            if len(parts) < 6:
                continue
            e = entry(parts[5].rstrip("\n"))
            if e is None:
                continue
            s = seen.setdefault(int(parts[4]), e)
            s.mappers.add(int(pid))
            if int(parts[2], 16) == 0:
                s.paths.append(f"/proc/{pid}/map_files/{parts[0]}")
    return seen


def _read_segment(seg: _Seen, reader):
    """``(snapshot, size, held_bytes)`` of a segment, mapped read-only;
    ``snapshot`` is an error string when it cannot be read, and None when
    ``reader`` is (a kind not read: only its size is wanted)."""
    err = "no process holds or maps it any more"
    for path in seg.paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            err = f"cannot open {path}: {e.strerror or e}"
            continue
        try:
            st = os.fstat(fd)
            if reader is None:
                return None, st.st_size, st.st_blocks * 512
            if st.st_size == 0:
                return "empty segment", 0, 0
            m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            return reader(m), st.st_size, st.st_blocks * 512
        except (_ring.SegmentMismatchError, _arena.ArenaError) as e:
            return str(e), st.st_size, st.st_blocks * 512
        finally:
            m.close()
    return err, None, None


def _ring_entry(seg: _Seen, snap: dict, size: int, used: int) -> dict:
    writer_next, pos = positions(snap["published"], snap["reads"], snap["max_chunks"])
    readers = []
    for rank, ((pid, started), left, p) in enumerate(zip(snap["readers"], snap["left"], pos)):
        if pid == 0:
            proc = {"pid": None, "name": None, "alive": None}
            state = "not attached"
        else:
            proc = _process(pid, started)
            state = "left" if left else "alive" if proc["alive"] else "dead"
        readers.append({"rank": rank, **proc, "state": state, **p})
    writer = _process(snap["writer_pid"], snap["writer_start"])
    writer["state"] = ("closed" if snap["writer_closed"]
                       else "alive" if writer["alive"] else "dead")
    writer["next_chunk"] = writer_next
    writer["parked"] = bool(snap["writer_parked"])
    return {
        "name": seg.name,
        "mapped_by": sorted(seg.mappers),
        "writer": writer,
        "n_reader": snap["n_reader"],
        "max_chunks": snap["max_chunks"],
        "max_chunk_bytes": snap["max_chunk_bytes"],
        "wait_mode": WAIT_MODES.get(snap["wait_mode"], str(snap["wait_mode"])),
        "spin_us": snap["spin_ns"] / 1000,
        "readers": readers,
        "parked_readers": snap["readers_parked"],
        "segment_bytes": size,
        "held_bytes": used,
        "arena": None,
    }


def _arena_entry(seg: _Seen, snap: dict, size: int, used: int) -> dict:
    in_use = [{"slot": s, "ranks": [r for r, d in enumerate(done) if d == 0]}
              for s, (_epoch, written, done) in enumerate(snap["slots"])
              if written == 1 and 0 in done]
    return {
        "name": seg.name,
        "mapped_by": sorted(seg.mappers),
        "n_reader": snap["n_reader"],
        "n_slots": snap["n_slots"],
        "slot_bytes": snap["slot_bytes"],
        "slots_in_use": in_use,
        "segment_bytes": size,
        "held_bytes": used,
    }


def _pair_arenas(rings: list[dict], arenas: list[tuple[int, dict]]) -> list[dict]:
    """Attach each arena to its queue's ring; returns the arenas left over.

    An arena's header does not name its ring.  Both are created by the
    writer (the pid in their names) for the same local readers, and every
    process of the queue maps both; so a ring of the same creator and
    reader count is the match, and when a process has several, the one
    mapped by exactly the same processes."""
    unmatched = []
    for pid, a in arenas:
        cands = [q for q in rings if q["arena"] is None and q["name_pid"] == pid
                 and q["n_reader"] == a["n_reader"]]
        if len(cands) > 1:
            cands = [q for q in cands if q["mapped_by"] == a["mapped_by"]]
        if len(cands) == 1:
            cands[0]["arena"] = a
        else:
            unmatched.append(a)
    return unmatched


def _with_arena_pids(q: dict) -> None:
    a = q["arena"]
    if a is None:
        return
    by_rank = {r["rank"]: r for r in q["readers"]}
    for use in a["slots_in_use"]:
        use["readers"] = [{"rank": r, "pid": by_rank[r]["pid"] if r in by_rank else None,
                           "state": by_rank[r]["state"] if r in by_rank else None}
                          for r in use["ranks"]]


def list_queues() -> dict:
    """Every fastmq segment on this host that a process the caller may
    inspect holds or maps, as one JSON-able dict: ``queues`` (one per ring,
    with its arena), ``arenas`` (arenas not paired with a ring), ``other``
    (other fastmq segments, or ones that could not be read, with the
    reason) and ``memory`` (bytes the segments hold, and the host's
    available memory)."""
    rings, arenas, other = [], [], []
    for seg in sorted(_scan().values(), key=lambda x: x.name):
        reader = {"ring": _snapshot.ring_snapshot,
                  "arena": _snapshot.arena_snapshot}.get(seg.kind)
        snap, size, used = _read_segment(seg, reader)
        if reader is None or isinstance(snap, str):
            other.append({"name": seg.name, "kind": seg.kind, "error": snap,
                          "mapped_by": sorted(seg.mappers), "segment_bytes": size,
                          "held_bytes": used})
        elif seg.kind == "ring":
            q = _ring_entry(seg, snap, size, used)
            q["name_pid"] = seg.name_pid
            rings.append(q)
        else:
            arenas.append((seg.name_pid, _arena_entry(seg, snap, size, used)))
    lone_arenas = _pair_arenas(rings, arenas)
    for q in rings:
        del q["name_pid"]
        _with_arena_pids(q)
    used = sum(x["held_bytes"] or 0 for x in rings + lone_arenas + other)
    used += sum(q["arena"]["held_bytes"] for q in rings if q["arena"])
    return {"host_time": time.time(), "queues": rings, "arenas": lone_arenas,
            "other": other,
            "memory": {"fastmq_held_bytes": used, "available_bytes": _available()}}


def _available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


# -- text ---------------------------------------------------------------------

def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _who(p: dict) -> str:
    if p.get("pid") is None:
        return "-"
    return f"{p['pid']} ({p['name']})" if p.get("name") else str(p["pid"])


def _chunk(c: int | None) -> str:
    return "?" if c is None else str(c)


def _table(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _arena_lines(a: dict, indent: str) -> list[str]:
    head = (f"{indent}arena {a['name']}: {a['n_slots']} x {_size(a['slot_bytes'])} slots, "
            f"{len(a['slots_in_use'])} in use; {_size(a['segment_bytes'])}, "
            f"{_size(a['held_bytes'])} of it held")
    lines = [head]
    for u in a["slots_in_use"]:
        who = u.get("readers")
        if who is None:
            held = ", ".join(f"rank {r}" for r in u["ranks"])
        else:
            held = ", ".join(
                f"rank {x['rank']} (pid {x['pid']}{', ' + x['state'] if x['state'] != 'alive' else ''})"
                if x["pid"] is not None else f"rank {x['rank']}" for x in who)
        lines.append(f"{indent}  slot {u['slot']}: not yet released by {held}")
    return lines


def format_text(listing: dict) -> str:
    out = []
    for q in listing["queues"]:
        w = q["writer"]
        out.append(f"{q['name']}  writer {_who(w)} {w['state']}")
        out.append(
            f"  ring {q['max_chunks']} x {_size(q['max_chunk_bytes'])} chunks, "
            f"{q['n_reader']} local reader{'s' if q['n_reader'] != 1 else ''}, "
            f"wait {q['wait_mode']} (spin {q['spin_us']:g} us); "
            f"{_size(q['segment_bytes'])}, {_size(q['held_bytes'])} of it held")
        out.append(f"  writer next chunk {_chunk(w['next_chunk'])}"
                   f"{', parked (ring full)' if w['parked'] else ''}; "
                   f"parked readers: {q['parked_readers']}")
        rows = [["rank", "pid", "process", "state", "chunk", "behind"]]
        for r in q["readers"]:
            rows.append([str(r["rank"]), "-" if r["pid"] is None else str(r["pid"]),
                         r["name"] or "-", r["state"], _chunk(r["chunk"]), str(r["behind"])])
        out.extend(_table(rows, "  "))
        if q["arena"]:
            out.extend(_arena_lines(q["arena"], "  "))
        out.append("")
    for a in listing["arenas"]:
        out.extend(_arena_lines(a, ""))
        out.append("  (not matched to one ring of its creator: none, or several alike)")
        out.append("")
    for o in listing["other"]:
        what = f"unreadable: {o['error']}" if o["error"] else f"{o['kind']} segment"
        out.append(f"{o['name']}  {what}; {_size(o['segment_bytes'])}")
    if listing["other"]:
        out.append("")
    mem = listing["memory"]
    n = len(listing["queues"])
    out.append(f"{n} queue{'s' if n != 1 else ''}; fastmq's segments hold "
               f"{_size(mem['fastmq_held_bytes'])} of shared memory "
               f"({_size(mem['available_bytes'])} available on this host)")
    return "\n".join(out)


__all__ = ["format_text", "list_queues", "positions"]
