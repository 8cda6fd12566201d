"""Handing a queue's segments to its local readers: the writer's door.

A local reader needs the writer's memory files (the ring, the arena).
Opening them through ``/proc/<writer pid>/fd/<n>`` asks the kernel for
ptrace read access to the writer, which a container often does not grant:
a writer that changed its uid or set ``PR_SET_DUMPABLE 0`` is not
dumpable, a reader with fewer capabilities than a root writer is refused,
``hidepid=2`` hides the writer altogether.  So the writer passes the
descriptors themselves, with ``SCM_RIGHTS`` over a unix socket (what
Wayland and systemd do with memory files): no ptrace check is involved.

The socket is in the abstract namespace (no file to leave behind), which
every process of the same network namespace can reach, a pod's sidecars
included.  So a reader proves that it holds the queue's handle: its
request carries the handle's local key (32 random bytes that travel only
inside the handle), compared in constant time; a peer without it is
refused, logged once with the pid and uid the kernel gives for it
(``SO_PEERCRED``), and named by the writer's long-wait line.

With the descriptors go:

* a pidfd of the writer (``pidfd_open``): it becomes readable when the
  writer exits, whatever pid namespace the reader is in, so a reader
  judges the writer's liveness without its pid (which means nothing in a
  child pid namespace) and without ``/proc`` (hidden by ``hidepid``);
* the reader's own pid as the writer's pid namespace numbers it
  (``SO_PEERCRED`` translates it), which the reader claims its ring slot
  with, so that the writer's liveness checks of its readers name the
  right process.

The door is open from the queue's creation until the queue is closed (a
reader that replaces a dead one attaches as the first did).  Its thread
sleeps in ``select()`` while no peer talks to it, and holds no lock the
queue takes.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time

logger = logging.getLogger("fastmq")

KEY_BYTES = 32
_REQUEST = struct.Struct(f"<8s{KEY_BYTES}si")
_MAGIC = b"fmqdoor1"
_REPLY_MAX = 1 << 16
PEER_TIMEOUT_S = 2.0    # a peer that connects and says nothing is dropped after this
MAX_PENDING = 64        # peers that connected and have not asked yet
MAX_REFUSED_KEPT = 16   # refused peers logged and named in the long-wait line
_PEERCRED = struct.Struct("3i")


class DoorError(RuntimeError):
    """A local reader could not get its writer's segments."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def peer_credentials(sock) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a unix
    socket, as the kernel recorded it at connect time; the pid in this
    process's pid namespace (0 when that process is not visible there)."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            _PEERCRED.size))


def _pidfd_self() -> int:
    try:
        return os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return -1     # older kernel: readers fall back to the writer's pid


class Door:
    """The writer's side: a listening socket and the thread that answers
    it, handing the segments ``[(name, fd), ...]`` to each reader that
    presents ``key``.  It holds its own copies of the descriptors, so that
    what it hands out is always those files, and lets go of them on
    ``close``."""

    def __init__(self, segments: list[tuple[str, int]], key: bytes):
        self._key = key
        self.refused: dict[tuple[int, int], str] = {}   # (pid, uid) -> why
        self.served = 0
        self._stop = False
        self._owner = os.getpid()
        self._release_lock = threading.Lock()
        self._segments = [(name, os.dup(fd)) for name, fd in segments]
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            name = f"fastmq_door_{os.getpid()}_{secrets.token_hex(8)}"
            self._sock.bind("\0" + name)
            self._sock.listen(64)
            self._sock.setblocking(False)
        except BaseException:
            self._release()
            raise
        self.address = "@" + name
        self._thread = threading.Thread(target=self._serve, name="fastmq-door", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # One thread, every peer at once: a peer that connects and says
        # nothing (or a flood of them) must not keep the readers out, so
        # no read blocks and each peer has PEER_TIMEOUT_S to ask.  Idle,
        # it sleeps in poll() until a peer or close() wakes it.
        listener = self._sock
        pending: dict = {}      # fd -> (socket, deadline, bytes so far)
        poller = select.poll()  # (not select(): descriptors past 1024)
        poller.register(self._wake_r, select.POLLIN)
        poller.register(listener, select.POLLIN)
        try:
            while not self._stop:
                wait = None
                if pending:
                    first = min(u for _, u, _ in pending.values())
                    wait = max(0, int((first - time.monotonic()) * 1000) + 1)
                ready = poller.poll(wait)
                if self._stop:
                    break
                now = time.monotonic()
                for fd, _ in ready:
                    if fd == listener.fileno():
                        self._accept(listener, pending, poller, now)
                    elif fd in pending:
                        self._read(fd, pending, poller)
                for fd, (sock, until, _) in list(pending.items()):
                    if now >= until:
                        del pending[fd]
                        poller.unregister(fd)
                        self._drop(sock, "sent no request")
        finally:
            for sock, _, _ in pending.values():
                sock.close()
            self._release()

    def _accept(self, listener, pending: dict, poller, now: float) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return          # EMFILE, a peer that left: nothing to answer
        if len(pending) >= MAX_PENDING:
            oldest = min(pending, key=lambda fd: pending[fd][1])
            sock = pending.pop(oldest)[0]
            poller.unregister(oldest)
            self._drop(sock, "sent no request")
        conn.setblocking(False)
        pending[conn.fileno()] = (conn, now + PEER_TIMEOUT_S, b"")
        poller.register(conn, select.POLLIN)

    def _read(self, fd: int, pending: dict, poller) -> None:
        sock, until, data = pending[fd]
        try:
            more = sock.recv(_REQUEST.size - len(data))
        except BlockingIOError:
            return
        except OSError:
            more = b""
        if more and len(data) + len(more) < _REQUEST.size:
            pending[fd] = (sock, until, data + more)
            return
        del pending[fd]
        poller.unregister(fd)
        try:
            self._answer(sock, data + more)
        except Exception as e:   # a peer's bytes never end the door
            logger.debug("fastmq: the segment door dropped a peer: %r", e)
        finally:
            sock.close()

    def _drop(self, sock, why: str) -> None:
        try:
            self._refuse(sock, why)
        except Exception:
            pass
        sock.close()

    def _answer(self, conn, data: bytes) -> None:
        if len(data) != _REQUEST.size:
            return self._refuse(conn, "sent no request")
        magic, key, rank = _REQUEST.unpack(data)
        if magic != _MAGIC or not hmac.compare_digest(key, self._key):
            return self._refuse(conn, "does not hold this queue's handle")
        pid, _, _ = peer_credentials(conn)
        pidfd = _pidfd_self()
        try:
            reply = json.dumps({"ok": True, "pid": pid,
                                "names": [n for n, _ in self._segments],
                                "pidfd": pidfd >= 0}).encode()
            fds = [fd for _, fd in self._segments] + ([pidfd] if pidfd >= 0 else [])
            # A fresh connection's send buffer takes this small reply whole.
            socket.send_fds(conn, [reply], fds)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        self.served += 1

    def _refuse(self, conn, why: str) -> None:
        pid, uid, _ = peer_credentials(conn)
        # Logged and kept once per process, and only the first few: a
        # flood of strangers must not fill the log or this process.
        if (pid, uid) not in self.refused and len(self.refused) < MAX_REFUSED_KEPT:
            logger.warning("fastmq: refused a process (pid %d, uid %d) that asked for this "
                           "queue's shared memory: it %s", pid, uid, why)
            self.refused[(pid, uid)] = why
        try:
            conn.sendall(json.dumps({"ok": False, "why": why}).encode())
        except OSError:
            pass

    def describe_refused(self) -> str:
        """The peers refused so far, for the writer's long-wait line."""
        # (A copy: the door's thread adds to it meanwhile.)
        return ", ".join(f"pid {pid} uid {uid} ({why})"
                         for (pid, uid), why in list(self.refused.items()))

    def close(self, linger: int = 0) -> None:
        """Stop answering; the name goes with the socket, and the door's
        copies of the descriptors with it (in the thread, which close()
        wakes and waits for).  In a forked child, which has no such thread, it closes
        the child's copies at once.  (``linger``: closed with the queue's
        sockets, as they are.)"""
        if self._stop:
            return
        self._stop = True
        if os.getpid() != self._owner or not self._thread.is_alive():
            self._release()
            return
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            # Its copies of the descriptors are closed when this returns:
            # a closed queue holds no memory.
            self._thread.join(5.0)

    def _release(self) -> None:
        # Once, whoever comes first (the thread, or close() when there is
        # no thread): a second close of a descriptor number could close a
        # file opened since.
        with self._release_lock:
            fds = [fd for _, fd in self._segments] + [self._wake_r, self._wake_w]
            self._segments = []
            self._wake_r = self._wake_w = -1
        for fd in fds:
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self._sock.close()
        except OSError:
            pass


class Admission:
    """What a reader got through the door: the segments' descriptors by
    name (``take`` hands each out once), the writer's pidfd (-1: none) and
    this reader's pid in the writer's pid namespace (0: not known)."""

    def __init__(self, fds: dict[str, int], pidfd: int, pid_for_writer: int):
        self.fds = fds
        self.pidfd = pidfd
        self.pid_for_writer = pid_for_writer

    def take(self, name: str) -> int:
        return self.fds.pop(name, -1)

    def take_pidfd(self) -> int:
        fd, self.pidfd = self.pidfd, -1
        return fd

    def close(self) -> None:
        """Close every descriptor not taken."""
        for fd in list(self.fds.values()) + ([self.pidfd] if self.pidfd >= 0 else []):
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        self.pidfd = -1


def admit(address: str, key: bytes, rank: int, writer_pid: int,
          timeout: float = 10.0) -> Admission:
    """Ask the writer's door at ``address`` for the queue's segments.
    ``DoorError`` naming the cause when it cannot be reached or refuses."""
    if not address.startswith("@"):
        raise DoorError(f"fastmq: {address!r} is not a fastmq segment door address")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + address[1:])
        except OSError as e:
            raise DoorError(
                f"fastmq: cannot reach the writer (pid {writer_pid})'s local socket "
                f"{address} ({e.strerror or e!r}): the writer is gone or closed the queue, "
                "or this reader is in another network namespace than the "
                "writer (local readers share the writer's network namespace: in Docker "
                "--network container:<writer>, in Kubernetes the same pod)") from None
        try:
            sock.sendall(_REQUEST.pack(_MAGIC, key, rank))
            msg, fds, _, _ = socket.recv_fds(sock, _REPLY_MAX, 8)
        except socket.timeout:
            raise DoorError(f"fastmq: the writer (pid {writer_pid}) did not answer on its "
                            f"local socket {address} within {timeout:g} s") from None
        except OSError as e:
            raise DoorError(f"fastmq: the writer (pid {writer_pid})'s local socket {address} "
                            f"failed while this reader asked for the queue's segments "
                            f"({e!r}): the writer closed the queue or exited") from None
    finally:
        sock.close()
    try:
        reply = json.loads(msg.decode())
        if not reply.get("ok"):
            raise DoorError(f"fastmq: the writer (pid {writer_pid}) refused this reader its "
                            f"shared memory: this process {reply.get('why', 'was refused')}")
        names = list(reply["names"])
        n_pidfd = 1 if reply.get("pidfd") else 0
        if len(fds) != len(names) + n_pidfd:
            raise DoorError(f"fastmq: the writer (pid {writer_pid}) sent {len(fds)} "
                            f"descriptors for {len(names)} segments")
        pid = int(reply.get("pid", 0))
    except BaseException as e:
        for fd in fds:
            os.close(fd)
        if isinstance(e, DoorError):
            raise
        raise DoorError(f"fastmq: the writer (pid {writer_pid})'s local socket {address} "
                        f"answered what is not a fastmq reply ({e!r})") from None
    return Admission(dict(zip(names, fds)), fds[-1] if n_pidfd else -1, pid)
