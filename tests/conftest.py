"""Shared test machinery.

* Every child process is started with the spawn start method through
  ``procs`` and is joined with a timeout; on failure all are killed.
* After every test, this process may hold no fastmq segment it did not
  hold before (no descriptor, no mapping: ``/proc/self/fd`` and
  ``/proc/self/maps``), and no fastmq file may exist in /dev/shm or the
  temporary directory (fastmq makes none) (``no_leftovers``, autouse).
* vLLM's own processes and queues, which many tests run (and kill),
  name their ZMQ ipc socket files in ``VLLM_RPC_BASE_PATH`` (by default
  the temporary directory), and a killed one leaves them: this session
  points it at a directory of its own, removed when the session ends.
"""
from __future__ import annotations

import gc
import glob
import multiprocessing as mp
import os
import shutil
import tempfile
import threading

import pytest

from _held import held_segments, segments_made_by  # noqa: F401 (tests import them here)

SPAWN = mp.get_context("spawn")

# Set before any test or child starts (children inherit the environment).
_VLLM_IPC_DIR = None
if "VLLM_RPC_BASE_PATH" not in os.environ:
    _VLLM_IPC_DIR = tempfile.mkdtemp(prefix="fastmq-tests-vllm-ipc-")
    # As /tmp is: tests run vLLM's queue across uids (a non-root writer's
    # socket, a root reader; a writer that changed its uid).
    os.chmod(_VLLM_IPC_DIR, 0o1777)
    os.environ["VLLM_RPC_BASE_PATH"] = _VLLM_IPC_DIR


def pytest_sessionfinish(session, exitstatus):
    if _VLLM_IPC_DIR is not None:
        shutil.rmtree(_VLLM_IPC_DIR, ignore_errors=True)


# Pids whose files this test session answers for: itself and its children
# (files are named fastmq_<creator pid>_...; other sessions' files are not ours).
OUR_PIDS = {os.getpid()}


def _creator(path: str) -> int:
    try:
        return int(os.path.basename(path).split("_")[1])
    except (IndexError, ValueError):
        return -1


def _fastmq_files() -> set[str]:
    shm = set(glob.glob("/dev/shm/fastmq_*"))
    tmp = set(glob.glob(os.path.join(tempfile.gettempdir(), "fastmq_*")))
    return {p for p in shm | tmp if _creator(p) in OUR_PIDS}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.fastmq_call_failed = rep.failed


@pytest.fixture(autouse=True)
def no_leftovers(request):
    before = _fastmq_files()
    held_before = held_segments()
    yield
    # An arena's background pre-fault (bounded work, milliseconds) holds
    # its arena until it ends; the segment goes with it, not before.
    for t in threading.enumerate():
        if t.name == "fastmq-arena-prefault":
            t.join(10)
    gc.collect()
    held = held_segments() - held_before
    left = _fastmq_files() - before
    for path in left:  # clean up first, so one failure does not cascade
        try:
            os.unlink(path)
        except OSError:
            pass
    # A failed test's traceback keeps its queues alive: we removed their
    # files above; only a passing test must have released them itself.
    if not getattr(request.node, "fastmq_call_failed", False):
        assert not left, f"test left files: {sorted(left)}"
        assert not held, f"test left this process holding segments: {sorted(held)}"


class Procs:
    """Start spawn children; ``join_all`` waits with a timeout and checks
    exit codes; teardown kills whatever is still running."""

    def __init__(self):
        self.procs: list = []

    def start(self, target, *args, **kwargs):
        p = SPAWN.Process(target=target, args=args, kwargs=kwargs, daemon=True)
        p.start()
        OUR_PIDS.add(p.pid)
        self.procs.append(p)
        return p

    def join_all(self, timeout: float = 60.0, expect_ok: bool = True):
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                raise AssertionError(f"child {p.pid} did not finish within {timeout}s")
            if expect_ok:
                assert p.exitcode == 0, f"child {p.pid} exited with {p.exitcode}"

    def kill_all(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.fixture
def procs():
    ps = Procs()
    try:
        yield ps
    finally:
        ps.kill_all()


@pytest.fixture
def spawn_ctx():
    return SPAWN


@pytest.fixture
def parts_as_if_waiting(monkeypatch):
    """The writer sends parts as if every reader were waiting for the
    message (it does only then: tests/test_run_ahead.py), so that a test of
    the parts themselves can read after enqueue() returns; its messages
    must fit the ring's free chunks, or the writer waits for the reader."""
    from fastmq import _parts
    monkeypatch.setattr(_parts, "readers_take_parts", lambda ring, total, until: True)
