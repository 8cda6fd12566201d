"""Building queues over a process group, and telling which ranks share a node.

Works with a torch ``ProcessGroup`` (gloo is enough, on CPU) and with any
object that has vLLM's ``StatelessProcessGroup`` methods.
"""
from __future__ import annotations

import secrets
from typing import Any

from fastmq._segment import Segment
from fastmq.segments import new_segment_name


class _Ops:
    """The four collectives we need, over either kind of group."""

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


def same_node_as(ops: _Ops, source_rank: int) -> list[bool]:
    """Which ranks can map the source rank's shared memory.

    The source writes a random token into a fresh segment; every rank tries
    to map it and compares.  This is the property the queue needs (hostnames
    lie across containers and namespaces; a shared /dev/shm does not)."""
    seg = None
    if ops.rank == source_rank:
        token = secrets.token_bytes(16)
        seg = Segment.create(new_segment_name("probe"), 16)
        memoryview(seg)[:16] = token
        msg = (seg.name, token)
    else:
        msg = None
    try:
        name, token = ops.broadcast(msg, source_rank)
        if ops.rank == source_rank:
            mine = True
        else:
            try:
                other = Segment.attach(name)
                try:
                    mine = bytes(memoryview(other)[:16]) == token
                finally:
                    other.close()
            except (OSError, ValueError):
                mine = False
        # The gather doubles as the barrier before the source unlinks.
        return [bool(x) for x in ops.all_gather(mine)]
    finally:
        if seg is not None:
            seg.unlink()
            seg.close()


def create_from_process_group(cls, pg, max_chunk_bytes, max_chunks, writer_rank=0,
                              external_writer_handle=None, blocking=True):
    ops = _Ops(pg)
    status = same_node_as(ops, writer_rank)
    if ops.rank == writer_rank:
        if external_writer_handle is not None:
            mq = cls.create_from_handle(external_writer_handle, ops.rank)
        else:
            local = [r for r, s in enumerate(status) if s and r != writer_rank]
            mq = cls(n_reader=ops.world_size - 1, n_local_reader=len(local),
                     local_reader_ranks=local, max_chunk_bytes=max_chunk_bytes,
                     max_chunks=max_chunks)
        ops.broadcast(mq.export_handle(), writer_rank)
    else:
        handle = ops.broadcast(None, writer_rank)
        mq = cls.create_from_handle(handle, ops.rank)
    if blocking:
        mq.wait_until_ready()
    return mq


def create_from_process_group_single_reader(cls, pg, max_chunk_bytes, max_chunks,
                                            reader_rank=0, blocking=False):
    ops = _Ops(pg)
    # As in vLLM, ``reader_rank`` is a *global* rank here (parallel_state
    # passes GroupCoordinator.ranks[i]); create_from_process_group's
    # ``writer_rank`` is a group rank.
    if reader_rank not in ops.global_ranks:
        raise ValueError(f"reader_rank {reader_rank} is not a rank of this group "
                         f"(global ranks {ops.global_ranks})")
    reader = ops.global_ranks.index(reader_rank)
    status = same_node_as(ops, reader)
    mq = cls(n_reader=1, n_local_reader=1 if status[ops.rank] else 0,
             max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)
    handles = ops.all_gather(mq.export_handle())
    if blocking:
        mq.wait_until_ready()
    return mq, (handles if ops.rank == reader else [])
