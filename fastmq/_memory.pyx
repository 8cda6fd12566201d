# cython: freethreading_compatible = False
"""Memory a new page of shared memory can still come from.

An anonymous memory file has no size limit of its own: allocating its pages
past what the host, or this process's memory cgroup, can give does not
fail, it wakes the OOM killer.  So fastmq asks first, and asks what the
kernel would really hand over (vLLM's queue just writes its pages, and
fastmq must not refuse what that write would get):

* the host's ``MemAvailable`` (it already counts reclaimable cache);
* for each memory cgroup on the path from this process's up to the
  highest one it can see, ``limit - usage + reclaimable``: page cache that
  is not dirty, under writeback or shared memory (memfd and ``/dev/shm``
  pages are counted as cache, but only swap frees them), and
  cgroup v1's ``hierarchical_memory_limit`` for a tighter limit above what
  is visible.  The cgroup directories are found through the mounts of the
  memory controller in ``/proc/self/mountinfo`` (a mount's root says which
  cgroup it shows), so a container's own cgroup bind-mounted at
  ``/sys/fs/cgroup/memory``, or a cgroup namespace, is read where it is.

Every file is read under a ``root`` (``"/"`` by default), so that a
directory tree laid out as the kernel lays out ``/proc`` and a cgroup file
system answers in its place.  What cannot be read is logged once and left
out: the check then never refuses for memory it cannot see is missing.
"""
import logging
import os
import threading
import time

logger = logging.getLogger("fastmq")

# Limits at or above this are "none" (v1 writes PAGE_COUNTER_MAX pages).
cdef long long UNLIMITED = 1LL << 62


class ShmFullError(RuntimeError):
    """The memory that a shared-memory segment needed could not be had.

    Raised instead of the fault that touching an unbacked page would be:
    nothing was written, and the same call works again once memory is
    back."""


# Named where users import it from (tracebacks say fastmq.ShmFullError).
ShmFullError.__module__ = "fastmq"


def shm_full_error(str what, Py_ssize_t needed, str name):
    mib = float(1 << 20)
    avail = memory_available()
    return ShmFullError(
        "%s needs %.1f MiB of shared memory in segment %r, which this host (or this "
        "container's memory limit) cannot give now (%s available). Nothing was "
        "sent or created; free memory or raise the limit, then retry."
        % (what, needed / mib, name,
           "%.1f MiB" % (avail / mib) if avail >= 0 else "unknown"))


cdef int check_memory(str what, Py_ssize_t nbytes, str name) except -1:
    # Asked through the kept reading (room_for): no file is read here while
    # memory is plentiful.  Callers that grow a range a page at a time
    # still ask once per larger step, and a ring's small first writes not
    # at all (its creation asked).
    if nbytes <= 0:
        return 0
    cdef long long avail = room_for(nbytes)
    if 0 <= avail < nbytes:
        raise shm_full_error(what, nbytes, name)
    return 0


# -- the reading kept in the background ------------------------------------------
# A reading costs this process about 125 us (several /proc and cgroup files
# read and parsed), more than a message: on a message's path it was a fresh
# queue's slowest step.  So while this process has a segment open, a thread
# ("fastmq-memory") takes one every REFRESH_S, and a message's check uses it,
# less what this process took since.  Memory held elsewhere may have gone
# in the meantime: the kept reading answers only while what it leaves
# covers the request twice over and SLACK_BYTES more, and only for
# STALE_S; otherwise (memory near its limit, or the thread starved) the
# check reads afresh on the spot, as correctness then is worth the read.
REFRESH_S = 1.0
STALE_S = 3.0
SLACK_BYTES = 256 << 20

cdef double _read_at = -1e300      # time.monotonic() of the kept reading
cdef long long _room = -1          # its bytes less those taken since; -1: unknown
cdef long long _n_background = 0
cdef long long _n_on_the_spot = 0
cdef int _open_segments = 0
_watcher = None
_watch_lock = threading.Lock()


cdef long long _read_now(Py_ssize_t taking, bint on_the_spot) except -2:
    global _read_at, _room, _n_background, _n_on_the_spot
    cdef long long avail = memory_available()
    _read_at = time.monotonic()
    _room = avail - taking if avail >= taking else avail
    if on_the_spot:
        _n_on_the_spot += 1
    else:
        _n_background += 1
    return avail


cdef long long room_for(Py_ssize_t need) except -2:
    """Bytes of memory available for ``need`` more (-1: unknown, nothing to
    check against), counted as taken by the caller when there is room."""
    global _room
    cdef long long have = _room
    if time.monotonic() - _read_at <= STALE_S and (have < 0 or have >= 2 * need + SLACK_BYTES):
        if have >= 0:
            _room = have - need
        return have
    _watch()                # a process forked from a watching one: start its own
    return _read_now(need, True)


def memory_room(Py_ssize_t need):
    """``room_for`` for Python callers: the bytes available for ``need``
    more, -1 when unknown; no file is read while memory is plentiful."""
    return room_for(need)


def memory_readings():
    """``{"background": n, "on_the_spot": n}``: the readings of /proc and
    the cgroup files this process took in the watcher, and on a caller's
    path (memory near its limit, the kept reading stale, a segment opened
    with none kept)."""
    return {"background": _n_background, "on_the_spot": _n_on_the_spot}


cdef int segment_opened() except -1:
    # Creating or attaching a segment is not a message's path: a reading
    # is taken here when none is kept, so that the first messages find one.
    global _open_segments
    _open_segments += 1
    if time.monotonic() - _read_at > REFRESH_S:
        _read_now(0, True)
    _watch()
    return 0


cdef void segment_closed() noexcept:
    # Called from deallocation, which a garbage collection may run inside
    # any lock of this process (an Event's among them): nothing here takes
    # one.  The watcher sees the count at its next turn and ends.
    global _open_segments
    _open_segments -= 1


cdef int _watch() except -1:
    global _watcher
    with _watch_lock:
        if _watcher is None and _open_segments > 0:
            _watcher = threading.Thread(target=_watch_loop, name="fastmq-memory", daemon=True)
            _watcher.start()
    return 0


def _watch_loop():
    global _watcher
    try:
        while True:
            with _watch_lock:
                if _open_segments <= 0:
                    return
            age = time.monotonic() - _read_at
            if age >= REFRESH_S:
                _read_now(0, False)
                age = 0.0
            time.sleep(REFRESH_S - age)
    finally:
        # Also when a reading raised: the next check reads on the spot and
        # starts another watcher.
        with _watch_lock:
            _watcher = None


def _forked_child():
    # The child has no watcher thread (only the forking thread lives on);
    # its next segment or check starts one.
    global _watcher, _watch_lock
    _watcher = None
    _watch_lock = threading.Lock()


os.register_at_fork(after_in_child=_forked_child)


# -- reading ---------------------------------------------------------------------
cdef set _warned = set()


cdef object _warn_once(str root, str what, str uses):
    key = (root, what)
    if key in _warned:
        return None
    _warned.add(key)
    logger.warning("fastmq cannot read %s; the memory check before shared memory is "
                   "allocated uses %s. Logged once.", what, uses)


cdef bytes _read(str path):
    # os.open/os.read, not open(): no Python-level io (and its decoders).
    # Raises OSError; the caller says what a missing file means.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    except OSError as e:            # os.read names no file
        raise type(e)(e.errno, e.strerror, path) from None
    finally:
        os.close(fd)


cdef str _unescape(str s):
    # mountinfo writes space, tab, newline and backslash as \ooo.
    if "\\" not in s:
        return s
    out = []
    cdef Py_ssize_t i = 0, n = len(s)
    while i < n:
        if s[i] == "\\" and i + 4 <= n and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(bytes text):
    """``[(version, cgroup root, mount point)]`` of the memory controller's
    mounts in a ``/proc/<pid>/mountinfo`` text: version 1 for a ``cgroup``
    mount with the ``memory`` option, 2 for ``cgroup2``.  A mount point
    mounted over keeps only its last (the visible) mount."""
    found = {}
    for line in text.decode(errors="replace").split("\n"):
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 4:        # fstype, source, super options
            continue
        fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
        point = _unescape(fields[4])
        if fstype == "cgroup" and "memory" in opts:
            found[point] = (1, _unescape(fields[3]), point)
        elif fstype == "cgroup2":
            found[point] = (2, _unescape(fields[3]), point)
        else:
            found.pop(point, None)       # something else mounted over it
    return list(found.values())


def parse_proc_cgroup(bytes text):
    """``(v1 memory path or None, v2 path or None)`` from a
    ``/proc/<pid>/cgroup`` text (paths relative to the cgroup namespace)."""
    v1 = v2 = None
    for line in text.decode(errors="replace").split("\n"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


cdef dict _mounts_cache = {}


cdef list _mounts(str root, bint fresh):
    # Mounts rarely change after a process starts: read once per process
    # (a fork re-reads), again when a directory they named is gone.
    key = (root, os.getpid())
    got = None if fresh else _mounts_cache.get(key)
    if got is None:
        got = parse_mountinfo(_read(root + "/proc/self/mountinfo"))
        _mounts_cache[key] = got
    return got


cdef object _under(str path, str mroot):
    # The part of cgroup ``path`` below a mount showing cgroup ``mroot``, or
    # None when the mount does not show it.
    if ".." in path.split("/"):
        return None                      # outside this cgroup namespace
    if mroot == "/":
        return path.rstrip("/")
    if path == mroot:
        return ""
    if path.startswith(mroot.rstrip("/") + "/"):
        return path[len(mroot.rstrip("/")):].rstrip("/")
    return None


cdef object _locate(str root, int version, str path, list mounts):
    # The directories of cgroup ``path`` and of its ancestors that a mount
    # shows, innermost first; None if no mount shows it.  The mount whose
    # root is highest shows the most ancestors.
    best = None
    for v, mroot, point in mounts:
        if v != version:
            continue
        rest = _under(path, mroot)
        if rest is None:
            continue
        base = root + point.rstrip("/")
        if not os.path.isdir(base + rest):
            continue
        if best is None or len(mroot) < len(best[0]):
            best = (mroot, base, rest)
    if best is None:
        return None
    _, base, rest = best
    dirs = [base + rest]
    while rest:
        rest = rest[:rest.rfind("/")]
        dirs.append(base + rest)
    return dirs


cdef dict _stat(bytes text):
    out = {}
    for line in text.split(b"\n"):
        k, _, v = line.partition(b" ")
        if v.strip().isdigit():
            out[k.decode()] = int(v)
    return out


cdef long long _reclaimable(dict st, int version):
    # Page cache the kernel frees to satisfy a charge: clean file pages.
    # Shared memory (memfd, /dev/shm, tmpfs) is in the cache / file counter
    # but sits on the anon LRU: only swap frees it.  Both views are taken
    # and the smaller kept, so that neither counts a shared page.
    cdef long long lru, nonshm, rec
    if version == 1:
        p = "total_" if "total_cache" in st else ""
        lru = st.get(p + "inactive_file", 0) + st.get(p + "active_file", 0)
        nonshm = st.get(p + "cache", 0) - st.get(p + "shmem", 0)
        rec = min(lru, nonshm) - st.get(p + "dirty", 0) - st.get(p + "writeback", 0)
    else:
        lru = st.get("inactive_file", -1)
        if lru >= 0:
            lru += st.get("active_file", 0)
        nonshm = st.get("file", 0) - st.get("shmem", 0)
        rec = (nonshm if lru < 0 else min(lru, nonshm)) - st.get("file_dirty", 0) \
            - st.get("file_writeback", 0)
    return max(0, rec)


cdef object _read_limit(str path, int version):
    # The limit in ``path`` (bytes), -1 for none; FileNotFoundError if the
    # file is not there.
    text = _read(path).strip()
    if version == 2 and text == b"max":
        return -1
    if not text.isdigit():
        raise OSError(0, "unexpected contents %r" % text[:40], path)
    n = int(text)
    return -1 if n >= UNLIMITED else n


cdef object _level(str d, int version, bint leaf):
    # {dir, limit, usage, reclaimable, room} of one cgroup directory;
    # None where it has no limit of its own (and is not the leaf, whose
    # memory.stat v1 also reads the hierarchical limit from).
    lim_name, use_name = (("memory.limit_in_bytes", "memory.usage_in_bytes") if version == 1
                          else ("memory.max", "memory.current"))
    try:
        limit = _read_limit(d + "/" + lim_name, version)
    except FileNotFoundError:
        return None                      # v2's root, or no memory controller here
    cdef dict st = {}
    if limit < 0 and not (leaf and version == 1):
        return None
    st = _stat(_read(d + "/memory.stat"))
    usage = int(_read(d + "/" + use_name).strip() or b"0")
    rec = min(_reclaimable(st, version), usage)
    lv = {"dir": d, "limit": limit, "usage": usage, "reclaimable": rec,
          "room": -1 if limit < 0 else max(0, limit - usage + rec)}
    if version == 1:
        h = st.get("hierarchical_memory_limit", -1)
        lv["hierarchical_limit"] = -1 if h >= UNLIMITED else h
    return lv


cdef long long _host(str root, list problems):
    try:
        text = _read(root + "/proc/meminfo")
    except OSError as e:
        problems.append("%s/proc/meminfo (%s)" % (root, e.strerror or e))
        return -1
    for line in text.split(b"\n"):
        if line.startswith(b"MemAvailable:"):
            return int(line.split()[1]) * 1024
    problems.append("MemAvailable in %s/proc/meminfo (not there)" % root)
    return -1


cdef list _cgroup_levels(str root, list problems):
    try:
        v1, v2 = parse_proc_cgroup(_read(root + "/proc/self/cgroup"))
    except OSError as e:
        problems.append("%s/proc/self/cgroup (%s)" % (root, e.strerror or e))
        return []
    if v1 is None and v2 is None:
        return []                        # no cgroups at all: no limit
    version, path = (1, v1) if v1 is not None else (2, v2)
    dirs = None
    try:
        for fresh in (False, True):
            dirs = _locate(root, version, path, _mounts(root, fresh))
            if dirs is not None:
                break
    except OSError as e:
        problems.append("%s/proc/self/mountinfo (%s)" % (root, e.strerror or e))
        return []
    if dirs is None:
        problems.append("this process's memory cgroup %s (no mount of the cgroup v%d %s "
                        "shows it)" % (path, version,
                                       "memory controller" if version == 1 else "file system"))
        return []
    levels = []
    for i, d in enumerate(dirs):
        try:
            lv = _level(d, version, i == 0)
        except (OSError, ValueError) as e:
            problems.append("%s (%s)" % (getattr(e, "filename", None) or d,
                                         getattr(e, "strerror", None) or e))
            continue
        if lv is not None:
            levels.append(lv)
    return levels


def memory_report(str root="/"):
    """What ``memory_available`` found: ``{"available", "host",
    "cgroup": [{"dir", "limit", "usage", "reclaimable", "room", ...}, ...],
    "unreadable": [...]}``, innermost cgroup first (limits -1: none)."""
    root = root.rstrip("/")
    problems = []
    cdef long long host = _host(root, problems)
    levels = _cgroup_levels(root, problems)
    cdef long long avail = host, room
    for lv in levels:
        if lv["room"] >= 0:
            avail = lv["room"] if avail < 0 else min(avail, lv["room"])
    if levels and levels[0].get("hierarchical_limit", -1) >= 0:
        # A limit above what is visible (v1 computes the tightest on the
        # whole path): its usage is not visible, this cgroup's stands in.
        leaf = levels[0]
        if all(lv["limit"] < 0 or lv["limit"] > leaf["hierarchical_limit"] for lv in levels):
            room = max(0, leaf["hierarchical_limit"] - leaf["usage"] + leaf["reclaimable"])
            avail = room if avail < 0 else min(avail, room)
    if problems:
        if not levels:
            uses = ("the host's MemAvailable only" if host >= 0
                    else "nothing: it refuses no allocation, as vLLM's queue does not")
        elif host < 0:
            uses = "the memory cgroup limits it could read only"
        else:
            uses = "the host's MemAvailable and the memory cgroup limits it could read"
        for p in problems:
            _warn_once(root or "/", p, uses)
    return {"available": avail, "host": host, "cgroup": levels, "unreadable": problems}


def memory_available(str root="/"):
    """Bytes of memory a new page of shared memory can still come from: the
    host's ``MemAvailable``, or the room left in this process's memory
    cgroup or an ancestor's if less (page cache the kernel would reclaim
    counted as room); -1 when unknown.  ``root``: where ``/proc`` and the
    cgroup file systems are read from."""
    return memory_report(root)["available"]
