"""fastmq inside vLLM: every ``MessageQueue`` vLLM builds is fastmq's.

The user's side: docs/operations.md, "How fastmq enters vLLM".

Installing fastmq is enough.  Three ways in, each idempotent and each
honouring the opt-out ``FASTMQ_VLLM=0``:

* the ``fastmq-vllm.pth`` file installed with the package puts an import
  hook (``fastmq.vllm._hook``) in every Python process, ``spawn`` children
  included: when vLLM's ``shm_broadcast`` module is imported, its
  ``MessageQueue`` and ``Handle`` become fastmq's before any other module
  binds them.  It also honours vLLM's ``VLLM_PLUGINS`` selection;
* the ``vllm.general_plugins`` entry point ``fastmq``
  (``fastmq.vllm.plugin:register``), which vLLM calls in the engine and in
  every worker;
* ``patch()`` for scripts, also after vLLM was imported: it rebinds the
  names in every module that had bound vLLM's classes.

``unpatch()`` gives vLLM its classes back.  When vLLM's queue API is not
the one fastmq implements (``fastmq.vllm._guard``), ``patch()`` raises
``RuntimeError`` naming what differs and changes nothing; the hook and the
plugin log that error and leave vLLM as it is.  Tested with vLLM 0.33.0.
"""
from __future__ import annotations

import importlib
import logging

from fastmq.vllm import _arena_default, _guard, _hook, _swap
from fastmq.vllm._arena_default import ArenaDefaultError

logger = logging.getLogger("fastmq")

SHM_MODULE = _hook.SHM_MODULE
PLUGIN_NAME = _hook.PLUGIN_NAME
TESTED_VERSIONS = _guard.TESTED_VERSIONS


def patch(*, _source: str = "fastmq.vllm.patch() call") -> dict[str, tuple[str, ...]]:
    """Make vLLM use fastmq's ``MessageQueue`` and ``Handle`` in this process.

    Imports vLLM's ``shm_broadcast`` if needed, replaces its two classes,
    rebinds them in every module that bound vLLM's, and installs the
    import hook (so a later re-import is covered too).  Returns
    ``{module name: names}`` now holding fastmq's classes because of
    fastmq; calling it again changes nothing and returns the same.

    With ``FASTMQ_VLLM=0`` it does nothing and returns ``{}``.  An explicit
    call does not consult ``VLLM_PLUGINS`` (that selects plugins).

    Where vLLM's engine arguments are imported, also makes the tensor
    arena their default (``fastmq.vllm._arena_default``).

    Raises ``RuntimeError`` naming the symbols when vLLM's API differs
    from what fastmq implements (nothing is changed then), or
    ``ArenaDefaultError`` (a ``RuntimeError``) when the arena flag's
    symbols moved (the queue is swapped, the default left as vLLM's),
    and ``ImportError`` when vLLM is not installed."""
    reason = _hook.opt_out_reason(honour_vllm_plugins=False)
    if reason is not None:
        logger.info("fastmq.vllm.patch(): %s, vLLM keeps its own MessageQueue", reason)
        return {}
    _hook.install()
    # Import before taking the swap lock: the hook takes it during the import.
    module = importlib.import_module(SHM_MODULE)
    out = _swap.swap(module, _source)
    _swap.apply_arena_default()
    return out


def unpatch() -> dict[str, tuple[str, ...]]:
    """Give vLLM its own classes back in this process and remove the import
    hook (a later import of vLLM stays vLLM's own until ``patch()``).
    Returns ``{module name: names}`` restored."""
    _hook.uninstall()
    return _swap.unswap()


def is_active() -> bool:
    """Whether vLLM's ``shm_broadcast.MessageQueue`` is fastmq's in this
    process (False while vLLM is not imported)."""
    return _swap.is_active()


def patched() -> dict[str, tuple[str, ...]]:
    """What ``patch()`` would return now, without changing anything."""
    return _swap.report()


def originals() -> dict[str, type]:
    """vLLM's own ``{"MessageQueue": ..., "Handle": ...}`` (imports vLLM).

    Only usable as queues while fastmq is not active: vLLM's methods look
    ``MessageQueue`` and ``Handle`` up in their module, which then holds
    fastmq's.  Compare against vLLM in a process started with
    ``FASTMQ_VLLM=0``, or after ``unpatch()``."""
    return _swap.originals()


def status() -> dict:
    """Everything an operator may ask: active, hook installed, opt-out
    reason, vLLM version, and what is patched."""
    try:
        reason = _hook.opt_out_reason()
    except ValueError as e:
        reason = str(e)
    return {
        "active": is_active(),
        "hook_installed": _hook.is_installed(),
        "opted_out": reason,
        "vllm_version": _swap.vllm_version(),
        "arena_default": _arena_default.is_applied(),
        "tested_versions": TESTED_VERSIONS,
        "patched": patched(),
    }


__all__ = ["patch", "unpatch", "is_active", "patched", "originals", "status", "ArenaDefaultError",
           "SHM_MODULE", "PLUGIN_NAME", "TESTED_VERSIONS"]
