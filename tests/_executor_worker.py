"""vLLM's real ``MultiprocExecutor`` for tests/test_vllm_executor.py.

Two parts:

* ``TestWorker``: the worker class vLLM's spawned ``WorkerProc`` builds
  (``ParallelConfig.worker_cls = "_executor_worker.TestWorker"``): no
  device, no model, ``echo`` / ``tensor_sum``
  and ``queues()``, which reports the queues vLLM's worker process holds;
* ``main(phase)``: the engine process, started by the test as ``python -c``
  (``FASTMQ_VLLM`` decides whose queue vLLM uses there and in the
  workers).  It builds the executor from a 2-layer Llama config, runs the
  phase and prints ``RESULT <json>`` as its last line.

Module level imports nothing of vLLM or torch: the engine must set
``ENGINE_ENV`` before vLLM is imported.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import sys
import tempfile
import threading
import time

SHM = "vllm.distributed.device_communicators.shm_broadcast"
MiB = 1 << 20
BIG = 64 * MiB


# -- the worker ---------------------------------------------------------------------
def _worker_class():
    from vllm.v1.worker.worker_base import WorkerBase

    class TestWorker(WorkerBase):
        def init_device(self) -> None:
            pass

        def load_model(self, *, load_dummy_weights: bool = False) -> None:
            pass

        def echo(self, x):
            return x

        def tensor_sum(self, t):
            return {"rank": self.rank, "sum": int(t.sum()), "numel": t.numel(),
                    "dtype": str(t.dtype)}

        def queues(self) -> dict:
            """The queues of the vLLM ``WorkerProc`` running this call (found on
            the stack: vLLM keeps them there, not on the worker)."""
            proc = _worker_proc()
            shm = sys.modules[SHM]
            out = {"pid": os.getpid(), "rank": self.rank,
                   "shm_classes": [shm.MessageQueue.__module__, shm.Handle.__module__],
                   "queues": [type(proc.rpc_broadcast_mq).__module__,
                              type(proc.worker_response_mq).__module__]}
            arena = getattr(proc.rpc_broadcast_mq, "tensor_arena", None)
            if arena is not None:
                out["arena"] = {"n_slots": arena.n_slots, "slot_bytes": arena.slot_bytes,
                                "name": arena.name, **proc.rpc_broadcast_mq.stats()}
            try:
                import fastmq.vllm as fv

                out["fastmq_active"] = fv.is_active()
            except ImportError:
                out["fastmq_active"] = False
            return out

    return TestWorker


def _worker_proc():
    from vllm.v1.executor.multiproc_executor import WorkerProc

    frame = sys._getframe(1)
    while frame is not None:
        me = frame.f_locals.get("self")
        if isinstance(me, WorkerProc):
            return me
        frame = frame.f_back
    raise RuntimeError("not called from vLLM's WorkerProc")


def __getattr__(name):
    # Resolved lazily: vLLM imports this module by name in each worker
    # (resolve_obj_by_qualname), after its own imports.
    if name == "TestWorker":
        cls = _worker_class()
        cls.__module__, cls.__qualname__ = __name__, "TestWorker"
        globals()["TestWorker"] = cls
        return cls
    raise AttributeError(name)


# -- the engine process ----------------------------------------------------------------
def _files_of(pids) -> list[str]:
    """What ``pids`` made and is still there: files named after them
    (fastmq makes none) and, as ``memfd:<name>``, their segments that any
    process of the host still holds or maps."""
    from _held import segments_made_by

    tmp = tempfile.gettempdir()
    out = []
    for pid in pids:
        out += glob.glob(f"/dev/shm/fastmq_{pid}_*")
        out += glob.glob(os.path.join(tmp, f"fastmq_{pid}_*"))
    for names in segments_made_by(pids).values():
        out += [f"memfd:{n}" for n in names]
    return sorted(set(out))


def _segments_of(mq) -> list[str]:
    """The ring (and arena) behind a queue end: ``memfd:<name>`` for
    fastmq's, the /dev/shm path for vLLM's."""
    buf = mq.buffer
    shared = getattr(buf, "shared_memory", None)      # vLLM's ShmRingBuffer
    if shared is not None:
        names = [os.path.join("/dev/shm", shared.name.lstrip("/"))]
    else:
        names = [f"memfd:{buf.name.split(':')[0]}"]
    arena = getattr(mq, "tensor_arena", None)
    if arena is not None and getattr(arena, "name", None):
        names.append(f"memfd:{arena.name.split(':')[0]}" if shared is None else
                     os.path.join("/dev/shm", arena.name.lstrip("/")))
    return names


def _held_here() -> set[str]:
    from _held import held_segments

    return {f"memfd:{n}" for n in held_segments()}


def _still_there(segments) -> list[str]:
    """Those of ``segments`` still there: a file that exists, or a fastmq
    segment that a process other than this (the engine) holds or maps.
    (This process may still map a worker's answer ring until it collects
    its last reader end, as it does with vLLM's own queue; the test checks
    that nothing holds any once this process has exited.)"""
    from _held import holders_of

    held = set().union(*(v for pid, v in holders_of(
        s[len("memfd:"):] for s in segments if s.startswith("memfd:")).items()
        if pid != os.getpid()))
    return [s for s in segments
            if (s[len("memfd:"):] in held if s.startswith("memfd:") else os.path.exists(s))]


def _alive(pid: int) -> bool:
    """Whether ``pid`` has not finished exiting: a zombie whose threads have
    all exited is gone, one whose first thread exited while others still
    run (or are still tearing down after a SIGKILL, files open) is not."""
    from fastmq._proc import is_alive

    return is_alive(pid)


def _task_states(pid: int) -> dict:
    """Each thread of ``pid``: its state, name and kernel wait channel (for
    a failure's message)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError as e:
        return {"error": repr(e)}
    for tid in tids:
        info = []
        for name in ("stat", "wchan"):
            try:
                with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                    text = f.read()
            except OSError as e:
                text = repr(e)
            info.append(text.rsplit(")", 1)[-1].split()[0] if name == "stat" and ")" in text
                        else text.strip())
        out[tid] = info
    return out


def still_alive(pids, grace: float = 30.0) -> tuple[list, dict]:
    """The pids of ``pids`` that have not finished exiting ``grace`` seconds
    from now (a process ends a moment after vLLM's shutdown returns), and
    their threads' states."""
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if _alive(p)]
    return alive, {p: _task_states(p) for p in alive}


def _tmpdir() -> list[str]:
    """What is left in this process's TMPDIR, less torch's compile cache
    (``torchinductor_<user>``, made by vLLM's import, not by a queue)."""
    return sorted(n for n in os.listdir(tempfile.gettempdir())
                  if not n.startswith("torchinductor_"))


def _children() -> list[str]:
    import psutil

    return [" ".join(c.cmdline()[:4]) for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def _executor(model_dir: str):
    from _vllm_models import make_executor

    return make_executor(model_dir, 2, worker_cls="_executor_worker.TestWorker")


def round_trips(model_dir: str) -> dict:
    """Many collective_rpc round trips, small and 64 MiB tensor arguments,
    every result checked; then shutdown, and what it left."""
    import torch

    executor, config = _executor(model_dir)
    out = {"engine_pid": os.getpid(), "queue": type(executor.rpc_broadcast_mq).__module__,
           "response_queues": [type(m).__module__ for m in executor.response_mqs],
           "arena_flag": config.parallel_config.enable_shm_tensor_arena}
    segments = _segments_of(executor.rpc_broadcast_mq)
    for mq in executor.response_mqs:
        segments += _segments_of(mq)
    out["segments"] = sorted(set(segments))
    workers = executor.collective_rpc("queues")
    out["workers"] = workers
    pids = [w["pid"] for w in workers]
    stats = getattr(executor.rpc_broadcast_mq, "stats", None)
    try:
        n = 0
        for i in range(300):
            msg = {"step": i, "ids": list(range(i % 17)), "blob": b"x" * (i * 37 % 5000)}
            assert executor.collective_rpc("echo", args=(msg,)) == [msg, msg], i
            assert executor.collective_rpc("echo", args=(i,), unique_reply_rank=0) == i
            n += 2
        small = torch.arange(10_000, dtype=torch.int64)
        for i in range(50):
            got = executor.collective_rpc("tensor_sum", args=(small + i,))
            want = int((small + i).sum())
            assert [g["sum"] for g in got] == [want, want] and [g["rank"] for g in got] == [0, 1]
            n += 1
        big_before = stats() if stats else None
        big_sends = []
        for i in range(3):
            t = torch.full((BIG // 4,), i + 1, dtype=torch.int32)
            before = stats() if stats else None
            got = executor.collective_rpc("tensor_sum", args=(t,))
            after = stats() if stats else None
            assert [g["sum"] for g in got] == [(i + 1) * (BIG // 4)] * 2, got
            assert all(g["numel"] == BIG // 4 and g["dtype"] == "torch.int32" for g in got)
            if stats:
                big_sends.append({k: after[k] - before[k] for k in after
                                  if isinstance(after[k], int) and k.startswith(
                                      ("arena_hits", "arena_bytes", "overflow_", "ring_"))})
            n += 1
        out["round_trips"] = n
        out["big_sends"] = big_sends
        out["writer_stats"] = stats() if stats else None
        out["writer_stats_before_big"] = big_before
        out["workers_after"] = executor.collective_rpc("queues")
    finally:
        executor.shutdown()
    # Only vLLM's references remain (its executor keeps itself alive through
    # weakref.finalize(self, self.shutdown); shutdown() drops the queues).
    del executor, stats
    import gc

    gc.collect()
    out["alive_after_shutdown"], out["alive_detail"] = still_alive(pids)
    out["children_after_shutdown"] = _children()
    out["files_after_shutdown"] = [f for f in _files_of([os.getpid()] + pids)
                                   if f not in _held_here()]
    # vLLM's own segments are unlinked by its workers and its resource
    # tracker, which may finish a moment after shutdown() returns.
    import time

    settle = time.monotonic() + 10
    while _still_there(out["segments"]) and time.monotonic() < settle:
        time.sleep(0.05)
    out["segments_after_shutdown"] = _still_there(out["segments"])
    out["tmpdir_after_shutdown"] = _tmpdir()
    return out


def kill_during_calls(executor, victim: int, hang_s: float = 30.0) -> dict:
    """SIGKILL ``victim`` (a worker) a second into a loop of round trips:
    what the engine raises, how soon after the kill, and how many calls
    came back first.  Past ``hang_s`` after the kill the engine's queues
    are shut down, so that a hang is reported (``hung``) instead of
    hanging the test."""
    killed, done, gave_up = threading.Event(), threading.Event(), threading.Event()
    t_kill = [0.0]

    def kill_soon():
        time.sleep(1.0)
        t_kill[0] = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        killed.set()
        if not done.wait(hang_s):
            gave_up.set()
            for mq in [executor.rpc_broadcast_mq, *executor.response_mqs]:
                if mq is not None:
                    mq.shutdown()

    threading.Thread(target=kill_soon, daemon=True).start()
    out = {"victim": victim}
    calls = 0
    try:
        while True:
            assert executor.collective_rpc("echo", args=(calls,)) == [calls, calls]
            calls += 1
    except Exception as e:
        done.set()
        out["raised_after_s"] = time.monotonic() - t_kill[0] if killed.is_set() else None
        out["error"] = f"{type(e).__name__}: {e}"
    out["hung"] = gave_up.is_set()
    out["calls_before"] = calls
    return out


def kill_worker(model_dir: str) -> dict:
    """SIGKILL worker 1 while the engine runs round trips: what the engine
    raises, how soon, and what is left once the engine has shut down."""
    executor, _ = _executor(model_dir)
    pids = [w["pid"] for w in executor.collective_rpc("queues")]
    victim = pids[1]
    out = {"engine_pid": os.getpid(), "pids": pids,
           "victim_files_before": _files_of([victim])}
    out.update(kill_during_calls(executor, victim))
    # vLLM's worker monitor shuts the executor down on its own thread; wait
    # for that (it ends the surviving worker), then shut down as an engine does.
    deadline = time.monotonic() + 120
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    executor.shutdown()
    del executor
    import gc

    gc.collect()
    out["alive_after_shutdown"], out["alive_detail"] = still_alive(pids)
    # A SIGKILLed process's mappings go once the kernel has torn it down,
    # which on a loaded host may trail its exit status a little.
    settle = time.monotonic() + 15
    while time.monotonic() < settle and [
            f for f in _files_of([victim]) if f not in _held_here()]:
        time.sleep(0.1)
    out["victim_files_after"] = [f for f in _files_of([victim]) if f not in _held_here()]
    out["files_after_shutdown"] = [f for f in _files_of([os.getpid()] + pids)
                                   if f not in _held_here()]
    out["tmpdir_after_shutdown"] = _tmpdir()
    return out


def arena_default(model_dir: str) -> dict:
    """What vLLM's engine arguments say about the arena here: programmatic
    (EngineArgs, AsyncEngineArgs, explicit False) and on the command line
    (no flag, --no-enable-shm-tensor-arena, --enable-shm-tensor-arena)."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def cli(*argv):
        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", model_dir, *argv])
        return AsyncEngineArgs.from_cli_args(args).enable_shm_tensor_arena

    out = {
        "engine_args": EngineArgs(model=model_dir).enable_shm_tensor_arena,
        "async_engine_args": AsyncEngineArgs(model=model_dir).enable_shm_tensor_arena,
        "explicit_off": EngineArgs(model=model_dir,
                                   enable_shm_tensor_arena=False).enable_shm_tensor_arena,
        "cli_default": cli(),
        "cli_off": cli("--no-enable-shm-tensor-arena"),
        "cli_on": cli("--enable-shm-tensor-arena"),
    }
    try:
        import fastmq.vllm as fv

        out["status"] = {k: fv.status()[k] for k in ("active", "arena_default")}
    except ImportError:
        out["status"] = None
    return out


PHASES = {"round_trips": round_trips, "kill_worker": kill_worker, "arena_default": arena_default}


def main(*phases: str) -> None:
    """Run ``phases`` in this engine process, one executor each; print
    ``RESULT <json>``.  The model directory is ``FASTMQ_TEST_MODEL_DIR``."""
    from _vllm_models import ENGINE_ENV, tiny_model

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    model_dir = tiny_model(os.environ["FASTMQ_TEST_MODEL_DIR"])
    result = {}
    for phase in phases:
        result[phase] = PHASES[phase](model_dir)
    print("RESULT " + json.dumps(result), flush=True)
