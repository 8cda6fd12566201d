"""While fastmq is active in vLLM, ``enable_shm_tensor_arena`` defaults to on.

vLLM builds the scheduler broadcast queue (``MultiprocExecutor``'s
``rpc_broadcast_mq``) with ``enable_shm_tensor_arena=parallel_config.
enable_shm_tensor_arena``, whose default is off.  That queue is where large
CPU tensors (multimodal inputs, prompt embeddings) go to every worker, so
fastmq turns the default on, the way deployments already do it with a
vLLM plugin:

* ``EngineArgs(...)`` (and its dataclass subclasses, ``AsyncEngineArgs``,
  ``vllm.LLM(...)``) without the argument: on; ``enable_shm_tensor_arena=
  False`` still turns it off;
* the command line: ``--enable-shm-tensor-arena`` defaults to on,
  ``--no-enable-shm-tensor-arena`` turns it off;
* Docker's default 64 MiB ``/dev/shm`` included: the arena's memory is
  not in ``/dev/shm`` (fastmq/_segment.pyx);
* sizing: fastmq's ``FASTMQ_ARENA_SLOTS`` / ``FASTMQ_ARENA_SLOT_MB`` (read
  by the engine's ``MessageQueue``, which creates the arena); workers take
  the geometry from the queue handle, whatever their environment says.

On a CUDA platform (``current_platform.is_cuda_alike()``, the test vLLM's
own arena makes before it page-locks its slots), the queue vLLM asks an
arena of (``enable_shm_tensor_arena=True``: the scheduler broadcast) gets
vLLM's arena semantics by default: shared readers, so that each CUDA
worker page-locks the slots (host-to-device copies from them are DMA) and
hands a slot back after a CUDA event behind that step's copies
(``queue_arena_defaults``, registered with the façade while fastmq is
active).  ``FASTMQ_ARENA_READERS`` set in the engine, or the
``arena_readers=`` keyword, keeps what the user chose; every other queue,
and fastmq outside vLLM, keeps isolated (copy-on-write) readers.

What vLLM's own ``ParallelConfig(...)`` says when built directly is left
alone.  All or nothing: ``problems()`` checks every symbol used before the
first change, and a vLLM whose symbols moved gets ``ArenaDefaultError``
(a ``RuntimeError``) naming them.  ``FASTMQ_VLLM=0`` leaves all of it as
vLLM ships it.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import os
import re
import sys
import threading
import types

ARG_UTILS = "vllm.engine.arg_utils"
EXECUTOR = "vllm.v1.executor.multiproc_executor"
FIELD = "enable_shm_tensor_arena"
# What vLLM's executor passes to the scheduler broadcast queue, checked in
# its source (whitespace removed) rather than by importing it: importing it
# pulls in the model stack, and this may run inside another module's import.
EXECUTOR_USE = re.compile(r"enable_shm_tensor_arena=\(?self\.parallel_config\."
                          r"enable_shm_tensor_arena\)?[,)]")


logger = logging.getLogger("fastmq")


class ArenaDefaultError(RuntimeError):
    """vLLM's symbols for the arena flag are not where fastmq expects them."""


_lock = threading.RLock()
# What was changed, to undo: [(class, old field default, old __init__ defaults,
# old __init__ kwdefaults)], and the original add_cli_args staticmethod.
_changed: list[tuple] = []
_original_add_cli_args = None
_module: types.ModuleType | None = None


def _engine_arg_classes(engine_args: type) -> list[type]:
    out, todo = [], [engine_args]
    while todo:
        cls = todo.pop()
        if dataclasses.is_dataclass(cls) and cls not in out:
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def problems(arg_utils: types.ModuleType) -> list[str]:
    """Everything about vLLM's arena flag that this patch cannot rely on;
    empty when it is safe to apply."""
    where = arg_utils.__name__
    out = []
    engine_args = vars(arg_utils).get("EngineArgs")
    if not isinstance(engine_args, type) or not dataclasses.is_dataclass(engine_args):
        return [f"{where}.EngineArgs is missing or no longer a dataclass"]
    parallel = vars(arg_utils).get("ParallelConfig")
    if parallel is None or FIELD not in {f.name for f in dataclasses.fields(parallel)}:
        out.append(f"{where}.ParallelConfig has no field {FIELD}")
    for cls in _engine_arg_classes(engine_args):
        name = f"{cls.__module__}.{cls.__qualname__}"
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if FIELD not in fields:
            out.append(f"{name} has no field {FIELD}")
            continue
        if fields[FIELD].default not in (True, False):
            out.append(f"{name}.{FIELD} defaults to {fields[FIELD].default!r}, not a bool")
        try:
            param = inspect.signature(cls.__init__).parameters.get(FIELD)
        except (TypeError, ValueError):
            param = None
        if param is None or param.default not in (True, False):
            out.append(f"{name}.__init__ takes no {FIELD}=<bool> argument")
    if not isinstance(vars(engine_args).get("add_cli_args"), staticmethod):
        out.append(f"{where}.EngineArgs.add_cli_args is not a staticmethod")
    source = ""
    for root in getattr(sys.modules.get("vllm"), "__path__", []):
        try:
            with open(os.path.join(root, *EXECUTOR.split(".")[1:]) + ".py",
                      encoding="utf-8") as f:
                source = f.read()
            break
        except OSError:
            continue
    if not EXECUTOR_USE.search("".join(source.split())):
        out.append(f"{EXECUTOR} no longer passes {FIELD} from ParallelConfig to its "
                   "scheduler broadcast queue")
    return out


def on_cuda_platform() -> bool:
    """Whether vLLM's platform here is CUDA (or ROCm): what vLLM's own arena
    asks before it page-locks its slots.  vLLM resolved the platform when
    its queue module was imported; this initialises nothing."""
    try:
        platforms = importlib.import_module("vllm.platforms")
        return bool(platforms.current_platform.is_cuda_alike())
    except Exception:
        return False


def arena_readers(enable) -> str | None:
    """The reader mode fastmq gives the arena of a queue vLLM builds with
    ``enable_shm_tensor_arena=enable``: ``"shared"`` (vLLM's semantics:
    page-locked in each CUDA reader, slots released after a CUDA event)
    where vLLM asked for an arena on a CUDA platform, else None (fastmq's
    own default, isolated).  None too when ``FASTMQ_ARENA_READERS`` is set:
    the operator chose."""
    if enable is None or not enable:
        return None     # vLLM asked for no arena: vLLM's readers get private copies
    if os.environ.get("FASTMQ_ARENA_READERS", "").strip():
        return None
    return "shared" if on_cuda_platform() else None


def queue_arena_defaults(enable) -> dict:
    """The façade's arena-defaults hook (``fastmq.queue.add_arena_defaults_hook``)
    while fastmq is active in vLLM."""
    mode = arena_readers(enable)
    return {} if mode is None else {"arena_readers": mode}


def _set_default(cls: type, value: bool) -> tuple:
    field = cls.__dataclass_fields__[FIELD]
    init = cls.__init__
    old = (cls, field.default, init.__defaults__, init.__kwdefaults__)
    field.default = value
    if FIELD in vars(cls):
        setattr(cls, FIELD, value)
    param = inspect.signature(init).parameters[FIELD]
    if param.kind == inspect.Parameter.KEYWORD_ONLY:
        init.__kwdefaults__ = {**init.__kwdefaults__, FIELD: value}
    else:
        positional = [p for p in inspect.signature(init).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        with_default = [p.name for p in positional if p.default is not p.empty]
        i = with_default.index(FIELD)
        defaults = list(init.__defaults__)
        defaults[i] = value
        init.__defaults__ = tuple(defaults)
    return old


def _restore(old: tuple) -> None:
    cls, default, defaults, kwdefaults = old
    cls.__dataclass_fields__[FIELD].default = default
    if FIELD in vars(cls):
        setattr(cls, FIELD, default)
    cls.__init__.__defaults__ = defaults
    cls.__init__.__kwdefaults__ = kwdefaults


def _wrap_add_cli_args(original, on: bool = True):
    @functools.wraps(original)
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        actions = [a for a in getattr(parser, "_actions", []) if a.dest == FIELD]
        if not actions:
            raise ArenaDefaultError(
                f"fastmq: {ARG_UTILS}.EngineArgs.add_cli_args no longer adds "
                f"--{FIELD.replace('_', '-')}; cannot make the tensor arena the default "
                "(set FASTMQ_VLLM=0 to run vLLM as it ships)")
        parser.set_defaults(**{FIELD: on})
        return parser

    add_cli_args.__fastmq_wrapped__ = original
    return add_cli_args


def apply(arg_utils: types.ModuleType) -> bool:
    """Make the arena the default in ``arg_utils`` (idempotent).  Returns
    whether anything changed.  Raises ``ArenaDefaultError`` naming what
    moved, before changing anything."""
    global _original_add_cli_args, _module
    with _lock:
        if _module is arg_utils:
            return False
        found = problems(arg_utils)
        if found:
            raise ArenaDefaultError(
                "fastmq cannot make the shared-memory tensor arena vLLM's default: "
                + "; ".join(found) + ". Nothing was changed; set FASTMQ_VLLM=0 to run "
                "vLLM as it ships.")
        if _module is not None:     # a reloaded arg_utils: only the new one counts
            undo()
        engine_args = arg_utils.EngineArgs
        for cls in _engine_arg_classes(engine_args):
            _changed.append(_set_default(cls, True))
        _original_add_cli_args = vars(engine_args)["add_cli_args"]
        engine_args.add_cli_args = staticmethod(
            _wrap_add_cli_args(_original_add_cli_args.__func__, True))
        _module = arg_utils
        return True


def undo() -> bool:
    """vLLM's own default back.  Returns whether anything was changed."""
    global _original_add_cli_args, _module
    with _lock:
        if _module is None:
            return False
        while _changed:
            _restore(_changed.pop())
        _module.EngineArgs.add_cli_args = _original_add_cli_args
        _original_add_cli_args = _module = None
        return True


def is_applied() -> bool:
    return _module is not None and sys.modules.get(ARG_UTILS) is _module
