"""A vLLM worker with no device or model: a round trip measures the executor."""
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
