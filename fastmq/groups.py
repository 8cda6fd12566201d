"""The collectives a queue needs over a process group, and which ranks share a node.

The façade (``MessageQueue.create_from_process_group``) builds the queues
with them.

Works with a torch ``ProcessGroup`` (gloo is enough, on CPU) and with any
object that has vLLM's ``StatelessProcessGroup`` methods.
"""
from __future__ import annotations

import os
import secrets
from typing import Any

from fastmq import _door
from fastmq._segment import Segment, lend_descriptor, parse_locator, reclaim_descriptor
from fastmq.segments import SHM_PATH, new_segment_name


class Group:
    """The collectives a queue needs, over either kind of group."""

    def __init__(self, pg: Any):
        self.pg = pg
        try:
            from torch.distributed import ProcessGroup
        except ImportError:  # pragma: no cover
            ProcessGroup = ()
        self.torch = isinstance(pg, ProcessGroup)
        if self.torch:
            import torch.distributed as dist

            self.dist = dist
            self.rank = dist.get_rank(pg)
            self.world_size = dist.get_world_size(pg)
            self.global_ranks = dist.get_process_group_ranks(pg)
        else:
            for attr in ("rank", "world_size", "broadcast_obj", "all_gather_obj"):
                if not hasattr(pg, attr):
                    raise TypeError(f"process group {pg!r} has no {attr!r}: pass a torch "
                                    "ProcessGroup or a vLLM StatelessProcessGroup")
            self.rank = pg.rank
            self.world_size = pg.world_size
            self.global_ranks = list(range(pg.world_size))

    def broadcast(self, obj: Any, src: int) -> Any:
        if self.torch:
            box = [obj]
            self.dist.broadcast_object_list(box, src=self.global_ranks[src], group=self.pg)
            return box[0]
        return self.pg.broadcast_obj(obj if self.rank == src else None, src)

    def all_gather(self, obj: Any) -> list:
        if self.torch:
            out = [None] * self.world_size
            self.dist.all_gather_object(out, obj, group=self.pg)
            return out
        return self.pg.all_gather_obj(obj)


def _shm_identity() -> tuple[int, int] | None:
    try:
        st = os.stat(SHM_PATH)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def same_node_as(ops: Group, source_rank: int) -> list[bool]:
    """Which ranks share the source rank's host, as the queue needs it: they
    can map the source's segments, and they see the same ``/dev/shm``.

    The source writes a random token into a fresh segment; every rank tries
    to map it, with the descriptor the source hands over its segment door
    (``fastmq._door``: the same host and network namespace, whatever the
    ranks' uids, capabilities or pid namespaces, as for a queue's readers),
    and compares.  Hostnames lie across containers and namespaces; this does
    not.  The ``/dev/shm`` mount must match too: that is what vLLM's own
    test of a shared node checks, so a process with a ``/dev/shm`` of its
    own is another node to both."""
    seg = door = None
    if ops.rank == source_rank:
        token = secrets.token_bytes(16)
        seg = Segment.create(new_segment_name("probe"), 16)
        memoryview(seg)[:16] = token
        key = _door.new_key()
        name, _, fd, _ = parse_locator(seg.locator)
        door = _door.Door([(name, fd)], key)
        msg = (seg.locator, token, _shm_identity(), door.address, key)
    else:
        msg = None
    try:
        locator, token, shm, address, key = ops.broadcast(msg, source_rank)
        if ops.rank == source_rank:
            mine = True
        elif _shm_identity() != shm:
            mine = False
        else:
            mine = _maps_token(locator, token, address, key)
        # The gather doubles as the barrier before the source lets go.
        return [bool(x) for x in ops.all_gather(mine)]
    finally:
        if door is not None:
            door.close()
        if seg is not None:
            seg.close()


def _maps_token(locator: str, token: bytes, address: str, key: bytes) -> bool:
    """Whether the probe segment ``locator`` can be had from the source's
    door at ``address`` and holds ``token``."""
    name, pid, _, _ = parse_locator(locator)
    try:
        admission = _door.admit(address, key, 0, pid)
    except (OSError, _door.DoorError):
        return False        # another network namespace, or host
    fd = admission.take(name)
    admission.close()
    if fd < 0:
        return False
    lend_descriptor(name, fd)
    try:
        other = Segment.attach(locator, writable=False)
        try:
            return bytes(memoryview(other)[:16]) == token
        finally:
            other.close()
    except (OSError, ValueError):
        return False
    finally:
        reclaim_descriptor(name, fd)


def group_rank_of(group: Group, reader_rank: int) -> int:
    """The group rank of global rank ``reader_rank``.  As in vLLM,
    ``create_from_process_group_single_reader`` takes a *global* rank
    (parallel_state passes ``GroupCoordinator.ranks[i]``), while
    ``create_from_process_group``'s ``writer_rank`` is a group rank."""
    if reader_rank not in group.global_ranks:
        raise ValueError(f"reader_rank {reader_rank} is not a rank of this group "
                         f"(global ranks {group.global_ranks})")
    return group.global_ranks.index(reader_rank)
