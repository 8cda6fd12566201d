"""fastmq: a Cython shared-memory broadcast queue, drop-in for vLLM's
``MessageQueue`` (``vllm.distributed.device_communicators.shm_broadcast``).

    from fastmq import MessageQueue
    writer = MessageQueue(n_reader=2, n_local_reader=2)
    handle = writer.export_handle()            # pickle this to the readers
    reader = MessageQueue.create_from_handle(handle, rank)   # in each reader
    # writer.wait_until_ready() / reader.wait_until_ready()  (collective)
    writer.enqueue({"step": 1});  reader.dequeue()
"""
from fastmq._ring import CorruptChunkError, SegmentMismatchError
from fastmq._segment import ShmFullError
from fastmq.queue import (LONG_WAIT_TIME_LOG_MSG, BufferHandle, Handle,
                          HandleMismatchError, MessageQueue, ReaderGoneError,
                          WriterGoneError)
from fastmq.ring import ShmRingBuffer
from fastmq.segments import SHM_PATH, check_shm_free_space
# The function shadows the submodule as an attribute of the package
# (``from fastmq.cleanup import ...`` still reaches the module).
from fastmq.cleanup import cleanup

__version__ = "0.1.0"


def __getattr__(name):
    # The .pth hook registers fastmq.vllm._hook before fastmq.vllm itself is
    # imported; importing the subpackage on first access keeps
    # ``import fastmq.vllm._hook as h`` working in such a process.
    if name == "vllm":
        import importlib

        return importlib.import_module("fastmq.vllm")
    raise AttributeError(f"module 'fastmq' has no attribute {name!r}")

__all__ = [
    "MessageQueue",
    "Handle",
    "BufferHandle",
    "ShmRingBuffer",
    "check_shm_free_space",
    "SHM_PATH",
    "CorruptChunkError",
    "SegmentMismatchError",
    "ShmFullError",
    "HandleMismatchError",
    "WriterGoneError",
    "ReaderGoneError",
    "LONG_WAIT_TIME_LOG_MSG",
    "cleanup",
]
