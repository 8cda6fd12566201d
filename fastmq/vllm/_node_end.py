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

Only for that queue, the scheduler broadcast (``rpc_broadcast_mq``), in a
worker of vLLM's ``MultiprocExecutor`` (its process name) whose parent is
still the process that started it; anywhere else (Ray's workers,
standalone use) and for every other queue, the user's own included, the
reader raises as before: on one node the worker's parent is the engine
core, which a user's queue must not stop.

A silent engine node (it died, or its link dropped everything) is found by
the reader's heartbeats as well as by a waiting ``dequeue``: the worker is
then often not in its busy loop's ``dequeue`` at all but in a collective
with ranks on that node, which never returns.  The heartbeat thread tells
the hook then, and the worker's parent is stopped all the same (vLLM's
shutdown ends a worker stuck so with SIGKILL).

How the queue is recognised: it is the one vLLM's ``WorkerProc`` holds as
``rpc_broadcast_mq`` and reads in its busy loop, and the ``dequeue`` that
found the writer gone is that loop's (the ``WorkerProc`` is ``self`` of a
frame on the way to the hook).  Nothing at creation can mark it on a node
whose engine is elsewhere: there vLLM's ``parallel_state`` attaches it,
from a handle received over the process group, and nothing in the handle
says which queue it is.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys

logger = logging.getLogger("fastmq")

# MultiprocExecutor names each worker process "VllmWorker-<rank>".
WORKER_PREFIX = "VllmWorker-"
# Where vLLM's WorkerProc is, and the attribute it keeps its scheduler
# broadcast queue in.
EXECUTOR = "vllm.v1.executor.multiproc_executor"
WORKER_CLASS = "WorkerProc"
BROADCAST_ATTR = "rpc_broadcast_mq"
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


def is_scheduler_broadcast(queue) -> bool:
    """Whether ``queue`` is the scheduler broadcast of a vLLM worker in this
    process, read by the caller: a ``WorkerProc`` (vLLM's, from ``EXECUTOR``)
    that holds ``queue`` as its ``rpc_broadcast_mq`` is ``self`` in one of
    the calling frames (its busy loop's ``dequeue``), or in a frame of
    another thread (the busy loop, busy elsewhere)."""
    executor = sys.modules.get(EXECUTOR)
    worker_class = getattr(executor, WORKER_CLASS, None)
    if not isinstance(worker_class, type):
        return False        # no vLLM executor here: not vLLM's worker
    # The caller's thread first; then the others: the heartbeat thread
    # finds a silent engine node while the worker's own thread is busy
    # elsewhere (a collective with the dead node's ranks, which never
    # returns), still inside its busy loop.
    here = sys._getframe(1)
    for frame in [here, *(f for f in sys._current_frames().values() if f is not here)]:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if (isinstance(owner, worker_class)
                    and getattr(owner, BROADCAST_ATTR, None) is queue):
                return True
            frame = frame.f_back
    return False


def on_writer_gone(error, queue) -> float | None:
    """``fastmq.queue``'s writer-gone hook while fastmq is active in vLLM:
    ``queue`` (a remote reader) found its writer gone with ``error``."""
    pid = node_process()
    if pid is None or not is_scheduler_broadcast(queue):
        return None
    logger.log(logging.INFO if getattr(error, "clean", False) else logging.WARNING,
               "%s. Stopping this node's vLLM process (pid %d) with SIGTERM, as an "
               "operator stops a node, so that vLLM shuts this node down.", error, pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    return GRACE_S
