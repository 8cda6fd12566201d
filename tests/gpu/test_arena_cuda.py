"""The tensor arena with a real CUDA runtime.

By default readers map the arena copy-on-write: such a mapping is never
page-locked (a long-term pin of a private mapping would pin private copies
of its pages, a snapshot later messages never reach), so copies to the GPU
read pageable memory, every message in a reused slot still arrives intact,
and a slot comes back as soon as its last view dies.  With shared-writable
readers (``arena_readers="shared"``) the reader's mapping is page-locked
once, a tensor viewed from it is pinned memory (its H2D copy is a true
DMA), and a slot comes back only after the event recorded behind the copy
completes.  The same logic is covered with a fake runtime in
tests/test_arena.py; this file runs it for real where CUDA exists."""
from __future__ import annotations

import gc

import pytest
import torch

from _queues import local_pair
from fastmq import _cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 1 << 20


def _pair(**kw):
    w, (r,) = local_pair(1, arena_slots=4, arena_slot_mb=8, arena_min_mb=1, **kw)
    return w, r


def _shared_pair():
    return _pair(arena_readers="shared")


def _held(w, slot):
    _, written, done = w.tensor_arena.core.slot_state(slot)
    return bool(written) and not all(done)


@pytest.fixture(autouse=True)
def cuda_ready():
    torch.cuda.init()                       # the arena pins only where CUDA is initialised
    _cuda.set_runtime(None)                 # the real runtime
    yield
    torch.cuda.synchronize()


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


# -- opt-in: shared-writable readers, pinned -------------------------------------------
def test_reader_mapping_is_pinned_and_copies_are_dma():
    w, r = _shared_pair()
    src = torch.randn(2 * MiB)              # 8 MiB
    w.enqueue(src)
    t = r.dequeue(timeout=30)
    assert r.tensor_arena.contains(t.data_ptr())
    assert r.stats()["arena_pinned"] == 1
    assert t.is_pinned()                    # registered host memory
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), src)


def test_release_waits_for_the_event_after_the_copy():
    w, r = _shared_pair()
    src = torch.randn(2 * MiB)
    w.enqueue(src)
    t = r.dequeue(timeout=30)
    stream = torch.cuda.current_stream()
    # Keep the stream busy so that the H2D below is still queued when the
    # view dies and the event is recorded behind it.
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy
        busy /= busy.norm()
    d = torch.empty_like(t, device="cuda")
    d.copy_(t, non_blocking=True)
    del t
    gc.collect()
    assert _held(w, 0)                      # freed, but the DMA may still read it
    w.enqueue({"step": 1})
    r.dequeue(timeout=30)                   # records the event on the current stream
    stats = r.stats()
    assert stats["arena_event_gated"] == 1
    stream.synchronize()
    w.enqueue({"step": 2})
    r.dequeue(timeout=30)                   # event complete: handed back
    assert not _held(w, 0)
    assert torch.equal(d.cpu(), src)


def test_unregistered_before_unmapped():
    w, r = _shared_pair()
    w.enqueue(torch.randn(2 * MiB))
    t = r.dequeue(timeout=30)
    assert t.is_pinned()
    ptr = r.tensor_arena.address
    del r
    gc.collect()
    assert t.is_pinned()                    # the view keeps mapping and registration
    del t
    gc.collect()
    # The mapping is gone and CUDA has no registration left for that range:
    # registering a fresh mapping that may reuse the address works.
    w2, r2 = _shared_pair()
    w2.enqueue(torch.randn(2 * MiB))
    t2 = r2.dequeue(timeout=30)
    assert t2.is_pinned() and r2.stats()["arena_pinned"] == 1
    torch.cuda.synchronize()
    del t2, ptr
