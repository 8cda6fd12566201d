"""Faults and hostile input: dead peers, long-wait logs, data in flight,
ring geometry, the remote path, no files."""
from __future__ import annotations

import logging
import os
import pickle
import re
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from fastmq import MessageQueue, ReaderGoneError, _proc
from fastmq._ring import READY, WRITER_CLOSED, WRITER_DIED

import _fault_children as children

WAIT_MODES = ["futex", "zmq", "spin"]


def _connect(writer, ranks):
    """Attach readers ``ranks`` in this process and run the handshake."""
    readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in ranks]
    writer.wait_until_ready()
    for r in readers:
        r.wait_until_ready()
    return readers


def _run_in_thread(fn, *args, **kwargs):
    out = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def _reap(proc):
    """Kill ``proc`` (if needed) and wait for it: its death leaves nothing
    (tests/test_lifetime.py)."""
    if proc.is_alive():
        proc.kill()
    proc.join(10)


# -- dead peers ----------------------------------------------------------------
@pytest.mark.parametrize("wait_mode", WAIT_MODES)
def test_writer_names_dead_reader_while_ring_full(procs, spawn_ctx, wait_mode):
    """kill -9 of a reader while the writer waits on a full ring: the writer
    raises, naming that reader's rank and pid, long before its timeout
    (and so within one warning interval, 60 s by default)."""
    writer = MessageQueue(2, 2, max_chunks=2, max_chunk_bytes=4096, wait_mode=wait_mode)
    ready = spawn_ctx.Event()
    p = procs.start(children.reader_stall, writer.export_handle(), 1, ready)
    reader0 = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready()
    reader0.wait_until_ready()
    assert ready.wait(60)
    for i in range(2):                      # fill the ring; rank 0 keeps up
        writer.enqueue(i)
        assert reader0.dequeue(timeout=10) == i
    killer = threading.Timer(0.3, p.kill)
    killer.start()
    try:
        with pytest.raises(ReaderGoneError) as info:
            writer.enqueue("never read", timeout=30)
    finally:
        killer.join()
    msg = str(info.value)
    assert f"reader rank 1 (pid {p.pid})" in msg and "died" in msg
    # A RuntimeError, as vLLM's queue raises; what went is in its attributes.
    assert isinstance(info.value, RuntimeError)
    assert (info.value.rank, info.value.pid, info.value.how) == (1, p.pid, "died")
    again = pickle.loads(pickle.dumps(info.value))      # e.g. from a worker pool
    assert (type(again), str(again), again.rank, again.pid, again.how) == (
        ReaderGoneError, msg, 1, p.pid, "died")
    assert "rank 0" not in msg
    writer.shutdown()


@pytest.mark.parametrize("wait_mode", WAIT_MODES)
def test_readers_raise_when_writer_killed(procs, spawn_ctx, wait_mode):
    """kill -9 of the writer while two readers wait (parked in futex/zmq
    mode, spinning in spin mode): both raise instead of hanging."""
    parent, child = spawn_ctx.Pipe()
    p = procs.start(children.writer_stall, child, 2, wait_mode, ["hello"])
    handle = parent.recv()
    readers = [MessageQueue.create_from_handle(handle, r) for r in (0, 1)]
    for r in readers:
        r.wait_until_ready()
    assert parent.recv() == "sent"
    assert [r.dequeue(timeout=10) for r in readers] == ["hello", "hello"]
    waits = [_run_in_thread(r.dequeue, timeout=30) for r in readers]
    ring = readers[0]._ring
    if wait_mode != "spin":
        # Kill only once both readers are really parked.
        deadline = time.monotonic() + 20
        while ring.parked_readers < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ring.parked_readers == 2
    else:
        time.sleep(0.3)
        assert ring.parked_readers == 0       # spinning, never parked
    p.kill()
    for t, out in waits:
        t.join(30)
        assert not t.is_alive()
        err = out.get("error")
        assert isinstance(err, RuntimeError) and not isinstance(err, TimeoutError), err
        assert f"writer (pid {p.pid}) died" in str(err)
    del readers, ring
    _reap(p)


def test_reader_waiting_for_overflow_payload_raises_when_writer_killed(procs, spawn_ctx):
    """The writer dies between an overflow mark and its payload: the reader
    waiting on the socket raises instead of hanging."""
    parent, child = spawn_ctx.Pipe()
    p = procs.start(children.writer_stall, child, 1, "futex", [], True)
    reader = MessageQueue.create_from_handle(parent.recv(), 0)
    reader.wait_until_ready()
    assert parent.recv() == "sent"
    t, out = _run_in_thread(reader.dequeue, timeout=30)
    time.sleep(0.3)
    p.kill()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(out.get("error"), RuntimeError) and "died" in str(out["error"])
    del reader
    _reap(p)


def test_a_killed_writers_memory_lives_while_its_reader_maps_it(procs, spawn_ctx):
    """A reader that finds its writer killed raises naming it; the writer's
    ring stays mapped (and readable) by that reader alone until the reader
    lets go, and then no process holds it."""
    from _held import holders_of

    parent, child = spawn_ctx.Pipe()
    p = procs.start(children.writer_stall, child, 1, "futex", ["hello"])
    reader = MessageQueue.create_from_handle(parent.recv(), 0)
    reader.wait_until_ready()
    assert parent.recv() == "sent"
    assert reader.dequeue(timeout=10) == "hello"
    ring = reader._end.buffer.name.split(":")[0]
    assert set(holders_of([ring])) == {os.getpid(), p.pid}
    os.kill(p.pid, 9)
    while _proc.is_alive(p.pid):   # every thread has exited (not reaped yet)
        time.sleep(0.01)
    assert set(holders_of([ring])) == {os.getpid()}
    assert reader._ring.peer_status() == WRITER_DIED
    assert f"writer (pid {p.pid}) died" in str(reader._end._writer_gone_error())
    reader.shutdown()
    del reader
    import gc

    gc.collect()
    assert holders_of([ring]) == {}
    p.join(10)


def test_shut_down_queue_names_a_dead_peer_of_this_process(procs, spawn_ctx):
    """A reader whose writer shut the queue down cannot know why; in vLLM
    the executor does that when another worker died.  The error names the
    process sharing queues with this one that is gone."""
    writer = MessageQueue(2, 2, max_chunks=2, max_chunk_bytes=4096)
    ready = spawn_ctx.Event()
    p = procs.start(children.reader_stall, writer.export_handle(), 1, ready)
    (reader0,) = [MessageQueue.create_from_handle(writer.export_handle(), 0)]
    writer.wait_until_ready()
    reader0.wait_until_ready()
    assert ready.wait(60)
    other = MessageQueue(1, 1, max_chunks=2, max_chunk_bytes=4096)
    (other_reader,) = _connect(other, [0])
    other.shutdown()
    with pytest.raises(RuntimeError) as alive:
        other_reader.dequeue(timeout=30)
    assert str(alive.value) == f"fastmq: the writer (pid {os.getpid()}) shut the queue down"
    p.kill()
    p.join(10)
    with pytest.raises(RuntimeError) as dead:
        other_reader.dequeue(timeout=30)
    msg = str(dead.value)
    assert msg.startswith(f"fastmq: the writer (pid {os.getpid()}) shut the queue down; ")
    assert f"pid {p.pid} (reader 1 of {writer.buffer.name})" in msg, msg
    writer.shutdown()


@pytest.mark.parametrize("wait_mode", WAIT_MODES)
def test_timeouts_and_shutdown_with_live_peers(wait_mode):
    writer = MessageQueue(1, 1, max_chunks=1, max_chunk_bytes=4096, wait_mode=wait_mode)
    (reader,) = _connect(writer, [0])
    # Reader timeout: the writer is alive and idle.
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.3)
    # Writer timeout: the ring is full, the reader is alive and not reading.
    writer.enqueue("a")
    with pytest.raises(TimeoutError):
        writer.enqueue("b", timeout=0.3)
    assert reader.dequeue(timeout=5) == "a"
    # shutdown() from another thread wakes a blocked reader.
    t, out = _run_in_thread(reader.dequeue, timeout=30)
    time.sleep(0.2)
    reader.shutdown()
    t.join(10)
    assert str(out.get("error")) == "cancelled"
    # ... and a writer blocked on a full ring.
    writer.enqueue("c")
    t, out = _run_in_thread(writer.enqueue, "d", timeout=30)
    time.sleep(0.2)
    writer.shutdown()
    t.join(10)
    assert str(out.get("error")) == "cancelled"


def test_reader_gets_what_was_published_before_writer_shutdown():
    writer = MessageQueue(1, 1, max_chunks=4, max_chunk_bytes=4096)
    (reader,) = _connect(writer, [0])
    writer.enqueue(1)
    writer.enqueue(2)
    writer.shutdown()
    assert reader.dequeue(timeout=5) == 1
    assert reader.dequeue(timeout=5) == 2
    with pytest.raises(RuntimeError, match="shut the queue down"):
        reader.dequeue(timeout=30)


def test_peer_check_delivers_message_published_before_writer_left():
    """The reader's peer check sees the writer closed, but a message that
    was published before is still read, not dropped for an error (the check
    re-reads the chunk after loading the writer's state)."""
    writer = MessageQueue(1, 1, max_chunks=2, max_chunk_bytes=4096)
    (reader,) = _connect(writer, [0])
    ring = reader._ring
    writer.enqueue("last words")
    writer.shutdown()
    assert ring.peer_status() == WRITER_CLOSED
    assert ring.wait_next(5) == READY                 # published before: no status
    assert reader.dequeue(timeout=5) == "last words"
    assert ring.wait_next(5) == WRITER_CLOSED
    with pytest.raises(RuntimeError, match="shut the queue down"):
        reader.dequeue(timeout=5)


# -- long-wait log -----------------------------------------------------------
def test_long_wait_log_names_readers_behind(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "1")
    caplog.set_level(logging.INFO, logger="fastmq")
    writer = MessageQueue(2, 2, max_chunks=1, max_chunk_bytes=4096)
    r0, r1 = _connect(writer, [0, 1])
    writer.enqueue("x")
    assert r0.dequeue(timeout=5) == "x"        # rank 1 stays behind
    with pytest.raises(TimeoutError):
        writer.enqueue("y", timeout=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastmq"]
    behind = [m for m in lines if "Readers that have not read chunk 0" in m]
    assert behind, lines
    assert "No available shared memory broadcast block found in 1 seconds" in behind[0]
    # Who is behind (rank and pid) and for how long; rank 0 has read it.
    assert re.search(rf"chunk 0 for [12] s: rank 1 \(pid {os.getpid()}\)\.$", behind[0]), behind
    # A reader waiting for the writer logs too, naming the writer.
    assert r1.dequeue(timeout=5) == "x"
    caplog.clear()
    with pytest.raises(TimeoutError):
        r0.dequeue(timeout=1.5)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastmq"]
    assert any(re.search(rf"reader \(rank 0\) has waited [12] s for the writer "
                         rf"\(pid {os.getpid()}\)", m) for m in lines), lines


# -- data in flight ------------------------------------------------------------
def _mutate_after_enqueue(writer, readers, make):
    """Enqueue ``make()``'s value, scribble over it at once, and check that
    every reader still gets the original."""
    value = make()
    expected = value.clone() if isinstance(value, torch.Tensor) else value.copy()
    writer.enqueue(value)
    value.fill_(7) if isinstance(value, torch.Tensor) else value.fill(7)
    for r in readers:
        got = r.dequeue(timeout=30)
        if isinstance(expected, torch.Tensor):
            assert torch.equal(got, expected)
        else:
            assert np.array_equal(got, expected)


BIG = 4 << 20   # well past the socket buffers: an unsnapshotted send would see the scribble


@pytest.mark.parametrize("make", [
    lambda: np.arange(1000, dtype=np.int64),
    lambda: torch.arange(1000, dtype=torch.float32),
    lambda: torch.arange(600_000, dtype=torch.int32),   # out-of-band buffer, in the ring
], ids=["numpy", "tensor", "tensor-oob"])
def test_mutate_after_enqueue_local_ring(make):
    writer = MessageQueue(2, 2, max_chunks=2, max_chunk_bytes=4 << 20)
    readers = _connect(writer, [0, 1])
    _mutate_after_enqueue(writer, readers, make)
    assert writer.stats()["ring_messages"] == 1


@pytest.mark.parametrize("make", [
    lambda: np.arange(BIG // 8, dtype=np.int64),
    lambda: torch.arange(BIG // 4, dtype=torch.int32),
], ids=["numpy", "tensor"])
def test_mutate_after_enqueue_local_overflow(make):
    writer = MessageQueue(1, 1, max_chunks=2, max_chunk_bytes=1 << 16)
    readers = _connect(writer, [0])
    _mutate_after_enqueue(writer, readers, make)
    assert writer.stats()["overflow_messages"] == 1


@pytest.mark.parametrize("make", [
    lambda: np.arange(BIG // 8, dtype=np.int64),
    lambda: torch.arange(BIG // 4, dtype=torch.int32),
    lambda: torch.arange(100, dtype=torch.int32),
], ids=["numpy", "tensor", "small-tensor"])
def test_mutate_after_enqueue_remote_tcp(make):
    writer = MessageQueue(2, 1, connect_ip="127.0.0.1", max_chunks=2, max_chunk_bytes=1 << 16)
    readers = _connect(writer, [0, 1])
    assert readers[1]._is_remote_reader
    _mutate_after_enqueue(writer, readers, make)
    assert writer.stats()["remote_messages"] == 1


def test_mutate_after_enqueue_with_arena_enabled():
    """With ``enable_shm_tensor_arena=True`` a large tensor is copied into
    an arena slot at enqueue (16 MiB: over the arena's default 8 MiB
    threshold); mutated afterwards, it is still read as it was."""
    writer = MessageQueue(2, 2, max_chunks=2, max_chunk_bytes=1 << 16,
                          enable_shm_tensor_arena=True)
    readers = _connect(writer, [0, 1])
    for make in (lambda: torch.arange(4 * BIG // 4, dtype=torch.int32),
                 lambda: np.arange(4 * BIG // 8, dtype=np.int64),
                 lambda: torch.arange(300, dtype=torch.float32)):
        _mutate_after_enqueue(writer, readers, make)
    if writer.tensor_arena is not None:
        assert writer.stats()["arena_hits"] == 2


# -- ring geometry ---------------------------------------------------------------
def test_env_geometry_overrides_every_queue(monkeypatch, parts_as_if_waiting):
    monkeypatch.setenv("FASTMQ_MAX_CHUNK_MB", "1")
    monkeypatch.setenv("FASTMQ_MAX_CHUNKS", "3")
    writer = MessageQueue(1, 1)              # vLLM's default: 24 MiB x 10
    assert tuple(writer.handle.buffer_handle[:3]) == (1, 1 << 20, 3)
    assert writer.buffer.segment.size < 4 << 20
    (reader,) = _connect(writer, [0])
    writer.enqueue(np.ones(2 << 20, dtype=np.uint8))          # > 1 MiB: 3 parts
    assert reader.dequeue(timeout=10).sum() == 2 << 20
    assert writer.stats()["parts_messages"] == 1


def test_budget_that_does_not_fit_fails_early(monkeypatch):
    monkeypatch.setenv("FASTMQ_MAX_CHUNK_MB", str(1 << 30))   # 1 PiB per chunk
    with pytest.raises(RuntimeError, match="cannot give now"):
        MessageQueue(1, 1)


@pytest.mark.parametrize("var", ["FASTMQ_MAX_CHUNK_MB", "FASTMQ_MAX_CHUNKS"])
def test_bad_budget_env_names_variable(monkeypatch, var):
    monkeypatch.setenv(var, "lots")
    with pytest.raises(ValueError, match=var):
        MessageQueue(1, 1)


# -- owner-only files ---------------------------------------------------------------
def test_segments_and_sockets_have_no_files():
    """Nothing of a queue is a file (so no mode to get wrong, nothing to
    leave): its segments are memory files reached through the writer's
    /proc, its sockets abstract."""
    from _held import held_segments

    writer = MessageQueue(1, 1, wait_mode="zmq")
    h = writer.handle
    for addr in (h.local_subscribe_addr, h.local_notify_addr):
        assert addr.startswith("ipc://@"), addr
    name, fd, ino = h.buffer_handle[3].rsplit(":", 2)
    assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}")
    assert os.stat(f"/proc/self/fd/{fd}").st_ino == int(ino)
    assert name in held_segments()
    assert not os.path.exists(f"/dev/shm/{name}")
    (reader,) = _connect(writer, [0])
    writer.enqueue("ok")
    assert reader.dequeue(timeout=10) == "ok"