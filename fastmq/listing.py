"""``fastmq ls``: every fastmq queue on this host, read from its segments.

The user's side: docs/operations.md, "Inspecting".

Everything comes from the shared-memory headers (``fastmq._snapshot``) and
from ``/proc``.  Segments are opened ``O_RDONLY`` and mapped ``PROT_READ``:
looking at a live queue never writes to it, so it cannot disturb the queue.

Where each reader is comes from two counters in the ring header: the
messages the writer has published and, in each reader slot, the messages
that reader has read.  Message ``k`` goes into chunk ``k % max_chunks``, so
a reader that has read ``n`` messages waits on chunk ``n % max_chunks`` and
is ``published - n`` messages behind.  The counters are read one after the
other while the queue runs: a moment's view, not an atomic one.

Run it in the pid namespace of the processes that use the queues (as with
``fastmq cleanup``): from another namespace every pid looks dead.
"""
from __future__ import annotations

import mmap
import os
import re
import shutil
import stat
import time

from fastmq import _arena, _proc, _ring, _snapshot
from fastmq.segments import SEGMENT_PREFIX, SHM_PATH

_SEGMENT = re.compile(rf"^{SEGMENT_PREFIX}(\d+)_([A-Za-z0-9]+)_[0-9a-f]+$")
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


def _read_segment(path: str, reader):
    """``(snapshot, size, used_bytes)`` of the segment at ``path``, mapped
    read-only; ``snapshot`` is an error string when it cannot be read."""
    # No following links, no blocking on a FIFO planted under our prefix.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        used = st.st_blocks * 512
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", st.st_size, used
        if st.st_size == 0:
            return "empty segment", 0, used
        m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return reader(m), st.st_size, used
    except (_ring.SegmentMismatchError, _arena.ArenaError) as e:
        return str(e), st.st_size, used
    finally:
        m.close()


def _mappers() -> dict[str, set[int]]:
    """Segment name -> pids that map it, from ``/proc/*/maps`` (processes
    this user may inspect)."""
    out: dict[str, set[int]] = {}
    marker = f" {SHM_PATH}/{SEGMENT_PREFIX}"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                lines = [ln for ln in f if marker in ln]
        except OSError:
            continue
        for ln in lines:
            name = ln.rsplit("/", 1)[-1].split()[0]
            out.setdefault(name, set()).add(int(entry))
    return out


def _ring_entry(name: str, snap: dict, size: int, used: int) -> dict:
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
        "name": name,
        "path": os.path.join(SHM_PATH, name),
        "writer": writer,
        "n_reader": snap["n_reader"],
        "max_chunks": snap["max_chunks"],
        "max_chunk_bytes": snap["max_chunk_bytes"],
        "wait_mode": WAIT_MODES.get(snap["wait_mode"], str(snap["wait_mode"])),
        "spin_us": snap["spin_ns"] / 1000,
        "readers": readers,
        "parked_readers": snap["readers_parked"],
        "segment_bytes": size,
        "shm_used_bytes": used,
        "arena": None,
    }


def _arena_entry(name: str, snap: dict, size: int, used: int) -> dict:
    in_use = [{"slot": s, "ranks": [r for r, d in enumerate(done) if d == 0]}
              for s, (_epoch, written, done) in enumerate(snap["slots"])
              if written == 1 and 0 in done]
    return {
        "name": name,
        "path": os.path.join(SHM_PATH, name),
        "n_reader": snap["n_reader"],
        "n_slots": snap["n_slots"],
        "slot_bytes": snap["slot_bytes"],
        "slots_in_use": in_use,
        "segment_bytes": size,
        "shm_used_bytes": used,
    }


def _pair_arenas(rings: list[dict], arenas: list[tuple[int, dict]]) -> list[dict]:
    """Attach each arena to its queue's ring; returns the arenas left over.

    An arena's header does not name its ring.  Both are created by the
    writer (the pid in their names) for the same local readers, and every
    process of the queue maps both; so a ring of the same creator and
    reader count is the match, and when a process has several, the one
    mapped by exactly the same processes."""
    unmatched = []
    mapped = None
    for pid, a in arenas:
        cands = [q for q in rings if q["arena"] is None and q["name_pid"] == pid
                 and q["n_reader"] == a["n_reader"]]
        if len(cands) > 1:
            if mapped is None:
                mapped = _mappers()
            who = mapped.get(a["name"], set())
            cands = [q for q in cands if mapped.get(q["name"], set()) == who]
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


def list_queues(shm_path: str = SHM_PATH) -> dict:
    """Every fastmq segment under ``shm_path``, as one JSON-able dict:
    ``queues`` (one per ring, with its arena), ``arenas`` (arenas not paired
    with a ring), ``other`` (other fastmq segments, or ones that could not
    be read, with the reason) and ``shm`` (bytes used by fastmq, and the
    filesystem's size and free bytes)."""
    rings, arenas, other = [], [], []
    try:
        names = sorted(os.listdir(shm_path))
    except OSError:
        names = []
    for name in names:
        m = _SEGMENT.match(name)
        if not m:
            continue
        pid, kind = int(m[1]), m[2]
        path = os.path.join(shm_path, name)
        reader = {"ring": _snapshot.ring_snapshot, "arena": _snapshot.arena_snapshot}.get(kind)
        try:
            if reader is None:
                st = os.lstat(path)
                other.append({"name": name, "path": path, "kind": kind, "error": None,
                              "segment_bytes": st.st_size,
                              "shm_used_bytes": st.st_blocks * 512})
                continue
            snap, size, used = _read_segment(path, reader)
        except FileNotFoundError:
            continue  # gone since listdir
        except OSError as e:
            other.append({"name": name, "path": path, "kind": kind,
                          "error": e.strerror or str(e), "segment_bytes": None,
                          "shm_used_bytes": None})
            continue
        if isinstance(snap, str):
            other.append({"name": name, "path": path, "kind": kind, "error": snap,
                          "segment_bytes": size, "shm_used_bytes": used})
        elif kind == "ring":
            q = _ring_entry(name, snap, size, used)
            q["name_pid"] = pid
            rings.append(q)
        else:
            arenas.append((pid, _arena_entry(name, snap, size, used)))
    lone_arenas = _pair_arenas(rings, arenas)
    for q in rings:
        del q["name_pid"]
        _with_arena_pids(q)
    used = sum(x["shm_used_bytes"] or 0 for x in rings + lone_arenas + other)
    used += sum(q["arena"]["shm_used_bytes"] for q in rings if q["arena"])
    try:
        du = shutil.disk_usage(shm_path)
        fs = {"size_bytes": du.total, "free_bytes": du.free}
    except OSError:
        fs = {"size_bytes": None, "free_bytes": None}
    return {"host_time": time.time(), "shm_path": shm_path, "queues": rings,
            "arenas": lone_arenas, "other": other,
            "shm": {"fastmq_used_bytes": used, **fs}}


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
            f"{len(a['slots_in_use'])} in use; /dev/shm {_size(a['segment_bytes'])} "
            f"reserved, {_size(a['shm_used_bytes'])} used")
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
            f"wait {q['wait_mode']} (spin {q['spin_us']:g} us); /dev/shm "
            f"{_size(q['segment_bytes'])} reserved, {_size(q['shm_used_bytes'])} used")
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
        out.append(f"{o['name']}  {what}; /dev/shm {_size(o['segment_bytes'])}")
    if listing["other"]:
        out.append("")
    shm = listing["shm"]
    n = len(listing["queues"])
    out.append(f"{n} queue{'s' if n != 1 else ''}; fastmq uses {_size(shm['fastmq_used_bytes'])} "
               f"of {listing['shm_path']} ({_size(shm['free_bytes'])} free of "
               f"{_size(shm['size_bytes'])})")
    return "\n".join(out)


__all__ = ["format_text", "list_queues", "positions"]
