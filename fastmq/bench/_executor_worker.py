"""The vLLM worker the ``executor`` scenario runs: vLLM's own worker
process (``WorkerProc``, its queues and its RPC loop) around a worker with
no device and no model, so that a ``collective_rpc`` round trip measures
the executor and its queues, nothing else.

Imported by the workers vLLM spawns (``ParallelConfig.worker_cls``), which
import vLLM anyway; keep it out of processes that do not.
"""
from __future__ import annotations

import os

from vllm.v1.worker.worker_base import WorkerBase


class EchoWorker(WorkerBase):
    """``echo(x)`` returns ``x``; ``tensor_sum(t)`` checks a tensor the
    engine sent; ``whoami()`` says which process answers."""

    def init_device(self) -> None:
        pass

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        pass

    def echo(self, x):
        return x

    def tensor_sum(self, t):
        return {"rank": self.rank, "sum": int(t.sum()), "numel": t.numel(),
                "dtype": str(t.dtype)}

    def whoami(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}
