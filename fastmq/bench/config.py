"""The presets and the parameters every scenario and reader process reads."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

KiB = 1 << 10
MiB = 1 << 20

SCENARIOS = ("step", "throughput", "tensor", "wake", "generate")


@dataclass
class Params:
    """Everything a run needs; picklable, sent to every reader process."""

    preset: str = "default"
    # whole runs: every scenario and implementation, then all again; each
    # figure is the median over the runs (their spread is reported).
    repeats: int = 1
    # readers per scenario (N): the runs with 1 writer and N readers.
    readers: dict = field(default_factory=lambda: {
        "step": [1, 2], "throughput": [1, 2], "tensor": [1, 2], "wake": [1],
        # generate (N = tensor parallel size): vLLM's start-up takes minutes
        # here; by name, --readers or --full.
        "generate": []})
    # step: executor round trip of one payload per size.
    step_sizes: list = field(default_factory=lambda: [100, KiB, 64 * KiB, MiB])
    step_warmup: int = 200          # round trips per size not counted
    step_min: int = 200             # at least this many counted...
    step_max: int = 5000            # ...at most this many...
    step_budget_s: float = 0.25     # ...stopping once past this time and the minimum
    # throughput: small messages pipelined; messages/s delivered to every reader.
    tp_payload: int = 64
    tp_budget_s: float = 0.3        # per repetition
    tp_max_msgs: int = 200_000
    tp_warmup_reps: int = 1
    tp_reps: int = 2
    # tensor: CPU tensor broadcast, every reader reads every byte.
    tensor_sizes: list = field(default_factory=lambda: [16 * MiB, 64 * MiB])
    # Warm-up covers a cycle of the ring's chunks and the arenas' slots (10 and 8 by
    # default): the counted messages are the steady state, not the first touch of fresh
    # shared-memory pages (the first message's time is reported separately).
    tensor_warmup: int = 10
    tensor_reps: int = 4            # counted per size from 64 MiB up (tensor_reps_at)
    # First use (fresh pages, a first message of a size): one sample per queue, so
    # each run takes it from this many fresh queues, the measured one included.
    tensor_first_queues: int = 1
    # wake: one message after the readers went idle (parked).
    wake_samples: int = 10
    wake_warmup: int = 20
    wake_gap_s: float = 0.1         # parked at least this long (after any spin phase)
    # The first messages of the fresh queue, before the warm-up, each after the
    # same gap: one pass over vLLM's default 10 ring chunks (fastmq's too).
    wake_first: int = 10
    idle_window_s: float = 2.0      # idle-CPU window after the last message
    # every blocking operation of the harness gives up after this long.
    timeout_s: float = 60.0


_PRESETS = {
    "default": {},
    "quick": dict(
        readers={"step": [1], "throughput": [1], "tensor": [1], "wake": [1], "generate": []},
        step_sizes=[KiB, MiB], step_warmup=10, step_min=20, step_max=100, step_budget_s=0.02,
        tp_budget_s=0.05, tp_max_msgs=5_000, tp_warmup_reps=0, tp_reps=1,
        tensor_sizes=[16 * MiB], tensor_warmup=2, tensor_reps=1,
        wake_samples=2, wake_warmup=2, wake_gap_s=0.02, idle_window_s=0.1, timeout_s=30.0),
    "full": dict(
        repeats=3, readers={"step": [1, 2, 4], "throughput": [1, 2, 4], "tensor": [1, 2, 4],
                            "wake": [1, 2], "generate": [2]},
        step_sizes=[100, KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB],
        step_warmup=300, step_min=500, step_max=10_000, step_budget_s=0.4,
        tp_budget_s=0.5, tp_max_msgs=500_000, tp_warmup_reps=1, tp_reps=2,
        tensor_sizes=[16 * MiB, 64 * MiB, 256 * MiB], tensor_warmup=9, tensor_reps=5,
        tensor_first_queues=5,
        wake_samples=20, wake_warmup=30, idle_window_s=5.0, timeout_s=120.0),
}


def tensor_reps_at(params: Params, size: int) -> int:
    """Counted tensor messages of ``size`` bytes: ``tensor_reps`` from 64 MiB up, and
    as many more below as keep the bytes counted the same (16 MiB: four times): a small
    tensor's round is short, and on an oversubscribed machine a few slow rounds would
    otherwise decide its p50."""
    return params.tensor_reps * max(1, (64 * MiB) // max(size, 1))


def preset(name: str) -> Params:
    """quick: CI's smoke run; default: minutes on 2 cores; full: every figure, 3 runs."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}")
    return Params(preset=name, **_PRESETS[name])


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*$")


def parse_size(text: str) -> int:
    """``100``, ``1K``, ``64KiB``, ``1M``, ``256MiB`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 100, 1K, 64KiB, 16M)")
    value = float(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 1 << 30}[m.group(2).lower()]
    if value != int(value) or value <= 0:
        raise ValueError(f"not a whole positive number of bytes: {text!r}")
    return int(value)


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"
