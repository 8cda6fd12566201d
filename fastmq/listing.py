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

Anyone can name a memory file ``fastmq_<n>_ring_<hex>``, and root's ``ls``
sees every user's.  So a file is mapped only when it is sealed against
shrinking and growing as fastmq seals its segments (a file its holder may
cut would fault under the mapping), lives in shared memory (not
hugetlbfs), and, if larger than 1 MiB, its header, read with ``pread``,
says it is a whole fastmq segment of that size (``_unmappable``); any
other is listed under "other" with the reason, its owner and holders, and
every failure to read one segment stays with that segment.

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

import ctypes
import fcntl
import mmap
import os
import re
import struct
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


# What a segment must be before ``ls`` maps it.  fastmq seals every ring
# and arena against shrinking and growing (fastmq/_segment.pyx,
# Segment.create): a mapping of a file that may shrink faults (SIGBUS) at
# the first page its holder cuts off, which would kill ``ls``.
# memfd_create's files are in shared memory (tmpfs) unless made with
# MFD_HUGETLB: a hugetlbfs page that is not there is allocated on the first
# touch, from a pool that may be empty (SIGBUS again).
_TMPFS_MAGIC = 0x01021994
_FS_NAMES = {0x958458F6: "hugetlbfs"}
# The words every ring and arena header begins with (fastmq/_ring_layout.pxd
# and fastmq/_arena_layout.pxd agree on them): the magic (u64 at 0), where
# the data begins (u64 at 40: the header and flags before it are all that
# ls reads) and the segment's size (u64 at 48).  A segment is mapped only
# once these, read with pread, say that it is a whole fastmq segment of its
# size whose header and flags ls can read, and then only that far: a
# sparse file of a PiB with no header is never mapped, and a forged header
# that claims billions of chunks is refused here.
_HEAD = struct.Struct("<Q32xQQ")
_MAX_FLAGS_BYTES = 64 << 20
_MAGIC = {"ring": _ring.MAGIC, "arena": _arena.MAGIC}


_fstatfs = None     # libc's fstatfs, looked up once (False: not there)


def _fs_type(fd: int) -> int | None:
    """``f_type`` of ``fstatfs(fd)``, or None where it cannot be asked."""
    global _fstatfs
    if _fstatfs is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _fstatfs = libc.fstatfs
        except (OSError, AttributeError):
            _fstatfs = False
    if not _fstatfs:
        return None
    # struct statfs begins with f_type, a C long; 256 bytes hold all of it.
    buf = ctypes.create_string_buffer(256)
    if _fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def _unmappable(fd: int, kind: str, size: int) -> tuple[str | None, int]:
    """``(why, span)``: why ``ls`` must not map this segment (its file
    ``fd`` of ``size`` bytes), or None: it is sealed as fastmq seals its
    segments, in shared memory, and its header says it is a whole ``kind``
    of this size; and how much of it to map: its header and flags (where
    its header, read with ``pread``, says its data starts: all that the
    snapshot reads)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        return f"cannot read its seals: {e.strerror or e}; not mapped", 0
    missing = [n for bit, n in ((fcntl.F_SEAL_SHRINK, "shrinking"),
                                (fcntl.F_SEAL_GROW, "growing")) if not seals & bit]
    if missing:
        return (f"not sealed against {' and '.join(missing)}, as fastmq seals its "
                "segments: not mapped"
                + (" (its holder could cut it under the mapping)"
                   if not seals & fcntl.F_SEAL_SHRINK else "")), 0
    fs = _fs_type(fd)
    if fs is not None and fs != _TMPFS_MAGIC:
        return (f"not in shared memory (a {_FS_NAMES.get(fs, hex(fs))} file, as fastmq's "
                "segments never are): not mapped"), 0
    try:
        head = os.pread(fd, _HEAD.size, 0)
    except OSError as e:
        return f"cannot read its header: {e.strerror or e}", 0
    magic, data_off, total = (_HEAD.unpack(head) if len(head) == _HEAD.size
                              else (None, 0, 0))
    if magic == _MAGIC[kind] and 0 < data_off <= min(size, _MAX_FLAGS_BYTES):
        span = data_off
    elif len(head) < _HEAD.size:
        return "its header could not be read whole", 0
    elif magic != _MAGIC[kind]:
        return f"not a fastmq {kind} (no fastmq header)", 0
    else:
        return (f"its fastmq {kind} header puts the data at byte {data_off}: a header and "
                f"flags larger than ls reads ({_size(_MAX_FLAGS_BYTES)}) or than the "
                "segment"), 0
    if total != size:
        return f"its fastmq {kind} header says {total} bytes, the segment has {size}", 0
    return None, span


def _read_segment(seg: _Seen, reader):
    """``(snapshot, size, held_bytes, uid)`` of a segment, mapped read-only
    once it is known to be safe to map (``_unmappable``); ``snapshot`` is
    an error string when it cannot be read, and None when ``reader`` is
    (a kind not read: only its size is wanted).  Never raises: one segment
    that cannot be read is listed with the reason, next to the others."""
    err = "no process holds or maps it any more"
    for path in seg.paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            err = f"cannot open {path}: {e.strerror or e}"
            continue
        try:
            st = os.fstat(fd)
            size, used, uid = st.st_size, st.st_blocks * 512, st.st_uid
            if reader is None:
                return None, size, used, uid
            if size == 0:
                return "empty segment", 0, 0, uid
            why, span = _unmappable(fd, seg.kind, size)
            if why is not None:
                return why, size, used, uid
            try:
                m = mmap.mmap(fd, span, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError, OverflowError) as e:
                return (f"cannot map its {_size(size)}: {getattr(e, 'strerror', None) or e}",
                        size, used, uid)
        except OSError as e:
            err = f"cannot read {path}: {e.strerror or e}"
            continue
        finally:
            os.close(fd)
        try:
            return reader(m, size), size, used, uid
        except (_ring.SegmentMismatchError, _arena.ArenaError, ValueError,
                OverflowError) as e:
            return str(e), size, used, uid
        finally:
            m.close()
    return err, None, None, None


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
        snap, size, used, uid = _read_segment(seg, reader)
        if reader is None or isinstance(snap, str):
            other.append({"name": seg.name, "kind": seg.kind, "error": snap,
                          "mapped_by": sorted(seg.mappers),
                          "held_by": sorted(seg.holders), "uid": uid,
                          "segment_bytes": size, "held_bytes": used})
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
    """What a queue's next pages can still come from: the host's and this
    process's memory cgroups' room, as the queues' own check counts it."""
    from fastmq._memory import memory_available

    avail = memory_available()
    return avail if avail >= 0 else None


# -- text ---------------------------------------------------------------------

def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, div in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
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
    me = os.geteuid()
    for o in listing["other"]:
        what = f"unreadable: {o['error']}" if o["error"] else f"{o['kind']} segment"
        if o.get("uid") not in (None, me):
            # Another user's file that only looks like fastmq's: say whose.
            held = ", ".join(map(str, o.get("held_by") or [])) or "-"
            what += f" (owner uid {o['uid']}, held by pid {held})"
        out.append(f"{o['name']}  {what}; {_size(o['segment_bytes'])}")
    if listing["other"]:
        out.append("")
    mem = listing["memory"]
    n = len(listing["queues"])
    out.append(f"{n} queue{'s' if n != 1 else ''}; fastmq's segments hold "
               f"{_size(mem['fastmq_held_bytes'])} of shared memory "
               f"({_size(mem['available_bytes'])} available to it, within the host's "
               "and this process's memory cgroups' limits)")
    return "\n".join(out)


__all__ = ["format_text", "list_queues", "positions"]
