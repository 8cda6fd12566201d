"""Resources and hostile input: memory running short, bad ranks, a rank
taken twice, another user on the local sockets, and failed wakeup
notifies."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest

from fastmq import MessageQueue

import _fault_children as children
from _queues import local_pair, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def _memory_cgroup(limit: int) -> tuple[str, str]:
    """A fresh memory cgroup limited to ``limit`` bytes: (its directory,
    the file a pid is written to, to move that process into it)."""
    name = f"fastmq_test_{os.getpid()}"
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):          # v2
        base, limit_file = "/sys/fs/cgroup", "memory.max"
    else:                                                             # v1
        base, limit_file = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
    path = os.path.join(base, name)
    try:
        os.mkdir(path)
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(limit))
    except OSError as e:
        pytest.fail(f"cannot make a memory cgroup here ({e}); the test needs root")
    return path, os.path.join(path, "cgroup.procs")


def test_memory_short_is_an_exception_not_sigbus_or_oom_kill():
    """Shared memory has no size limit of its own: a ring larger than the
    memory there is, or an arena slot whose pages cannot be had, used to
    wake the OOM killer (and, in a full /dev/shm, a SIGBUS).  In a 320 MiB
    memory cgroup: a clear error at creation, and the arena sends the
    buffer the socket way."""
    path, procs_file = _memory_cgroup(320 << 20)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        res = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs_file} && exec "$0" "$1"', sys.executable,
             os.path.join(HERE, "_memory_short_child.py")],
            capture_output=True, text=True, timeout=120, env=env)
    finally:
        os.rmdir(path)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    assert res.stdout.strip().endswith("OK"), res.stdout
    assert "ring OK" in res.stdout and "arena OK" in res.stdout
    assert "cannot give now" in res.stdout


@pytest.mark.parametrize("rank", [-1, 2, 99, None, "0", 0.0, True, 1.5])
def test_bad_rank_local_queue(rank):
    w = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2)
    h = w.export_handle()
    with pytest.raises(ValueError, match=r"rank .* \[0, 1\]"):
        MessageQueue.create_from_handle(h, rank)
    # The queue is still usable with good ranks.
    rs = [MessageQueue.create_from_handle(h, r) for r in (0, 1)]
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    for r in rs:
        r.wait_until_ready()
    t.join(10)
    w.enqueue("ok")
    assert [r.dequeue(timeout=10) for r in rs] == ["ok", "ok"]


@pytest.mark.parametrize("rank", [None, "1", 2.0, True])
def test_bad_rank_mixed_queue(rank):
    # Any integer not listed as local is a remote reader there, as in vLLM
    # (tests/test_vllm_call_shapes.py); only a non-integer is refused.
    w = MessageQueue(2, 1, max_chunk_bytes=4096, max_chunks=2, connect_ip="127.0.0.1")
    with pytest.raises(ValueError, match="rank .* is not an integer"):
        MessageQueue.create_from_handle(w.export_handle(), rank)


def test_local_rank_attached_twice_names_the_other_pid(procs, spawn_ctx):
    """Two processes attaching as one local rank: one used to get everything
    and the other hang forever in wait_until_ready()."""
    w = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    ready = spawn_ctx.Event()
    p = procs.start(children.reader_stall, w.export_handle(), 0, ready)
    w.wait_until_ready()
    assert ready.wait(30)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"process {p.pid}"):
        MessageQueue.create_from_handle(w.export_handle(), 0)
    assert time.monotonic() - t0 < 1.0
    # Once that reader is dead, its rank can be taken over.
    p.kill()
    p.join(10)
    MessageQueue.create_from_handle(w.export_handle(), 0)


def test_failed_zmq_notify_is_counted_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="fastmq")
    w, (r,) = local_pair(1, max_chunk_bytes=4096, max_chunks=4, wait_mode="zmq", spin_us=0)
    w._end.notify_socket.close(linger=0)      # every notify now fails
    got = []
    for i in range(3):
        t = threading.Thread(target=lambda: got.append(r.dequeue(timeout=10)))
        t.start()
        wait_for(lambda: w._ring.parked_readers > 0)
        w.enqueue(i)
        t.join(10)
    assert got == [0, 1, 2]             # the park slice's re-check still delivers
    assert w.stats()["notify_errors"] == 3
    warnings = [rec for rec in caplog.records if "notify failed" in rec.getMessage()]
    assert len(warnings) == 1


_STRANGER = r"""
import os, sys, zmq
os.setgid(65534)
os.setuid(65534)
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.SUBSCRIBE, b"")
s.setsockopt(zmq.RCVTIMEO, int(float(sys.argv[2]) * 1000))
s.connect(sys.argv[1])
print("ready", flush=True)
try:
    s.recv()
    print("GOT A MESSAGE")
except zmq.Again:
    print("nothing")
"""


def test_another_user_cannot_subscribe_to_the_local_sockets():
    """The local sockets are abstract (no file, so no file permission): the
    writer's libzmq drops a connection from any other user before it can
    subscribe, so the overflow payloads never reach it."""
    if os.geteuid() != 0:
        pytest.fail("the test needs root, to run a process as another user")
    w, (r,) = local_pair(1, max_chunk_bytes=1 << 16, max_chunks=2,
                         enable_shm_tensor_arena=False)
    addr = w.export_handle().local_subscribe_addr
    assert addr.startswith("ipc://@")
    stranger = subprocess.Popen([sys.executable, "-c", _STRANGER, addr, "3"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stranger.stdout.readline().strip() == "ready"
        big = b"s" * (1 << 17)                     # larger than a chunk: the socket
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            w.enqueue(big)
            assert r.dequeue(timeout=10) == big
        out, _ = stranger.communicate(timeout=30)
    finally:
        stranger.kill()
        stranger.wait()
    assert out.strip() == "nothing", out
