"""Docker's default 64 MiB /dev/shm, in a private mount namespace: vLLM's
default rings start there (fastmq reserves ring pages as messages first use
them), a message that does not fit raises ShmFullError, and a ring whose
one chunk cannot fit fails at creation naming /dev/shm, its size and the
setting.  vLLM itself on 64 MiB: tests/test_vllm_generation.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_vllm_default_rings_serve_in_64_mib():
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare -m is not permitted here (the test needs a private /dev/shm)")
    script = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && "
              f"exec {sys.executable} {os.path.join(HERE, '_small_shm_child.py')}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("FASTMQ_ARENA", None)
    env.pop("FASTMQ_MAX_CHUNK_MB", None)
    env.pop("FASTMQ_MAX_CHUNKS", None)
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                         text=True, timeout=300, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "small steps OK" in out
    assert "ShmFullError: /dev/shm is full" in out
    assert "after OK" in out
    assert ("RuntimeError: Insufficient space in /dev/shm for the message queue ring buffer "
            "(its header and one 128 MiB chunk)") in out
    assert "free of 64 MiB" in out and "FASTMQ_MAX_CHUNK_MB" in out
    # vLLM's default arena (8 x 256 MiB) does not fit: off by default, and why.
    assert "arena default fits: False" in out
    assert "/dev/shm is 64 MiB" in out and "FASTMQ_ARENA_SLOTS=" in out
