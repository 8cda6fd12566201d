"""vLLM 0.33.0's multi-node ``MultiprocExecutor`` when the engine's node
goes silent: node 0 (engine core and worker 0) runs in a network namespace
of its own, joined to node 1 (headless, worker 1; its own ``/dev/shm``) by
a veth pair (``_silent_children.SilentNode``).  Once the engine has run
round trips through both workers and waits, node 0's link is set down and
its processes are SIGKILLed: nothing leaves node 0.

With vLLM's own queue worker 1 would wait in its ``dequeue`` for ever.
With fastmq, worker 1's remote reader finds its writer silent within the
bound (``FASTMQ_PEER_TIMEOUT_S``) and raises ``WriterGoneError`` (not
clean), which inside vLLM stops the node through vLLM's own shutdown, as
when the engine exited (``fastmq.vllm._node_end``): node 1 ends by itself
and leaves nothing.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

import _nodes
import _silent_children as sc
from _vllm_models import ENGINE_ENV
from test_vllm_multinode import UNSET

BOUND = 3.0
# vLLM's own shutdown of the node after the hook's SIGTERM (its workers,
# its queues): a few seconds on a quiet machine, more on two shared cores.
SHUTDOWN_S = 60.0

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="needs root: the engine's node is a network namespace joined "
                              "by a veth pair whose link the test sets down"),
    pytest.mark.skipif(shutil.which("ip") is None,
                       reason="needs iproute2's ip command (network namespace, veth pair)"),
    pytest.mark.skipif(not _nodes.can_unshare(),
                       reason="node 1 needs a mount namespace of its own (unshare -m)"),
]


def _env(tmp, node, model, port: int, ip: str, dev: str) -> dict:
    env = _nodes.node_env(str(tmp), FASTMQ_VLLM="1", FASTMQ_TEST_MODEL_DIR=str(model),
                          FASTMQ_TEST_MASTER_PORT=str(port),
                          FASTMQ_TEST_MASTER_ADDR=node.node_ip, VLLM_HOST_IP=ip,
                          GLOO_SOCKET_IFNAME=dev, FASTMQ_PEER_TIMEOUT_S=f"{BOUND:g}",
                          VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO",
                          **ENGINE_ENV)
    for k in UNSET:
        env.pop(k, None)
    return env


def _wait_for(path, prefix: str, timeout: float, proc) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return json.loads(line[len(prefix):])
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    with open(path) as f:
        pytest.fail(f"no {prefix.strip()} line from node 0:\n{f.read()[-6000:]}")


def test_a_node_whose_engines_node_went_silent_ends_by_itself(tmp_path):
    node = sc.SilentNode()
    model = tmp_path / "model"
    model.mkdir()
    tmp0, tmp1 = tmp_path / "node0", tmp_path / "node1"
    tmp0.mkdir()
    tmp1.mkdir()
    port = random.randrange(20000, 30000)   # free: node 0's namespace is new
    log0 = tmp_path / "node0.log"
    node0 = node1 = None
    try:
        node1 = _nodes.Node("import _silent_children as s; s.vllm_headless()",
                            _env(tmp1, node, model, port, node.host_ip, node.host_dev),
                            str(tmp_path / "node1.log"), own_shm=True, cwd=str(tmp1))
        with open(log0, "w") as out:
            node0 = subprocess.Popen(
                ["ip", "netns", "exec", node.name, sys.executable, "-c",
                 "import _silent_children as s; s.vllm_engine()"],
                env=_env(tmp0, node, model, port, node.node_ip, node.node_dev),
                cwd=str(tmp0), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        idle = _wait_for(log0, "IDLE ", 600, node0)
        cut = time.monotonic()
        node.cut()
        os.killpg(node0.pid, signal.SIGKILL)
        try:
            node1.wait(2 * BOUND + SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still runs {2 * BOUND + SHUTDOWN_S:.0f} s after its "
                        f"engine's node went silent:\n{node1.output()[-6000:]}")
        ended_after = time.monotonic() - cut
        out1 = node1.output()
        results = [json.loads(ln[len("RESULT "):]) for ln in out1.splitlines()
                   if ln.startswith("RESULT ")]
        assert results, out1[-6000:]
        r = results[-1]
        print(f"node 1 ended {ended_after:.1f} s after the cut; {r}")
        stopping = [ln for ln in out1.splitlines()
                    if "Stopping this node's vLLM process" in ln]
        assert stopping and "went silent" in stopping[0], out1[-6000:]
        assert f"pid {idle['engine_pid']}" in stopping[0] or node.node_ip in stopping[0]
        assert r["stopped"] is True, r
        assert r["alive_after_shutdown"] == [], r
        assert r["leftovers"] == {"shm": [], "tmpdir": [], "of_pids": []}, r
        assert node1.proc.returncode == 0, out1[-6000:]
    finally:
        if node0 is not None:
            try:
                os.killpg(node0.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node0.wait(30)
        if node1 is not None:
            node1.kill()
        node.close()
