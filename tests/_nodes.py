"""Two "nodes" on one machine, for the multi-node tests.

Node 0 is an ordinary process.  Node 1 is a process started in a mount
namespace of its own (``unshare -m``) with a fresh tmpfs on ``/dev/shm``, so
no shared-memory segment of one node can be mapped by the other (the
property by which vLLM and fastmq tell nodes apart); each node gets its own
``TMPDIR`` (ipc socket files).  The network is shared: the nodes talk over
127.0.0.1 only.

Each node is started in a session of its own, and ``stop()`` ends it with
everything it started (vLLM's spawned workers inherit its process group);
the namespace, and the tmpfs with it, goes away with its last process.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# Mounted inside node 1's namespace only; exec keeps the node's pid.
_OWN_SHM = 'mount -t tmpfs -o size=1g,mode=1777 fastmq-test-node /dev/shm && exec "$@"'


def can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous both nodes are told)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(tmpdir: str, **extra: str) -> dict:
    """The environment of a node's process: its own TMPDIR, loopback only
    (vLLM's and fastmq's advertised address, gloo's interface), this
    checkout and tests/ on the path."""
    env = dict(os.environ)
    # (vLLM's ipc socket files go to VLLM_RPC_BASE_PATH, which the session
    # set: the node's own TMPDIR instead.)
    env.update(TMPDIR=tmpdir, VLLM_RPC_BASE_PATH=tmpdir, VLLM_HOST_IP="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo",
               PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([TESTS, ROOT, env.get("PYTHONPATH", "")]))
    env.pop("FASTMQ_HOST_IP", None)
    env.update(extra)
    return env


class Node:
    """``python -c code`` as one node (``own_shm``: in its own mount
    namespace with a fresh /dev/shm), output to ``log``."""

    def __init__(self, code: str, env: dict, log: str, own_shm: bool, cwd: str | None = None):
        argv = [sys.executable, "-c", code]
        if own_shm:
            argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", _OWN_SHM, "sh",
                    *argv]
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the node (as an operator stops a vLLM node), then SIGKILL
        whatever of it is left after ``grace`` seconds."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the node's process group (the node and its workers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        # Workers that left the group (none should) are not waited for, but
        # the group must be empty before the test says the node is gone.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self._out.close()
