"""The core queue: content over every path, surface, errors and cleanup."""
from __future__ import annotations

import os
import pickle
import socket
import threading

import numpy as np
import pytest
import torch

import _core_children as cc
from _queues import local_pair
from fastmq import (CorruptChunkError, Handle, MessageQueue, ShmFullError, ShmRingBuffer,
                    check_shm_free_space)


class MyTensor(torch.Tensor):
    """A tensor subclass the queue must not turn into a plain Tensor."""


def _pair(n_local=1, **kw):
    return local_pair(n_local, **kw)


@pytest.mark.parametrize("n_readers", [1, 2, 4])
def test_mixed_messages_to_local_readers(procs, spawn_ctx, n_readers):
    count = {1: 1200, 2: 600, 4: 300}[n_readers]
    w = MessageQueue(n_readers, n_readers, max_chunk_bytes=cc.CHUNK, max_chunks=4,
                     enable_shm_tensor_arena=False)
    q = spawn_ctx.Queue()
    for r in range(n_readers):
        procs.start(cc.reader_main, w.export_handle(), r, count, q)
    w.wait_until_ready()
    for i in range(count):
        w.enqueue(cc.make_message(i), timeout=60)
    results = dict(q.get(timeout=120) for _ in range(n_readers))
    procs.join_all()
    assert results == {r: [] for r in range(n_readers)}
    st = w.stats()
    # Larger than a chunk: in parts when they fit the free ring, else over the socket.
    oversize = sum(1 for i in range(count) if i % 9 in (5, 6))
    assert st["ring_messages"] > 0 and st["parts_messages"] > 0
    assert st["parts_messages"] + st["overflow_messages"] == oversize


def test_remote_reader_next_to_local(procs, spawn_ctx):
    count = 300
    w = MessageQueue(2, 1, max_chunk_bytes=cc.CHUNK, max_chunks=4, connect_ip="127.0.0.1")
    h = w.export_handle()
    assert h.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    q = spawn_ctx.Queue()
    procs.start(cc.reader_main, h, 0, count, q)   # local
    procs.start(cc.reader_main, h, 1, count, q)   # rank 1 is not local: TCP
    w.wait_until_ready()
    for i in range(count):
        w.enqueue(cc.make_message(i), timeout=60)
    results = dict(q.get(timeout=120) for _ in range(2))
    procs.join_all()
    assert results == {0: [], 1: []}
    assert w.stats()["remote_messages"] == count


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_remote_reader_ipv6():
    if not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    w = MessageQueue(1, 0, connect_ip="::1")
    h = w.export_handle()
    assert h.remote_addr_ipv6 and h.remote_subscribe_addr.startswith("tcp://[::1]:")
    r = MessageQueue.create_from_handle(h, 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join(10)
    w.enqueue({"v6": True})
    assert r.dequeue(timeout=10) == {"v6": True}


def test_tensor_semantics_in_process():
    w, (r,) = _pair(max_chunk_bytes=cc.CHUNK, max_chunks=2, enable_shm_tensor_arena=False)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cases = {
        "noncontig": base.t(),
        "zero_dim": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 7, dtype=torch.float8_e4m3fn),
        "grad": torch.ones(3, requires_grad=True),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "big_oob": torch.arange(300_000, dtype=torch.int64),   # 2.4 MiB: overflow
        "mid_oob": torch.arange(150_000, dtype=torch.int64),   # 1.2 MiB: oob in chunk
    }
    for name, t in cases.items():
        w.enqueue(t)
        got = r.dequeue(timeout=10)
        assert type(got) is type(t), name
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.resolve_conj(), t.detach().resolve_conj()), name
        assert got.requires_grad == t.requires_grad, name
        if got.numel() and not got.requires_grad:
            got.view(-1)[0] = got.view(-1)[-1]   # writable
    # A tensor rebuilt from a chunk does not alias it: the chunk is reused.
    w.enqueue(torch.full((300_000 // 2,), 7, dtype=torch.int64))  # oob in chunk 0
    kept = r.dequeue(timeout=10)
    for i in range(4):
        w.enqueue(bytes([i]) * 1_500_000)
        r.dequeue(timeout=10)
    assert bool((kept == 7).all())


def test_numpy_and_subclass_types():
    w, (r,) = _pair(max_chunk_bytes=cc.CHUNK, max_chunks=2)

    a = np.arange(200_000, dtype=np.float64)      # 1.6 MiB: out of band
    w.enqueue({"a": a, "f": np.float32(2.5)})
    got = r.dequeue(timeout=10)
    assert np.array_equal(got["a"], a) and got["a"].flags.writeable
    sub = torch.ones(3).as_subclass(MyTensor)
    w.enqueue(sub)
    assert type(r.dequeue(timeout=10)) is MyTensor


def test_timeouts_both_sides_and_queue_survives():
    w, (r,) = _pair(max_chunk_bytes=1024, max_chunks=2)
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.2)
    w.enqueue(1)
    w.enqueue(2)
    with pytest.raises(TimeoutError):
        w.enqueue(3, timeout=0.2)       # ring full: nobody read
    assert r.dequeue(timeout=5) == 1
    w.enqueue(4, timeout=5)
    assert [r.dequeue(timeout=5), r.dequeue(timeout=5)] == [2, 4]


def test_shutdown_stops_busy_reader():
    w, (r,) = _pair(max_chunks=4)
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            try:
                w.enqueue(i, timeout=0.05)
                i += 1
            except TimeoutError:
                pass

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(200):
            r.dequeue(timeout=10)
        r.shutdown()
        with pytest.raises(RuntimeError, match="cancelled"):
            for _ in range(100):
                r.dequeue(timeout=10)
    finally:
        stop.set()
        t.join(10)


def test_reader_raising_inside_acquire_read_marks_read():
    w, (r,) = _pair(max_chunks=2)
    w.enqueue("first")
    with pytest.raises(ZeroDivisionError):
        with r.acquire_read(timeout=5):
            1 / 0
    w.enqueue("second")
    w.enqueue("third")        # would time out if "first" were still unread
    assert r.dequeue(timeout=5) == "second"
    assert r.dequeue(timeout=5) == "third"


def test_acquire_write_raw_chunk_roundtrip():
    w, (r,) = _pair()
    with w.acquire_write(timeout=5) as buf:
        buf[:4] = b"abcd"
    with r.acquire_read(timeout=5) as buf:
        assert bytes(buf[:4]) == b"abcd"


def test_unpicklable_object_writes_nothing():
    w, (r,) = _pair(max_chunks=2)
    idx = w.current_idx
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        w.enqueue({"f": lambda: 1})
    assert w.current_idx == idx
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.1)
    w.enqueue({"ok": 1})
    assert r.dequeue(timeout=5) == {"ok": 1}


@pytest.mark.parametrize("garbage", [
    b"\x07",                                                   # bad overflow mark
    b"\x00\x00\x00\x00" + (0).to_bytes(4, "little"),           # zero buffers
    b"\x00\x00\x00\x00" + (1 << 31).to_bytes(4, "little"),     # absurd count
    b"\x00\x00\x00\x00" + (1).to_bytes(4, "little") + (1 << 62).to_bytes(8, "little"),
    b"\x00\x00\x00\x00" + (2).to_bytes(4, "little") + (10).to_bytes(8, "little")
    + (4060).to_bytes(8, "little"),                            # second buffer overruns
])
def test_corrupt_chunk_raises_and_queue_survives(garbage):
    w, (r,) = _pair(max_chunk_bytes=4096, max_chunks=2)
    with w.acquire_write(timeout=5) as buf:
        buf[:len(garbage)] = garbage
    with pytest.raises(CorruptChunkError):
        r.dequeue(timeout=5)
    w.enqueue("intact")
    assert r.dequeue(timeout=5) == "intact"


def test_garbage_pickle_stream_raises_cleanly():
    w, (r,) = _pair(max_chunk_bytes=4096, max_chunks=2)
    with w.acquire_write(timeout=5) as buf:
        junk = (b"\x00\x00\x00\x00" + (1).to_bytes(4, "little")
                + (8).to_bytes(8, "little") + b"\xffnot_pk")
        buf[:len(junk)] = junk
    with pytest.raises(pickle.UnpicklingError):
        r.dequeue(timeout=5)
    w.enqueue("next")
    assert r.dequeue(timeout=5) == "next"


def test_ring_larger_than_memory_raises_at_creation():
    # Reserved at creation: an error now, never the OOM killer or a fault later.
    with pytest.raises(ShmFullError, match="cannot give now"):
        MessageQueue(1, 1, max_chunk_bytes=1 << 40, max_chunks=4)
    with pytest.raises(RuntimeError, match="Insufficient space"):
        check_shm_free_space(1 << 50)


def _mapped_pages(buf) -> int:
    """How many of ``buf``'s pages are in this process's page tables
    (/proc/self/pagemap: bit 63 of each page's entry)."""
    import ctypes
    import struct

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    page = os.sysconf("SC_PAGE_SIZE")
    assert addr % page == 0
    n = len(buf) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // page * 8)
        entries = struct.unpack(f"{n}Q", f.read(8 * n))
    return sum(e >> 63 for e in entries)


def test_a_chunk_taken_for_writing_is_mapped_before_the_copy():
    # The writer's first use of a chunk allocates its pages and maps them
    # in one call, before anything is written: the copy into a fresh chunk
    # then takes no page fault per 4 KiB (posix_fallocate allocated only).
    w, (r,) = _pair(max_chunk_bytes=4 << 20, max_chunks=2)

    class Looked(Exception):
        pass

    with pytest.raises(Looked):       # (an exception leaves the chunk unpublished)
        with w.acquire_write(timeout=5) as buf:
            mapped, pages = _mapped_pages(buf), len(buf) // os.sysconf("SC_PAGE_SIZE")
            raise Looked
    assert mapped == pages
    w.enqueue("next")
    assert r.dequeue(timeout=5) == "next"


def test_attach_missing_segment():
    ghost = ShmRingBuffer(1, 1024, 2, name="fastmq_0_ring_doesnotexist:3:1")
    assert ghost.segment is None          # deferred, as for handles on other nodes
    w = MessageQueue(1, 1)
    h = w.export_handle()
    from fastmq import BufferHandle

    def with_name(name):
        return Handle(**{**h.__dict__, "buffer_handle": BufferHandle(
            1, h.buffer_handle[1], h.buffer_handle[2], name)})

    # The writer's pid, another descriptor: not that file.
    name, fd, ino = h.buffer_handle[3].rsplit(":", 2)
    gone = f"{name}:{fd}:{int(ino) + 1}"
    with pytest.raises(FileNotFoundError, match="is gone"):
        MessageQueue.create_from_handle(with_name(gone), 0)
    # A segment the writer does not hand its readers, at a descriptor it
    # does not have.
    with pytest.raises(FileNotFoundError, match="is gone"):
        MessageQueue.create_from_handle(with_name(f"{name[:-4]}beef:9999:{ino}"), 0)
    with pytest.raises(ValueError, match="not a fastmq segment locator"):
        MessageQueue.create_from_handle(with_name("fastmq_0_ring_gone"), 0)
    r = MessageQueue.create_from_handle(h, 0)      # the right one still works
    w.wait_until_ready()
    r.wait_until_ready()
    w.enqueue(1)
    assert r.dequeue(timeout=10) == 1


def test_handle_is_picklable_and_has_vllm_fields():
    w = MessageQueue(2, 1, connect_ip="127.0.0.1")
    h = pickle.loads(pickle.dumps(w.export_handle()))
    assert h == w.export_handle()
    for f in ("local_reader_ranks", "buffer_handle", "local_subscribe_addr",
              "local_notify_addr", "remote_subscribe_addr", "remote_addr_ipv6",
              "tensor_arena_handle"):
        assert hasattr(h, f)
    n, chunk, chunks, name = (h.buffer_handle[i] for i in range(4))
    assert (n, chunk, chunks) == (1, 24 << 20, 10) and name.startswith("fastmq_")


def test_broadcast_object_in_process():
    w, rs = _pair(n_local=2)
    assert w.broadcast_object({"x": 1}) == {"x": 1}
    assert [r.broadcast_object() for r in rs] == [{"x": 1}, {"x": 1}]


def test_segments_released_on_gc():
    from _held import held_segments

    w, (r,) = _pair()
    name = w.buffer.name.split(":")[0]
    assert name in held_segments()
    w.shutdown()
    r.shutdown()
    del w, r
    import gc

    gc.collect()
    assert name not in held_segments()


@pytest.mark.parametrize("single_reader", [False, True])
def test_process_group_gloo(procs, spawn_ctx, tmp_path, single_reader):
    world = 3
    q = spawn_ctx.Queue()
    init = tmp_path / "gloo_init"
    for rank in range(world):
        procs.start(cc.gloo_main, rank, world, str(init), q, single_reader)
    results = dict(q.get(timeout=120) for _ in range(world))
    procs.join_all(timeout=60)
    if single_reader:
        assert results[0] == [("from", 1), ("from", 2)]
    else:
        for rank in range(world):
            out, n_local = results[rank]
            assert out == [{"n": n} for n in range(5)]
        assert results[1][1] == 2          # both other ranks share this node


def test_hostile_tensor_stub_with_empty_buffer_raises():
    from fastmq._serde import rebuild_tensor

    with pytest.raises(pickle.UnpicklingError, match="empty buffer"):
        rebuild_tensor(b"", (1 << 40,), "float32")
    assert rebuild_tensor(b"", (0, 3), "bfloat16").shape == (0, 3)


def test_single_reader_names_a_global_rank(procs, spawn_ctx, tmp_path):
    q = spawn_ctx.Queue()
    init = tmp_path / "gloo_init"
    for rank in range(3):
        procs.start(cc.gloo_subgroup_single_reader, rank, 3, str(init), q)
    results = dict(q.get(timeout=120) for _ in range(3))
    procs.join_all(timeout=60)
    assert results == {0: None, 1: (2, "from global rank 2"), 2: (0, None)}


def test_infinite_timeout_waits_instead_of_expiring():
    w, (r,) = _pair(spin_us=0)
    threading.Timer(0.3, w.enqueue, args=("late",)).start()
    assert r.dequeue(timeout=float("inf")) == "late"
    threading.Timer(0.3, w.enqueue, args=(b"x" * (25 << 20),)).start()   # overflow path
    assert len(r.dequeue(timeout=1e12)) == 25 << 20


def test_handles_are_ordinary_values():
    """A handle converts, serialises and unpacks like any dataclass and
    tuple; fastmq tells its ring from vLLM's by the buffer handle's type."""
    import dataclasses
    import json

    from fastmq import HandleMismatchError

    w = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2, enable_shm_tensor_arena=False)
    h = w.export_handle()
    assert dataclasses.asdict(h)["buffer_handle"] == h.buffer_handle
    assert list(h.buffer_handle) == [2, 4096, 2, w.buffer.name]
    n_reader, chunk_bytes, n_chunks, name = h.buffer_handle
    assert (n_reader, chunk_bytes, n_chunks, name) == (2, 4096, 2, w.buffer.name)
    assert json.loads(json.dumps(h.buffer_handle)) == list(h.buffer_handle)
    assert pickle.loads(pickle.dumps(h)) == h
    # A plain tuple is what vLLM's own queue puts there.
    foreign = dataclasses.replace(h, buffer_handle=tuple(h.buffer_handle))
    with pytest.raises(HandleMismatchError, match="created by vLLM's own MessageQueue"):
        MessageQueue.create_from_handle(foreign, 0)
    r = MessageQueue.create_from_handle(pickle.loads(pickle.dumps(h)), 1)   # still usable
    del r
    w.shutdown()
