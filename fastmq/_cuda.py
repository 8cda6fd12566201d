"""The few CUDA runtime calls the tensor arena makes, behind one small object.

A reader that uses CUDA page-locks the arena mapping once
(``cudaHostRegister``) so that host-to-device copies out of it are true DMA,
unregisters it before the mapping goes away, and gates the release of a slot
on a CUDA event recorded after the step's copies.  Everything the arena needs
is the four methods of ``TorchCudaRuntime``; tests inject an object with the
same methods through ``set_runtime`` to exercise that logic on machines
without a GPU.

Nothing here initialises CUDA: the arena only pins in a process where CUDA
is already initialised (``is_initialized``), so a CPU-only reader never pays
for creating a context it would not otherwise have.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from typing import Any

# cudaHostRegisterPortable: the registration is visible to every CUDA
# context of the process, not only the current device's.
HOST_REGISTER_PORTABLE = 1

_lock = threading.Lock()
_runtime: Any = None
_runtime_set = False


class TorchCudaRuntime:
    """CUDA through torch: ``torch.cuda.cudart()`` for host registration
    (ctypes ``libcudart`` when torch's binding lacks it), ``torch.cuda.Event``
    for events on the current stream."""

    def __init__(self):
        import torch

        self._torch = torch
        self._cudart = None

    def is_initialized(self) -> bool:
        # A plain flag in torch: never initialises or even queries the driver.
        return self._torch.cuda.is_initialized()

    def _rt(self):
        if self._cudart is None:
            rt = None
            try:
                rt = self._torch.cuda.cudart()
            except Exception:
                rt = None
            if rt is None or not hasattr(rt, "cudaHostRegister"):
                rt = _CtypesCudart()
            self._cudart = rt
        return self._cudart

    def host_register(self, ptr: int, nbytes: int) -> int:
        """0 on success, else the CUDA error code."""
        return int(self._rt().cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))

    def host_unregister(self, ptr: int) -> int:
        return int(self._rt().cudaHostUnregister(ptr))

    def record_event(self):
        """An event recorded on the current stream (``query()`` -> done)."""
        ev = self._torch.cuda.Event()
        ev.record()
        return ev


class _CtypesCudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` straight from libcudart."""

    def __init__(self):
        self._lib = ctypes.CDLL(_find_libcudart())
        self._lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._lib.cudaHostRegister.restype = ctypes.c_int
        self._lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self._lib.cudaHostUnregister.restype = ctypes.c_int

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        return self._lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, flags)

    def cudaHostUnregister(self, ptr: int) -> int:
        return self._lib.cudaHostUnregister(ctypes.c_void_p(ptr))


def _find_libcudart() -> str:
    found = ctypes.util.find_library("cudart")
    if found:
        return found
    try:
        import torch

        roots = [os.path.join(os.path.dirname(torch.__file__), "lib"),
                 os.path.join(os.path.dirname(os.path.dirname(torch.__file__)),
                              "nvidia", "cuda_runtime", "lib")]
    except ImportError:
        roots = []
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "libcudart*.so*"))):
            return path
    raise OSError("libcudart not found")


def runtime() -> Any:
    """The runtime the arena uses: the injected one, else torch's (None
    without torch)."""
    global _runtime, _runtime_set
    if _runtime_set:
        return _runtime
    if sys.modules.get("torch") is None:
        # Without torch imported nothing initialised CUDA through it, and
        # importing it here would cost a torch-free reader seconds: ask
        # again later (not cached), once something has imported it.
        return None
    with _lock:
        if not _runtime_set:
            try:
                _runtime = TorchCudaRuntime()
            except ImportError:
                _runtime = None
            _runtime_set = True
    return _runtime


def set_runtime(rt: Any) -> Any:
    """Use ``rt`` from now on (``None`` restores the default); returns the
    previous one.  An object with ``is_initialized()``, ``host_register(ptr,
    nbytes) -> int``, ``host_unregister(ptr) -> int`` and ``record_event()``
    (returning an object with ``query() -> bool``)."""
    global _runtime, _runtime_set
    with _lock:
        prev = _runtime if _runtime_set else None
        if rt is None:
            _runtime, _runtime_set = None, False
        else:
            _runtime, _runtime_set = rt, True
    return prev
