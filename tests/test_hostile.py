"""Resources and hostile input: a full /dev/shm, bad ranks, a rank taken
twice, and failed wakeup notifies."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from fastmq import MessageQueue

import _fault_children as children
from _queues import local_pair, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def test_full_dev_shm_is_an_exception_not_sigbus():
    """/dev/shm filled by someone else after the ring was created used to
    kill the writer with SIGBUS on its first write into an untouched chunk."""
    if not _can_unshare():
        pytest.skip("unshare -m is not permitted here (needs root or user namespaces)")
    script = (f"mount -t tmpfs -o size=8m tmpfs /dev/shm && "
              f"exec {sys.executable} {os.path.join(HERE, '_shm_full_child.py')}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    assert res.stdout.strip().endswith("OK"), res.stdout
    assert "arena OK" in res.stdout and "arena populate OK" in res.stdout
    assert "/dev/shm is full" in res.stdout


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
