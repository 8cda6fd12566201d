"""Nothing is left, at once, however a queue's processes end.

Each case starts a writer and two readers (spawned), brings them to a
moment (the handshake, a message under way, readers holding views of the
tensor arena), SIGKILLs a subset of them, then the rest, and checks through
``/proc`` (not a listing of ``/dev/shm``): no fastmq file anywhere, no
process of the host holding or mapping a segment of theirs, and ``Shmem``
in ``/proc/meminfo`` back where it was.  The queue's arena has a 64 MiB slot
pre-faulted at creation, so one left behind cannot hide in the slack.
"""
from __future__ import annotations

import glob
import os
import signal
import tempfile
import time

import pytest

from fastmq import cli
from fastmq.cleanup import NOTHING_LEFT

import _lifetime_children as children
from _held import held_segments, segments_made_by as _made_by, shmem_bytes

SHMEM_SLACK = 32 << 20


def _files(pids) -> list[str]:
    """Files named after one of ``pids`` (fastmq makes none)."""
    return [f for pid in pids for f in glob.glob(f"/dev/shm/fastmq_{pid}_*") + glob.glob(
        os.path.join(tempfile.gettempdir(), f"fastmq_{pid}_*"))]


def _until(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if not got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {got}")
        time.sleep(0.05)


def _start(procs, spawn_ctx, moment: str):
    here, there = spawn_ctx.Pipe()
    writer = procs.start(children.writer, there, 2, moment)
    handle = here.recv()
    readers, conns = [], []
    for rank in range(2):
        a, b = spawn_ctx.Pipe()
        readers.append(procs.start(children.reader, b, handle, rank, moment))
        conns.append(a)
    for c in (here, *conns):
        assert c.poll(120), "a process never reached the moment"
        assert c.recv() == "waiting"
    return writer, readers, conns


def _kill(ps):
    for p in ps:
        os.kill(p.pid, signal.SIGKILL)
    for p in ps:
        p.join(20)
        assert p.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("subset", ["writer", "readers", "all"])
@pytest.mark.parametrize("moment", ["handshake", "message", "arena"])
def test_kill_9_leaves_nothing(procs, spawn_ctx, moment, subset):
    base = shmem_bytes()
    writer, readers, conns = _start(procs, spawn_ctx, moment)
    pids = {writer.pid, *(r.pid for r in readers)}
    held = _made_by(pids)
    assert set(held) == pids, held          # every process maps the queue
    first = {"writer": [writer], "readers": readers, "all": [writer, *readers]}[subset]
    assert _files(pids) == []
    _kill(first)
    assert _files(pids) == []
    rest = [p for p in (writer, *readers) if p not in first]
    if moment == "arena" and subset == "writer":
        # The readers' views outlive the writer: the memory is theirs now.
        for c in conns:
            c.send("read")
            assert c.poll(30) and c.recv() == 7 * children.TENSOR_BYTES
    if rest:
        # The survivors hold the queue's memory, and nothing else does.
        assert set(_made_by(pids)) == {p.pid for p in rest}
    _kill(rest)
    _until(lambda: _made_by(pids), "processes still hold the queue's segments")
    _until(lambda: max(0, shmem_bytes() - base - SHMEM_SLACK),
           f"Shmem did not come back to {base >> 20} MiB (+{SHMEM_SLACK >> 20})")


def test_a_queue_closed_in_process_leaves_nothing_held():
    from fastmq import MessageQueue

    w = MessageQueue(1, 1, **children.RING)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    w.wait_until_ready()
    r.wait_until_ready()
    w.enqueue("x")
    assert r.dequeue(timeout=10) == "x"
    mine = held_segments()
    assert any("_ring_" in n for n in mine)
    w.shutdown()
    r.shutdown()
    del w, r
    import gc

    gc.collect()
    assert not any(n in held_segments() for n in mine)


def test_cleanup_has_nothing_to_do_and_says_so(capsys):
    from fastmq import cleanup

    assert cleanup() == [] and cleanup(dry_run=True) == []
    assert cli.main(["cleanup"]) == 0
    err = capsys.readouterr().err
    assert "nothing to remove" in err and NOTHING_LEFT in err
    assert cli.main(["cleanup", "--dry-run"]) == 0
    with pytest.raises(SystemExit):
        cli.main([])


# -- when a process counts as ended (dead-peer checks rely on it) ------------------
def _state(pid: int, tid: int | None = None) -> str:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _python_child(code: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", code])


def test_an_exited_process_not_yet_reaped_has_ended():
    """A process that exited but that its parent has not reaped (a zombie:
    its pid still answers signals) is gone for its peers."""
    from fastmq import _proc

    p = _python_child("pass")
    try:
        _until(lambda: _state(p.pid) != "Z", "the child to exit")   # not waited for
        assert not _proc.is_alive(p.pid)
    finally:
        p.kill()
        p.wait()


def test_a_process_whose_main_thread_exited_is_alive_while_a_thread_runs():
    """The main thread's exit leaves the process's first task a zombie while
    its other threads run on: that process is alive."""
    from fastmq import _proc

    p = _python_child("import ctypes, threading, time\n"
                      "threading.Thread(target=time.sleep, args=(120,)).start()\n"
                      "ctypes.CDLL(None).pthread_exit(None)\n")
    try:
        _until(lambda: _state(p.pid) != "Z", "the main thread to exit")
        assert any(_state(p.pid, int(t)) != "Z" for t in os.listdir(f"/proc/{p.pid}/task"))
        assert _proc.is_alive(p.pid)
        assert _proc.is_alive(p.pid, _proc.start_time(p.pid))
    finally:
        p.kill()
        p.wait()
