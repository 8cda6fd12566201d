"""Child-process targets for tests/test_containers.py: a writer and a
reader that first put themselves where containers put vLLM's processes
(another uid, fewer capabilities, not dumpable, a mount namespace whose
/proc hides other users' processes, a child pid namespace), then run one
queue, fastmq's or vLLM's own (``impl``).

Everything the queue needs is imported before a child drops its uid: the
interpreter lives under /root (mode 0700), which uid 65534 cannot read.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import time

NOBODY = 65534
# Docker's default capability set (CAP_SYS_PTRACE and CAP_SYS_ADMIN are not in it).
DOCKER_CAPS = (0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31)
PR_SET_DUMPABLE = 4
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_REC, MS_PRIVATE = 0x4000, 0x40000

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def keep_only_caps(caps) -> None:
    """Keep only ``caps`` (all below 32) in this thread's capability sets;
    threads started later inherit them."""
    mask = sum(1 << c for c in caps)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = mask
    _check(_libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data), "capset")


def become(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def hide_other_processes() -> None:
    """A private mount namespace whose /proc is mounted hidepid=2."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _check(_libc.mount(b"proc", b"/proc", b"proc", 0, b"hidepid=2"), "mount proc hidepid=2")


PR_SET_PDEATHSIG = 1


def in_own_container(run, proc: bool = True, tmp: str | None = None, before=None) -> None:
    """Run ``run()`` in a child of this process in pid and mount
    namespaces of its own (a container): with ``proc``, its own /proc (it
    sees only its pid namespace); with ``tmp``, a fresh tmpfs there.
    ``before(pid)`` runs in this process once the child exists.  The child
    is killed with this process (a test that kills its child leaves no
    grandchild behind), and this process waits for it."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare(CLONE_NEWNS|CLONE_NEWPID)")
    pid = os.fork()
    if pid:
        if before is not None:
            before(pid)
        os.waitpid(pid, 0)
        return
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None),
               "mount --make-rprivate /")
        if proc:
            _check(_libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount proc")
        if tmp is not None:
            _check(_libc.mount(b"tmpfs", tmp.encode(), b"tmpfs", 0, None), "mount tmpfs")
        run()
    finally:
        os._exit(0)


def _queue_class(impl: str):
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        assert "fastmq" not in MessageQueue.__module__
    else:
        from fastmq import MessageQueue
    return MessageQueue


def _prepare(impl: str) -> None:
    # What the queue uses lazily, loaded while the files can still be read.
    import pickle  # noqa: F401
    import zmq  # noqa: F401
    _queue_class(impl)
    if impl == "fastmq":
        import fastmq._door  # noqa: F401
        import fastmq.arena  # noqa: F401


# Small (ring), 300 kB (vLLM: the socket; fastmq: the socket), 5 MiB (fastmq: parts).
MESSAGES = [{"step": 1}, b"a" * 300_000, b"b" * (5 << 20)]


def summary(msgs: list) -> list:
    return [m if isinstance(m, dict) else (len(m), bytes(m[:1])) for m in msgs]


def writer(conn, impl: str, setup: tuple, linger_s: float = 0.0) -> None:
    """Create a 1-reader queue after ``setup`` ("nondumpable", "nobody"),
    hand its handle over, send MESSAGES and None; report "sent"."""
    _prepare(impl)
    if "nobody" in setup:
        become(NOBODY)
    if "nondumpable" in setup:
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    MessageQueue = _queue_class(impl)
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    conn.send((mq.export_handle(), os.getpid()))
    mq.wait_until_ready()
    for m in MESSAGES:
        mq.enqueue(m)
    mq.enqueue(None)
    conn.send("sent")
    if linger_s:
        time.sleep(linger_s)
    conn.recv()     # the test is done with it


def _read(conn, impl: str, handle) -> None:
    MessageQueue = _queue_class(impl)
    try:
        mq = MessageQueue.create_from_handle(handle, 0)
        mq.wait_until_ready()
        got = []
        while (m := mq.dequeue(timeout=60)) is not None:
            got.append(m)
        conn.send(("ok", summary(got)))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def reader(conn, impl: str, handle, setup: tuple) -> None:
    """Attach as rank 0 after ``setup`` ("docker_caps", "nobody",
    "hidepid", "pidns"), read until None; report ("ok", summary) or
    ("error", text)."""
    _prepare(impl)
    if "hidepid" in setup:
        hide_other_processes()
    if "nobody" in setup:
        become(NOBODY)
    if "docker_caps" in setup:
        keep_only_caps(DOCKER_CAPS)
    if "pidns" in setup:
        # A child pid namespace that still sees this one's /proc.
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _read(conn, impl, handle)
            except BaseException:
                code = 1
            os._exit(code)
        os.waitpid(pid, 0)
        return
    _read(conn, impl, handle)


def reader_until_writer_dies(conn, handle, setup: tuple) -> None:
    """Attach (after ``setup``), read one message, then wait without a
    timeout: report what ended the wait."""
    _prepare("fastmq")
    if "hidepid" in setup:
        hide_other_processes()
    if "nobody" in setup:
        become(NOBODY)

    def run():
        from fastmq import MessageQueue

        mq = MessageQueue.create_from_handle(handle, 0)
        mq.wait_until_ready()
        first = mq.dequeue(timeout=60)
        conn.send(("first", first))
        try:
            mq.dequeue()
            conn.send(("error", "dequeue() returned"))
        except BaseException as e:
            conn.send(("raised", f"{type(e).__name__}: {e}"))

    if "pidns" in setup:
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        pid = os.fork()
        if pid == 0:
            try:
                run()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        return
    run()


def writer_one_then_wait(conn, setup: tuple) -> None:
    """A writer (after ``setup``) that sends one message and then waits to
    be killed."""
    _prepare("fastmq")
    if "nobody" in setup:
        become(NOBODY)
    if "nondumpable" in setup:
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    from fastmq import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    conn.send((mq.export_handle(), os.getpid()))
    mq.wait_until_ready()
    mq.enqueue("one")
    time.sleep(600)


def sidecar(conn, seconds: float, tmp: str | None = None) -> None:
    """A same-uid process of another container in the writer's network
    namespace: its own mount and pid namespaces, so the writer's /proc is
    out of its reach, but /proc/net/unix lists the unix sockets.  With
    ``tmp``, a fresh tmpfs there (its container's own /tmp).  It reports
    its pid as the writer sees it, ("pid", n); then subscribes to every
    fastmq socket it finds and to every socket file listed under ``tmp``
    (vLLM's), knocks on the segment door, and reports what it received."""
    import zmq

    in_own_container(lambda: _sidecar_watch(conn, seconds, zmq, tmp), tmp=tmp,
                     before=lambda pid: conn.send(("pid", pid)))


def _sidecar_watch(conn, seconds: float, zmq, tmp: str | None = None) -> None:
    names = set()
    with open("/proc/net/unix") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 8 else ""
            if path.startswith("@fastmq_") or (
                    tmp is not None and path.startswith(tmp.rstrip("/") + "/")):
                names.add(path)
    ctx = zmq.Context()
    subs = []
    door = []
    for name in sorted(names):
        if name.startswith("@fastmq_door_"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\0" + name[1:])
                s.sendall(b"fmqdoor1" + bytes(32) + bytes(4))
                s.settimeout(5)
                door.append(s.recv(4096).decode(errors="replace"))
            except OSError as e:
                door.append(repr(e))
            finally:
                s.close()
            continue
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect("ipc://" + name)
        subs.append(sub)
    # A socket file it can reach: one its own mount namespace shows.
    files = sorted(n for n in names if not n.startswith("@"))
    conn.send(("connected", sorted(names), [n for n in files if os.path.exists(n)]))
    got = 0
    until = time.monotonic() + seconds
    poller = zmq.Poller()
    for s in subs:
        poller.register(s, zmq.POLLIN)
    while time.monotonic() < until:
        for s, _ in poller.poll(100):
            got += sum(len(f) for f in s.recv_multipart())
    conn.send(("received", got, door))
    for s in subs:
        s.close(0)
    ctx.term()


def group_rank(conn, rank: int, port: int, setup: tuple) -> None:
    """Rank ``rank`` of a 2-rank gloo group (after ``setup``): vLLM's
    ``create_from_process_group`` call, rank 0 the writer; report whether
    rank 1 was made a local reader and what it read."""
    import torch.distributed as dist

    _prepare("fastmq")
    if "nondumpable" in setup:
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    if "docker_caps" in setup:
        keep_only_caps(DOCKER_CAPS)
    from fastmq import MessageQueue

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mq = MessageQueue.create_from_process_group(dist.group.WORLD, 1 << 16, 4, 0)
        if rank == 0:
            mq.enqueue({"step": 1})
            conn.send(("writer", mq.export_handle().local_reader_ranks))
        else:
            conn.send(("reader", mq.dequeue(timeout=60)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
