"""vLLM 0.33.0's ``MultiprocExecutor`` across two nodes, for
tests/test_vllm_multinode.py.

``tensor_parallel_size=2`` over ``nnodes=2``: one worker per node.  Node 0
runs the engine (``engine(*phases)``: the executor, which starts worker 0
there); node 1 runs what ``vllm serve --nnodes 2 --node-rank 1 --headless``
runs (``headless()``: ``MultiprocExecutor(config, monitor_workers=False)``,
which starts worker 1, then its worker monitor, inline).  vLLM wires the
queues itself: the engine's scheduler broadcast has worker 0 as a local
reader and worker 1 as a remote one, worker 0 reads its response queue
locally, and the engine reads worker 1's response queue as a remote reader
(``create_from_handle(handle, -1)``).

The worker is ``_executor_worker.TestWorker`` (no device, no model) plus
what a multi-node worker needs before vLLM builds its queues: vLLM's
distributed environment (gloo over 127.0.0.1, master_addr/master_port).

Each node prints ``RESULT <json>`` as its last line.  Module level imports
nothing of vLLM or torch.
"""
from __future__ import annotations

import gc
import glob
import json
import os
import signal
import sys
import tempfile
import time

import _executor_worker as ew

MiB = 1 << 20
BIG = 32 * MiB
# A remote reader that cannot tell its writer died would wait forever: the
# engine gives up (and says it hung) after this long.
KILL_WAIT_S = 30


# -- the worker ---------------------------------------------------------------------
def _worker_class():
    class MultiNodeWorker(ew.TestWorker):
        def init_device(self) -> None:
            # What vLLM's CPU worker does first: join the world group (the
            # executor builds its multi-node queues over it).
            from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

            init_worker_distributed_environment(self.vllm_config, self.rank,
                                                self.distributed_init_method,
                                                self.local_rank, "gloo")

    return MultiNodeWorker


def __getattr__(name):
    if name == "MultiNodeWorker":
        cls = _worker_class()
        cls.__module__, cls.__qualname__ = __name__, "MultiNodeWorker"
        globals()["MultiNodeWorker"] = cls
        return cls
    raise AttributeError(name)


# -- both nodes -----------------------------------------------------------------------
def _config(node_rank: int):
    # The node's environment has _vllm_models.ENGINE_ENV (vLLM's
    # CPU platform), set before anything imported vLLM.
    from _vllm_models import tiny_model
    from vllm.engine.arg_utils import EngineArgs

    model = tiny_model(os.environ["FASTMQ_TEST_MODEL_DIR"])
    args = EngineArgs(model=model, skip_tokenizer_init=True, tensor_parallel_size=2,
                      distributed_executor_backend="mp",
                      worker_cls="_multinode_worker.MultiNodeWorker", enforce_eager=True,
                      max_model_len=256, nnodes=2, node_rank=node_rank,
                      master_addr="127.0.0.1",
                      master_port=int(os.environ["FASTMQ_TEST_MASTER_PORT"]))
    return args.create_engine_config(headless=node_rank > 0)


def _fastmq_active() -> bool:
    try:
        import fastmq.vllm as fv
    except ImportError:
        return False
    return fv.is_active()


def _leftovers(pids) -> dict:
    """fastmq's files on this node: in /dev/shm and in TMPDIR, those of
    ``pids`` and, on a node of its own, all of them."""
    tmp = tempfile.gettempdir()
    return {"shm": sorted(glob.glob("/dev/shm/fastmq_*")),
            "tmpdir": sorted(glob.glob(os.path.join(tmp, "fastmq_*"))),
            "of_pids": ew._files_of(pids)}


# -- node 0: the engine --------------------------------------------------------------
def round_trips(executor) -> dict:
    """collective_rpc round trips, every answer checked: both workers, only
    the remote one, only the local one; small tensors; 32 MiB tensors
    (larger than a ring chunk)."""
    import torch

    n = 0
    for i in range(150):
        msg = {"step": i, "ids": list(range(i % 17)), "blob": b"x" * (i * 37 % 5000)}
        assert executor.collective_rpc("echo", args=(msg,)) == [msg, msg], i
        assert executor.collective_rpc("echo", args=(i,), unique_reply_rank=1) == i
        assert executor.collective_rpc("echo", args=(-i,), unique_reply_rank=0) == -i
        n += 3
    small = torch.arange(10_000, dtype=torch.int64)
    for i in range(20):
        got = executor.collective_rpc("tensor_sum", args=(small + i,))
        want = int((small + i).sum())
        assert [(g["rank"], g["sum"]) for g in got] == [(0, want), (1, want)], got
        n += 1
    for i in range(2):
        t = torch.full((BIG // 4,), i + 1, dtype=torch.int32)
        got = executor.collective_rpc("tensor_sum", args=(t,))
        assert [g["sum"] for g in got] == [(i + 1) * (BIG // 4)] * 2, got
        assert all(g["numel"] == BIG // 4 and g["dtype"] == "torch.int32" for g in got)
        n += 1
    return {"round_trips": n}


def kill_remote_worker(executor, workers) -> dict:
    """SIGKILL worker 1 (node 1) while the engine runs round trips: what the
    engine raises and how soon, or that it hung."""
    return ew.kill_during_calls(executor, workers[1]["pid"], KILL_WAIT_S)


def engine(*phases: str) -> None:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    config = _config(0)
    executor = MultiprocExecutor(config)
    out = {"engine_pid": os.getpid(), "engine_fastmq_active": _fastmq_active(),
           "queue": type(executor.rpc_broadcast_mq).__module__,
           "response_queues": [type(m).__module__ for m in executor.response_mqs],
           "remote_response": [bool(getattr(m, "_is_remote_reader", False))
                               for m in executor.response_mqs]}
    workers = executor.collective_rpc("queues")
    out["workers"] = workers
    pids = [w["pid"] for w in workers]
    try:
        if "round_trips" in phases:
            out["round_trips"] = round_trips(executor)
        if "kill_remote_worker" in phases:
            out["kill_remote_worker"] = kill_remote_worker(executor, workers)
    finally:
        executor.shutdown()
    del executor
    gc.collect()
    # Worker 1 is node 1's: its node reports on it.
    out["alive_after_shutdown"], out["alive_detail"] = ew.still_alive(pids[:1])
    out["leftovers"] = _leftovers([os.getpid(), *pids])
    print("RESULT " + json.dumps(out), flush=True)


# -- node 1: headless ----------------------------------------------------------------
def serve_headless(make_executor) -> None:
    """As ``vllm serve --nnodes N --node-rank K --headless`` runs a node:
    ``make_executor()`` (vLLM's ``MultiprocExecutor`` with this node's
    workers), then its worker monitor, inline, until a worker dies or this
    node is stopped (SIGTERM); then ``RESULT``: how it ended and what is
    left on this node."""
    def stop(signum, frame):
        raise SystemExit

    signal.signal(signal.SIGTERM, stop)
    executor = make_executor()
    pids = [w.proc.pid for w in executor.workers]
    out = {"node_pid": os.getpid(), "node_fastmq_active": _fastmq_active(),
           "worker_pids": pids, "stopped": False}
    print("NODE1 " + json.dumps(out), flush=True)
    try:
        executor.start_worker_monitor(inline=True)
    except SystemExit:
        out["stopped"] = True
        out["stopped_at"] = time.time()
    finally:
        executor.shutdown()
    del executor
    gc.collect()
    out["alive_after_shutdown"], out["alive_detail"] = ew.still_alive(pids)
    out["leftovers"] = _leftovers([os.getpid(), *pids])
    print("RESULT " + json.dumps(out), flush=True)
    sys.exit(0)


def headless() -> None:
    """Node 1 of the executor tests (``serve_headless``)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    serve_headless(lambda: MultiprocExecutor(_config(1), monitor_workers=False))
