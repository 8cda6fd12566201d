"""A vLLM node whose engine is elsewhere ends through vLLM's own shutdown
when the engine's queue goes (fastmq/vllm/_node_end.py), with stand-ins
for the node's processes (``_node_end_children``): no vLLM needed.

The writer is a process of its own that sends one message and is then
SIGKILLed: its remote reader sees the connection cut."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
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


def _run(tmp_path, worker_name: str, ignore_sigterm: bool, grace_s: float = 30.0):
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
                             args=(handle, str(tmp_path), worker_name, ignore_sigterm, grace_s))
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
