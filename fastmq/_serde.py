"""Pickling for the queue: protocol 5, big buffers out of band, CPU tensors
reduced to raw bytes instead of torch's copying reducer.

A writer keeps one ``Encoder`` for its lifetime: the pickler, its dispatch
table and the buffer it writes into (``fastmq._sink.PickleSink``) are built
once, not per message.

torch is never imported here ahead of need: ``import fastmq`` stays fast and
works without torch.  A message can only hold a tensor once something has
imported torch, so the encoder registers the tensor reducer as soon as torch
is in ``sys.modules``; decoding a tensor imports torch at that point.
"""
from __future__ import annotations

import copyreg
import pickle
import sys
from pickle import PickleBuffer
from typing import Any

from fastmq import _pools
from fastmq._ring import decode_frames, decode_stream
from fastmq._sink import PickleSink

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


class Encoder:
    """Turns an object into ``[pickle stream, oob buffer, ...]`` (``encode``),
    or leaves it pickled in ``sink`` for the ring to frame (``pickler`` and
    ``sink`` are what ``RingWriter.send_object`` takes).

    ``arena`` (the writer's end of the tensor arena) may claim large buffers
    first: its ``copy_to_slot(buf)`` is asked for every ``PickleBuffer`` and
    may return a small slot descriptor to send out of band instead of the
    bytes, its ``commit()`` runs once a message is published (``abort()``
    once sending it failed before that), and its
    ``reducer_override(obj)`` is the pickler's (see ``fastmq._arena_writer``): the
    core's bound (Cython) method itself, since the pickler calls it for
    every object that is not a builtin container or atom.
    """

    def __init__(self, arena: Any = None, oob_min_bytes: int = OOB_MIN_BYTES):
        self._reducer_override = None
        to_slot = commit = abort = None
        if arena is not None:
            self._reducer_override = arena.reducer_override
            to_slot = getattr(arena, "copy_to_slot", None)
            commit = getattr(arena, "commit", None)
            abort = getattr(arena, "abort", None)
        # Memory for large streams sent over a socket (remote readers, the
        # overflow path), reused once the send lets go of it: the process's,
        # shared by its queues (fastmq._pools).
        self.pool = _pools.streams()
        self.sink = PickleSink(to_slot, commit, abort, oob_min_bytes, self.pool)
        self.pickler = None
        self.refresh()

    def refresh(self) -> None:
        """Build a fresh pickler (the sink says when: a reducer registered
        or torch imported since, or the last dump failed)."""
        sink = self.sink
        if self._reducer_override is not None:
            p = _OverridePickler(sink, self._reducer_override, protocol=5,
                                 buffer_callback=sink.on_buffer)
        else:
            p = pickle.Pickler(sink, protocol=5, buffer_callback=sink.on_buffer)
        torch_module = _loaded_torch()
        # Pending while torch is not (or only half) imported; not where its
        # import is blocked (``sys.modules["torch"] = None``).
        torch_pending = (torch_module is None
                         and sys.modules.get("torch", True) is not None)
        p.dispatch_table = _base_dispatch_table(torch_module)
        self.pickler = p
        sink.expect(copyreg.dispatch_table, torch_pending, sys.modules)

    def encode(self, obj: Any) -> list:
        sink = self.sink
        if sink.stale():
            self.refresh()
        return sink.dump(self.pickler, obj, self.pool)


# Every message is decoded by the ring's one decode, whichever way its
# frames came (a chunk, or a socket), or, read as it arrives
# (fastmq._piecewise), by its decode_stream.
decode = decode_frames
