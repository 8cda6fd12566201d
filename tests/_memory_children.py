"""Memory cgroups for tests/test_memory_limits.py and
tests/test_vllm_generation_cgroup.py, and the processes that run in them.

``Cgroup``: a real cgroup v1 memory cgroup under this process's own (as
``/proc/self/cgroup`` says), removed on ``close()`` with whatever ran in it.
``in_cgroup``: the argv that runs a command inside one, in a layout:

* ``plain``: the host's view (``/proc/self/cgroup`` names the cgroup's whole
  path, ``/sys/fs/cgroup/memory`` shows the whole hierarchy);
* ``bind``: a private mount namespace where the cgroup itself is
  bind-mounted at ``/sys/fs/cgroup/memory`` (Docker and Kubernetes without a
  cgroup namespace): ``/proc/self/cgroup`` still names the host's path;
* ``cgroupns``: a cgroup namespace rooted at the cgroup, and the memory
  controller mounted afresh at ``/sys/fs/cgroup/memory`` (Docker's v1
  layout): ``/proc/self/cgroup`` says ``/``, and nothing above is visible;
* ``hidden``: a private mount namespace with an empty tmpfs over
  ``/sys/fs/cgroup``: no cgroup file system visible at all.

Run as a script (``python _memory_children.py MODE ...``) a mode prints
``RESULT {json}``:

* ``cache IMPL FILE``: a queue made first; then FILE read whole (page cache
  up to the limit); then a 3 MiB message into a fresh chunk of that queue,
  ``MessageQueue(1, 1)`` and 9 x 20 MiB through it;
* ``fill IMPL``: a 10 x 64 MiB ring, then filled with 60 MiB messages (the
  OOM killer's end where the ring is more than the limit, unless the queue
  refuses at creation; fastmq with ``FASTMQ_PARTS=0`` fills it as vLLM's
  does, a message in one chunk);
* ``first-writes``: the /proc and cgroup files opened by the first message
  into each chunk of a fresh queue (an audit hook), and by a large one near
  a memory limit;
* ``hidden``: queues made and used where no cgroup file system is visible
  (fastmq's log lines printed).

IMPL is ``fastmq`` or ``vllm`` (vLLM 0.33.0's own class, ``FASTMQ_VLLM=0``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
V1_MOUNT = "/sys/fs/cgroup/memory"


# -- cgroups (the test's side) --------------------------------------------------
def own_memory_cgroup() -> str | None:
    """This process's cgroup v1 memory directory, or None (no v1 memory
    controller mounted here, or not root)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                d = V1_MOUNT + path.rstrip("/")
                if os.path.isdir(d) and os.access(d, os.W_OK):
                    return d
    return None


class Cgroup:
    """A memory cgroup ``name`` under ``parent`` (a directory), limited to
    ``limit`` bytes if given."""

    def __init__(self, parent: str, name: str, limit: int | None = None):
        self.path = os.path.join(parent, name)
        os.mkdir(self.path)
        self.children: list[Cgroup] = []
        if limit is not None:
            self.write("memory.limit_in_bytes", str(limit))

    def child(self, name: str, limit: int | None = None) -> "Cgroup":
        c = Cgroup(self.path, name, limit)
        self.children.append(c)
        return c

    def write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (ln.split() for ln in self.read("memory.stat").splitlines())}

    def oom_kills(self) -> int:
        for line in self.read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    @property
    def procs(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def tasks(self) -> list[int]:
        try:
            return [int(x) for x in self.read("cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def close(self) -> None:
        """Kill what still runs in it, then remove it (children first)."""
        for c in self.children:
            c.close()
        deadline = time.monotonic() + 30
        while os.path.isdir(self.path):
            for pid in self.tasks():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.path)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def in_cgroup(cg: Cgroup, argv: list[str], layout: str = "plain", before: str = "") -> list[str]:
    """argv that moves into ``cg``, runs the shell line ``before`` there
    (e.g. reading a file, charged to ``cg``), then execs ``argv`` in
    ``layout`` (see the module's docstring)."""
    import shlex

    cmd = " ".join(shlex.quote(a) for a in argv)
    if layout == "plain":
        inner = f"exec {cmd}"
    elif layout == "bind":
        inner = "exec unshare -m sh -c " + shlex.quote(
            f"mount --bind {cg.path} {V1_MOUNT} && exec {cmd}")
    elif layout == "cgroupns":
        inner = ("exec unshare -C -m sh -c " + shlex.quote(
            f"umount {V1_MOUNT} && mount -t cgroup -o memory cgroup {V1_MOUNT} && exec {cmd}"))
    elif layout == "hidden":
        inner = ("exec unshare -m sh -c " + shlex.quote(
            f"mount -t tmpfs tmpfs /sys/fs/cgroup && exec {cmd}"))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    pre = f"{before} && " if before else ""
    return ["sh", "-c", f"echo $$ > {shlex.quote(cg.procs)} && {pre}{inner}"]


def child_env(impl: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_MAX_CHUNK_MB",
                        "FASTMQ_MAX_CHUNKS", "FASTMQ_ARENA")}
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["FASTMQ_VLLM"] = "0" if impl == "vllm" else "1"
    return env


def run_child(cg: Cgroup, args: list[str], impl: str = "fastmq", layout: str = "plain",
              before: str = "", timeout: float = 300,
              **env: str) -> tuple[int, str, dict | None]:
    """Run this script with ``args`` inside ``cg`` (``env`` added to its
    environment): (returncode, output, the RESULT or None)."""
    argv = in_cgroup(cg, [sys.executable, os.path.abspath(__file__), *args], layout, before)
    proc = subprocess.Popen(argv, env={**child_env(impl), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    results = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return proc.returncode, out, json.loads(results[-1][7:]) if results else None


# -- the children -----------------------------------------------------------------
def _queue_class(impl: str):
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    else:
        from fastmq import MessageQueue
    return MessageQueue


def _pair(cls, **kw):
    # A writer and one local reader in this process, handshaken.
    w = cls(1, 1, **kw)
    r = cls.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join(30)
    return w, r


def _kw(impl: str, **kw) -> dict:
    if impl == "fastmq":
        kw["enable_shm_tensor_arena"] = False      # bytes messages: ring only
    return kw


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _report() -> dict:
    from fastmq._memory import memory_report

    r = memory_report()
    lv = r["cgroup"][0] if r["cgroup"] else {}
    return {"available": r["available"], "reclaimable": lv.get("reclaimable"),
            "usage": lv.get("usage")}


def cache(impl: str, path: str) -> dict:
    cls = _queue_class(impl)
    out: dict = {"impl": impl}
    earlier = _pair(cls, **_kw(impl, max_chunk_bytes=4 * MiB, max_chunks=4))
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass
    out["after_read"] = _report()
    w, r = earlier
    try:
        w.enqueue(b"e" * (3 * MiB))
        out["earlier_3mib"] = len(r.dequeue(timeout=30)) == 3 * MiB
    except Exception as e:
        out["earlier_3mib"] = _err(e)
    try:
        w2, r2 = _pair(cls, **_kw(impl))
    except Exception as e:
        out["new_queue"] = _err(e)
        return out
    out["new_queue"] = True
    got = 0
    try:
        for i in range(9):
            w2.enqueue(bytes([i]) * (20 * MiB))
            got += len(r2.dequeue(timeout=60)) == 20 * MiB
    except Exception as e:
        out["error"] = _err(e)
    out["messages_20mib"] = got
    if impl == "fastmq":
        # The ring's pages are shared memory: none of them may count as
        # reclaimable.
        from fastmq._segment import Segment

        before = _report()
        seg = Segment.create("fastmq_test_shm", 128 * MiB)
        seg.populate(0, 128 * MiB)
        out["shm_128mib"] = {"before": before, "after": _report()}
        seg.close()
    return out


def fill(impl: str) -> dict:
    cls = _queue_class(impl)
    try:
        w, r = _pair(cls, **_kw(impl, max_chunk_bytes=64 * MiB, max_chunks=10))
    except Exception as e:
        return {"refused": _err(e), "available": _report()["available"]}
    print("CREATED", flush=True)
    for i in range(10):
        w.enqueue(bytes([i]) * (60 * MiB))
        assert len(r.dequeue(timeout=60)) == 60 * MiB
    return {"refused": None, "filled": True}


def first_writes() -> dict:
    from _queues import local_pair
    from fastmq import _memory

    opened: list[str] = []
    watching = [False]
    me = threading.get_ident()

    def hook(event, args):
        # This thread's opens only: the message's path, not the reading
        # the watcher thread takes in the background.
        if watching[0] and event == "open" and args and threading.get_ident() == me:
            p = args[0]
            if isinstance(p, bytes):
                p = p.decode(errors="replace")
            if isinstance(p, str) and (p.startswith("/proc") or p.startswith("/sys")):
                opened.append(p)

    sys.addaudithook(hook)
    w, (r,) = local_pair(1, max_chunk_bytes=1 * MiB, max_chunks=8,
                         enable_shm_tensor_arena=False)
    # One per chunk: small ones, and ones past the first 64 KiB the ring's
    # creation asked for.
    sizes = [10, 1000, 4000, 60_000, 100_000, 300_000, 100, 900_000]
    per_message = []
    for n in sizes:
        watching[0] = True
        w.enqueue(b"s" * n)
        watching[0] = False
        per_message.append(list(opened))
        opened.clear()
        assert r.dequeue(timeout=10) == b"s" * n
    # Near a memory limit every check reads afresh: the hook sees it.
    w2, (r2,) = local_pair(1, max_chunk_bytes=1 * MiB, max_chunks=2,
                           enable_shm_tensor_arena=False)
    _memory.STALE_S = -1.0
    watching[0] = True
    w2.enqueue(b"L" * (512 << 10))
    watching[0] = False
    _memory.STALE_S = 3.0
    assert len(r2.dequeue(timeout=10)) == 512 << 10
    return {"small": dict(zip(map(str, sizes), per_message)), "large": opened}


def hidden() -> dict:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                        format="LOG %(name)s %(levelname)s %(message)s")
    from fastmq import MessageQueue
    from fastmq._memory import memory_report

    w, r = _pair(MessageQueue, max_chunk_bytes=4 * MiB, max_chunks=4)
    w.enqueue(b"h" * (3 * MiB))
    ok = len(r.dequeue(timeout=30)) == 3 * MiB
    more = MessageQueue(1, 1)
    print("QUEUES DONE", flush=True)        # what the queues logged is above
    rep = memory_report()
    more.shutdown()
    return {"delivered": ok, "available": rep["available"], "host": rep["host"],
            "cgroup": rep["cgroup"], "unreadable": rep["unreadable"]}


def main() -> int:
    mode = sys.argv[1]
    if mode == "cache":
        res = cache(sys.argv[2], sys.argv[3])
    elif mode == "fill":
        res = fill(sys.argv[2])
    elif mode == "first-writes":
        res = first_writes()
    elif mode == "hidden":
        res = hidden()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
