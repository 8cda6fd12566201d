"""Child-process targets for test_node_end.py (spawnable): a stand-in for
the processes of a vLLM node whose engine is elsewhere.

``node`` plays the node's vLLM process: it starts one worker process named
as vLLM's ``MultiprocExecutor`` names them, keeps the write end of a death
pipe to it (closed when this process exits, as vLLM's is), records SIGTERM
and then exits (or, with ``ignore_sigterm``, stays), and waits for the
worker.  ``worker`` attaches as the queue's remote reader, registers the
façade's writer-gone hook, shuts its queue down when the death pipe
closes (as vLLM's worker does), and records how its ``dequeue`` ended."""
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


def node(handle, out_dir, worker_name, ignore_sigterm, grace_s):
    record = os.path.join(out_dir, "node.jsonl")

    def on_sigterm(signum, frame):
        _record(record, event="sigterm", at=time.monotonic())
        if not ignore_sigterm:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    ctx = mp.get_context("spawn")
    death_r, death_w = ctx.Pipe(duplex=False)
    w = ctx.Process(target=worker, name=worker_name,
                    args=(handle, out_dir, death_r, grace_s))
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


def worker(handle, out_dir, death_r, grace_s):
    from fastmq import MessageQueue, queue
    from fastmq.vllm import _node_end

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
    try:
        mq.dequeue(indefinite=True)
        _record(record, event="dequeue returned")
    except Exception as e:
        _record(record, event="raised", error=f"{type(e).__name__}: {e}",
                seconds=time.monotonic() - start)
    sys.stdout.flush()
