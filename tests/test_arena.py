"""The shared-memory tensor arena: content, zero copy, slot lifetimes,
fallbacks, CUDA pinning logic (fake runtime), sizing, and end to end through
``MessageQueue`` with reader processes."""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import re
import shutil
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import _arena_children as ac
from _queues import local_pair
from fastmq import MessageQueue, _arena, _arena_reader, _cuda, shm_usage
from fastmq import arena as A
from fastmq._arena import ArenaEnd, SlotBuffer
from fastmq._arena_reader import ArenaReaderEnd
from fastmq._arena_writer import ArenaWriterEnd

MiB = 1 << 20


def _pair(n_local=1, slots=4, slot_mb=4, min_mb=1, **kw):
    """A writer with an arena and ``n_local`` in-process readers, handshaken."""
    w, rs = local_pair(n_local, arena_slots=slots, arena_slot_mb=slot_mb,
                       arena_min_mb=min_mb, **kw)
    assert w.tensor_arena is not None
    return w, rs


def _core(q):
    return q.tensor_arena.core


def _held_by(w, slot):
    """Readers that still hold ``slot`` (published and not released)."""
    _, written, done = _core(w).slot_state(slot)
    return [r for r, d in enumerate(done) if written and not d]


def _addr(x):
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def _blocks(q):
    """Bytes of memory actually allocated to the queue's arena segment."""
    return q.tensor_arena.core.segment.held_bytes()


# -- content and zero copy ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.int64, torch.float16, torch.complex64])
def test_tensor_round_trip_is_byte_exact_and_zero_copy(dtype):
    w, (r,) = _pair()
    g = torch.Generator().manual_seed(1)
    numel = 3 * MiB // dtype.itemsize                   # 3 MiB whatever the dtype
    src = torch.randn(numel, generator=g).to(dtype) if dtype != torch.int64 else \
        torch.randint(-2**62, 2**62, (numel,), generator=g, dtype=torch.int64)
    src = src.reshape(-1, 8)
    w.enqueue({"t": src, "tag": "x"})
    got = r.dequeue(timeout=10)["t"]
    assert got.dtype == dtype and got.shape == src.shape
    assert got.view(torch.uint8).reshape(-1).numpy().tobytes() == \
        src.view(torch.uint8).reshape(-1).numpy().tobytes()
    # Zero copy: the reader's tensor lies inside the reader's own mapping of
    # the arena, not in memory the transport copied.
    assert r.tensor_arena.contains(got.data_ptr())
    assert not w.tensor_arena.contains(got.data_ptr())   # another mapping
    st = w.stats()
    assert st["arena_hits"] == 1 and st["arena_bytes"] == src.nbytes
    assert st["ring_messages"] == 1 and st["ring_bytes"] < 1024   # only a descriptor travelled
    assert r.stats()["arena_views"] == 1


@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_copy_is_byte_exact(threads):
    # The threads take 256 KiB steps in turn, each populating its cold
    # pages first.  5 MiB + 7 bytes into a cold slot, then 13 MiB + 5 (warm
    # up to a page boundary inside a step, the last step ragged), then the
    # same into warm pages.
    w, (r,) = _pair(slots=2, slot_mb=16, arena_copy_threads=threads, arena_prefault="off")
    rng = np.random.default_rng(5)
    for n in (5 * MiB + 7, 13 * MiB + 5, 13 * MiB + 5):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        w.enqueue(src)
        got = r.dequeue(timeout=10)
        assert np.array_equal(got, src) and r.tensor_arena.contains(got.ctypes.data)
        del got
    assert _core(w).faulted_bytes(0) == 13 * MiB + 4096


# -- readers' in-place writes: private by default, shared on request -------------------
def _writer_bytes(w, r, t):
    """What the writer's own mapping holds where reader ``r``'s tensor ``t`` lies."""
    off = t.data_ptr() - _core(r).data_address
    return ctypes.string_at(_core(w).data_address + off, t.nbytes)


def _perms(addr):
    """Permissions of the mapping holding ``addr`` in /proc/self/maps (e.g. ``rw-p``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return perms
    raise AssertionError(f"{addr:#x} is not mapped")


def test_readers_own_their_tensors_by_default():
    w, (r1, r2) = _pair(2)
    src = torch.arange(MiB // 2, dtype=torch.float32)            # 2 MiB
    w.enqueue(src)
    a, b = r1.dequeue(timeout=10), r2.dequeue(timeout=10)
    for r, t in ((r1, a), (r2, b)):
        assert r.tensor_arena.contains(t.data_ptr())           # still zero copy
        assert r.stats()["arena_isolated"] == 1
    # Slots are copy-on-write in readers, shared in the writer; the header
    # and flag lines stay shared everywhere.
    assert _perms(_core(r1).data_address) == "rw-p"
    assert _perms(_core(r1).address) == "rw-s"
    assert _perms(_core(w).data_address) == "rw-s"
    a.add_(1)
    assert torch.equal(a, src + 1)                             # the writer of a sees it
    assert torch.equal(b, src)                                 # the other reader does not
    assert _writer_bytes(w, r1, a) == src.numpy().tobytes()    # nor does the writer
    b[7] = -5.0
    assert a[7].item() == 8.0 and torch.equal(b[8:], src[8:])
    assert w.stats()["arena_hits"] == 1 and w.stats()["arena_isolated"] == 1


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "whole-slot"])
def test_a_later_message_in_the_slot_shows_no_earlier_write(scan):
    if scan and not _arena_reader.cow_scan_available():
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux 6.7)")
    prev = _arena_reader.set_cow_scan(scan)
    try:
        w, (r,) = _pair(slots=1)                     # every message uses slot 0
        n = MiB // 2                                  # 2 MiB of float32: 512 pages
        for i in range(4):
            w.enqueue(torch.full((n,), float(i)))
            t = r.dequeue(timeout=10)
            assert r.tensor_arena.contains(t.data_ptr())
            assert torch.all(t == float(i)), f"message {i} shows an earlier message's write"
            if i % 2 == 0:
                t.add_(100)                           # every page
            else:
                t[n // 2:].mul_(-1)                   # the second half only
            del t
        st = r.stats()
        assert st["arena_released"] == 4 and w.stats()["arena_hits"] == 4
        # The last message's pages go at the next dequeue(), before it views the slot.
        w.enqueue(torch.full((n,), 9.0))
        t = r.dequeue(timeout=10)
        assert torch.all(t == 9.0)
        del t
        st = r.stats()
        if scan:
            # Exactly the pages written, and nothing when nothing was.
            assert st["arena_private_bytes_dropped"] == 2 * (2 * MiB) + 2 * MiB
            assert st["arena_whole_slot_drops"] == 0
            w.enqueue(torch.full((n,), 9.0))
            assert torch.all(r.dequeue(timeout=10) == 9.0)
            assert r.stats()["arena_private_bytes_dropped"] == st["arena_private_bytes_dropped"]
        else:
            assert st["arena_whole_slot_drops"] == 4
            assert st["arena_private_bytes_dropped"] == 0
    finally:
        _arena_reader.set_cow_scan(prev)


@pytest.mark.parametrize("how", ["store", "system call"])
def test_a_reader_that_took_no_fault_skips_the_walk_and_a_later_write_still_goes(how, tmp_path):
    # Finding a reader's private pages walks the page tables of what it
    # viewed (~2.7 ms per 256 MiB); a private copy needs a write fault of
    # the process, so while its fault count stands still the walk is
    # skipped.  A write after skipped walks, by a store or by the kernel
    # writing into the view, is still found and dropped.
    if not _arena_reader.cow_scan_available():
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux 6.7)")
    w, (r,) = _pair(slots=1)                          # every message in slot 0
    src = torch.full((MiB // 2,), 3.0)                # 2 MiB, one tensor sent again and again
    for i in range(200):
        w.enqueue(src)
        t = r.dequeue(timeout=10)
        assert float(t[0]) == 3.0 and float(t[-1]) == 3.0
        del t
        if r.stats()["arena_page_walks_skipped"] >= 3:
            break
    st = r.stats()
    assert st["arena_page_walks_skipped"] >= 3, st
    assert st["arena_private_bytes_dropped"] == 0
    w.enqueue(src)
    t = r.dequeue(timeout=10)
    view = t.numpy().view(np.uint8)
    if how == "store":
        view[4096 * 5:4096 * 7] = 0xee                        # two pages
    else:
        path = tmp_path / "pages"
        path.write_bytes(b"\xee" * (2 * 4096))
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.readv(fd, [memoryview(view)[4096 * 5:4096 * 7]]) == 2 * 4096
        finally:
            os.close(fd)
    assert view[4096 * 5] == 0xee
    del t, view
    w.enqueue(src)
    t = r.dequeue(timeout=10)
    assert torch.all(t == 3.0), "a write after skipped walks shows in the next message"
    assert r.stats()["arena_private_bytes_dropped"] == 2 * 4096


def test_private_pages_go_at_the_next_dequeue_and_never_under_a_live_view():
    # A slot goes back to the writer when its last view dies; the reader's
    # own writes in it are dropped at its next dequeue(), or before it views
    # the slot again, whichever comes first; a slot it still views keeps them.
    if not _arena_reader.cow_scan_available():
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux 6.7)")
    w, (r,) = _pair(slots=2)
    w.enqueue(torch.zeros(MiB // 2))                  # 2 MiB in slot 0
    kept = r.dequeue(timeout=10)
    kept.add_(1)                                      # private, and in use
    for i in range(6):
        n = MiB // 2 if i % 2 else MiB // 4           # 2 MiB and 1 MiB in turn, slot 1
        w.enqueue(torch.full((n,), float(i)))
        t = r.dequeue(timeout=10)
        assert torch.all(t == float(i)), f"message {i} shows an earlier message's write"
        t.add_(100)
        del t
        assert _held_by(w, 1) == []                   # handed back at once
        assert torch.all(kept == 1.0)                 # a live view keeps its writes
    assert r.stats()["arena_private_bytes_dropped"] == 3 * MiB + 2 * (2 * MiB)
    w.enqueue(torch.full((MiB // 2,), 7.0))           # slot 1, the last write still there
    t = r.dequeue(timeout=10)
    assert torch.all(t == 7.0) and torch.all(kept == 1.0)
    del kept, t
    r.tensor_arena.flush_releases()
    assert r.stats()["arena_private_bytes_dropped"] == 3 * MiB + 3 * (2 * MiB) + 2 * MiB
    w.enqueue(torch.full((MiB // 2,), 8.0))
    assert torch.all(r.dequeue(timeout=10) == 8.0)


def test_a_slot_viewed_again_before_any_dequeue_drops_the_writes_first():
    # A view that dies between two map_oob() calls with no flush between
    # them (another thread's garbage, a caller driving the arena itself):
    # the slot is the writer's again at once, and resolving its next
    # publication drops this reader's writes before making the view.
    writer = A.ShmTensorArena(1, 1 << 16, 1, min_bytes=1, prefault="off")
    reader = A.ShmTensorArena(*writer.handle(), reader_rank=0)
    try:
        for fill in (1, 2, 3):
            data = np.full(1 << 15, fill, dtype=np.uint8)
            desc = writer.copy_to_slot(pickle.PickleBuffer(data))
            writer.commit()
            assert desc is not None, f"slot not handed back before message {fill}"
            (view,) = reader.map_oob([desc])
            assert bytes(view) == data.tobytes(), f"message {fill} shows an earlier write"
            view[:100] = b"\xee" * 100                # a private copy of the first page
            view.release()
            del view
    finally:
        reader.close()
        writer.close()


def test_a_reader_that_locks_its_memory_sees_each_message(procs, spawn_ctx):
    # Under mlockall(MCL_FUTURE) a writable private mapping is locked as it
    # is made, which writes every page: a snapshot of the arena that no
    # later message reaches. The reader's slots must be the shared pages.
    w = MessageQueue(1, 1, enable_shm_tensor_arena=True, arena_slots=1, arena_slot_mb=4,
                     arena_min_mb=1)
    q = spawn_ctx.Queue()
    procs.start(ac.locked_reader_main, w.export_handle(), q)
    try:
        w.wait_until_ready()
        for i in range(3):          # one slot, handed back before the next: reused
            w.enqueue(torch.full((MiB // 4,), float(i + 1)), timeout=30)
            kind, seen = q.get(timeout=60)
            if kind == "mlockall":
                pytest.skip(f"mlockall refused here: {seen}")
            assert (kind, seen) == ("seen", (float(i + 1), float(i + 1), True)), i
    finally:
        w.shutdown()


def test_writer_memory_is_not_written_by_readers():
    w, (r,) = _pair()
    t = w.empty_tensor((MiB // 4,), torch.float32)              # sent without a copy
    t.fill_(3.0)
    w.enqueue(t)
    got = r.dequeue(timeout=10)
    assert w.stats()["arena_inplace"] == 1
    got.add_(1)
    assert torch.all(got == 4.0) and torch.all(t == 3.0)


def test_shared_writable_readers_are_an_explicit_opt_in(monkeypatch):
    w, (r1, r2) = _pair(2, arena_readers="shared")
    src = torch.zeros(MiB // 4)
    w.enqueue(src)
    a, b = r1.dequeue(timeout=10), r2.dequeue(timeout=10)
    assert _perms(_core(r1).data_address) == "rw-s"
    a[5] = 42.0                 # one reader writes through its view ...
    assert b[5].item() == 42.0  # ... the other reader sees it, and so does the writer
    assert struct.unpack_from("<f", _writer_bytes(w, r1, a), 5 * 4)[0] == 42.0
    assert r1.stats()["arena_isolated"] == 0 and w.stats()["arena_isolated"] == 0
    del a, b
    assert r1.stats()["arena_whole_slot_drops"] == 0         # nothing to drop
    assert r1.stats()["arena_private_bytes_dropped"] == 0
    # The environment variable, in the writer; readers follow the writer's
    # header whatever their own environment says.
    monkeypatch.setenv("FASTMQ_ARENA_READERS", "shared")
    ws, (rs,) = _pair()
    assert ws.tensor_arena.readers == "shared" and rs.tensor_arena.readers == "shared"
    monkeypatch.setenv("FASTMQ_ARENA_READERS", "isolated")
    rs2 = MessageQueue.create_from_handle(ws.export_handle(), 0)
    assert rs2.tensor_arena.readers == "shared"
    monkeypatch.setenv("FASTMQ_ARENA_READERS", "SHARED ")
    assert MessageQueue(1, 1, arena_readers="isolated").tensor_arena.readers == "isolated"
    monkeypatch.delenv("FASTMQ_ARENA_READERS")
    assert MessageQueue(1, 1).tensor_arena.readers == "isolated"


@pytest.mark.parametrize("order", ["C", "F"])
def test_numpy_arrays_use_the_arena(order):
    w, (r,) = _pair()
    src = np.asarray(np.random.default_rng(3).standard_normal((600, 300)), order=order)
    w.enqueue([src, np.arange(10)])
    got, small = r.dequeue(timeout=10)
    assert np.array_equal(got, src) and got.dtype == src.dtype
    assert got.flags.f_contiguous == (order == "F") and got.flags.writeable
    assert r.tensor_arena.contains(got.ctypes.data)
    assert np.array_equal(small, np.arange(10))
    assert w.stats()["arena_hits"] == 1


def test_raw_pickle_buffers_use_the_arena():
    w, (r,) = _pair()
    data = bytes(range(256)) * (3 * 4096)     # 3 MiB
    w.enqueue({"rw": pickle.PickleBuffer(bytearray(data)), "ro": pickle.PickleBuffer(data)})
    got = r.dequeue(timeout=10)
    for k in ("rw", "ro"):
        mv = memoryview(got[k])
        assert mv.tobytes() == data
        assert r.tensor_arena.contains(np.frombuffer(got[k], np.uint8).ctypes.data)
    assert memoryview(got["ro"]).readonly and not memoryview(got["rw"]).readonly
    assert w.stats()["arena_hits"] == 2


def test_parameter_keeps_its_type_and_its_slot():
    w, (r,) = _pair()
    p = torch.nn.Parameter(torch.randn(MiB // 2), requires_grad=True)
    q = torch.nn.Parameter(torch.randn(MiB // 2), requires_grad=False)
    w.enqueue((p, q))
    gp, gq = r.dequeue(timeout=10)
    assert type(gp) is torch.nn.Parameter and gp.requires_grad
    assert type(gq) is torch.nn.Parameter and not gq.requires_grad
    assert torch.equal(gp.detach(), p.detach()) and torch.equal(gq, q)
    assert r.tensor_arena.contains(gp.data_ptr()) and r.tensor_arena.contains(gq.data_ptr())
    slot = (gp.data_ptr() - _core(r).data_address) // _core(r).slot_bytes
    assert _held_by(w, slot) == [0]
    del gp
    assert _held_by(w, slot) == []        # the Parameter was the last user of that slot
    assert w.stats()["arena_hits"] == 2


def test_overflow_path_maps_descriptors_too():
    # A 1 MiB ring: the declined (non-contiguous) 2 MiB tensor forces the
    # socket path, next to one copied into a slot.
    w, (r,) = _pair(max_chunk_bytes=1 * MiB, max_chunks=2)
    big = torch.randn(1024, 1024)
    nc = torch.randn(1024, 512).t()
    w.enqueue((big, nc))
    gb, gn = r.dequeue(timeout=10)
    assert torch.equal(gb, big) and torch.equal(gn, nc)
    assert r.tensor_arena.contains(gb.data_ptr()) and not r.tensor_arena.contains(gn.data_ptr())
    st = w.stats()
    assert st["overflow_messages"] == 1 and st["arena_hits"] == 1
    assert st["arena_fallback_declined"] == 1


# -- slot lifecycle ---------------------------------------------------------------
def test_no_reuse_until_every_reader_released():
    w, (r1, r2) = _pair(2, slots=1)
    w.enqueue(torch.full((MiB // 4,), 1.0))
    a, b = r1.dequeue(timeout=10), r2.dequeue(timeout=10)
    del a
    assert _held_by(w, 0) == [1]
    w.enqueue(torch.full((MiB // 4,), 2.0))          # reader 1 still holds the slot
    a2, b2 = r1.dequeue(timeout=10), r2.dequeue(timeout=10)
    assert not r1.tensor_arena.contains(a2.data_ptr())
    assert w.stats()["arena_fallback_exhausted"] == 1
    assert torch.all(b == 1.0)                        # never overwritten
    del b
    assert _held_by(w, 0) == [] and _core(w).free_slots() == [0]
    w.enqueue(torch.full((MiB // 4,), 3.0))
    a3, b3 = r1.dequeue(timeout=10), r2.dequeue(timeout=10)
    assert r1.tensor_arena.contains(a3.data_ptr()) and torch.all(b3 == 3.0)
    assert w.stats()["arena_hits"] == 2


def test_release_only_after_the_last_view_dies():
    w, (r,) = _pair()
    w.enqueue(torch.arange(MiB // 4, dtype=torch.float32))
    t = r.dequeue(timeout=10)
    view = t[10:20]
    arr = t.numpy()[100:]
    wrapped = torch.nn.Parameter(t[::2], requires_grad=False)
    del t
    assert _held_by(w, 0) == [0] and _core(r).reader_refs(0) == 1
    del view
    assert _held_by(w, 0) == [0]
    del wrapped
    assert _held_by(w, 0) == [0]
    assert arr[0] == 100.0
    del arr
    assert _held_by(w, 0) == []
    assert r.stats()["arena_released"] == 1


def test_view_held_across_20_messages_stays_intact():
    w, (r,) = _pair(slots=8, slot_mb=1, min_mb=0.25)
    n = MiB // 8 // 2                                   # 0.5 MiB of float64

    def msg(i):
        return torch.full((n,), float(i), dtype=torch.float64)

    w.enqueue(msg(0))
    first = r.dequeue(timeout=10)
    kept = []
    for i in range(1, 21):
        w.enqueue(msg(i))
        kept.append(r.dequeue(timeout=10))             # the reader keeps every one
    # Slots 1..7 went to messages 1..7; the remaining 13 fell back.
    st = w.stats()
    assert st["arena_hits"] == 8 and st["arena_fallback_exhausted"] == 13
    assert torch.all(first == 0.0)
    for i, t in enumerate(kept, 1):
        assert torch.all(t == float(i)) and r.tensor_arena.contains(t.data_ptr()) == (i < 8)
    # Now drop each message right away: traffic reuses slots 1..7, never 0.
    del kept
    for i in range(21, 41):
        w.enqueue(msg(i))
        t = r.dequeue(timeout=10)
        assert torch.all(t == float(i)) and r.tensor_arena.contains(t.data_ptr())
        assert t.data_ptr() - _core(r).data_address >= _core(r).slot_bytes
        del t
    assert torch.all(first == 0.0) and _held_by(w, 0) == [0]


def test_failed_message_gives_its_slots_back():
    w, (r,) = _pair(max_chunks=1)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        w.enqueue([torch.ones(MiB // 2), lambda: None])   # pickling fails after the copy
    assert _core(w).free_slots() == [0, 1, 2, 3]
    w.enqueue(torch.ones(MiB // 2))                      # fills the only ring chunk
    with pytest.raises(TimeoutError):
        w.enqueue(torch.ones(MiB // 2), timeout=0.05)     # copied, never published
    assert _core(w).free_slots() == [1, 2, 3]
    assert torch.all(r.dequeue(timeout=10) == 1.0)
    w.enqueue(torch.full((MiB // 2,), 5.0))
    got = r.dequeue(timeout=10)
    assert torch.all(got == 5.0) and r.tensor_arena.contains(got.data_ptr())


# -- fallbacks ----------------------------------------------------------------------
class MyTensor(torch.Tensor):
    pass


def test_fallbacks_are_counted_by_reason(caplog):
    w, (r,) = _pair(slots=1, slot_mb=2, min_mb=1)
    n = MiB // 4                                         # 1 MiB of float32
    declined = [
        torch.randn(2 * n).reshape(-1, 2).t(),            # non-contiguous
        torch.randn(n, requires_grad=True),
        torch.randn(n // 2, dtype=torch.complex64).conj(),
        torch._neg_view(torch.randn(n)),
        torch.randn(n).as_subclass(MyTensor),
    ]
    for t in declined:
        w.enqueue(t)
        got = r.dequeue(timeout=10)
        assert type(got) is type(t) and got.requires_grad == t.requires_grad
        assert torch.equal(got.detach().resolve_conj().resolve_neg(),
                           t.detach().resolve_conj().resolve_neg())
        assert not r.tensor_arena.contains(got.data_ptr())
    st = w.stats()
    assert st["arena_fallback_declined"] == len(declined) and st["arena_hits"] == 0
    with caplog.at_level(logging.WARNING, logger="fastmq"):
        for _ in range(2):
            w.enqueue(torch.randn(n * 3))                # 3 MiB > 2 MiB slot
            assert r.dequeue(timeout=10).shape == (n * 3,)
        w.enqueue(torch.randn(n // 4))                   # under the 1 MiB threshold
        r.dequeue(timeout=10)
        w.enqueue(torch.randn(n))
        held = r.dequeue(timeout=10)                      # holds the only slot
        for _ in range(2):
            w.enqueue(torch.randn(n))
            assert not r.tensor_arena.contains(r.dequeue(timeout=10).data_ptr())
    st = w.stats()
    assert (st["arena_fallback_oversize"], st["arena_fallback_small"],
            st["arena_fallback_exhausted"], st["arena_hits"]) == (2, 1, 2, 1)
    logs = [rec.getMessage() for rec in caplog.records if rec.name == "fastmq"]
    oversize = [m for m in logs if "does not fit" in m]
    exhausted = [m for m in logs if "no free slot" in m]
    assert len(oversize) == 1 and f"{3 * MiB}-byte" in oversize[0] and f"{2 * MiB}-byte" in oversize[0]
    assert len(exhausted) == 1 and f"{MiB}-byte" in exhausted[0]
    assert r.tensor_arena.contains(held.data_ptr())


# -- writer-side allocation ---------------------------------------------------------
def test_empty_tensor_is_sent_without_a_copy():
    w, (r1, r2) = _pair(2, slots=2)
    t = w.empty_tensor((256, 1024), torch.float32)
    assert w.tensor_arena.contains(t.data_ptr())
    t.copy_(torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024))
    w.enqueue({"x": t, "half": t[128:]})
    st = w.stats()
    assert st["arena_inplace"] == 2 and st["arena_hits"] == 1 and st["arena_empty_tensors"] == 1
    a, b = r1.dequeue(timeout=10), r2.dequeue(timeout=10)
    for got in (a, b):
        assert torch.equal(got["x"], t) and torch.equal(got["half"], t[128:])
    assert a["half"].data_ptr() == a["x"].data_ptr() + 128 * 1024 * 4   # same slot, offset
    assert _core(r1).reader_refs(0) == 2
    # Sent again while readers still hold it: it is copied into another slot.
    w.enqueue(t)
    c = r1.dequeue(timeout=10)
    r2.dequeue(timeout=10)
    assert torch.equal(c, t) and c.data_ptr() != a["x"].data_ptr()
    assert w.stats()["arena_hits"] == 2
    # No slot free: an ordinary tensor.
    del t
    u = w.empty_tensor((256, 1024))
    assert not w.tensor_arena.contains(u.data_ptr()) and u.shape == (256, 1024)
    assert w.stats()["arena_empty_misses"] == 1
    assert MessageQueue(1, 1, enable_shm_tensor_arena=False).empty_tensor(3).shape == (3,)


def test_empty_tensor_slot_returns_to_rotation_when_dropped():
    w, (r,) = _pair(slots=1)
    t = w.empty_tensor(MiB // 4)
    assert _core(w).free_slots() == []
    del t
    assert _core(w).free_slots() == [0]


# -- one class per role --------------------------------------------------------------
WRITER_ONLY = ("reducer_override", "copy_to_slot", "commit", "abort", "reserve", "prefault",
               "prefault_idle", "faulted_bytes", "min_bytes", "copy_threads", "prefault_ahead")
READER_ONLY = ("map_oob", "flush_releases", "reader_refs", "reader_rank", "owner_pid", "pinned")
# A method that asks which end it is on: the rank compared with -1 or 0, a
# writer flag, or one side's state tested for absence outside allocation.
ROLE_TEST = re.compile(r"reader_rank\s*(<|>=)\s*0\b|reader_rank\s*[!=]=\s*-1|"
                       r"reader_rank\s*>\s*-1|\bwriter_side\b|\bis_writer\b|"
                       r"\b(prefault_lock|prefault_jobs|pending|deferred)\s+is\s+None|"
                       r"\b(reserved|faulted|refs)\s*==\s*NULL\s+or\s+not\b")


def test_each_end_has_only_its_roles_methods():
    w, (r,) = _pair()
    assert type(_core(w)) is ArenaWriterEnd and type(_core(r)) is ArenaReaderEnd
    assert issubclass(ArenaWriterEnd, ArenaEnd) and issubclass(ArenaReaderEnd, ArenaEnd)
    for name in WRITER_ONLY:
        assert hasattr(ArenaWriterEnd, name), name
        assert not hasattr(ArenaReaderEnd, name) and not hasattr(ArenaEnd, name), name
    for name in READER_ONLY:
        assert hasattr(ArenaReaderEnd, name), name
        assert not hasattr(ArenaWriterEnd, name) and not hasattr(ArenaEnd, name), name
    assert not hasattr(SlotBuffer, "writer_side")


def test_no_method_asks_which_end_it_is():
    import fastmq

    sources = sorted(Path(fastmq.__file__).parent.glob("_arena*.pyx"))
    assert {p.name for p in sources} >= {"_arena.pyx", "_arena_writer.pyx", "_arena_reader.pyx"}
    found = [f"{p.name}:{i}: {line.strip()}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if ROLE_TEST.search(line)]
    assert not found, "role checks in the arena's ends:\n" + "\n".join(found)


# -- validation of what comes from shared memory --------------------------------------
def _descriptor(core, slot=0, offset=0, nbytes=16, epoch=1, token=None):
    return struct.pack("<QQIIQQQ", _arena.DESC_MAGIC, core.token if token is None else token,
                       slot, 0, offset, nbytes, epoch)


def test_bogus_descriptors_raise_clear_errors():
    w, (r,) = _pair(slots=2, slot_mb=1)
    wc, rc = _core(w), _core(r)
    desc = wc.copy_to_slot(pickle.PickleBuffer(bytearray(MiB)))
    wc.commit()
    ok = rc.map_oob([desc])[0]
    assert ok.nbytes == MiB and rc.reader_refs(0) == 1
    bad = {
        "another arena": _descriptor(rc, token=rc.token ^ 1),
        "names slot": _descriptor(rc, slot=7),
        "overruns": _descriptor(rc, offset=MiB - 8, nbytes=16),
        "overruns ": _descriptor(rc, offset=2**63, nbytes=2**63),
        "stale": _descriptor(rc, slot=0, epoch=5),
        "stale ": _descriptor(rc, slot=1, epoch=1),       # never published
    }
    for what, d in bad.items():
        with pytest.raises(A.ArenaError, match=what.strip()):
            rc.map_oob([bytearray(d)])
    del ok
    assert rc.reader_refs(0) == 0
    # A descriptor is replayed after its slot was handed back and refilled.
    desc2 = wc.copy_to_slot(pickle.PickleBuffer(bytearray(MiB)))
    wc.commit()
    with pytest.raises(A.ArenaError, match="stale"):
        rc.map_oob([desc])
    assert rc.map_oob([desc2])[0].nbytes == MiB
    # Through the queue: a forged descriptor raises in dequeue, the queue goes on.
    stream = pickle.dumps(pickle.PickleBuffer(b"x" * 64), protocol=5,
                          buffer_callback=lambda b: False)
    w._ring.send([stream, _descriptor(rc, slot=1, nbytes=2**40)])
    with pytest.raises(A.ArenaError, match="overruns"):
        r.dequeue(timeout=10)
    w.enqueue(torch.ones(MiB // 4))
    assert torch.all(r.dequeue(timeout=10) == 1.0)


def test_a_bad_descriptor_does_not_keep_the_other_slots_of_its_message():
    w, (r,) = _pair(slots=4, slot_mb=1)
    n = MiB // 4
    bufs = w._end.encoder.encode([torch.full((n,), float(k)) for k in range(3)])
    w.tensor_arena.commit()
    assert len(bufs) == 4 and all(len(b) == _arena.DESC_LEN for b in bufs[1:])
    assert _core(w).free_slots() == [3]
    # The first descriptor's range is corrupted (its token, slot and epoch
    # still name its slot); the two after it are intact.
    bad = bytearray(bufs[1])
    struct.pack_into("<Q", bad, 32, 2**40)
    w._ring.send([bufs[0], bytes(bad), bufs[2], bufs[3]])
    with pytest.raises(A.ArenaError, match="overruns"):
        r.dequeue(timeout=10)
    assert _core(w).free_slots() == [0, 1, 2, 3]      # every slot it named came back
    assert r.stats()["arena_released"] == 3
    # A descriptor that does not name a slot's current publication hands
    # nothing back: that slot may be a later message's, not yet read.
    later = w._end.encoder.encode(torch.full((n,), 7.0))   # slot 0, epoch 2 ...
    w.tensor_arena.commit()
    epoch = _core(w).slot_state(0)[0]
    for e in (epoch - 1, epoch + 1):                     # ... and a forged descriptor
        w._ring.send([bufs[0], _descriptor(_core(r), slot=0, epoch=e, nbytes=2**40)])
    w._ring.send(later)                                  # before the message that owns it
    for _ in range(2):
        with pytest.raises(A.ArenaError, match="overruns"):
            r.dequeue(timeout=10)
    assert _held_by(w, 0) == [0]
    assert torch.all(r.dequeue(timeout=10) == 7.0)     # that message still arrives intact
    assert _held_by(w, 0) == []
    w.enqueue([torch.full((n,), 8.0)] * 2)
    assert all(torch.all(t == 8.0) for t in r.dequeue(timeout=10))


def test_attach_failure_is_deferred():
    w = MessageQueue(1, 1, arena_slots=2, arena_slot_mb=1, arena_min_mb=1)
    h = replace(w.export_handle(),
                tensor_arena_handle=(1, MiB, 2, "fastmq_999999999_arena_doesnotexist:3:1"))
    r = MessageQueue.create_from_handle(h, 0)            # does not raise
    assert r.stats()["arena_attached"] == 0
    assert "FileNotFoundError" in A.attach_error("fastmq_999999999_arena_doesnotexist:3:1")
    w.enqueue({"small": 1})
    assert r.dequeue(timeout=10) == {"small": 1}
    w.enqueue(torch.ones(MiB // 4))                      # 1 MiB: into a slot
    with pytest.raises(A.ArenaError, match="could not attach"):
        r.dequeue(timeout=10)
    # A mismatched geometry is refused the same way, naming what differs.
    h2 = replace(w.export_handle(),
                 tensor_arena_handle=(1, 2 * MiB, 2, w.tensor_arena.name))
    r2 = MessageQueue.create_from_handle(h2, 0)
    assert "does not match its handle" in A.attach_error(w.tensor_arena.name)
    del r2


def test_registry_is_weak_and_survives_shutdown():
    w, (r,) = _pair()
    name = w.tensor_arena.name
    assert A.attached(name) is r.tensor_arena
    w.enqueue(torch.full((MiB // 4,), 9.0))
    t = r.dequeue(timeout=10)
    r.shutdown()
    assert A.attached(name) is r.tensor_arena
    del r
    import gc
    gc.collect()
    assert A.attached(name) is None                     # only the view is left ...
    assert torch.all(t == 9.0)                          # ... and its memory is still mapped
    del t
    assert _core(w).free_slots() == [0, 1, 2, 3]


# -- CUDA pinning and event-gated release (fake runtime) ---------------------------------
class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class FakeCuda:
    """The four calls of fastmq._cuda's runtime, recording what happens."""

    def __init__(self, rc=0):
        self.rc = rc
        self.registered: list = []
        self.unregistered: list = []
        self.mapped_at_unregister: list = []
        self.events: list[FakeEvent] = []

    def is_initialized(self):
        return True

    def host_register(self, ptr, nbytes):
        self.registered.append((ptr, nbytes))
        return self.rc

    def host_unregister(self, ptr):
        self.unregistered.append(ptr)
        self.mapped_at_unregister.append(_is_mapped(ptr))
        return 0

    def record_event(self):
        ev = FakeEvent()
        self.events.append(ev)
        return ev


def _is_mapped(ptr):
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == ptr for line in f)


@pytest.fixture
def fake_cuda():
    rt = FakeCuda()
    _cuda.set_runtime(rt)
    try:
        yield rt
    finally:
        _cuda.set_runtime(None)


def test_isolated_reader_never_pins(fake_cuda, caplog):
    # Pinning a copy-on-write mapping would pin private copies of every
    # page: the reader would keep seeing the arena as it was at that moment.
    w, (r,) = _pair()
    with caplog.at_level(logging.INFO, logger="fastmq"):
        for i in range(2):
            w.enqueue(torch.full((MiB // 4,), float(i)))
            t = r.dequeue(timeout=10)
            assert torch.all(t == float(i))
            del t
    assert fake_cuda.registered == [] and r.stats()["arena_pinned"] == 0
    assert _held_by(w, 0) == [] and fake_cuda.events == []     # released at once, no event
    notes = [rec.getMessage() for rec in caplog.records if "not page-locked" in rec.getMessage()]
    assert len(notes) == 1 and "FASTMQ_ARENA_READERS=shared" in notes[0]


def test_pinned_reader_releases_after_the_event(fake_cuda):
    w, (r,) = _pair(arena_readers="shared")
    rc = _core(r)
    w.enqueue({"x": 1})
    r.dequeue(timeout=10)
    assert fake_cuda.registered == []                 # nothing pinned before a large buffer
    w.enqueue(torch.ones(MiB // 4))
    t = r.dequeue(timeout=10)
    assert fake_cuda.registered == [(rc.address, rc.total_bytes)]   # whole mapping, once
    assert r.stats()["arena_pinned"] == 1
    del t                                              # the view dies, a DMA may still run
    assert _held_by(w, 0) == [0]
    w.enqueue({"step": 2})
    r.dequeue(timeout=10)                              # records the event after the copies
    assert len(fake_cuda.events) == 1 and _held_by(w, 0) == [0]
    w.enqueue({"step": 3})
    r.dequeue(timeout=10)                              # event not done: still held
    assert _held_by(w, 0) == [0]
    fake_cuda.events[0].done = True
    w.enqueue({"step": 4})
    r.dequeue(timeout=10)
    assert _held_by(w, 0) == []
    w.enqueue(torch.ones(MiB // 4))
    r.dequeue(timeout=10)
    assert len(fake_cuda.registered) == 1              # never registered twice
    assert r.stats()["arena_event_gated"] == 1


def test_unregister_happens_before_unmap_after_the_last_view(fake_cuda):
    import gc

    w, (r,) = _pair(arena_readers="shared")
    w.enqueue(torch.ones(MiB // 4))
    t = r.dequeue(timeout=10)
    base = _core(r).address
    del r
    gc.collect()
    assert fake_cuda.unregistered == []                # a view is alive: stay pinned and mapped
    assert _is_mapped(base)
    del t
    gc.collect()
    assert fake_cuda.unregistered == [base] and fake_cuda.mapped_at_unregister == [True]
    assert not _is_mapped(base)


def test_failed_pin_releases_immediately():
    rt = FakeCuda(rc=2)
    _cuda.set_runtime(rt)
    try:
        w, (r,) = _pair(arena_readers="shared")
        w.enqueue(torch.ones(MiB // 4))
        t = r.dequeue(timeout=10)
        assert len(rt.registered) == 1 and r.stats()["arena_pinned"] == 0
        del t
        assert _held_by(w, 0) == [] and rt.events == []
    finally:
        _cuda.set_runtime(None)


def test_no_pin_without_initialised_cuda():
    class NotInitialised(FakeCuda):
        def is_initialized(self):
            return False

    rt = NotInitialised()
    _cuda.set_runtime(rt)
    try:
        w, (r,) = _pair(arena_readers="shared")
        w.enqueue(torch.ones(MiB // 4))
        t = r.dequeue(timeout=10)
        assert rt.registered == [] and r.stats()["arena_pinned"] == 0
        del t
        assert _held_by(w, 0) == []
    finally:
        _cuda.set_runtime(None)


# -- switch, sizing, environment ---------------------------------------------------------
def test_on_by_default_for_local_queues_only(monkeypatch):
    monkeypatch.delenv("FASTMQ_ARENA", raising=False)
    w = MessageQueue(1, 1)
    assert w.tensor_arena is not None and w.handle.tensor_arena_handle[:3] == (1, 256 * MiB, 8)
    assert MessageQueue(1, 1, enable_shm_tensor_arena=False).tensor_arena is None
    assert MessageQueue(2, 1, connect_ip="127.0.0.1").tensor_arena is None
    assert MessageQueue(2, 1, connect_ip="127.0.0.1",
                        enable_shm_tensor_arena=True).tensor_arena is None
    monkeypatch.setenv("FASTMQ_ARENA", "0")
    assert MessageQueue(1, 1).tensor_arena is None
    assert MessageQueue(1, 1, enable_shm_tensor_arena=True).tensor_arena is None
    monkeypatch.setenv("FASTMQ_ARENA", "1")
    assert MessageQueue(1, 1).tensor_arena is not None


def test_idle_arena_costs_no_memory_and_prefault_modes(monkeypatch):
    monkeypatch.setenv("FASTMQ_WARM_MB", "0")           # nothing made ready at creation
    off = MessageQueue(1, 1, arena_slots=4, arena_slot_mb=4, arena_min_mb=1,
                       arena_prefault="off")
    assert _blocks(off) <= 64 * 1024                    # header and flag lines only
    w, (r,) = _pair(slots=4, slot_mb=4)                  # default: "ahead"
    core = _core(w)
    _wait_prefault(core)
    assert _blocks(w) <= 64 * 1024
    w.enqueue(torch.ones(MiB // 2))                      # 2 MiB: first use of slot 0, cold
    r.dequeue(timeout=10)
    _wait_prefault(core)
    # The copy's own pages, and twice as many in the slot the next buffer
    # takes (capped by the slot): not the rest of either slot.
    assert [core.faulted_bytes(s) for s in range(4)] == [2 * MiB, 4 * MiB, 0, 0]
    assert 6 * MiB <= _blocks(w) < 7 * MiB
    assert core.stats()["arena_prefaulted_bytes"] == 4 * MiB
    off.enqueue(torch.ones(MiB // 4))                    # "off": only what the copy used
    assert [_core(off).faulted_bytes(s) for s in range(4)] == [MiB, 0, 0, 0]
    for mode, want in (("all", [4 * MiB] * 4), (1, [4 * MiB, 0, 0, 0])):
        q = MessageQueue(1, 1, arena_slots=4, arena_slot_mb=4, arena_prefault=mode)
        _wait_prefault(_core(q))
        assert [_core(q).faulted_bytes(s) for s in range(4)] == want
        assert _core(q).stats()["arena_prefaulted_bytes"] == sum(want)


def test_a_new_arena_warms_the_first_slot_only(monkeypatch):
    # FASTMQ_WARM_MB of the first slot are populated in the background at
    # creation, capped by the slot, and nothing else; "off" warms nothing.
    monkeypatch.setenv("FASTMQ_WARM_MB", "3")
    w, (r,) = _pair(slots=4, slot_mb=4)
    core = _core(w)
    _wait_prefault(core)
    assert [core.faulted_bytes(s) for s in range(4)] == [3 * MiB, 0, 0, 0]
    assert 3 * MiB <= _blocks(w) < 3 * MiB + 64 * 1024
    # The first buffer takes those pages, and the next slot gets twice its
    # size ahead, as after a copy into cold pages: warming the first slot
    # moves no cost to the second buffer.
    t = torch.arange(MiB // 2, dtype=torch.float32)      # 2 MiB
    w.enqueue(t)
    assert torch.equal(r.dequeue(timeout=10), t)
    _wait_prefault(core)
    assert [core.faulted_bytes(s) for s in range(4)] == [3 * MiB, 4 * MiB, 0, 0]
    assert core.stats()["arena_prefaulted_bytes"] == 7 * MiB
    monkeypatch.setenv("FASTMQ_WARM_MB", "64")           # capped by the slot
    big = MessageQueue(1, 1, arena_slots=2, arena_slot_mb=4)
    _wait_prefault(_core(big))
    assert [_core(big).faulted_bytes(s) for s in range(2)] == [4 * MiB, 0]
    off = MessageQueue(1, 1, arena_slots=2, arena_slot_mb=4, arena_prefault="off")
    _wait_prefault(_core(off))
    assert [_core(off).faulted_bytes(s) for s in range(2)] == [0, 0]


def test_a_default_queue_commits_what_its_tensors_use(monkeypatch):
    # The default geometry (8 x 256 MiB) and pre-fault mode.  Eleven 16 MiB
    # tensors, each sent while the reader still holds the one before: two
    # slots in use, one with 16 MiB of pages, the other with 32 (pre-faulted
    # ahead for a larger buffer), and no whole slot committed (which held
    # 512 MiB of /dev/shm for the arena's life).
    for var in ("FASTMQ_ARENA", "FASTMQ_ARENA_SLOTS", "FASTMQ_ARENA_SLOT_MB",
                "FASTMQ_ARENA_MIN_MB", "FASTMQ_ARENA_PREFAULT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("FASTMQ_WARM_MB", raising=False)
    w, (r,) = local_pair(1)
    core = _core(w)
    assert (core.n_slots, core.slot_bytes) == (8, 256 * MiB)
    size = 16 * MiB
    _wait_prefault(core)
    assert [core.faulted_bytes(s) for s in range(2)] == [size, 0]   # made ready at creation
    held = None
    for i in range(11):
        t = torch.full((size // 8,), i, dtype=torch.int64)
        w.enqueue(t)
        got = r.dequeue(timeout=30)
        assert torch.equal(got, t) and r.tensor_arena.contains(got.data_ptr())
        held = got                                       # released once the next one arrives
        _wait_prefault(core)
        if i == 0:
            assert [core.faulted_bytes(s) for s in range(3)] == [size, 2 * size, 0]
    del held, got
    assert w.stats()["arena_hits"] == 11
    assert [core.faulted_bytes(s) for s in range(8)] == [size, 2 * size] + [0] * 6
    assert core.stats()["arena_prefaulted_bytes"] == 3 * size   # the first slot's too
    assert 3 * size <= _blocks(w) <= 3 * size + 4 * MiB
    # The same figure through the mapping, as fastmq.shm_usage reports it.
    held_now = shm_usage.held_bytes(w)
    assert held_now["arena"] == _blocks(w)
    assert held_now["total"] == held_now["arena"] + held_now["ring"] < 3 * size + 8 * MiB
    assert shm_usage.held_bytes(r)["arena"] == held_now["arena"]


def test_a_larger_buffer_goes_where_the_prefault_ahead_made_room(monkeypatch):
    # A 2 MiB buffer into a cold slot has the next free slot populated to
    # twice its size; a 4 MiB buffer after it (larger than any before) takes
    # that slot and touches no cold page, rather than the lowest free slot
    # (2 MiB warm), which would fault 2 MiB more in the copy.
    monkeypatch.setenv("FASTMQ_WARM_MB", "0")
    w, (r,) = _pair(slots=4, slot_mb=16)
    core = _core(w)
    for n_float in (MiB // 2, MiB):
        t = torch.arange(n_float, dtype=torch.float32)
        w.enqueue(t)
        got = r.dequeue(timeout=10)
        assert torch.equal(got, t)
        del got
        _wait_prefault(core)
        if n_float == MiB // 2:
            assert [core.faulted_bytes(s) for s in range(4)] == [2 * MiB, 4 * MiB, 0, 0]
    assert [core.faulted_bytes(s) for s in range(4)] == [2 * MiB, 4 * MiB, 0, 0]
    assert core.stats()["arena_prefaulted_bytes"] == 4 * MiB
    assert w.stats()["arena_hits"] == 2


def _wait_prefault(core, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not core.prefault_idle():
        assert time.monotonic() < deadline, "background pre-fault did not finish"
        time.sleep(0.005)


def test_sizing_from_env_and_kwargs(monkeypatch):
    monkeypatch.setenv("FASTMQ_ARENA_SLOTS", "3")
    monkeypatch.setenv("FASTMQ_ARENA_SLOT_MB", "1.5")
    monkeypatch.setenv("FASTMQ_ARENA_MIN_MB", "0.5")
    monkeypatch.setenv("FASTMQ_ARENA_COPY_THREADS", "2")
    w = MessageQueue(1, 1)
    assert w.handle.tensor_arena_handle[:3] == (1, 3 * MiB // 2, 3)
    assert _core(w).min_bytes == MiB // 2 and _core(w).copy_threads == 2
    w2 = MessageQueue(1, 1, arena_slots=5, arena_slot_mb=1)   # kwargs win
    assert w2.handle.tensor_arena_handle[:3] == (1, MiB, 5)
    # Readers adopt the writer's geometry whatever their own environment says.
    monkeypatch.setenv("FASTMQ_ARENA_SLOTS", "7")
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    assert (r.tensor_arena.n_slots, r.tensor_arena.slot_bytes) == (3, 3 * MiB // 2)
    assert A.sizing({"arena_slot_mb": 0.001}).slot_bytes == 4096   # whole pages


@pytest.mark.parametrize("var,value", [
    ("FASTMQ_ARENA", "maybe"), ("FASTMQ_ARENA_SLOTS", "many"), ("FASTMQ_ARENA_SLOTS", "0"),
    ("FASTMQ_ARENA_SLOT_MB", "-1"), ("FASTMQ_ARENA_SLOT_MB", "0"), ("FASTMQ_ARENA_SLOT_MB", "inf"),
    ("FASTMQ_ARENA_MIN_MB", "x"), ("FASTMQ_ARENA_PREFAULT", "sometimes"),
    ("FASTMQ_ARENA_COPY_THREADS", "0"), ("FASTMQ_ARENA_READERS", "private"),
    ("FASTMQ_WARM_MB", "-1"), ("FASTMQ_WARM_MB", "lots"),
])
def test_bad_environment_names_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        MessageQueue(1, 1)


@pytest.mark.parametrize("kw", [{"arena_slots": 0}, {"arena_slot_mb": -2}, {"arena_min_mb": "1"},
                                {"arena_prefault": "never"}, {"arena_copy_threads": 1.5},
                                {"arena_readers": "writable"}, {"arena_readers": True}])
def test_bad_keyword_names_the_keyword(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        MessageQueue(1, 1, **kw)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="arena_slotz"):
        MessageQueue(1, 1, arena_slotz=3)


def test_an_arena_larger_than_dev_shm_works():
    """The arena's memory is not in /dev/shm, and takes memory only as its
    slots are used: one larger than /dev/shm is created, and serves."""
    too_big_mb = shutil.disk_usage("/dev/shm").free // MiB + 1024
    w, (r,) = local_pair(1, enable_shm_tensor_arena=True, arena_slots=2,
                         arena_slot_mb=too_big_mb, arena_min_mb=1, arena_prefault="off")
    assert w.tensor_arena is not None and w.tensor_arena.total_bytes > too_big_mb * MiB
    a = np.arange(1 << 18, dtype=np.float64)      # 2 MiB
    w.enqueue(a)
    assert np.array_equal(r.dequeue(timeout=10), a)
    assert w.stats()["arena_hits"] == 1
    assert _blocks(w) < 64 * MiB


# -- end to end with reader processes ----------------------------------------------------
def _reader_processes(procs, spawn_ctx, w, n_readers, target, *args) -> dict:
    """Start ``n_readers`` processes running ``target(handle, rank, *args,
    hq)``, each of which sends back the handle of its own response queue;
    returns those queues by rank, with every handshake done."""
    hq = spawn_ctx.Queue()
    for rank in range(n_readers):
        procs.start(target, w.export_handle(), rank, *args, hq)
    resps = {}
    for _ in range(n_readers):
        rank, h = hq.get(timeout=120)
        resps[rank] = MessageQueue.create_from_handle(h, 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    for q in resps.values():
        q.wait_until_ready()
    t.join(60)
    return resps


@pytest.mark.parametrize("n_readers", [2, 3])
def test_end_to_end_reader_processes(procs, spawn_ctx, n_readers):
    n_msgs = 6
    w = MessageQueue(n_readers, n_readers, arena_slots=8, arena_slot_mb=4, arena_min_mb=1)
    resps = _reader_processes(procs, spawn_ctx, w, n_readers, ac.reader_main, n_msgs)
    core = _core(w)

    def acks(tag):
        for rank, q in resps.items():
            assert q.dequeue(timeout=120) == ("ack", rank, tag)

    for i in range(n_msgs):
        w.enqueue(ac.make_message(i), timeout=60)
        acks(i)
        # Message 0's four buffers (slots 0-3) stay with every reader; each
        # later message's slots came back from all readers before the ack.
        for s in range(4):
            assert _held_by(w, s) == list(range(n_readers)), (i, s)
        for s in range(4, 8):
            assert _held_by(w, s) == []
    t = w.empty_tensor(1 << 18)
    t.fill_(7.0)
    w.enqueue(t)
    del t
    acks("inplace")
    w.enqueue("drop")
    done = [q.dequeue(timeout=120) for q in resps.values()]
    w.enqueue("bye")
    procs.join_all()
    for tag, rank, errors, rst in done:
        assert tag == "done" and errors == [], (rank, errors)
        assert rst["arena_views"] == 4 * n_msgs + 1
        assert rst["arena_released"] == 4 * n_msgs + 1
    st = w.stats()
    assert st["arena_hits"] == 4 * n_msgs + 1 and st["arena_inplace"] == 1
    assert st["arena_fallback_exhausted"] == st["arena_fallback_oversize"] == 0
    assert st["arena_fallback_declined"] == 0
    assert core.free_slots() == list(range(8))


@pytest.mark.parametrize("mode", ["isolated", "shared"])
def test_in_place_writes_across_reader_processes(procs, spawn_ctx, mode):
    # Rank 0 writes in place into every tensor; rank 1 only reads.  One slot:
    # every message reuses the slot rank 0 wrote into before.
    n_readers, n_msgs = 2, 3
    w = MessageQueue(n_readers, n_readers, arena_slots=1, arena_slot_mb=4, arena_min_mb=1,
                     arena_readers=mode)
    resps = _reader_processes(procs, spawn_ctx, w, n_readers, ac.inplace_reader_main, n_msgs,
                              mode == "shared")
    core = _core(w)
    for i in range(n_msgs):
        w.enqueue(ac.inplace_tensor(i), timeout=60)
        for rank, q in resps.items():
            assert q.dequeue(timeout=120) == ("got", rank, i)
        # Rank 0 has written; the writer's own copy of the slot:
        sent = ac.inplace_tensor(i) + (1 if mode == "shared" else 0)
        assert ctypes.string_at(core.data_address, sent.nbytes) == sent.numpy().tobytes()
        w.enqueue("check")
        for rank, q in resps.items():
            tag, r_, i_, fresh, zero_copy, seen, st = q.dequeue(timeout=120)
            assert (tag, r_, i_) == ("checked", rank, i)
            assert zero_copy, (rank, i)
            if mode == "isolated" or rank == 0:
                assert fresh, f"rank {rank} saw an earlier write in message {i}"
            assert seen, f"rank {rank}, message {i}: wrong view of rank 0's write ({mode})"
            assert st["arena_isolated"] == (mode == "isolated")
    assert w.stats()["arena_hits"] == n_msgs and core.free_slots() == [0]
    w.enqueue("bye")
    procs.join_all()



def test_a_descriptor_moved_to_another_slot_is_refused():
    # Two slots published as often as each other: a descriptor whose slot
    # number was changed to the other's must not pass for it (wrong bytes
    # handed out, one slot held for good, the other released while held).
    w, (r,) = _pair(slots=4, slot_mb=1)
    try:
        n = MiB // 4
        bufs = w._end.encoder.encode([torch.full((n,), 1.0), torch.full((n,), 2.0)])
        w.tensor_arena.commit()
        moved = bytearray(bufs[1])
        assert struct.unpack_from("<I", moved, 16)[0] == 0
        struct.pack_into("<I", moved, 16, 1)           # D_SLOT: slot 0 -> slot 1
        w._ring.send([bufs[0], bytes(moved), bufs[2]])
        with pytest.raises(A.ArenaError, match="stale"):
            r.dequeue(timeout=10)
        r.tensor_arena.flush_releases()
        # The queue goes on, and the slots come back.
        w.enqueue(torch.full((n,), 3.0), timeout=10)
        assert torch.all(r.dequeue(timeout=10) == 3.0)
    finally:
        r.shutdown()
        w.shutdown()


def test_empty_tensor_cannot_take_the_slot_an_enqueue_is_copying_into(monkeypatch):
    # The copy's memory check may read /proc (the GIL is let go there): an
    # empty_tensor() on another thread meanwhile must not get that slot,
    # or filling it would change what the reader holds.
    from fastmq import _memory
    w, (r,) = _pair(slots=2, slot_mb=2, arena_prefault="off")
    real = _memory.memory_available

    def slow():
        value = real()
        time.sleep(0.3)          # widens the window the /proc reads open
        return value

    # Every check reads on the spot (as near a memory limit), slowly.
    monkeypatch.setattr(_memory, "STALE_S", -1.0)
    monkeypatch.setattr(_memory, "memory_available", slow)
    try:
        n = MiB // 4
        sender = threading.Thread(target=w.enqueue, args=(torch.full((n,), 1.0),))
        sender.start()
        time.sleep(0.1)
        fresh = w.empty_tensor((n,), torch.float32)
        sender.join(10)
        monkeypatch.undo()
        got = r.dequeue(timeout=10)
        fresh.fill_(9.0)
        assert torch.all(got == 1.0)
        del got, fresh
    finally:
        r.shutdown()
        w.shutdown()
