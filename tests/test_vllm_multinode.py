"""vLLM 0.33.0's real multi-node ``MultiprocExecutor`` on fastmq, and on
vLLM's own queue for comparison: two nodes on this machine (see
``_nodes``: node 1 has its own ``/dev/shm`` and ``TMPDIR``; loopback only),
``tensor_parallel_size=2`` with ``nnodes=2``, node 1 headless, one
``_multinode_worker.MultiNodeWorker`` per node.

Each implementation is run once per module (vLLM is imported in four
processes: about a minute or two on a busy 2-core machine); the tests below
check its parts.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest

import _nodes
from _vllm_models import ENGINE_ENV

ACTIVE_LINE = "fastmq is active in vLLM"
SHM = "vllm.distributed.device_communicators.shm_broadcast"
UNSET = ("VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB", "FASTMQ_MAX_CHUNKS",
         "VLLM_MQ_MAX_CHUNK_BYTES_MB", "FASTMQ_ARENA_SLOTS", "FASTMQ_ARENA_SLOT_MB",
         "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_STREAM")

pytestmark = pytest.mark.skipif(not _nodes.can_unshare(),
                                reason="a second node needs unshare -m (root)")


def _lines(output: str, prefix: str) -> list[dict]:
    return [json.loads(ln.removeprefix(prefix)) for ln in output.splitlines()
            if ln.startswith(prefix)]


def two_nodes(tmp_path, phases, fastmq_vllm: str, timeout: float = 600) -> dict:
    """Run the engine on node 0 and the headless node 1; node 1 is stopped
    (SIGTERM) once the engine is done, unless it ended on its own.  Returns
    both nodes' RESULTs and output."""
    port = _nodes.free_port()
    model = tmp_path / "model"
    model.mkdir()
    nodes = {}
    try:
        for rank, code in ((1, "import _multinode_worker as w; w.headless()"),
                           (0, f"import _multinode_worker as w; w.engine(*{list(phases)!r})")):
            tmp = tmp_path / f"node{rank}"
            tmp.mkdir()
            env = _nodes.node_env(str(tmp), FASTMQ_VLLM=fastmq_vllm,
                                  FASTMQ_TEST_MODEL_DIR=str(model),
                                  FASTMQ_TEST_MASTER_PORT=str(port),
                                  VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO",
                                  **ENGINE_ENV)
            for k in UNSET:
                env.pop(k, None)
            nodes[rank] = _nodes.Node(code, env, str(tmp_path / f"node{rank}.log"),
                                      own_shm=rank == 1, cwd=str(tmp))
        rc = nodes[0].wait(timeout)
        engine_out = nodes[0].output()
        assert rc == 0, f"engine exited with {rc}:\n{engine_out[-8000:]}\n" \
                        f"node 1:\n{nodes[1].output()[-4000:]}"
        try:
            # After a kill its worker monitor ends it; otherwise it serves on.
            nodes[1].wait(30 if "kill_remote_worker" in phases else 1)
        except subprocess.TimeoutExpired:
            nodes[1].stop(grace=60)
        node1_out = nodes[1].output()
        engine = _lines(engine_out, "RESULT ")
        node1 = _lines(node1_out, "RESULT ")
        assert engine, engine_out[-8000:]
        assert node1, node1_out[-8000:]
        return {"engine": engine[-1], "node1": node1[-1], "output": engine_out + node1_out}
    finally:
        for node in nodes.values():
            node.kill()


@pytest.fixture(scope="module")
def fastmq_run(tmp_path_factory):
    return two_nodes(tmp_path_factory.mktemp("fastmq"), ["round_trips", "kill_remote_worker"],
                     "1")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return two_nodes(tmp_path_factory.mktemp("vllm"), ["round_trips"], "0")


def active_pids(output: str) -> set[int]:
    out = set()
    for line in output.splitlines():
        if ACTIVE_LINE in line:
            m = re.search(r"process \S+, pid (\d+);", line)
            assert m, line
            out.add(int(m[1]))
    return out


# -- fastmq ---------------------------------------------------------------------------
def test_fastmq_is_active_in_every_process_of_both_nodes(fastmq_run):
    e, n1 = fastmq_run["engine"], fastmq_run["node1"]
    assert e["engine_fastmq_active"] is True and n1["node_fastmq_active"] is True
    assert e["queue"] == "fastmq.queue"
    assert e["response_queues"] == ["fastmq.queue", "fastmq.queue"]
    # Worker 1's answers come over TCP: the engine reads them as a remote reader.
    assert e["remote_response"] == [False, True]
    for w in e["workers"]:
        assert w["fastmq_active"] is True
        assert w["shm_classes"] == ["fastmq.queue", "fastmq.handle"]
        assert w["queues"] == ["fastmq.queue", "fastmq.queue"]
    assert [w["rank"] for w in e["workers"]] == [0, 1]
    assert n1["worker_pids"] == [e["workers"][1]["pid"]]
    # Every process that makes a queue logs the activation line (node 1's
    # main process makes none: is_active() above says it is on there too).
    pids = {e["engine_pid"]} | {w["pid"] for w in e["workers"]}
    assert pids <= active_pids(fastmq_run["output"])


def test_round_trips_across_the_nodes_are_exact(fastmq_run):
    # Every answer is compared in the engine; a wrong one fails the run.
    assert fastmq_run["engine"]["round_trips"] == {"round_trips": 472}


def test_a_killed_remote_worker_is_named_by_the_engine(fastmq_run):
    """SIGKILL worker 1 on node 1 mid-run: the engine's collective_rpc
    raises fastmq's error naming that worker's pid instead of waiting
    forever (the engine gives up after _multinode_worker.KILL_WAIT_S)."""
    e = fastmq_run["engine"]
    k = e["kill_remote_worker"]
    print(f"engine after the SIGKILL: {k}")
    assert k["calls_before"] > 0
    assert not k["hung"], k
    # The engine reads worker 1's answers as a remote reader: its writer is
    # gone (fastmq.WriterGoneError, a RuntimeError).
    assert k["error"].startswith("WriterGoneError: fastmq: "), k["error"]
    assert f"pid {k['victim']}" in k["error"], k["error"]


def test_nothing_left_on_either_node(fastmq_run):
    e, n1 = fastmq_run["engine"], fastmq_run["node1"]
    assert e["alive_after_shutdown"] == [], e["alive_detail"]
    assert n1["alive_after_shutdown"] == [], n1["alive_detail"]
    assert e["leftovers"]["of_pids"] == [] and e["leftovers"]["tmpdir"] == []
    # Node 1's /dev/shm is its own: nothing of fastmq may be there.
    assert n1["leftovers"] == {"shm": [], "tmpdir": [], "of_pids": []}


# -- vLLM's own queue -------------------------------------------------------------------
def test_vllms_own_queue_runs_the_same_executor(vllm_run):
    e, n1 = vllm_run["engine"], vllm_run["node1"]
    assert e["engine_fastmq_active"] is False and n1["node_fastmq_active"] is False
    assert e["queue"] == SHM and e["response_queues"] == [SHM, SHM]
    assert e["remote_response"] == [False, True]
    for w in e["workers"]:
        assert w["fastmq_active"] is False and w["queues"] == [SHM, SHM]
    assert not active_pids(vllm_run["output"])
    assert e["round_trips"] == {"round_trips": 472}
    assert n1["stopped"] is True and n1["alive_after_shutdown"] == [], n1["alive_detail"]
