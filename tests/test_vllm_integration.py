"""fastmq swapped into the real vLLM 0.33.0 (installed with ``--no-deps``):
the .pth import hook, vLLM's plugin loader, ``patch()``/``unpatch()``, the
version guard, vLLM's own usage patterns across spawn processes, vLLM's
``StatelessProcessGroup``, and handles crossing implementations.

The test process itself has the hook (fastmq is installed editable), so
vLLM's ``shm_broadcast`` is fastmq's here too; ``active`` makes sure of it.
Children run with the spawn start method, or as ``python -c`` where their
log output is checked; vLLM's executor modules are used through
``_vllm_children.import_executor`` (see its docstring).  vLLM's
``MultiprocExecutor`` itself, with real workers, is tested in
test_vllm_executor.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import multiprocessing as mp
import os
import re
import site
import socket
import subprocess
import sys
import types

import pytest

import _vllm_children as children
import fastmq
import fastmq.vllm as fv
from fastmq.vllm import _hook, plugin

SHM = children.SHM
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
PTH = os.path.join(ROOT, "fastmq", "vllm", "fastmq-vllm.pth")
FASTMQ = {"MessageQueue": "fastmq.queue", "Handle": "fastmq.handle"}
VLLM = {"MessageQueue": SHM, "Handle": SHM}
ACTIVE_LINE = "fastmq is active in vLLM"
SPAWN = mp.get_context("spawn")
# vLLM's log format: "(<process name> pid=<pid>) INFO <date> [<file>:<line>] <message>"
VLLM_INFO = re.compile(r"^\(.* pid=\d+\) INFO ")


# Settings that would change what these tests expect, should this process
# have them (spawn children copy the environment as it is during the test).
UNSET = ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB",
         "FASTMQ_MAX_CHUNKS", "VLLM_MQ_MAX_CHUNK_BYTES_MB", "VLLM_RINGBUFFER_WARNING_INTERVAL")


@pytest.fixture
def active(monkeypatch):
    """vLLM's shm_broadcast, with fastmq active in this process before and
    after the test (a test that unpatches cannot leave it so)."""
    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    fv.patch()
    assert fv.is_active()
    yield importlib.import_module(SHM)
    monkeypatch.delenv("FASTMQ_VLLM", raising=False)
    fv.patch()


@pytest.fixture
def fastmq_log():
    """Records of the ``fastmq`` logger, whatever vLLM did to logging."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("fastmq")
    handler, level = Keep(level=logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(level)


def child_env(**overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["PYTHONPATH"] = TESTS + os.pathsep + env.get("PYTHONPATH", "")
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_python(code: str, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def start_with_env(procs, monkeypatch, env: dict, target, *args):
    """Start a spawn child whose environment differs from ours only by
    ``env`` (a child copies the environment when it starts)."""
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        return procs.start(target, *args)


def recv(conn, timeout: float = 120):
    assert conn.poll(timeout), f"no answer from the child within {timeout}s"
    return conn.recv()


def assert_fastmq_executors(executors: dict) -> None:
    """Every vLLM executor module (or, for ray's, its stand-in) holds
    fastmq's classes; multiproc_executor is vLLM's real module."""
    assert set(executors) == set(children.EXECUTORS)
    for name, seen in executors.items():
        assert {k: seen[k] for k in FASTMQ} == FASTMQ, (name, seen)
        if "how" in seen and name not in children.NEEDS:
            assert seen["how"] == "imported", (name, seen)


# -- the .pth -------------------------------------------------------------------------
def test_pth_is_installed_and_cheap():
    """The .pth is in site-packages (identical to the source), installs the
    hook in a fresh interpreter without importing vLLM, torch or even
    fastmq, and does nothing under FASTMQ_VLLM=0."""
    installed = [os.path.join(d, "fastmq-vllm.pth") for d in site.getsitepackages()
                 if os.path.exists(os.path.join(d, "fastmq-vllm.pth"))]
    assert installed, f"fastmq-vllm.pth not in {site.getsitepackages()}: pip install -e ."
    with open(installed[0]) as a, open(PTH) as b:
        assert a.read() == b.read(), "the installed .pth is stale: pip install -e ."

    probe = ("import sys, json; h = sys.modules.get('fastmq.vllm._hook'); "
             "print(json.dumps([h is not None and h.is_installed(), h and h.__file__, "
             "[m for m in ('vllm', 'torch', 'fastmq', 'zmq') if m in sys.modules]]))")
    on = run_python(probe)
    assert on.returncode == 0 and on.stderr == "", on.stderr
    installed_hook, path, imported = json.loads(on.stdout)
    assert installed_hook and imported == []
    assert os.path.samefile(path, os.path.join(ROOT, "fastmq", "vllm", "_hook.py"))

    off = run_python(probe, FASTMQ_VLLM="0")
    assert off.returncode == 0 and off.stderr == "", off.stderr
    assert json.loads(off.stdout)[0] is False

    bad = run_python(probe, FASTMQ_VLLM="maybe")
    assert bad.returncode == 0 and json.loads(bad.stdout)[0] is False
    assert "FASTMQ_VLLM='maybe' is not a boolean" in bad.stderr


# -- import order ---------------------------------------------------------------------
def test_hook_before_vllm_import_swaps_everything_and_logs_once():
    """A fresh process with only the .pth hook: vLLM's shm_broadcast, its
    executor modules and plugin loading all give fastmq's classes; the
    activation line appears once per process (here and in a worker forked
    from here), in vLLM's log stream (vLLM's logging configured as vLLM
    configures it), and so does vLLM's long-wait message at the
    VLLM_RINGBUFFER_WARNING_INTERVAL the process set."""
    done = run_python("import _vllm_children as c; c.hook_first()", FASTMQ_WAIT="futex",
                      # vLLM's logging defaults, whatever this process inherited
                      VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO",
                      VLLM_LOGGING_CONFIG_PATH=None, VLLM_LOGGING_PREFIX=None,
                      VLLM_LOGGING_STREAM=None)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["at_start"] == {"hook_installed": True, "imported": []}
    assert result["shm"] == FASTMQ
    assert_fastmq_executors(result["executors"])
    assert result["patch_idempotent"] and result["after_plugin_unchanged"]
    assert result["report"][SHM] == ["Handle", "MessageQueue"]
    assert result["status"]["active"] and result["status"]["hook_installed"]
    assert result["status"]["vllm_version"] == "0.33.0"
    assert result["full_ring_timed_out"] and result["read"] == [1, 2]

    lines = done.stdout.splitlines()
    active = [ln for ln in lines if ACTIVE_LINE in ln]
    assert result["forked"]["exitcode"] == 0
    assert len(active) == 2, active     # this process, and its forked worker
    line, forked = active
    assert f"pid {result['forked']['pid']}" in forked and "process VllmWorker-0" in forked
    assert VLLM_INFO.match(line), line                # vLLM's handler and format
    assert "vLLM 0.33.0 (by the import hook)" in line
    assert f"pid {result['pid']}" in line and "process MainProcess" in line
    assert "wait mode futex" in line and "tensor arena" in line
    waits = [ln for ln in lines if "No available shared memory broadcast block found in 1 "
             "seconds" in ln]
    assert waits and all(VLLM_INFO.match(ln) for ln in waits), lines[-20:]


def test_patch_after_vllm_import_rebinds_and_unpatch_restores(active):
    """Modules that bound vLLM's classes before fastmq was active (as an
    executor module imported first does) are rebound by patch(); unpatch()
    puts vLLM's classes back everywhere, and vLLM's own queue works again."""
    shm = active
    restored = fv.unpatch()
    assert restored[SHM] == ("Handle", "MessageQueue")
    assert not fv.is_active() and not _hook.is_installed()
    vllm_classes = fv.originals()
    assert shm.MessageQueue is vllm_classes["MessageQueue"] and shm.MessageQueue.__module__ == SHM
    assert shm.Handle is vllm_classes["Handle"]

    # vLLM's own class is whole again (its methods look names up in shm_broadcast).
    own = shm.MessageQueue(1, 1)
    assert type(own.export_handle()) is vllm_classes["Handle"]
    del own

    execs = [children.import_executor(name)[0] for name in children.EXECUTORS]
    assert all(children.classes_of(m) == VLLM for m in execs)

    report = fv.patch()
    assert report[SHM] == ("Handle", "MessageQueue")
    for m in execs:
        assert report[m.__name__] == ("Handle", "MessageQueue")
        assert m.MessageQueue is fastmq.MessageQueue and m.Handle is fastmq.Handle
    assert shm.MessageQueue is fastmq.MessageQueue and _hook.is_installed()
    assert fv.patch() == report == fv.patched()        # idempotent
    assert fv.originals() == vllm_classes

    fv.unpatch()
    assert all(m.MessageQueue is vllm_classes["MessageQueue"] for m in execs)
    fv.patch()
    assert all(m.MessageQueue is fastmq.MessageQueue for m in execs)


def test_plugin_honours_vllm_plugins_and_rebinds_after_import(procs, monkeypatch, active):
    """VLLM_PLUGINS without ``fastmq``: the hook declines and vLLM's loader
    does not call the plugin.  A process whose VLLM_PLUGINS names it gets
    fastmq through vLLM's own plugin loading, after vLLM's modules (and
    the executor's names) were imported."""
    here, there = children_pipe()
    start_with_env(procs, monkeypatch, {"VLLM_PLUGINS": "someone_else"},
                   children.plugin_peer, there)
    out = recv(here)
    procs.join_all(timeout=60)
    assert out["at_start"]["hook_installed"]
    assert out["after_import"] == VLLM and out["after_filtered_load"] == VLLM
    assert "fastmq" in out["selected"]
    assert out["after_plugin"] == FASTMQ
    assert_fastmq_executors(out["executors"])
    assert all(v == ("Handle", "MessageQueue") for v in out["stand_ins_rebound"].values())


def children_pipe():
    return SPAWN.Pipe()


# -- opt-out and handles across implementations ---------------------------------------
def test_opt_out_leaves_vllm_untouched_and_mixed_handles_fail_at_attach(
        procs, monkeypatch, active):
    """A process with FASTMQ_VLLM=0 keeps vLLM's classes (hook, plugin and
    patch() all stand aside).  A fastmq handle given to its vLLM queue, and
    its vLLM handle given to fastmq, fail naming both sides: the fastmq
    handle is an ordinary value, so vLLM's queue attaches it, and the fastmq
    writer's handshake refuses a reader that claimed no reader slot."""
    here, there = children_pipe()
    start_with_env(procs, monkeypatch, {"FASTMQ_VLLM": "0"}, children.opted_out_peer, there)
    out = recv(here)
    assert out["at_start"] == {"hook_installed": False, "imported": []}
    assert out["patch"] == {} and out["active"] is False
    assert out["shm"] == VLLM and out["executors_hold_vllm_classes"]

    # ZMQ mode: vLLM's reader needs a notify address to attach at all.
    writer = fastmq.MessageQueue(1, 1, enable_shm_tensor_arena=False, wait_mode="zmq")
    here.send(writer.export_handle())
    assert recv(here) == ("attached", SHM)
    with pytest.raises(fastmq.HandleMismatchError) as refused:
        writer.wait_until_ready()
    message = str(refused.value)
    assert "created by fastmq" in message and "vLLM's own MessageQueue" in message
    assert writer.export_handle().buffer_handle[3] in message
    here.send("refused")

    vllm_handle = recv(here)
    with pytest.raises(fastmq.HandleMismatchError) as e:
        fastmq.MessageQueue.create_from_handle(vllm_handle, 0)
    text = str(e.value)
    assert "created by vLLM's own MessageQueue" in text and "attached by fastmq" in text
    here.send("done")
    procs.join_all(timeout=60)
    del writer


# -- vLLM's usage (its executor runs for real in test_vllm_executor.py) -------------
def test_vllm_constructor_arguments_keep_their_meaning(active, monkeypatch):
    """--enable-shm-tensor-arena / --no-enable-shm-tensor-arena arrive as
    ``enable_shm_tensor_arena=True/False``; VLLM_MQ_MAX_CHUNK_BYTES_MB as
    ``max_chunk_bytes``; VLLM_RINGBUFFER_WARNING_INTERVAL is read per queue."""
    import vllm.envs as envs

    shm = active
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "2")
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "7")
    size = envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 1024 * 1024
    off = shm.MessageQueue(2, 2, max_chunk_bytes=size, enable_shm_tensor_arena=False)
    on = shm.MessageQueue(2, 2, max_chunk_bytes=size, enable_shm_tensor_arena=True)
    assert off.tensor_arena is None and off.export_handle().tensor_arena_handle is None
    assert on.tensor_arena is not None and on.export_handle().tensor_arena_handle is not None
    assert off.export_handle().buffer_handle[1] == on.buffer.max_chunk_bytes == 2 << 20
    assert on._ring.warn_interval == 7
    # With remote readers vLLM passes the flag too; no arena can serve them.
    mixed = shm.MessageQueue(2, 1, max_chunk_bytes=size, connect_ip="127.0.0.1",
                             enable_shm_tensor_arena=True)
    assert mixed.tensor_arena is None
    del off, on, mixed


def test_process_group_queues_with_vllms_stateless_process_group(procs, active):
    """vLLM's GroupCoordinator.create_mq_broadcaster and
    create_single_reader_mq_broadcasters (their function-local import of
    MessageQueue) over vLLM's own StatelessProcessGroup on a 127.0.0.1
    TCPStore: this process is rank 0 (writer, then single reader), two
    spawn children are ranks 1 and 2."""
    from vllm.distributed.utils import StatelessProcessGroup

    world_size = 3
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("127.0.0.1", 0))          # a free port, held: no race with others
    listen.listen()
    port = listen.getsockname()[1]
    pipes = []
    for rank in range(1, world_size):
        here, there = children_pipe()
        procs.start(children.group_rank, rank, world_size, port, there)
        pipes.append(here)
    pg = StatelessProcessGroup.create("127.0.0.1", port, 0, world_size, store_timeout=60,
                                      listen_socket=listen)
    coordinator = types.SimpleNamespace(cpu_group=pg, ranks=list(range(world_size)))
    mine = children.group_steps(coordinator, 0)
    theirs = [recv(p) for p in pipes]
    for p in pipes:
        p.send("go")
    procs.join_all(timeout=60)

    expected = [{"step": i, "from": 0} for i in range(3)]
    assert mine["broadcast"] == expected
    assert all(isinstance(q, fastmq.MessageQueue) for q in mine["queues"])
    assert sorted(mine["heard"]) == [("from", 1), ("from", 2)]
    assert mine["n_handles"] == world_size
    for out in theirs:
        assert out["broadcast"] == expected
        assert out["fastmq"] == [True, True]
        assert out["n_handles"] == 0 and out["heard"] == []
    del mine


# -- the version guard ---------------------------------------------------------------------
def _namespace_copy(**replace) -> types.ModuleType:
    """A stand-in for vLLM's shm_broadcast: a new module object holding the
    real module's names and vLLM's own classes, with ``replace`` applied
    (``None`` deletes).  The installed files are not touched."""
    real = importlib.import_module(SHM)
    copy = types.ModuleType(SHM)
    vars(copy).update(vars(real))
    vars(copy).update(fv.originals())
    for k, v in replace.items():
        if v is None:
            delattr(copy, k)
        else:
            setattr(copy, k, v)
    return copy


def _class_copy(cls: type, rename: dict | None = None, add: dict | None = None) -> type:
    ns = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    for old, new in (rename or {}).items():
        ns[new] = ns.pop(old)
    ns.update(add or {})
    return type(cls.__name__, cls.__bases__, ns)


def _vllm_init_with_new_argument(self, n_reader, n_local_reader, local_reader_ranks=None,
                                 max_chunk_bytes=1 << 24, max_chunks=10, connect_ip=None,
                                 enable_shm_tensor_arena=False, ring_name=None):
    raise AssertionError("never constructed")


def _renamed_handle_field():
    vh = fv.originals()["Handle"]
    fields = [("ring_handle" if f.name == "buffer_handle" else f.name, f.type,
               dataclasses.field(default=None) if f.name != "local_reader_ranks"
               else dataclasses.field(default_factory=list))
              for f in dataclasses.fields(vh)]
    return dataclasses.make_dataclass("Handle", fields)


GUARD_CASES = {
    "class renamed": (lambda mq: {"MessageQueue": None, "BroadcastQueue": mq},
                      [f"{SHM}.MessageQueue is missing"]),
    "method renamed": (lambda mq: {"MessageQueue": _class_copy(
        mq, rename={"create_from_handle": "attach"})},
        [f"{SHM}.MessageQueue has no create_from_handle",
         "has attach, which fastmq's MessageQueue does not implement"]),
    "new method": (lambda mq: {"MessageQueue": _class_copy(
        mq, add={"drain": lambda self: None})},
        ["has drain, which fastmq's MessageQueue does not implement"]),
    "new constructor argument": (lambda mq: {"MessageQueue": _class_copy(
        mq, add={"__init__": _vllm_init_with_new_argument})},
        [f"{SHM}.MessageQueue.__init__ takes (self, n_reader", "ring_name) in vLLM"]),
    "Handle field renamed": (lambda mq: {"Handle": _renamed_handle_field()},
                             [f"{SHM}.Handle has field(s) ring_handle, which fastmq's "
                              "Handle lacks"]),
}


@pytest.mark.parametrize("case", sorted(GUARD_CASES))
def test_version_guard_refuses_a_changed_vllm_and_changes_nothing(
        case, active, monkeypatch, fastmq_log):
    """patch() raises RuntimeError naming what changed; the plugin and the
    import hook log it and leave vLLM as it is: no class of the changed
    module is replaced (not half patched), and the real module's state is
    unchanged."""
    make, expected = GUARD_CASES[case]
    copy = _namespace_copy(**make(fv.originals()["MessageQueue"]))
    before = dict(vars(copy))
    patched_before = fv.patched()
    monkeypatch.setitem(sys.modules, SHM, copy)

    with pytest.raises(RuntimeError) as e:
        fv.patch()
    for text in expected:
        assert text in str(e.value)
    assert "vLLM 0.33.0" in str(e.value) and "left in place" in str(e.value)
    assert vars(copy) == before

    plugin.register()                         # must not raise: vLLM would not start
    _hook._on_loaded(copy)                    # what the import hook's loader calls
    errors = [r.getMessage() for r in fastmq_log if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all(expected[0] in m for m in errors), errors
    assert vars(copy) == before

    monkeypatch.undo()
    assert fv.patched() == patched_before and fv.is_active()


def test_guard_accepts_the_installed_vllm(active):
    from fastmq.vllm import _guard

    theirs = fv.originals()
    ours = {"MessageQueue": fastmq.MessageQueue, "Handle": fastmq.Handle}
    assert _guard.problems(SHM, theirs, ours) == []
    assert fv.status()["vllm_version"] in _guard.TESTED_VERSIONS


def test_opt_out_variable_is_validated(monkeypatch, active):
    monkeypatch.setenv("FASTMQ_VLLM", "sometimes")
    with pytest.raises(ValueError, match="FASTMQ_VLLM='sometimes' is not a boolean"):
        fv.patch()
    monkeypatch.setenv("FASTMQ_VLLM", "off")
    assert fv.patch() == {}
    assert fv.is_active()          # an opted-out patch() call changes nothing either way
    assert fv.status()["opted_out"] == "FASTMQ_VLLM=off"
