"""Child-process targets for test_node_end.py (spawnable): a stand-in for
the processes of a vLLM node whose engine is elsewhere.

``node`` plays the node's vLLM process: it starts one worker process named
as vLLM's ``MultiprocExecutor`` names them, keeps the write end of a death
pipe to it (closed when this process exits, as vLLM's is), records SIGTERM
and then exits (or, with ``ignore_sigterm``, stays), and waits for the
worker.  ``worker`` attaches as the queue's remote reader, registers the
façade's writer-gone hook, shuts its queue down when the death pipe
closes (as vLLM's worker does), and records how its ``dequeue`` ended.

In the worker, ``WorkerProc`` stands in for vLLM's (installed as
``vllm.v1.executor.multiproc_executor.WorkerProc``): its busy loop
dequeues its ``rpc_broadcast_mq`` and runs each request.  With ``role``
``"broadcast"`` the queue is that ``rpc_broadcast_mq``; with ``"own"`` it
is a queue of the user's own, read by a request the busy loop runs (as a
``collective_rpc`` function would), the scheduler broadcast being another."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time


def _record(path, **item):
    with open(path, "a") as f:
        f.write(json.dumps(item) + "\n")


class WorkerProc:
    """vLLM's ``WorkerProc``, as far as the writer-gone hook looks at it."""

    def __init__(self, rpc_broadcast_mq):
        self.rpc_broadcast_mq = rpc_broadcast_mq

    def worker_busy_loop(self):
        while True:
            request = self.rpc_broadcast_mq.dequeue(indefinite=True)
            request()


class _Requests:
    """A scheduler broadcast that hands the busy loop one request."""

    def __init__(self, request):
        self.request = request

    def dequeue(self, indefinite=False):
        request, self.request = self.request, None
        if request is None:
            raise RuntimeError("no second request in this stand-in")
        return request


EXECUTOR = "vllm.v1.executor.multiproc_executor"


def _as_vllm_worker():
    import types

    executor = types.ModuleType(EXECUTOR)
    executor.WorkerProc = WorkerProc
    sys.modules[EXECUTOR] = executor


def node(handle, out_dir, worker_name, ignore_sigterm, grace_s, role="broadcast"):
    record = os.path.join(out_dir, "node.jsonl")

    def on_sigterm(signum, frame):
        _record(record, event="sigterm", at=time.monotonic())
        if not ignore_sigterm:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    ctx = mp.get_context("spawn")
    death_r, death_w = ctx.Pipe(duplex=False)
    w = ctx.Process(target=worker, name=worker_name,
                    args=(handle, out_dir, death_r, grace_s, role))
    w.start()
    death_r.close()
    _record(record, event="started", worker=w.pid)
    try:
        w.join()
    except SystemExit:      # told to stop: close the pipe, then wait for the worker
        pass
    finally:
        death_w.close()
    w.join()
    _record(record, event="worker exited", code=w.exitcode)


def worker(handle, out_dir, death_r, grace_s, role):
    from fastmq import MessageQueue, queue
    from fastmq.vllm import _node_end

    _as_vllm_worker()

    record = os.path.join(out_dir, "worker.jsonl")
    _node_end.GRACE_S = grace_s
    queue.add_writer_gone_hook(_node_end.on_writer_gone)
    mq = MessageQueue.create_from_handle(handle, 0)

    def death_monitor():
        try:
            death_r.recv()
        except EOFError:
            _record(record, event="death pipe closed")
            mq.shutdown()

    threading.Thread(target=death_monitor, daemon=True).start()
    mq.wait_until_ready()
    _record(record, event="first", message=mq.dequeue(timeout=30))
    start = time.monotonic()

    def users_request():
        mq.dequeue(indefinite=True)

    try:
        if role == "broadcast":
            WorkerProc(mq).worker_busy_loop()
        else:
            WorkerProc(_Requests(users_request)).worker_busy_loop()
        _record(record, event="dequeue returned")
    except Exception as e:
        _record(record, event="raised", error=f"{type(e).__name__}: {e}",
                seconds=time.monotonic() - start)
    sys.stdout.flush()


def recognised_in_vllms_busy_loop() -> dict:
    """What the hook's test says inside vLLM's real ``WorkerProc.worker_busy_loop``
    (vLLM imported; no worker started): for the queue that loop reads, and
    for another queue dequeued there; and the same asked from another
    thread while the loop is busy."""
    from vllm.v1.executor import multiproc_executor

    from fastmq.vllm import _node_end

    seen = {}

    class Broadcast:
        def dequeue(self, indefinite=False):
            seen["its rpc_broadcast_mq"] = _node_end.is_scheduler_broadcast(self)
            seen["another queue"] = _node_end.is_scheduler_broadcast(Broadcast())
            # The heartbeat thread's view, while the loop's thread is busy
            # (here: in this call) and never comes back to dequeue.
            other = threading.Thread(target=lambda: seen.update({
                "from another thread": _node_end.is_scheduler_broadcast(self),
                "another queue from another thread":
                    _node_end.is_scheduler_broadcast(Broadcast())}))
            other.start()
            other.join()
            raise _Out

    class _Out(Exception):
        pass

    proc = object.__new__(multiproc_executor.WorkerProc)
    proc.rpc_broadcast_mq = Broadcast()
    try:
        multiproc_executor.WorkerProc.worker_busy_loop(proc)
    except _Out:
        pass
    return seen

