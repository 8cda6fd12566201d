"""Inside vLLM on a CUDA platform, the scheduler broadcast's arena has
vLLM's semantics by default (shared readers: page-locked in each CUDA
reader, slots released after a CUDA event); isolated readers where the user
asks for them, on other platforms, for the queues vLLM builds without an
arena, and outside vLLM.  This machine has no GPU: each child replaces
vLLM's platform object, before anything asks it, by one that answers as
vLLM's CUDA (or CPU) platform does (tests/_vllm_cuda_children.py).  With a
real GPU: tests/gpu/test_arena_cuda.py.  Also: ``fastmq.shm_usage`` reads
vLLM's own arena the way it reads fastmq's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from fastmq import shm_usage

TESTS = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(TESTS, "_vllm_cuda_children.py")
MiB = 1 << 20
UNSET = ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_ARENA_READERS",
         "FASTMQ_ARENA_SLOTS", "FASTMQ_ARENA_SLOT_MB")


def _child(platform: str, case: str, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in UNSET}
    full["PYTHONPATH"] = os.pathsep.join(
        [TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    full.update(env)
    res = subprocess.run([sys.executable, CHILD, platform, case], capture_output=True,
                         text=True, timeout=240, env=full)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_broadcast_arena_has_shared_readers_on_cuda():
    out = _child("cuda", "plugin")
    assert out["active"]
    # Only the queue vLLM asks an arena of gets vLLM's semantics.
    assert out["decision"] == {"True": "shared", "False": None, "None": None}
    assert out["broadcast"] == "shared" and out["broadcast_core_isolated"] is False
    assert out["broadcast_readers"] == ["shared", "shared"]
    assert out["broadcast_reader_isolated"] == [0, 0]
    assert out["response"] == "isolated"            # MessageQueue(1, 1): vLLM gives no arena
    assert out["keyword_isolated"] == "isolated"    # the keyword wins
    assert out["after_unpatch"] == "isolated"       # fastmq without vLLM


def test_other_platforms_keep_isolated_readers():
    out = _child("cpu", "plugin")
    assert out["active"]
    assert out["decision"] == {"True": None, "False": None, "None": None}
    assert out["broadcast"] == "isolated" and out["broadcast_reader_isolated"] == [1, 1]


@pytest.mark.parametrize("mode", ["isolated", "shared"])
def test_the_operators_variable_wins(mode):
    out = _child("cuda", "plugin", FASTMQ_ARENA_READERS=mode)
    assert out["decision"]["True"] is None          # nothing of fastmq.vllm's own
    assert out["broadcast"] == mode and out["broadcast_readers"] == [mode, mode]
    assert out["response"] == mode


def test_broadcast_readers_pin_and_release_after_the_event_on_cuda():
    # fastmq._cuda's runtime is replaced in the child (no CUDA here); the
    # same with a real one: tests/gpu/test_arena_cuda.py.
    out = _child("cuda", "pinned")
    assert out == {"readers": "shared", "pinned": 1, "registered": True,
                   "held_until_event": True, "free_after_event": True, "event_gated": 1}


def test_standalone_fastmq_keeps_isolated_readers():
    code = ("import sys, fastmq; q = fastmq.MessageQueue(1, 1, enable_shm_tensor_arena=True); "
            "print(q.tensor_arena.readers, 'vllm' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["isolated", "False"]


def test_held_bytes_reads_vllms_arena_as_it_reads_fastmqs():
    from vllm.distributed.device_communicators.shm_tensor_arena import ShmTensorArena

    arena = ShmTensorArena(1, slot_bytes=32 * MiB, n_slots=2)
    try:
        assert shm_usage.held_bytes(types.SimpleNamespace(tensor_arena=arena))["arena"] <= MiB
        assert arena.write_tensor(torch.ones(4 * MiB)) == 0           # 16 MiB into slot 0
        held = shm_usage.held_bytes(types.SimpleNamespace(tensor_arena=arena))
        path = os.path.join("/dev/shm", arena.shared_memory.name.lstrip("/"))
        assert held["arena"] == os.stat(path).st_blocks * 512
        assert 16 * MiB <= held["arena"] < 17 * MiB and held["total"] == held["arena"]
    finally:
        arena.shared_memory.close()
        arena.shared_memory.unlink()
        arena.is_creator = False        # its __del__ would unlink the name again
