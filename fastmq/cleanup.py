"""Remove what crashed fastmq processes left behind.

The user's side: docs/operations.md, "Leaked segments".

A process killed with SIGKILL (or by the OOM killer) cannot unlink its
shared-memory segments or its ipc socket files; tmpfs keeps the segments'
pages until someone does.  fastmq names everything it creates after its
creator:

* ``/dev/shm/fastmq_<pid>_<kind>_<hex>``: segments (``fastmq.segments``);
* ``<tmp>/fastmq_<pid>_<hex>.ipc``: ipc sockets (``fastmq._net``);
* ``<tmp>/fastmq_<pid>_<random>.bind``: the private directory an ipc socket
  is bound in for an instant before it is renamed to its public name.

``cleanup()`` removes those whose creator is dead and never one of a live
queue:

* a ring segment's header holds its creator's pid *and start time*, so a
  pid reused by an unrelated process does not keep a dead queue's ring
  alive, and a live queue's ring is recognised by the same pair;
* other files carry only the pid in their name: they are kept while any
  process has that pid (at worst a leftover survives until that process
  exits; a live file is never removed);
* an ipc file whose pid looks dead is also kept while something still
  accepts connections on it (a creator in another pid namespace).

Run it in the pid namespace of the processes that use the queues (as with
``ipcrm``): from another namespace, every creator looks dead.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import socket
import stat
import tempfile

from fastmq import _proc
from fastmq._net import IPC_PREFIX
from fastmq._ring_reader import RingReader
from fastmq._snapshot import CREATOR_BYTES
from fastmq._snapshot import ring_creator as _header_creator
from fastmq.segments import SEGMENT_PREFIX, SHM_PATH

logger = logging.getLogger("fastmq")

_SEGMENT = re.compile(rf"^{SEGMENT_PREFIX}(\d+)_([A-Za-z0-9]+)_[0-9a-f]+$")
_IPC = re.compile(rf"^{IPC_PREFIX}(\d+)_[0-9a-f]+\.ipc$")
_BIND_DIR = re.compile(rf"^{IPC_PREFIX}(\d+)_\w+\.bind$")

def ring_creator(path: str, with_pidns: bool = False) -> tuple | None:
    """(pid, start time) from the header of the ring segment at ``path``
    (``with_pidns``: and the writer's pid namespace), or None when the file
    is not a complete fastmq ring."""
    # No following links, no blocking on a FIFO someone planted under our
    # prefix: only a regular file can be a ring.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, CREATOR_BYTES)
    finally:
        os.close(fd)
    return _header_creator(head, with_pidns)


def _segment_alive(path: str, name_pid: int) -> bool:
    creator = ring_creator(path)
    if creator is None:
        return _proc.is_alive(name_pid)
    pid, started = creator
    # The header pid is the creator's (RingWriter.create runs in the process that
    # named the segment); a disagreeing name keeps the file if it is alive.
    return _proc.is_alive(pid, started) or (pid != name_pid and _proc.is_alive(name_pid))


def _listening(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except OSError as e:
        # Refused: nobody listens.  Anything else (permission, timeout) is
        # not proof of death.
        return e.errno != errno.ECONNREFUSED
    finally:
        s.close()
    return True


def _ipc_dir() -> str:
    return tempfile.gettempdir()   # where fastmq._net puts them


def _candidates(only_pid: int | None = None):
    """(path, kind, creator pid, is_alive) for every fastmq file on this
    host (of creator ``only_pid`` alone, when given)."""
    try:
        names = sorted(os.listdir(SHM_PATH))
    except OSError:
        names = []
    for name in names:
        m = _SEGMENT.match(name)
        if m and only_pid in (None, int(m[1])):
            path = os.path.join(SHM_PATH, name)
            yield path, "segment", int(m[1]), lambda p=path, pid=int(m[1]): _segment_alive(p, pid)
    ipc_dir = _ipc_dir()
    try:
        names = sorted(os.listdir(ipc_dir))
    except OSError:
        names = []
    for name in names:
        path = os.path.join(ipc_dir, name)
        m = _IPC.match(name) or _BIND_DIR.match(name)
        if not m or only_pid not in (None, int(m[1])):
            continue
        if m.re is _IPC:
            yield path, "ipc", int(m[1]), lambda p=path, pid=int(m[1]): (
                _proc.is_alive(pid) or _listening(p))
        else:
            yield path, "bind", int(m[1]), lambda pid=int(m[1]): _proc.is_alive(pid)


_KIND_MODE = {"segment": stat.S_ISREG, "ipc": stat.S_ISSOCK, "bind": stat.S_ISDIR}


def _remove(path: str, kind: str) -> None:
    # lstat: a symlink or a file of the wrong type under our prefix (in a
    # world-writable directory, possibly planted) is never acted on.
    if not _KIND_MODE[kind](os.lstat(path).st_mode):
        raise OSError(errno.EPERM, f"not a fastmq {kind} (wrong file type)", path)
    if kind != "bind":
        os.unlink(path)
        return
    # Only the staged socket "s" ever lives there; leave anything else.
    try:
        os.unlink(os.path.join(path, "s"))
    except FileNotFoundError:
        pass
    os.rmdir(path)


def cleanup(dry_run: bool = False) -> list[str]:
    """Remove fastmq segments and ipc files whose creating process is dead.

    Returns the paths removed (with ``dry_run``, those that would be).  A
    file that cannot be inspected or removed (another user's, or gone
    meanwhile) is skipped and logged, never guessed about.
    """
    removed = []
    for path, kind, _, alive in _candidates():
        if _remove_if(path, kind, lambda: not alive(), dry_run):
            removed.append(path)
    return removed


def _remove_if(path: str, kind: str, dead, dry_run: bool = False) -> bool:
    try:
        if not dead():
            return False
        if not dry_run:
            _remove(path, kind)
    except FileNotFoundError:
        return False  # removed by its owner or another cleanup meanwhile
    except OSError as e:
        logger.warning("fastmq cleanup: skipping %s: %s", path, e)
        return False
    logger.info("fastmq cleanup: %s %s", "would remove" if dry_run else "removed", path)
    return True


def remove_files_of(pid: int, started: int) -> list[str]:
    """Remove every fastmq file that process ``pid``, started at ``started``
    (``/proc`` clock ticks, as a ring header records its writer), created,
    if that process has ended.  Returns the paths removed.

    For a peer that knows its creator's identity from a ring header: the
    readers of a queue whose writer was killed (``SIGKILL``, OOM) remove
    its ring, arena and ipc files, as ``fastmq cleanup`` would, without
    waiting for someone to run it.  Unlike ``cleanup()``, a killed process
    that its parent has not reaped yet (a zombie) counts as ended.  Nothing
    is removed while the pid belongs to another live process (its files
    may be new), nor a ring whose header names another creator."""
    if pid <= 0 or not started or _proc.is_alive(pid, started):
        return []
    now = _proc.start_time(pid)
    if now and now != started:
        return []     # the pid was reused: files named after it may be the new process's
    removed = []
    for path, kind, _, _ in _candidates(only_pid=pid):
        if kind == "segment":
            try:
                creator = ring_creator(path)
            except OSError:
                continue
            if creator is not None and creator != (pid, started):
                continue
        # No _listening() check for ipc files: the creator is known dead in
        # this pid namespace, and a killed process whose leader is already
        # a zombie can still hold its sockets while its other threads exit.
        if _remove_if(path, kind, lambda: not _proc.is_alive(pid, started)):
            removed.append(path)
    return removed


def reap_dead_queues() -> list[str]:
    """Remove the files of every queue on this host whose writer has ended
    without removing them (SIGKILL, the OOM killer, a process that left
    through ``os._exit``), as ``remove_files_of`` its writer.  Run by every
    new writer, so that a host that restarts a killed engine again and
    again does not fill ``/dev/shm``.

    Only rings whose header records this process's pid namespace are
    judged: ``/dev/shm`` is often shared between containers whose pids
    mean nothing here (``--ipc=host``), and their queues must never be
    touched.  ``fastmq cleanup`` does the rest, where an operator runs it."""
    ns = _proc.pid_namespace()
    if not ns:
        return []
    try:
        names = os.listdir(SHM_PATH)
    except OSError:
        return []
    me = os.getpid()
    removed = []
    for name in names:
        m = _SEGMENT.match(name)
        if not m or m[2] != "ring" or int(m[1]) == me:
            continue
        try:
            creator = ring_creator(os.path.join(SHM_PATH, name), with_pidns=True)
        except OSError:
            continue
        if creator is None or creator[2] != ns or creator[0] != int(m[1]):
            continue
        removed += remove_files_of(creator[0], creator[1])
    return removed


def remove_dead_writer(ring) -> list[str]:
    """``remove_files_of`` the writer a reader end of ``ring`` names in its
    header, if that writer has ended (killed, or killed after it closed the
    queue: one that exits normally has removed its files already)."""
    if not isinstance(ring, RingReader):
        return []
    return remove_files_of(ring.writer_pid, ring.writer_start)


__all__ = ["cleanup", "ring_creator", "reap_dead_queues", "remove_files_of",
           "remove_dead_writer"]
