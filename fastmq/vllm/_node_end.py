"""Ending a vLLM node whose engine runs on another node, once the engine's
queue is gone.

On a node that runs only workers (``vllm serve --nnodes N --node-rank K
--headless``), each worker reads the scheduler's broadcast as a remote
reader, and the node's vLLM process does nothing but watch its workers.
When the engine goes (vLLM's own shutdown SIGKILLs its engine core; the
head node dies), vLLM's queue waits forever and an operator stops the node
with SIGTERM.  fastmq's reader learns it: the end of the stream, or the
connection cut.  Raising that from the worker's busy loop would end the
worker as a failure (vLLM logs ``WorkerProc failed.`` and its monitor
``died unexpectedly``), so the worker does what the operator would do
instead: SIGTERM to its node's vLLM process (the worker's parent).  vLLM's
own shutdown runs from there (the parent exits, the worker's death pipe
closes, vLLM shuts the worker's queues down), and the waiting ``dequeue``
ends with ``RuntimeError("cancelled")``, as in any vLLM shutdown.  If
nothing shuts the queue down within ``GRACE_S``, it raises the original
error after all.

Only in a worker of vLLM's ``MultiprocExecutor`` (its process name) whose
parent is still the process that started it; anywhere else (Ray's
workers, standalone use) the reader raises as before.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal

logger = logging.getLogger("fastmq")

# MultiprocExecutor names each worker process "VllmWorker-<rank>".
WORKER_PREFIX = "VllmWorker-"
GRACE_S = 30.0


def node_process() -> int | None:
    """The pid of this vLLM worker's node process, or None when this is
    not a vLLM worker or its parent is no longer the process that started
    it."""
    if not multiprocessing.current_process().name.startswith(WORKER_PREFIX):
        return None
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != os.getppid():
        return None
    return parent.pid


def on_writer_gone(error) -> float | None:
    """``fastmq.queue``'s writer-gone hook while fastmq is active in vLLM."""
    pid = node_process()
    if pid is None:
        return None
    logger.log(logging.INFO if getattr(error, "clean", False) else logging.WARNING,
               "%s. Stopping this node's vLLM process (pid %d) with SIGTERM, as an "
               "operator stops a node, so that vLLM shuts this node down.", error, pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    return GRACE_S
