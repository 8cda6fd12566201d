"""The memory a process's writers send large messages from, kept once for
the process rather than once per queue.

A writer's large messages go out of memory of their own: the pickle sink's
buffer (``fastmq._sink``), handed over as a frame for a socket, and under
``"encrypt"`` the blocks a message's ciphertext goes into
(``fastmq._wire.Outgoing``).  Fresh pages cost a fault and a page of zeros
each, about what filling them costs, so memory a sent message gave back is
kept for the next one.  Kept per queue, a queue made after another was
closed (or beside it) started from fresh pages, where the process already
had memory to spare; a malloc'd buffer -- what vLLM's writer pickles into
-- comes from the heap glibc keeps for the whole process.  Kept per
process, the next queue starts from what the last one gave back, and a
process with several queues keeps at most the cap once, not once each.

The pools are private anonymous mappings: a fork child gets its own copy
(copy-on-write), and nothing outlives the process.  Taken and given back
under the GIL, from any thread (``fastmq._recv_buffers`` lets it go only
to populate a block already out of the pool's lists).
"""
from __future__ import annotations

from fastmq import _config, _wire
from fastmq._recv_buffers import BufferPool

_streams: BufferPool | None = None
_ciphertexts: BufferPool | None = None


def streams() -> BufferPool:
    """The process's pool for large pickle streams sent over a socket,
    keeping up to ``FASTMQ_REMOTE_BUFFERS_MB`` (read again for each new
    queue: the newest setting applies from then on)."""
    global _streams
    cap = _config.remote_buffers_bytes()
    if _streams is None:
        _streams = BufferPool(cap, _config.default_copy_threads())
    else:
        _streams.set_cap(cap)
    return _streams


def ciphertexts() -> BufferPool:
    """The process's pool for ``"encrypt"``'s ciphertext blocks (a segment
    and its tag each; ``fastmq._wire.CIPHER_POOL_BYTES`` kept)."""
    global _ciphertexts
    if _ciphertexts is None:
        _ciphertexts = BufferPool(_wire.CIPHER_POOL_BYTES)
    return _ciphertexts
