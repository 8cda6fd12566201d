"""Children for test_signals: each blocks in one fastmq wait, with every
periodic re-check stretched to ten minutes, and has a SIGTERM handler that
raises SystemExit(SIGNALLED), as vLLM's engine core and workers do."""
from __future__ import annotations

SIGNALLED = 7
TEN_MINUTES_NS = 600 * 10**9


def _arm(ready) -> None:
    import signal

    from fastmq import _overflow, _wire

    def handler(signum, frame):
        raise SystemExit(SIGNALLED)

    signal.signal(signal.SIGTERM, handler)
    # A handler that runs only when a slice ends would show up as a ten
    # minute wait, not as a late millisecond.
    _overflow.RECV_SLICE_MS = 600_000
    _overflow.FLUSH_SLICE_S = 600.0
    _wire.SLICE_S = 600.0
    ready.send("armed")


def reader_in_dequeue(handle, rank, ready):
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    if mq._ring is not None:
        mq._ring.park_slice_ns = TEN_MINUTES_NS
    _arm(ready)
    mq.dequeue()


def reader_in_handshake(handle, rank, ready):
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    _arm(ready)
    mq.wait_until_ready()


def writer_in_handshake(ready, n_local, n_remote):
    from fastmq import MessageQueue

    mq = MessageQueue(n_local + n_remote, n_local, max_chunk_bytes=4096, max_chunks=2,
                      connect_ip="127.0.0.1" if n_remote else None,
                      enable_shm_tensor_arena=False)
    _arm(ready)
    mq.wait_until_ready()


def writer_on_a_full_ring(ready, handle_out, mode):
    from fastmq import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, wait_mode=mode,
                      enable_shm_tensor_arena=False)
    handle_out.send(mq.export_handle())
    mq.wait_until_ready()
    mq._ring.park_slice_ns = TEN_MINUTES_NS
    mq.enqueue(0)
    mq.enqueue(1)
    _arm(ready)
    mq.enqueue(2)     # the reader reads nothing: the ring stays full


def idle_reader(handle, rank, done):
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    done.recv()
