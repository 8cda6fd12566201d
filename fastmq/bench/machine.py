"""What the figures were measured on: CPU, cores, kernel, memory, load,
and the versions of everything measured."""
from __future__ import annotations

import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
    }


def versions(with_vllm: bool) -> dict:
    """Versions of what was measured; ``torch``: None when not installed
    (the tensor scenario is then skipped)."""
    import numpy
    import zmq

    import fastmq

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    out = {
        "fastmq": fastmq.__version__,
        "torch": torch_version,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "numpy": numpy.__version__,
    }
    if with_vllm:
        try:
            import vllm

            out["vllm"] = vllm.__version__
        except Exception:
            out["vllm"] = None
    return out
