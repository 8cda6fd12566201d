"""Run as ``python _vllm_cuda_children.py <platform> <case>`` (see
test_vllm_cuda_arena.py): vLLM's platform object is replaced, before
anything asks it, by one that answers as vLLM's CUDA platform does
(``platform`` = ``cuda``) or as its CPU platform (``cpu``), since this
machine has no GPU; then fastmq is swapped into vLLM and the queues are
built with the arguments vLLM's own code passes.  Prints one JSON object.
"""
import json
import sys
import threading

PLATFORM, CASE = sys.argv[1], sys.argv[2]

import vllm.platforms  # noqa: E402
from vllm.platforms.interface import Platform, PlatformEnum  # noqa: E402


class CudaLike(Platform):
    _enum = PlatformEnum.CUDA
    device_name = device_type = "cuda"


class CpuLike(Platform):
    _enum = PlatformEnum.CPU
    device_name = device_type = "cpu"


vllm.platforms.current_platform = CudaLike() if PLATFORM == "cuda" else CpuLike()

MiB = 1 << 20


def readers_of(q):
    a = q.tensor_arena
    return None if a is None else a.readers


def handshake(w, n):
    rs = [type(w).create_from_handle(w.export_handle(), r) for r in range(n)]
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    for r in rs:
        r.wait_until_ready()
    t.join(30)
    return rs


def plugin():
    """Through fastmq's plugin: vLLM's queues as vLLM's code builds them."""
    import fastmq.vllm
    from fastmq.vllm import _arena_default

    fastmq.vllm.patch()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    out = {"active": fastmq.vllm.is_active(),
           "decision": {str(e): _arena_default.arena_readers(e) for e in (True, False, None)}}
    # MultiprocExecutor's scheduler broadcast (enable_shm_tensor_arena from
    # the engine arguments, on by default under fastmq) ...
    bq = MessageQueue(2, 2, max_chunk_bytes=16 * MiB, connect_ip="127.0.0.1",
                      enable_shm_tensor_arena=True)
    out["broadcast"] = readers_of(bq)
    out["broadcast_core_isolated"] = bq.tensor_arena.core.isolated
    rs = handshake(bq, 2)
    out["broadcast_readers"] = [readers_of(r) for r in rs]
    out["broadcast_reader_isolated"] = [r.stats()["arena_isolated"] for r in rs]
    # ... and a worker's response queue, built without the argument.
    out["response"] = readers_of(MessageQueue(1, 1))
    # The keyword, which vLLM never passes, still decides.
    out["keyword_isolated"] = readers_of(MessageQueue(1, 1, enable_shm_tensor_arena=True,
                                                      arena_readers="isolated"))
    fastmq.vllm.unpatch()
    import fastmq

    out["after_unpatch"] = readers_of(fastmq.MessageQueue(1, 1, enable_shm_tensor_arena=True))
    for q in [bq, *rs]:
        q.shutdown()
    return out


def pinned():
    """The broadcast's readers under the CUDA decision page-lock the arena
    and hand a slot back only after the event behind the step's copies
    (fastmq._cuda's runtime replaced: there is no CUDA here)."""
    import torch

    import fastmq.vllm
    from fastmq import _cuda

    class Event:
        done = False

        def query(self):
            return self.done

    class Runtime:
        registered, events = [], []

        def is_initialized(self):
            return True

        def host_register(self, ptr, nbytes):
            self.registered.append(nbytes)
            return 0

        def host_unregister(self, ptr):
            return 0

        def record_event(self):
            self.events.append(Event())
            return self.events[-1]

    rt = Runtime()
    _cuda.set_runtime(rt)
    fastmq.vllm.patch()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    w = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    (r,) = handshake(w, 1)
    w.enqueue(torch.ones(4 * MiB))
    t = r.dequeue(timeout=30)
    out = {"readers": readers_of(w), "pinned": r.stats()["arena_pinned"],
           "registered": rt.registered == [r.tensor_arena.total_bytes]}
    del t
    w.enqueue("step")
    r.dequeue(timeout=30)                    # the event is recorded here
    out["held_until_event"] = w.tensor_arena.core.free_slots()[0] != 0
    rt.events[0].done = True
    w.enqueue("step")
    r.dequeue(timeout=30)
    out["free_after_event"] = w.tensor_arena.core.free_slots()[0] == 0
    out["event_gated"] = r.stats()["arena_event_gated"]
    w.shutdown()
    r.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps({"plugin": plugin, "pinned": pinned}[CASE]()), flush=True)
