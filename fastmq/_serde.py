"""Pickling for the queue: protocol 5, big buffers out of band, CPU tensors
reduced to raw bytes instead of torch's copying reducer.

A writer keeps one ``Encoder`` for its lifetime: the pickler, its dispatch
table and its buffer list are built once, not per message.
"""
from __future__ import annotations

import copyreg
import io
import pickle
from pickle import PickleBuffer
from typing import Any

try:  # torch is optional: without it the queue carries everything else.
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None

# Out-of-band buffers smaller than this stay in the pickle stream (as vLLM).
OOB_MIN_BYTES = 1 << 20

_DTYPES: dict[str, Any] = {}


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
    if t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad:
        try:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError):
            pass  # conjugate/negative bit and other views numpy cannot alias
        else:
            name = str(t.dtype)[6:]  # "torch.float32" -> "float32"
            return rebuild_tensor, (PickleBuffer(raw), tuple(t.shape), name)
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _base_dispatch_table() -> dict:
    table = dict(copyreg.dispatch_table)
    if torch is not None:
        table[torch.Tensor] = reduce_tensor
    return table


class Encoder:
    """Turns an object into ``[pickle stream, oob buffer, ...]``.

    ``diverter`` (the tensor arena) may claim large buffers first: its
    ``divert_buffer(buf)`` is asked for every ``PickleBuffer`` and may return
    a small descriptor to send out of band instead of the bytes, and its
    ``reducer_override(obj)`` is the pickler's (see ``fastmq._arena``).
    """

    def __init__(self, diverter: Any = None, oob_min_bytes: int = OOB_MIN_BYTES):
        self._bio = io.BytesIO()
        self._buffers: list = [b""]
        self._oob_min = oob_min_bytes
        self._copyreg_len = len(copyreg.dispatch_table)
        self._divert = None
        if diverter is not None:
            # The diverter's bound (Cython) method itself, not a Python
            # wrapper around it: the pickler calls it for every object that is
            # not a builtin container or atom.
            pickler_cls = type(
                "_DivertingPickler",
                (pickle.Pickler,),
                {"reducer_override": staticmethod(diverter.reducer_override)},
            )
            self._divert = getattr(diverter, "divert_buffer", None)
        else:
            pickler_cls = pickle.Pickler
        self._pickler_cls = pickler_cls
        self._pickler = self._new_pickler()

    def _new_pickler(self):
        p = self._pickler_cls(self._bio, protocol=5, buffer_callback=self._on_buffer)
        p.dispatch_table = _base_dispatch_table()
        return p

    def _on_buffer(self, buf: PickleBuffer) -> bool:
        if self._divert is not None:
            desc = self._divert(buf)
            if desc is not None:
                self._buffers.append(desc)
                return False
        raw = buf.raw()
        if raw.nbytes < self._oob_min:
            return True  # serialise in band
        self._buffers.append(raw)
        return False

    def encode(self, obj: Any) -> list:
        if len(copyreg.dispatch_table) != self._copyreg_len:
            # Somebody registered a reducer since: pick it up.
            self._copyreg_len = len(copyreg.dispatch_table)
            self._pickler = self._new_pickler()
        bio = self._bio
        bio.seek(0)
        bio.truncate()
        buffers = self._buffers = [b""]
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
        buffers[0] = bio.getvalue()
        self._buffers = [b""]
        return buffers


def decode(stream: Any, oob: list) -> Any:
    return pickle.loads(stream, buffers=oob)
