"""What a reader attaches with: ``Handle`` (vLLM's fields, plus fastmq's
own), ``BufferHandle`` (the ring part of it), and the rank check.

Both are ordinary values: they pickle, ``dataclasses.asdict`` and
``json.dumps`` take them, and a ``BufferHandle`` indexes and unpacks like
the plain tuple vLLM puts in the same field.  Its type is the marker that
tells a fastmq ring from a vLLM one.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import NamedTuple


class HandleMismatchError(RuntimeError):
    """A handle from one queue implementation was given to the other."""


class BufferHandle(NamedTuple):
    """The ring of a fastmq queue: vLLM's ``(n_reader, max_chunk_bytes,
    max_chunks, name)``, as a type of its own so that fastmq can tell its
    rings from vLLM's (whose handles hold a plain tuple)."""

    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    name: str


def is_fastmq_ring(buffer_handle) -> bool:
    return isinstance(buffer_handle, BufferHandle)


@dataclass
class Handle:
    """Everything a reader needs to attach; picklable, same fields as vLLM's."""

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None
    local_notify_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: tuple | None = None
    # fastmq only: the remote path's security mode and where its readers'
    # pre-shared key comes from (fastmq._keys): the key itself when no
    # deployment secret is set (kept out of repr, so that logging the handle
    # does not print it), else the salt the key is derived with from the
    # secret and the derived key's id (no key).
    remote_security: str | None = None
    remote_key: bytes | None = field(default=None, repr=False)
    remote_salt: bytes | None = None
    remote_key_id: bytes | None = None
    # fastmq only: how long (microseconds) a remote reader spins for the
    # next message before it waits in the kernel (the writer's spin_us;
    # local readers read it from the ring).
    spin_us: float | None = None
    # fastmq only: how many readers in all, local and remote.
    n_reader: int | None = None
    # fastmq only: the writer's pid, so that a remote reader (which cannot
    # see the writer's process) can name it when its connection drops.
    writer_pid: int | None = None
    # fastmq only: where local readers get the segments' descriptors
    # (fastmq._door), and the key that proves a reader holds this handle
    # there and on the local socket (kept out of repr, like remote_key).
    local_door_addr: str | None = None
    local_key: bytes | None = field(default=None, repr=False)
    # fastmq only: the writer's FASTMQ_PEER_TIMEOUT_S; a remote reader's
    # bound is at least this, so that it never takes an idle writer (which
    # beats once per quarter of its own bound) for a silent one.
    peer_timeout_s: float | None = None


def vllm_ring_error(buffer_handle) -> HandleMismatchError:
    return HandleMismatchError(
        f"this MessageQueue handle was created by vLLM's own MessageQueue "
        f"(ring segment {buffer_handle[3]!r}) but is being attached by fastmq: the "
        "writer's process does not use fastmq. Activate fastmq in every "
        "vLLM process (install it; do not set FASTMQ_VLLM=0) or in none.")


def check_rank(handle: Handle, rank) -> int:
    """``rank`` as an int, if a reader of that rank can attach to ``handle``.

    As in vLLM, a rank listed in ``handle.local_reader_ranks`` is a local
    reader and any other rank is a remote one (vLLM's executor attaches to
    its peers' response queues as rank -1).  Refused, with ``ValueError``:
    a rank that is not an integer, and a rank not listed when the queue has
    no remote address (there is nothing such a reader could connect to)."""
    local = list(handle.local_reader_ranks)
    remote = handle.remote_subscribe_addr is not None
    if remote:
        valid = (f"local reader ranks {local}; any other rank attaches as a remote "
                 "reader")
    else:
        valid = f"the local reader ranks {local} and no remote readers"
    if isinstance(rank, bool) or not hasattr(type(rank), "__index__"):
        raise ValueError(f"fastmq: reader rank {rank!r} is not an integer; this queue "
                         f"has {valid}")
    rank = operator.index(rank)
    if rank not in local and not remote:
        raise ValueError(f"fastmq: reader rank {rank} is not a reader of this queue: "
                         f"it has {valid}")
    return rank


__all__ = ["Handle", "BufferHandle", "HandleMismatchError", "check_rank", "is_fastmq_ring",
           "vllm_ring_error"]
