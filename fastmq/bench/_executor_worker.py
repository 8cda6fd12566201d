"""The worker of the ``executor`` scenario: vLLM's own ``WorkerProc``
around a worker with no device and no model, so that a round trip measures
the executor and its queues.  Imported only by the workers vLLM spawns."""
from __future__ import annotations

from vllm.v1.worker.worker_base import WorkerBase


class EchoWorker(WorkerBase):
    """``echo(x)`` returns ``x``."""

    def init_device(self) -> None:
        pass

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        pass

    def echo(self, x):
        return x
