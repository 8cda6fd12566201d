"""The writer runs ahead of its readers as far as vLLM's does: max_chunks
messages, whatever their sizes, each taking one chunk (a large one its
overflow mark).  Parts (fastmq._parts) take several chunks, so they go
only to readers waiting for the message, who take each part as it comes.

The same cases (``_run_ahead_children.CASES``: a few unread messages, small,
too big for a chunk, a tensor; one or two readers; the arena on or off;
readers that take the first message and no more; FASTMQ_PARTS at its
default) run with vLLM's own class (``FASTMQ_VLLM=0``)
and with fastmq's: every enqueue() must return in both, and every reader
then receives every message in order, intact.  Then: parts still go to
readers that wait, and leave the run-ahead whole."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import _run_ahead_children as children
from _queues import local_pair, shut

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# Settings that would change the paths or the class under test.
UNSET = ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_ARENA_MIN_MB",
         "FASTMQ_ARENA_SLOT_MB", "FASTMQ_PARTS", "FASTMQ_MAX_CHUNK_MB", "FASTMQ_MAX_CHUNKS",
         "VLLM_MQ_MAX_CHUNK_BYTES_MB")


def _run_child(which: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(PYTHONPATH=os.pathsep.join([TESTS, ROOT, env.get("PYTHONPATH", "")]),
               VLLM_TARGET_DEVICE="cpu")
    if which == "vllm":
        env["FASTMQ_VLLM"] = "0"
    # subprocess.run kills the child if it overruns or this test is interrupted.
    done = subprocess.run([sys.executable, os.path.join(TESTS, "_run_ahead_children.py"), which],
                          env=env, cwd=TESTS, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"{which} child exited with {done.returncode}:\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def results():
    """Every case with each class: ``{"vllm": {case: result}, "fastmq": ...}``."""
    return {which: _run_child(which) for which in ("vllm", "fastmq")}


@pytest.mark.parametrize("case", sorted(children.CASES))
def test_unread_messages_return_as_in_vllm(results, case):
    n_msgs = len(children.CASES[case][5])
    for which in ("vllm", "fastmq"):
        got = results[which][case]
        assert got["error"] is None and got["returned"] == n_msgs, (
            f"{which}: enqueue() {got['returned'] + 1} of {n_msgs} did not return: "
            f"{got['error']} (paths {got.get('paths')})")
        assert got["delivered"] is True, f"{which}: a reader got a message wrong: {got}"


def _big(seed: int, nbytes: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"seed": seed, "a": rng.integers(0, 1 << 40, nbytes // 8, dtype=np.int64)}


def _same(got, want) -> bool:
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, np.ndarray):
        return np.array_equal(got, want)
    if isinstance(want, torch.Tensor):
        return torch.equal(got, want)
    return got == want


def _waiting_readers(w, rs, want):
    """Every reader in ``rs`` dequeues one message in a thread; returns once
    the writer's ring shows all of them waiting, with a join that checks
    each got ``want``."""
    ring, got = w._end.ring, {}

    def read(k):
        got[k] = rs[k].dequeue(timeout=60)

    ts = [threading.Thread(target=read, args=(k,), daemon=True) for k in range(len(rs))]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 30
    while not ring.readers_waiting():
        assert time.monotonic() < deadline, "the readers never showed as waiting"
        time.sleep(0.001)

    def join():
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts), "a reader did not finish its dequeue()"
        for k in range(len(rs)):
            assert _same(got[k], want), f"reader {k} got another message"
    return join


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("shape", ["larger-than-a-chunk", "fits-a-chunk"])
def test_parts_go_to_waiting_readers_and_leave_the_run_ahead_whole(n, shape):
    # Readers waiting in dequeue(): the message goes in parts (for the one
    # larger than the ring, the writer takes each chunk as the readers
    # release it).  Then, with no reader reading, the writer still runs
    # max_chunks messages ahead, large ones included, as vLLM's does.
    if shape == "larger-than-a-chunk":
        kw, big = dict(max_chunk_bytes=64 << 10, max_chunks=4), _big(1, 1 << 20)
        later = [b"s" * 100, b"m" * (128 << 10), torch.arange(1 << 18), b"x" * (200 << 10)]
    else:
        kw, big = dict(max_chunk_bytes=8 << 20, max_chunks=2), _big(2, 6 << 20)
        later = [torch.arange(6 << 17), b"s" * 100]
    w, rs = local_pair(n, enable_shm_tensor_arena=False, **kw)
    try:
        join = _waiting_readers(w, rs, big)
        w.enqueue(big, timeout=30)
        join()
        assert w.stats()["parts_messages"] == 1
        assert w._end.ring.free_chunks() == kw["max_chunks"]   # the parts left no chunk
        for m in later:
            w.enqueue(m, timeout=5)
        for r in rs:
            for m in later:
                assert _same(r.dequeue(timeout=10), m)
        st = w.stats()
        assert st["parts_messages"] == 1, st   # nobody waited for the later ones
    finally:
        shut(w, *rs)

