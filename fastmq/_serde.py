"""Pickling for the queue: protocol 5, big buffers out of band, CPU tensors
reduced to raw bytes instead of torch's copying reducer.

A writer keeps one ``Encoder`` for its lifetime: the pickler, its dispatch
table and its buffer list are built once, not per message.

torch is never imported here ahead of need: ``import fastmq`` stays fast and
works without torch.  A message can only hold a tensor once something has
imported torch, so the encoder registers the tensor reducer as soon as torch
is in ``sys.modules``; decoding a tensor imports torch at that point.
"""
from __future__ import annotations

import copyreg
import io
import pickle
import sys
from pickle import PickleBuffer
from typing import Any

# The torch module once a tensor has been encoded or decoded (see
# ``_load_torch``); None until then.  torch is optional: without it the
# queue carries everything else.
torch: Any = None

# Out-of-band buffers smaller than this stay in the pickle stream (as vLLM).
OOB_MIN_BYTES = 1 << 20

_DTYPES: dict[str, Any] = {}


def _load_torch():
    """Import torch now: a tensor is being encoded or decoded."""
    global torch
    import torch as module

    torch = module
    return module


def _loaded_torch():
    """torch if this process has imported it (far enough to define
    ``Tensor``), else None; never imports it."""
    module = sys.modules.get("torch")
    if module is None or getattr(module, "Tensor", None) is None:
        return None
    return module


def _dtype(name: str):
    dt = _DTYPES.get(name)
    if dt is None:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise pickle.UnpicklingError(f"unknown torch dtype {name!r} in message")
        _DTYPES[name] = dt
    return dt


def rebuild_tensor(buf: Any, shape: tuple[int, ...], dtype_name: str):
    """Rebuild a CPU tensor over ``buf``: a bytearray copied out of a ring
    chunk, a ``zmq.Frame`` (zero copy; the frame owns its memory), an arena
    slot view, or ``bytes`` when the buffer travelled in band (copied so the
    tensor is writable)."""
    if torch is None:
        _load_torch()
    dtype = _dtype(dtype_name)
    if isinstance(buf, bytes):
        buf = bytearray(buf)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        # Only a tensor with no elements has no bytes: a stream claiming
        # otherwise must not make us allocate whatever shape it names.
        if 0 not in tuple(shape):
            raise pickle.UnpicklingError(
                f"empty buffer for a tensor of shape {tuple(shape)} in message")
        return torch.empty(shape, dtype=dtype)
    if mv.readonly:
        buf = bytearray(mv)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def reduce_tensor(t):
    """Reducer for exact ``torch.Tensor``: raw bytes as a ``PickleBuffer``."""
    if torch is None:
        _load_torch()  # already imported: ``t`` is a tensor
    if t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad:
        try:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError):
            pass  # conjugate/negative bit and other views numpy cannot alias
        else:
            name = str(t.dtype)[6:]  # "torch.float32" -> "float32"
            return rebuild_tensor, (PickleBuffer(raw), tuple(t.shape), name)
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _base_dispatch_table(torch_module: Any) -> dict:
    table = dict(copyreg.dispatch_table)
    if torch_module is not None:
        table[torch_module.Tensor] = reduce_tensor
    return table


class _OverridePickler(pickle.Pickler):
    """A pickler whose ``reducer_override`` is a given callable.

    It is set as an instance attribute before ``Pickler.__init__`` (which
    looks it up once): no class per queue, and no reference cycle that would
    keep the arena's mapping alive until a GC pass."""

    def __init__(self, file, reducer_override, **kw):
        self.reducer_override = reducer_override
        super().__init__(file, **kw)


class _OobBuffers:
    """Collects one message's out-of-band buffers (the pickler's
    ``buffer_callback``).  Separate from the Encoder so that the pickler does
    not reference the object that owns it."""

    __slots__ = ("buffers", "to_slot", "oob_min")

    def __init__(self, to_slot, oob_min: int):
        self.buffers: list = [b""]
        self.to_slot = to_slot
        self.oob_min = oob_min

    def on_buffer(self, buf: PickleBuffer) -> bool:
        if self.to_slot is not None:
            desc = self.to_slot(buf)
            if desc is not None:
                self.buffers.append(desc)
                return False
        raw = buf.raw()
        if raw.nbytes < self.oob_min:
            return True  # serialise in band
        self.buffers.append(raw)
        return False


class Encoder:
    """Turns an object into ``[pickle stream, oob buffer, ...]``.

    ``arena`` (the writer's end of the tensor arena) may claim large buffers
    first: its ``copy_to_slot(buf)`` is asked for every ``PickleBuffer`` and
    may return a small slot descriptor to send out of band instead of the
    bytes, and its ``reducer_override(obj)`` is the pickler's (see
    ``fastmq._arena``): the core's bound (Cython) method itself, since the
    pickler calls it for every object that is not a builtin container or
    atom.
    """

    def __init__(self, arena: Any = None, oob_min_bytes: int = OOB_MIN_BYTES):
        self._bio = io.BytesIO()
        self._copyreg_len = len(copyreg.dispatch_table)
        # True while the pickler was built without the tensor reducer because
        # torch was not imported yet: ``encode`` rebuilds it once torch is.
        self._torch_pending = True
        self._reducer_override = None
        to_slot = None
        if arena is not None:
            self._reducer_override = arena.reducer_override
            to_slot = getattr(arena, "copy_to_slot", None)
        self._oob = _OobBuffers(to_slot, oob_min_bytes)
        self._pickler = self._new_pickler()

    def _new_pickler(self):
        cb = self._oob.on_buffer
        if self._reducer_override is not None:
            p = _OverridePickler(self._bio, self._reducer_override, protocol=5,
                                 buffer_callback=cb)
        else:
            p = pickle.Pickler(self._bio, protocol=5, buffer_callback=cb)
        torch_module = _loaded_torch()
        # Pending while torch is not (or only half) imported; not where its
        # import is blocked (``sys.modules["torch"] = None``).
        self._torch_pending = (torch_module is None
                               and sys.modules.get("torch", True) is not None)
        p.dispatch_table = _base_dispatch_table(torch_module)
        return p

    def encode(self, obj: Any) -> list:
        if len(copyreg.dispatch_table) != self._copyreg_len or (
                self._torch_pending and "torch" in sys.modules):
            # Somebody registered a reducer, or imported torch, since: pick
            # it up (once torch is bound, the second test is one attribute).
            self._copyreg_len = len(copyreg.dispatch_table)
            self._pickler = self._new_pickler()
        bio = self._bio
        bio.seek(0)
        bio.truncate()
        oob = self._oob
        buffers = oob.buffers = [b""]
        pickler = self._pickler
        try:
            pickler.dump(obj)
        except BaseException:
            # A failed dump can leave the pickler's memo and framing in any
            # state: start the next message from a fresh one.
            self._pickler = self._new_pickler()
            raise
        finally:
            pickler.clear_memo()
            oob.buffers = None
        buffers[0] = bio.getvalue()
        return buffers


def decode(stream: Any, oob: list, arena: Any = None) -> Any:
    """The object a message's frames carry: ``stream`` is the pickle stream
    (a view into a ring chunk, or a socket frame) and ``oob`` its
    out-of-band buffers, some of which may be descriptors of ``arena``
    slots (a reader's end, which maps them to views of the slots)."""
    if oob and arena is not None:
        oob = arena.map_oob(oob)
    return pickle.loads(stream, buffers=oob)
