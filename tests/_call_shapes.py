"""The queue calls of vLLM 0.33.0's multi-node executor and of
``parallel_state.GroupCoordinator``, for tests/test_vllm_call_shapes.py.

``main(rank, port)`` runs one rank of a 2-rank gloo group (rank 0 on node
0, rank 1 on node 1, see ``_nodes``) with whatever class vLLM's
``shm_broadcast.MessageQueue`` is in this process (``FASTMQ_VLLM`` decides):

* rank 0 first tries the ranks ``create_from_handle`` takes and refuses
  (``refusals``), then plays both the engine (the scheduler broadcast's
  writer, and the reader of every worker's response queue) and worker 0;
* every call is the one vLLM makes, with vLLM's own arguments: the executor's
  ``MessageQueue(world, local_world, connect_ip=...)``,
  ``MessageQueue(1, 1)`` + ``create_from_handle(h, 0)``,
  ``create_from_handle(h, -1)`` on a peer's response queue, and
  ``GroupCoordinator.create_mq_broadcaster`` (blocking, and with
  ``external_writer_handle`` and ``blocking=False``) and
  ``create_single_reader_mq_broadcasters``.

Prints ``RESULT <json>`` as its last line.  Imports nothing of vLLM at
module level.
"""
from __future__ import annotations

import json
import os
import threading
import types

SHM = "vllm.distributed.device_communicators.shm_broadcast"
WORLD = 2
N = 3


def _payload(i: int):
    if i == N:
        # A large in-band message (about 4 MB of small objects): several
        # segments to a remote worker, whose dequeue(indefinite=True)
        # unpickles it as it arrives.
        return [bytes([k % 251]) * 1000 for k in range(4000)]
    return {"step": i, "blob": bytes(range(256)) * (i + 1)}


def refusals(MessageQueue) -> dict:
    """What ``create_from_handle`` does with odd ranks: on a queue with no
    remote readers, and on one with a remote reader (any rank not listed as
    local is a remote reader there)."""
    out = {"local_only": {}, "mixed": {}}
    local = MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=2)
    for rank in (None, "0", 1.5, 2, 5, -1):
        try:
            MessageQueue.create_from_handle(local.export_handle(), rank)
            out["local_only"][repr(rank)] = "attached"
        except Exception as e:
            out["local_only"][repr(rank)] = f"{type(e).__name__}: {e}"
    mixed = MessageQueue(2, 1, max_chunk_bytes=1 << 16, max_chunks=2, connect_ip="127.0.0.1")
    for rank in (-1, 1, 2, 5, 99):
        try:
            r = MessageQueue.create_from_handle(mixed.export_handle(), rank)
            out["mixed"][repr(rank)] = "remote" if r.local_reader_rank == -1 else "local"
        except Exception as e:
            out["mixed"][repr(rank)] = f"{type(e).__name__}: {e}"
    return out


def _in_thread(fn) -> threading.Thread:
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # reported by join()
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.errors = errors
    t.start()
    return t


def _join(*threads) -> None:
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a writer's wait_until_ready() did not return"
        if t.errors:
            raise t.errors[0]


def main(rank: int, port: int) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch.distributed as dist

    import vllm.distributed.device_communicators.shm_broadcast as shm
    from vllm.distributed.parallel_state import GroupCoordinator

    MessageQueue = shm.MessageQueue
    out = {"rank": rank, "class": MessageQueue.__module__}
    if rank == 0:
        out["refusals"] = refusals(MessageQueue)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    group = types.SimpleNamespace(cpu_group=dist.group.WORLD, ranks=list(range(WORLD)))
    # Rank 0 stands in for vLLM's GroupCoordinator there; the executor's
    # engine process is rank 0 too.

    # 1. The single-node worker's response queue: MessageQueue(1, 1) read by
    # the engine as rank 0.
    if rank == 0:
        mine = MessageQueue(1, 1)
        engine_side = MessageQueue.create_from_handle(mine.export_handle(), 0)
        t = _in_thread(mine.wait_until_ready)
        engine_side.wait_until_ready()
        _join(t)
        for i in range(N):
            mine.enqueue(_payload(i))
        out["single_node_response"] = [engine_side.dequeue(timeout=60) == _payload(i)
                                       for i in range(N)]

    # 2. GroupCoordinator's own broadcaster (blocking, writer rank 0; rank 1
    # is on the other node: a remote reader).
    mq = GroupCoordinator.create_mq_broadcaster(group)
    out["group_broadcast"] = [mq.broadcast_object(_payload(i) if rank == 0 else None)
                              == _payload(i) for i in range(N)]
    out["group_broadcast_remote"] = bool(rank == 1 and mq._is_remote_reader)

    # 3. The multi-node executor: the engine's scheduler broadcast
    # (world_size readers, local_world_size of them local), joined by the
    # workers through create_mq_broadcaster(external_writer_handle=...,
    # blocking=False), and each worker's response queue from
    # create_single_reader_mq_broadcasters, read by the engine.
    engine_mq = handle = None
    if rank == 0:
        engine_mq = MessageQueue(WORLD, 1, max_chunk_bytes=1 << 20, connect_ip="127.0.0.1")
        handle = engine_mq.export_handle()
    rpc_mq = GroupCoordinator.create_mq_broadcaster(group, external_writer_handle=handle,
                                                    blocking=False)
    response_mq, handles = GroupCoordinator.create_single_reader_mq_broadcasters(
        group, reader_rank_in_group=0)
    if rank == 0:
        # What the engine does with worker 0's ready message
        # (WorkerProc.wait_for_response_handle_ready).
        own = MessageQueue.create_from_handle(response_mq.export_handle(), 0)
        peers = [MessageQueue.create_from_handle(h, -1)
                 if h.remote_subscribe_addr is not None else None for h in handles]
        out["peer_handles_remote"] = [p is not None for p in peers]
        writers = [_in_thread(engine_mq.wait_until_ready),
                   _in_thread(response_mq.wait_until_ready)]
        rpc_mq.wait_until_ready()
        own.wait_until_ready()
        peers[1].wait_until_ready()
        _join(*writers)
        for i in range(N + 1):
            engine_mq.enqueue(("echo", _payload(i)))
        # A worker's call (WorkerProc.worker_busy_loop).
        got = [rpc_mq.dequeue(indefinite=True) for _ in range(N + 1)]
        for _, p in got:
            response_mq.enqueue(("from", 0, p))
        answers = [[own.dequeue(timeout=60), peers[1].dequeue(timeout=60)]
                   for _ in range(N + 1)]
        out["executor_round_trips"] = [
            a == [("from", 0, _payload(i)), ("from", 1, _payload(i))]
            for i, a in enumerate(answers)]
        # fastmq's counters (vLLM's class has none): with a remote reader on
        # the queue the large message reaches the local worker over the
        # overflow socket, as in vLLM (parts are for queues of local readers).
        st = getattr(engine_mq, "stats", dict)()
        out["large_path"] = [st.get("parts_messages"), st.get("overflow_messages")]
    else:
        out["rpc_remote"] = bool(rpc_mq._is_remote_reader)
        rpc_mq.wait_until_ready()
        response_mq.wait_until_ready()
        for _ in range(N + 1):
            _, p = rpc_mq.dequeue(indefinite=True)
            response_mq.enqueue(("from", 1, p))
    dist.barrier()   # every answer is in before anyone goes
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
