"""vLLM 0.33.0's real ``MultiprocExecutor`` on fastmq, and on vLLM's own
queue for comparison.

Each run is one engine process (``python -c``, see ``_executor_worker``)
that builds a ``VllmConfig`` from a 2-layer Llama config (no weights) with
``tensor_parallel_size=2``, ``distributed_executor_backend="mp"`` and the
CPU platform: vLLM spawns two real ``WorkerProc`` workers running
``_executor_worker.TestWorker``, with vLLM's scheduler broadcast queue and
per-worker response queues.  Nothing of vLLM is replaced but the queue
classes (by fastmq's import hook, as in a deployment), and the engine
process and its workers get a private ``TMPDIR``.

The engine runs take minutes on a busy 2-core machine (vLLM is imported
in three processes per executor); each is run once per module and the
tests below check its parts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import types

import pytest

import fastmq.vllm as fv
from _held import holders_of, segments_made_by
from fastmq.vllm import _arena_default, plugin

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
MiB = 1 << 20
BIG = 64 * MiB
ACTIVE_LINE = "fastmq is active in vLLM"
# Sizing the engine asks for; workers must take it from the handle.
ARENA_ENV = {"FASTMQ_ARENA_SLOTS": "3", "FASTMQ_ARENA_SLOT_MB": "72"}
UNSET = ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB",
         "FASTMQ_MAX_CHUNKS", "VLLM_MQ_MAX_CHUNK_BYTES_MB", "FASTMQ_ARENA_SLOTS",
         "FASTMQ_ARENA_SLOT_MB", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX",
         "VLLM_LOGGING_STREAM")


def engine(tmp_path, phases, timeout=900, **env) -> tuple[dict, str]:
    """Run ``_executor_worker.main(*phases)`` in a fresh engine process;
    returns (its RESULT, its output and its workers')."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    e = {k: v for k, v in os.environ.items() if k not in UNSET}
    e.update(PYTHONPATH=os.pathsep.join([TESTS, ROOT, e.get("PYTHONPATH", "")]),
             TMPDIR=str(tmp), FASTMQ_TEST_MODEL_DIR=str(model),
             VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
    e.update(env)
    code = f"import _executor_worker as w; w.main(*{list(phases)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=e,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    result = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert result, out[-6000:]
    return json.loads(result[-1].removeprefix("RESULT ")), out


@pytest.fixture(scope="module")
def fastmq_run(tmp_path_factory):
    return engine(tmp_path_factory.mktemp("fastmq"),
                  ["arena_default", "round_trips", "kill_worker"], FASTMQ_VLLM="1", **ARENA_ENV)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return engine(tmp_path_factory.mktemp("vllm"), ["arena_default", "round_trips"],
                  FASTMQ_VLLM="0", **ARENA_ENV)


def active_lines(output: str) -> dict[int, str]:
    """pid -> fastmq's activation line, from the engine's and its workers' logs."""
    out = {}
    for line in output.splitlines():
        if ACTIVE_LINE in line:
            m = re.search(r"process \S+, pid (\d+);", line)
            assert m, line
            out.setdefault(int(m[1]), line)
    return out


# -- fastmq in the executor ------------------------------------------------------------
def test_round_trips_with_small_and_64_mib_arguments(fastmq_run):
    r = fastmq_run[0]["round_trips"]
    # 300 x (both workers + rank 0 only) echoes, 50 small tensors, 3 x 64 MiB,
    # each result checked in the engine.
    assert r["round_trips"] == 653
    assert [w["rank"] for w in r["workers"]] == [0, 1]


def test_fastmq_is_active_in_the_engine_and_both_workers(fastmq_run):
    result, output = fastmq_run
    r = result["round_trips"]
    assert r["queue"] == "fastmq.queue"
    assert r["response_queues"] == ["fastmq.queue", "fastmq.queue"]
    for w in r["workers"]:
        assert w["fastmq_active"] is True
        assert w["shm_classes"] == ["fastmq.queue", "fastmq.handle"]
        assert w["queues"] == ["fastmq.queue", "fastmq.queue"]
    lines = active_lines(output)
    pids = {r["engine_pid"]} | {w["pid"] for w in r["workers"]}
    assert pids <= set(lines), (pids, lines)
    assert "process VllmWorker-1" in lines[r["workers"][1]["pid"]]
    assert "scheduler broadcast: on unless --no-enable-shm-tensor-arena" in lines[r["engine_pid"]]


def test_arena_is_the_default_for_the_scheduler_broadcast(fastmq_run):
    """Engine arguments default to the arena while fastmq is active; the
    explicit opt-out still works; the executor's queue then carries a
    64 MiB argument through the arena once for both workers, sized by
    FASTMQ_ARENA_SLOTS / FASTMQ_ARENA_SLOT_MB, and the workers map the
    writer's geometry."""
    result = fastmq_run[0]
    a = result["arena_default"]
    assert a["status"] == {"active": True, "arena_default": True}
    assert a["engine_args"] is True and a["async_engine_args"] is True
    assert a["cli_default"] is True and a["cli_on"] is True
    assert a["explicit_off"] is False and a["cli_off"] is False

    r = result["round_trips"]
    assert r["arena_flag"] is True
    for sent in r["big_sends"]:
        assert sent["arena_hits"] == 1 and sent["arena_bytes"] == BIG, sent
        assert sent["overflow_messages"] == 0 and sent["ring_messages"] == 1, sent
    assert r["writer_stats"]["arena_slots"] == 3
    assert r["writer_stats"]["arena_slot_bytes"] == 72 * MiB
    for before, after in zip(r["workers"], r["workers_after"]):
        assert before["arena"]["n_slots"] == 3 and before["arena"]["slot_bytes"] == 72 * MiB
        assert after["arena"]["arena_views"] - before["arena"]["arena_views"] == 3


def test_shutdown_leaves_no_process_and_no_file(fastmq_run):
    r = fastmq_run[0]["round_trips"]
    assert r["alive_after_shutdown"] == [], r["alive_detail"]
    assert all("resource_tracker" in c for c in r["children_after_shutdown"]), r
    assert r["segments"] and r["segments_after_shutdown"] == []
    assert r["files_after_shutdown"] == []
    # The engine has exited: no process holds any of the queues' segments.
    assert holders_of(f[len("memfd:"):] for f in r["segments"]) == {}
    assert r["tmpdir_after_shutdown"] == []


def test_a_killed_worker_is_named_and_its_files_removed(fastmq_run):
    """SIGKILL worker 1 mid-run: the engine's collective_rpc raises fastmq's
    error naming that worker's pid (vLLM's executor reacts by shutting the
    surviving worker down, whose response queue is the one the engine may be
    reading); once the engine has shut down, no worker runs and the killed
    worker's ring and arena are held by no process (fastmq makes no files)."""
    k = fastmq_run[0]["kill_worker"]
    print(f"engine raised {k['raised_after_s']} s after the SIGKILL: {k['error']}")
    assert k["calls_before"] > 0
    assert not k["hung"], k
    assert k["raised_after_s"] is not None, k
    assert k["error"].startswith("RuntimeError: fastmq: "), k["error"]
    assert f"pid {k['victim']}" in k["error"], k["error"]
    before = k["victim_files_before"]
    assert any("_ring_" in f for f in before) and any("_arena_" in f for f in before), k
    assert k["alive_after_shutdown"] == [], k["alive_detail"]
    assert k["victim_files_after"] == []
    assert k["files_after_shutdown"] == []
    assert segments_made_by([k["engine_pid"], *k["pids"]]) == {}
    assert k["tmpdir_after_shutdown"] == []


# -- vLLM's own queue in the same executor ----------------------------------------------
def test_vllms_own_queue_with_fastmq_vllm_0(vllm_run):
    result, output = vllm_run
    r = result["round_trips"]
    shm = "vllm.distributed.device_communicators.shm_broadcast"
    assert r["queue"] == shm and r["response_queues"] == [shm, shm]
    for w in r["workers"]:
        assert w["fastmq_active"] is False
        assert w["shm_classes"] == [shm, shm] and w["queues"] == [shm, shm]
    assert not active_lines(output)
    assert r["round_trips"] == 653
    # vLLM's defaults, untouched.
    a = result["arena_default"]
    assert a["engine_args"] is False and a["cli_default"] is False and a["cli_on"] is True
    assert r["arena_flag"] is False
    assert r["alive_after_shutdown"] == [], r["alive_detail"]
    # vLLM's own segments: unlinked by its workers, or by the engine's
    # resource tracker once the engine process has exited (which the run
    # has by now; the tracker may take a moment more).
    assert r["segments"]
    print(f"vLLM's queue segments left right after shutdown(): {r['segments_after_shutdown']}")
    settle = time.monotonic() + 30
    while any(os.path.exists(p) for p in r["segments"]) and time.monotonic() < settle:
        time.sleep(0.1)
    assert [p for p in r["segments"] if os.path.exists(p)] == []
    # vLLM's own queue leaves its ipc socket files (ipc://$TMPDIR/<uuid4>)
    # behind after shutdown; said here so that a change shows.
    uuid = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$")
    print(f"vLLM's queue left in $TMPDIR: {r['tmpdir_after_shutdown']}")
    assert all(uuid.match(n) for n in r["tmpdir_after_shutdown"]), r["tmpdir_after_shutdown"]


# -- the arena default against a vLLM whose symbols moved ---------------------------------
def _fake_arg_utils(drop_field: bool = False, cli_static: bool = True) -> types.ModuleType:
    """A stand-in for vllm.engine.arg_utils with the names the patch uses."""
    mod = types.ModuleType(_arena_default.ARG_UTILS)

    @dataclasses.dataclass
    class ParallelConfig:
        enable_shm_tensor_arena: bool = False

    fields = [("model", str, dataclasses.field(default="m"))]
    if not drop_field:
        fields.append(("enable_shm_tensor_arena", bool, dataclasses.field(default=False)))

    def add_cli_args(parser):
        parser.add_argument("--enable-shm-tensor-arena", action="store_true")
        return parser

    ns = {"add_cli_args": staticmethod(add_cli_args) if cli_static else add_cli_args}
    mod.EngineArgs = dataclasses.make_dataclass("EngineArgs", fields, namespace=ns)
    mod.ParallelConfig = ParallelConfig
    return mod


@pytest.mark.parametrize("case", ["field removed", "add_cli_args changed"])
def test_moved_vllm_symbols_raise_naming_them_and_change_nothing(case, monkeypatch):
    import vllm  # noqa: F401  (the executor source is found through it)

    fake = _fake_arg_utils(drop_field=case == "field removed",
                           cli_static=case != "add_cli_args changed")
    before = dict(vars(fake.EngineArgs))
    expected = ("has no field enable_shm_tensor_arena" if case == "field removed"
                else "EngineArgs.add_cli_args is not a staticmethod")
    with pytest.raises(fv.ArenaDefaultError, match=expected):
        _arena_default.apply(fake)
    assert dict(vars(fake.EngineArgs)) == before
    assert not _arena_default.is_applied()
    # The plugin, which vLLM calls in every process, raises it too.
    monkeypatch.delenv("FASTMQ_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setitem(sys.modules, _arena_default.ARG_UTILS, fake)
    try:
        with pytest.raises(RuntimeError, match=expected):
            plugin.register()
    finally:
        monkeypatch.undo()
    assert dict(vars(fake.EngineArgs)) == before


def test_the_patch_applies_to_a_matching_module_and_undoes():
    import vllm  # noqa: F401
    from argparse import ArgumentParser

    fake = _fake_arg_utils()
    real = _arena_default._module       # vLLM's own, if patched in this process
    try:
        assert _arena_default.apply(fake) is True
        assert _arena_default.apply(fake) is False         # idempotent
        assert fake.EngineArgs().enable_shm_tensor_arena is True
        assert fake.EngineArgs(enable_shm_tensor_arena=False).enable_shm_tensor_arena is False
        assert fake.EngineArgs.add_cli_args(ArgumentParser()).parse_args(
            []).enable_shm_tensor_arena is True
    finally:
        _arena_default.undo()
        if real is not None:
            _arena_default.apply(real)
    assert fake.EngineArgs().enable_shm_tensor_arena is False
    assert fake.EngineArgs.add_cli_args(ArgumentParser()).parse_args(
        []).enable_shm_tensor_arena is False
