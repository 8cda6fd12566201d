"""The tensor arena with a real CUDA runtime: one script for a GPU machine.

Run it there, after building in place, with
``python3 tests/gpu/test_arena_cuda.py`` (or ``python3 -m pytest tests/gpu -q``);
it takes well under a minute, and every test is skipped where CUDA is not
available.  It prints one figure: host-to-device time from an arena tensor
pinned (shared readers) against pageable (isolated readers), as a ratio.

By default readers map the arena copy-on-write: such a mapping is never
page-locked (a long-term pin of a private mapping would pin private copies
of its pages, a snapshot later messages never reach), so copies to the GPU
read pageable memory and a slot comes back as soon as its last view dies.
With shared readers (``arena_readers="shared"``, and by default for vLLM's
scheduler broadcast on a CUDA platform) the reader's mapping is page-locked
once, a tensor viewed from it is pinned memory (its H2D copy is a true DMA
that may still run after the view died), and a slot comes back only after
the event recorded behind the copy completes: no later message can be
copied into a slot a copy still reads.  The same logic is covered with a
fake runtime in tests/test_arena.py and tests/test_vllm_cuda_arena.py."""
from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time

import pytest
import torch

# tests/ (the shared helpers), also when this file is run as a script.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from _queues import local_pair  # noqa: E402
from fastmq import _cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 1 << 20


def _pair(slot_mb=8, **kw):
    return local_pair(1, arena_slots=4, arena_slot_mb=slot_mb, arena_min_mb=1, **kw)


def _held(w, slot):
    _, written, done = w.tensor_arena.core.slot_state(slot)
    return bool(written) and not all(done)


def _busy(seconds: float = 1.0) -> None:
    """Keep the current stream busy for about ``seconds``: work queued
    behind it (a copy, an event) stays pending that long."""
    if hasattr(torch.cuda, "_sleep"):
        # clock_rate is in kHz where torch reports it; 2 GHz, above any
        # current GPU's clock, errs on the long side.
        khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 2e6
        torch.cuda._sleep(int(seconds * khz * 1e3))
        return
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(int(40 * seconds)):
        x = x @ x
        x /= x.norm()


@pytest.fixture(autouse=True)
def cuda_ready():
    torch.cuda.init()                       # the arena pins only where CUDA is initialised
    _cuda.set_runtime(None)                 # the real runtime
    yield
    torch.cuda.synchronize()


# -- the figure: pinned against pageable --------------------------------------------------
def _h2d_ms(w, r, src, reps=10):
    times = []
    dst = torch.empty_like(src, device="cuda")
    for i in range(reps + 2):
        w.enqueue(src)
        t = r.dequeue(timeout=60)
        assert r.tensor_arena.contains(t.data_ptr())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        if i >= 2:                           # the first ones fault and register
            times.append((time.perf_counter() - t0) * 1e3)
        pinned = t.is_pinned()
        del t
    assert torch.equal(dst.cpu(), src)
    return statistics.median(times), pinned


def test_pinned_against_pageable_h2d_time(capsys):
    src = torch.randn(16 * MiB)              # 64 MiB
    w, (r,) = _pair(slot_mb=64)
    pageable_ms, pinned = _h2d_ms(w, r, src)
    assert not pinned and r.stats()["arena_pinned"] == 0
    w, (r,) = _pair(slot_mb=64, arena_readers="shared")
    pinned_ms, pinned = _h2d_ms(w, r, src)
    assert pinned and r.stats()["arena_pinned"] == 1
    # For scale: the same copy from torch's own pinned memory.
    ref = torch.empty_like(src).pin_memory().copy_(src)
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(ref, non_blocking=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    gbps = src.nbytes / 1e9
    with capsys.disabled():
        print(f"\nH2D of a 64 MiB arena tensor: pinned (shared readers) {pinned_ms:.2f} ms "
              f"({gbps / pinned_ms * 1e3:.1f} GB/s), pageable (isolated readers) "
              f"{pageable_ms:.2f} ms ({gbps / pageable_ms * 1e3:.1f} GB/s): pinned/pageable "
              f"speed-up {pageable_ms / pinned_ms:.2f}x; torch pinned memory "
              f"{statistics.median(times):.2f} ms")


# -- default: isolated readers -------------------------------------------------------
def test_isolated_reader_is_not_pinned_and_its_copies_are_right():
    w, (r1, r2) = local_pair(2, arena_slots=1, arena_slot_mb=8, arena_min_mb=1)
    for i in range(3):                      # the same slot every time
        src = torch.randn(2 * MiB)          # 8 MiB
        w.enqueue(src)
        a, b = r1.dequeue(timeout=30), r2.dequeue(timeout=30)
        assert r1.tensor_arena.contains(a.data_ptr())
        assert not a.is_pinned() and r1.stats()["arena_pinned"] == 0
        d = a.to("cuda", non_blocking=True)
        a.add_(1)                           # after the copy was issued: pageable, so consumed
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), src), i
        assert torch.equal(b, src) and torch.equal(a, src + 1), i
        del a, b
        gc.collect()
        assert not _held(w, 0)              # no event to wait for
    assert r1.stats()["arena_event_gated"] == 0


# -- shared readers, pinned ------------------------------------------------------------
def test_reader_mapping_is_pinned_and_copies_are_dma():
    w, (r,) = _pair(arena_readers="shared")
    src = torch.randn(2 * MiB)              # 8 MiB
    w.enqueue(src)
    t = r.dequeue(timeout=30)
    assert r.tensor_arena.contains(t.data_ptr())
    assert r.stats()["arena_pinned"] == 1
    assert t.is_pinned()                    # registered host memory
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), src)


def test_release_waits_for_the_event_under_a_busy_stream():
    w, (r,) = _pair(arena_readers="shared")
    src = torch.randn(2 * MiB)
    w.enqueue(src)
    t = r.dequeue(timeout=30)
    stream = torch.cuda.current_stream()
    _busy(1.0)                              # the H2D below stays queued behind this
    d = torch.empty_like(t, device="cuda")
    d.copy_(t, non_blocking=True)
    del t
    gc.collect()
    assert _held(w, 0)                      # freed, but the DMA may still read it
    w.enqueue({"step": 1})
    r.dequeue(timeout=30)                   # records the event on the current stream
    assert not stream.query(), "the stream finished too early for this test: raise _busy()"
    assert r.stats()["arena_event_gated"] == 1
    w.enqueue({"step": 2})
    r.dequeue(timeout=30)                   # event still pending: still held
    assert _held(w, 0) or stream.query()
    stream.synchronize()
    w.enqueue({"step": 3})
    r.dequeue(timeout=30)                   # event complete: handed back
    assert not _held(w, 0)
    assert torch.equal(d.cpu(), src)


def test_no_slot_is_reused_while_a_copy_reads_it():
    # Two slots, six tensors sent while every copy out of the arena is still
    # queued behind a busy stream: the first two take the slots, the others
    # find both held (their readers' views are gone, their copies are not)
    # and take the normal path.  Every device copy then holds exactly what
    # was sent.
    w, (r,) = local_pair(1, arena_slots=2, arena_slot_mb=8, arena_min_mb=1,
                         arena_readers="shared")
    stream = torch.cuda.current_stream()
    srcs = [torch.full((2 * MiB,), float(i)) for i in range(6)]
    dsts = [torch.empty(2 * MiB, device="cuda") for _ in srcs]
    w.enqueue(torch.zeros(2 * MiB))          # pin the mapping before the stream is busy
    first = r.dequeue(timeout=30)
    assert first.is_pinned()
    del first
    torch.cuda.synchronize()
    w.enqueue("flush")
    r.dequeue(timeout=30)
    torch.cuda.synchronize()
    w.enqueue("flush")
    r.dequeue(timeout=30)
    assert w.tensor_arena.core.free_slots() == [0, 1]
    _busy(1.5)
    in_arena, private = [], {}
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        w.enqueue(src)
        t = r.dequeue(timeout=30)
        in_arena.append(r.tensor_arena.contains(t.data_ptr()))
        if in_arena[-1]:
            dst.copy_(t, non_blocking=True)  # queued behind the busy stream
        else:
            private[i] = t                   # a private copy: nothing to guard (and a
        del t                                # synchronous copy would wait for the stream)
    assert not stream.query(), "the stream finished too early for this test: raise _busy()"
    assert in_arena == [True, True, False, False, False, False]
    assert w.stats()["arena_fallback_exhausted"] == 4
    torch.cuda.synchronize()
    for i, t in private.items():
        dsts[i].copy_(t)
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        assert torch.equal(dst.cpu(), src), i
    w.enqueue("flush")
    r.dequeue(timeout=30)                   # the events are complete now
    assert w.tensor_arena.core.free_slots() == [0, 1]


def test_unregistered_before_unmapped():
    w, (r,) = _pair(arena_readers="shared")
    w.enqueue(torch.randn(2 * MiB))
    t = r.dequeue(timeout=30)
    assert t.is_pinned()
    del r
    gc.collect()
    assert t.is_pinned()                    # the view keeps mapping and registration
    del t
    gc.collect()
    # The mapping is gone and CUDA has no registration left for that range:
    # registering a fresh mapping that may reuse the address works.
    w2, (r2,) = _pair(arena_readers="shared")
    w2.enqueue(torch.randn(2 * MiB))
    t2 = r2.dequeue(timeout=30)
    assert t2.is_pinned() and r2.stats()["arena_pinned"] == 1
    torch.cuda.synchronize()
    del t2


# -- inside vLLM on this CUDA platform ---------------------------------------------------
def test_vllm_scheduler_broadcast_is_pinned_by_default(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.delenv("FASTMQ_ARENA_READERS", raising=False)
    monkeypatch.delenv("FASTMQ_VLLM", raising=False)
    import fastmq.vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        pytest.skip(f"vLLM's platform here is {type(current_platform).__name__}")
    fastmq.vllm.patch()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    # As vLLM's executor builds its scheduler broadcast.
    w = MessageQueue(1, 1, enable_shm_tensor_arena=True, arena_slots=2, arena_slot_mb=8)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    th = threading.Thread(target=w.wait_until_ready)
    th.start()
    r.wait_until_ready()
    th.join(30)
    assert w.tensor_arena.readers == "shared"
    src = torch.randn(2 * MiB)
    w.enqueue(src)
    t = r.dequeue(timeout=30)
    assert t.is_pinned() and r.stats()["arena_pinned"] == 1
    assert torch.equal(t.to("cuda", non_blocking=True).cpu(), src)
    del t


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
