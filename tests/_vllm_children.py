"""Child processes for tests/test_vllm_integration.py.

Nothing here imports vLLM, torch or fastmq at module level: a child must
start exactly as a vLLM worker does, with only the .pth import hook in
place, and import vLLM itself.

vLLM's executor modules are imported for real, except
``ray_executor_v2`` where ray is not installed (ray is not among vLLM's
requirements, and without it that module fails at import: it names ray's
``ObjectRef`` in a class body).  For it, ``import_executor`` runs, in a
module of its own, exactly the statements with which the installed file
binds shm_broadcast's names, read from that file.  vLLM's executor itself
runs for real in tests/test_vllm_executor.py.
"""
from __future__ import annotations

import ast
import gc
import importlib
import importlib.util
import itertools
import json
import os
import sys
import types

SHM = "vllm.distributed.device_communicators.shm_broadcast"
EXECUTORS = ("vllm.v1.executor.multiproc_executor", "vllm.v1.executor.ray_executor_v2")
STAND_IN_PREFIX = "_fastmq_test_stand_in"
_stand_in_ids = itertools.count()


# Executor modules that need a package vLLM does not require.
NEEDS = {"vllm.v1.executor.ray_executor_v2": "ray"}


def import_executor(name: str) -> tuple[types.ModuleType, str]:
    """``(module, how)``: vLLM's executor module itself, or, for a module
    whose extra package is not installed, the stand-in described in the
    module docstring (any other import error is raised)."""
    extra = NEEDS.get(name)
    if extra is None or importlib.util.find_spec(extra) is not None:
        return importlib.import_module(name), "imported"
    why = f"{name} needs {extra!r}, not installed"
    root = list(importlib.util.find_spec("vllm").submodule_search_locations)[0]
    path = os.path.join(root, *name.split(".")[1:]) + ".py"
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    binds = [node for node in tree.body
             if isinstance(node, ast.ImportFrom) and node.module == SHM and node.level == 0]
    names = {a.asname or a.name for node in binds for a in node.names}
    if "MessageQueue" not in names:
        raise AssertionError(f"{path} no longer binds MessageQueue from {SHM}: {names}")
    mod = types.ModuleType(f"{STAND_IN_PREFIX}{next(_stand_in_ids)}.{name}")
    mod.__file__ = path
    sys.modules[mod.__name__] = mod
    exec(compile(ast.Module(body=binds, type_ignores=[]), path, "exec"), vars(mod))
    return mod, f"stand-in ({why})"


def hook_state() -> dict:
    hook = sys.modules.get("fastmq.vllm._hook")
    return {"hook_installed": bool(hook is not None and hook.is_installed()),
            "imported": sorted(m for m in ("vllm", "torch", "fastmq", "fastmq.vllm", SHM)
                               if m in sys.modules)}


def classes_of(mod) -> dict:
    """Where ``mod``'s ``MessageQueue`` and ``Handle`` come from."""
    return {n: getattr(vars(mod).get(n), "__module__", None) for n in ("MessageQueue", "Handle")}


# -- the import hook, before vLLM is imported (run with python -c) --------------------
def hook_first() -> None:
    """Prints ``RESULT <json>`` last.  Imports vLLM after the .pth hook,
    configures vLLM's logging as vLLM does, checks the classes, then makes
    queues: the activation line and vLLM's long-wait message must appear
    in vLLM's log stream."""
    out = {"at_start": hook_state(), "pid": os.getpid()}
    import vllm.logger

    vllm.logger._configure_vllm_root_logger()   # what vLLM's entry points do (stdout)
    shm = importlib.import_module(SHM)
    import fastmq
    import fastmq.vllm as fv

    out["shm"] = classes_of(shm)
    out["executors"] = {}
    for name in EXECUTORS:
        mod, how = import_executor(name)
        out["executors"][name] = {"how": how, **classes_of(mod)}
    first = fv.patch()
    out["patch_idempotent"] = fv.patch() == first == fv.patched()
    out["report"] = first
    os.environ["VLLM_PLUGINS"] = "fastmq"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out["after_plugin_unchanged"] = fv.patched() == first
    out["status"] = fv.status()

    # vLLM's knob for the long-wait message, read when a queue is made.
    os.environ["VLLM_RINGBUFFER_WARNING_INTERVAL"] = "1"
    writer = shm.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2,
                              enable_shm_tensor_arena=False)
    reader = shm.MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready()
    reader.wait_until_ready()
    writer.enqueue(1)
    writer.enqueue(2)
    try:
        writer.enqueue(3, timeout=2.5)      # the reader reads nothing: ring full
        out["full_ring_timed_out"] = False
    except TimeoutError:
        out["full_ring_timed_out"] = True
    out["read"] = [reader.dequeue(timeout=10), reader.dequeue(timeout=10)]
    out["queue_type"] = type(writer).__module__
    assert isinstance(writer, fastmq.MessageQueue)
    del writer, reader
    gc.collect()

    # vLLM's default start method for workers is fork: the child inherits
    # the swapped classes, runs no import hook and no plugin, and must log
    # its own line (at its first queue).
    import multiprocessing

    sys.stdout.flush()      # or the child flushes our buffered output again
    child = multiprocessing.get_context("fork").Process(target=_forked_worker,
                                                        name="VllmWorker-0")
    child.start()
    child.join(60)
    out["forked"] = {"pid": child.pid, "exitcode": child.exitcode}
    print("RESULT " + json.dumps(out), flush=True)


def _forked_worker() -> None:
    shm = sys.modules[SHM]
    queues = [shm.MessageQueue(1, 1, enable_shm_tensor_arena=False) for _ in range(2)]
    assert all(type(q).__module__ == "fastmq.queue" for q in queues)
    del queues
    gc.collect()


# -- opted out: vLLM untouched; then both cross-implementation directions ----------
def opted_out_peer(conn) -> None:
    out = {"at_start": hook_state(), "FASTMQ_VLLM": os.environ.get("FASTMQ_VLLM")}
    shm = importlib.import_module(SHM)
    execs = {name: import_executor(name)[0] for name in EXECUTORS}
    import fastmq
    import fastmq.vllm as fv
    from vllm import plugins

    os.environ["VLLM_PLUGINS"] = "fastmq"
    plugins.load_general_plugins()          # vLLM's loader calls fastmq's register()
    out["patch"] = fv.patch()
    out["active"] = fv.is_active()
    out["shm"] = classes_of(shm)
    out["executors"] = {n: classes_of(m) for n, m in execs.items()}
    out["executors_hold_vllm_classes"] = all(m.MessageQueue is shm.MessageQueue
                                             and m.Handle is shm.Handle for m in execs.values())
    conn.send(out)

    # A fastmq writer's handle reaches vLLM's own MessageQueue: an ordinary
    # value, it attaches; the fastmq writer's handshake refuses it.
    handle = conn.recv()
    try:
        foreign = shm.MessageQueue.create_from_handle(handle, 0)
        conn.send(("attached", type(foreign.buffer).__module__))
    except Exception as e:
        conn.send((type(e).__name__, str(e)))
    conn.recv()        # the writer has refused it

    # vLLM's own writer; its handle goes to the fastmq process.
    writer = shm.MessageQueue(1, 1)
    conn.send(writer.export_handle())
    conn.recv()        # the other side is done with it
    del writer
    gc.collect()


# -- VLLM_PLUGINS filtering, then vLLM's plugin loader after vLLM's import ----------
def plugin_peer(conn) -> None:
    out = {"at_start": hook_state(), "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS")}
    shm = importlib.import_module(SHM)
    execs = {name: import_executor(name)[0] for name in EXECUTORS}
    import fastmq.vllm as fv
    from vllm import plugins

    out["after_import"] = classes_of(shm)
    plugins.load_general_plugins()          # VLLM_PLUGINS does not name fastmq
    out["after_filtered_load"] = classes_of(shm)
    # A process whose VLLM_PLUGINS names fastmq: vLLM's own selection, then
    # the call load_general_plugins() makes for each selected plugin.
    os.environ["VLLM_PLUGINS"] = "fastmq"
    selected = plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)
    out["selected"] = sorted(selected)
    for func in selected.values():
        func()
    out["after_plugin"] = classes_of(shm)
    out["executors"] = {n: classes_of(m) for n, m in execs.items()}
    out["stand_ins_rebound"] = {m.__name__: fv.patched().get(m.__name__)
                                for m in execs.values()}
    conn.send(out)


# -- create_from_process_group with vLLM's StatelessProcessGroup ---------------------
def group_rank(rank: int, world_size: int, port: int, conn) -> None:
    """Rank ``rank`` (not 0) of a StatelessProcessGroup whose rank 0 is the
    test process; queues are built by vLLM's own GroupCoordinator code."""
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.distributed.utils import StatelessProcessGroup

    import fastmq

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=60)
    coordinator = types.SimpleNamespace(cpu_group=pg, ranks=list(range(world_size)))
    out = group_steps(coordinator, rank)
    queues = out.pop("queues")
    out["fastmq"] = [isinstance(q, fastmq.MessageQueue) for q in queues]
    conn.send(out)
    conn.recv()     # rank 0 has read our queue: it may go now


def group_steps(coordinator, rank: int) -> dict:
    """What a rank of a vLLM GroupCoordinator does with its queues:
    ``create_mq_broadcaster`` + ``broadcast_object``, then
    ``create_single_reader_mq_broadcasters`` (rank 0 reads every other
    rank's queue).  Runs vLLM's methods on a stand-in ``self`` that holds
    only what they read (``cpu_group``, ``ranks``)."""
    from vllm.distributed.parallel_state import GroupCoordinator

    mq = GroupCoordinator.create_mq_broadcaster(coordinator, writer_rank=0)
    got = [mq.broadcast_object({"step": i, "from": 0} if rank == 0 else None)
           for i in range(3)]
    own, handles = GroupCoordinator.create_single_reader_mq_broadcasters(
        coordinator, reader_rank_in_group=0)
    heard = []
    if rank == 0:
        for other, handle in enumerate(handles):
            if other == 0:
                continue
            reader = type(own).create_from_handle(handle, 0)
            reader.wait_until_ready()
            heard.append(reader.dequeue(timeout=60))
    else:
        own.wait_until_ready()
        own.enqueue(("from", rank))
    return {"rank": rank, "broadcast": got, "heard": heard, "n_handles": len(handles),
            "queues": [mq, own]}
