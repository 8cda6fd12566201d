"""The import hook that swaps fastmq into vLLM in every process.

The ``fastmq-vllm.pth`` file installed with the package loads this module
at interpreter start-up (also in ``spawn`` children), so it must stay cheap:
only the standard library here, and nothing of vLLM, torch or fastmq until
vLLM's ``shm_broadcast`` module is actually imported.  The .pth loads this
file by path, without importing the ``fastmq`` package (whose import pulls
in torch); keep it free of imports from fastmq at module level.

How: a ``sys.meta_path`` finder that answers for one module name only,
``vllm.distributed.device_communicators.shm_broadcast``.  It asks the
finders after it for the real spec and wraps its loader, so that right
after the module body has run -- before any other module can import names
from it -- ``fastmq.vllm._swap`` puts fastmq's ``MessageQueue`` and
``Handle`` in it.  Modules imported later (``multiproc_executor``'s
``from ...shm_broadcast import Handle, MessageQueue``, the function-local
imports in ``parallel_state``) then bind fastmq's classes.

A failure here must never break vLLM's import: it is logged and vLLM keeps
its own classes (see ``_swap.activate_from_hook``).
"""
from __future__ import annotations

import os
import sys

SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
# Where vLLM's engine arguments live: fastmq makes the tensor arena their
# default (fastmq.vllm._arena_default) right after this module's body runs.
ARG_UTILS_MODULE = "vllm.engine.arg_utils"
WATCHED = (SHM_MODULE, ARG_UTILS_MODULE)
# The entry point's name in the ``vllm.general_plugins`` group (pyproject.toml);
# ``VLLM_PLUGINS`` selects plugins by this name.
PLUGIN_NAME = "fastmq"
OPT_OUT_VAR = "FASTMQ_VLLM"
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def opt_out_reason(honour_vllm_plugins: bool = True) -> str | None:
    """Why fastmq must leave vLLM alone in this process, or None.

    Read at the moment of use (not at start-up), so that a script may set
    the variables before it imports vLLM.  ``VLLM_PLUGINS`` is parsed the
    way vLLM 0.33 parses it (``vllm/envs.py``: unset means every plugin;
    otherwise a comma-separated list of names, not stripped, so ``""``
    selects none)."""
    raw = os.environ.get(OPT_OUT_VAR)
    if raw is not None:
        value = raw.strip().lower()
        if value in _OFF:
            return f"{OPT_OUT_VAR}={raw}"
        if value not in _ON:
            raise ValueError(f"{OPT_OUT_VAR}={raw!r} is not a boolean (use 1 or 0)")
    if honour_vllm_plugins:
        plugins = os.environ.get("VLLM_PLUGINS")
        if plugins is not None and PLUGIN_NAME not in plugins.split(","):
            return f"VLLM_PLUGINS={plugins!r} does not name {PLUGIN_NAME!r}"
    return None


class _PatchingLoader:
    """Runs the real loader, then swaps the classes.  Everything else
    (``get_source`` for tracebacks, ``is_package``, resource readers) is
    the real loader's."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _on_loaded(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class ShmBroadcastFinder:
    """``sys.meta_path`` entry that finds nothing by itself: for the
    modules in ``WATCHED`` it returns the spec the next finders give, with
    a loader that patches the module once it has run."""

    def __init__(self):
        self._busy: set[int] = set()   # thread ids inside find_spec (re-entry guard)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED:
            return None
        import _thread

        me = _thread.get_ident()
        if me in self._busy:      # a later finder asked the whole meta path again
            return None
        self._busy.add(me)
        try:
            spec = None
            for finder in _finders_after(self):
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(me)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if not isinstance(spec.loader, _PatchingLoader):
            spec.loader = _PatchingLoader(spec.loader)
        return spec

    # Let importlib.invalidate_caches() reach the finders behind us.
    def invalidate_caches(self) -> None:
        pass


def _finders_after(me) -> list:
    path = list(sys.meta_path)
    for i, finder in enumerate(path):
        if finder is me:
            return path[i + 1:]
    return path


def _on_loaded(module) -> None:
    if not is_installed():
        return      # uninstalled while this import was in flight
    try:
        if opt_out_reason() is not None:
            return
    except ValueError as e:
        _report(f"fastmq: not swapped into vLLM: {e}")
        return
    try:
        from fastmq.vllm import _swap
    except Exception as e:   # e.g. fastmq's extension missing: vLLM must still import
        _report(f"fastmq: not swapped into vLLM: cannot import fastmq ({type(e).__name__}: {e})")
        return
    if module.__name__ == ARG_UTILS_MODULE:
        _swap.arena_default_from_hook(module)
    else:
        _swap.activate_from_hook(module)


def _report(message: str) -> None:
    import logging

    logging.getLogger("fastmq").error("%s", message)


_finder: ShmBroadcastFinder | None = None


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (idempotent).  Returns
    whether it was newly installed.  Does not import vLLM."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        return False
    _finder = ShmBroadcastFinder()
    sys.meta_path.insert(0, _finder)
    return True


def uninstall() -> bool:
    """Take the finder off ``sys.meta_path``.  Returns whether it was there."""
    global _finder
    finder, _finder = _finder, None
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
        return True
    return False


def is_installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def install_at_startup() -> None:
    """What the .pth runs: install the finder unless opted out.  Never
    raises (an exception in a .pth line is printed at every start-up)."""
    try:
        if opt_out_reason(honour_vllm_plugins=False) is None:
            install()
    except ValueError as e:
        sys.stderr.write(f"fastmq: vLLM import hook not installed: {e}\n")
