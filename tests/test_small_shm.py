"""Docker's default 64 MiB /dev/shm, full, in a private mount namespace:
fastmq's segments are not in /dev/shm, so vLLM's default rings and the
tensor arena at its default sizing serve there, a 64 MiB tensor goes
through the arena, and nothing of fastmq appears in /dev/shm.  vLLM itself
on 64 MiB: tests/test_vllm_generation.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_vllm_default_rings_and_arena_serve_in_a_full_64_mib_dev_shm():
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare -m is not permitted here (the test needs a private /dev/shm)")
    script = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && "
              f"exec {sys.executable} {os.path.join(HERE, '_small_shm_child.py')}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for var in ("FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB", "FASTMQ_MAX_CHUNKS",
                "FASTMQ_ARENA_SLOTS", "FASTMQ_ARENA_SLOT_MB"):
        env.pop(var, None)
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                         text=True, timeout=300, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    for line in ("small steps OK", "arena OK", "overflow OK", "OK"):
        assert line in out.splitlines(), out
