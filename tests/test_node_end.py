"""A vLLM node whose engine is elsewhere ends through vLLM's own shutdown
when the engine's queue goes (fastmq/vllm/_node_end.py), with stand-ins
for the node's processes (``_node_end_children``): no vLLM needed.

The writer is a process of its own that sends one message and is then
SIGKILLed: its remote reader sees the connection cut."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

import _node_end_children as nc
import _remote_children as rc
from _queues import wait_for
from conftest import OUR_PIDS

SPAWN = mp.get_context("spawn")


def _events(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run(tmp_path, worker_name: str, ignore_sigterm: bool, grace_s: float = 30.0,
         role: str = "broadcast"):
    """Writer, node and worker; the writer killed once the worker has its
    first message.  Returns the node's and the worker's events."""
    parent, child = SPAWN.Pipe()
    writer = SPAWN.Process(target=rc.remote_writer_then_die, args=(child,), daemon=True)
    writer.start()
    OUR_PIDS.add(writer.pid)
    node = worker_pid = None
    try:
        handle = parent.recv()
        node = SPAWN.Process(target=nc.node,
                             args=(handle, str(tmp_path), worker_name, ignore_sigterm, grace_s,
                                   role))
        node.start()
        OUR_PIDS.add(node.pid)
        wait_for(lambda: any(e["event"] == "first" for e in _events(tmp_path / "worker.jsonl")),
                 timeout=60)
        worker_pid = next(e["worker"] for e in _events(tmp_path / "node.jsonl")
                          if e["event"] == "started")
        OUR_PIDS.add(worker_pid)
        parent.send("die")
        writer.join(10)
        node.join(60)
        assert not node.is_alive(), (_events(tmp_path / "node.jsonl"),
                                     _events(tmp_path / "worker.jsonl"))
    finally:
        for pid in (writer.pid, worker_pid, node and node.pid):
            if pid is not None:
                _kill(pid)
        for p in (writer, node):
            if p is not None:
                p.join(10)
    return _events(tmp_path / "node.jsonl"), _events(tmp_path / "worker.jsonl")


def test_a_vllm_worker_stops_its_node_and_ends_through_its_shutdown(tmp_path):
    """Before, the worker raised "connection ... was cut" from its busy
    loop, which vLLM logs as a worker failure; now its node process is told
    to stop (SIGTERM), vLLM's shutdown closes the death pipe, and the
    dequeue ends as any shutdown does."""
    node, worker = _run(tmp_path, "VllmWorker-1", ignore_sigterm=False)
    kinds = [e["event"] for e in node]
    assert kinds[:2] == ["started", "sigterm"], node
    assert node[-1] == {"event": "worker exited", "code": 0}, node
    assert [e["event"] for e in worker] == ["first", "death pipe closed", "raised"], worker
    assert worker[0]["message"] == "last words"
    assert worker[-1]["error"] == "RuntimeError: cancelled", worker


def test_a_node_that_does_not_stop_gets_the_error_after_the_grace(tmp_path):
    node, worker = _run(tmp_path, "VllmWorker-1", ignore_sigterm=True, grace_s=1.0)
    assert [e["event"] for e in node] == ["started", "sigterm", "worker exited"], node
    raised = worker[-1]
    assert raised["event"] == "raised", worker
    assert "was cut before the writer closed the queue" in raised["error"], raised
    assert raised["error"].startswith("WriterGoneError: fastmq: "), raised
    assert 0.9 < raised["seconds"] < 20, raised


@pytest.mark.parametrize("name", ["Worker-1", "Process-1"])
def test_any_other_reader_raises_at_once_and_signals_nobody(tmp_path, name):
    node, worker = _run(tmp_path, name, ignore_sigterm=False)
    assert [e["event"] for e in node] == ["started", "worker exited"], node
    raised = worker[-1]
    assert "was cut before the writer closed the queue" in raised["error"], raised
    assert raised["seconds"] < 20, raised


def test_a_users_own_queue_in_a_vllm_worker_raises_and_signals_nobody(tmp_path):
    """Before, any remote queue a vLLM worker read stopped its parent when
    its writer went: on one node that parent is the engine core.  A queue
    of the user's own, read inside a request vLLM's busy loop runs, raises
    its error at once and leaves the node alone."""
    node, worker = _run(tmp_path, "VllmWorker-1", ignore_sigterm=False, role="own")
    assert [e["event"] for e in node] == ["started", "worker exited"], node
    raised = worker[-1]
    assert raised["event"] == "raised", worker
    assert raised["error"].startswith("WriterGoneError: fastmq: "), raised
    assert "was cut before the writer closed the queue" in raised["error"], raised
    assert raised["seconds"] < 20, raised


def test_vllms_own_busy_loop_is_recognised(tmp_path):
    """The stand-in above is vLLM 0.33.0's shape: in vLLM's real
    ``WorkerProc.worker_busy_loop`` the queue it reads is recognised as the
    scheduler broadcast, and no other queue is; also by another thread
    (fastmq's heartbeat thread finds a silent engine node while the loop's
    thread is busy in a collective).  It used to look at the calling
    thread's frames only."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (bash .ci/setup installs vLLM 0.33.0)")
    code = ("import json, _node_end_children as nc; "
            "print(json.dumps(nc.recognised_in_vllms_busy_loop()))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "its rpc_broadcast_mq": True, "another queue": False,
        "from another thread": True, "another queue from another thread": False}
