"""Level-triggered wakeup: no lost wakeups, cancellation and timeouts while
parked, a parked writer woken by a reader; every wait mode."""
from __future__ import annotations

import random
import threading
import time

import pytest

import _wakeup_children as wc
from _queues import local_pair, wait_for as _wait_for
from fastmq import MessageQueue

MODES = ["futex", "zmq", "spin"]


def _pair(**kw):
    w, (r,) = local_pair(1, **kw)
    return w, r


@pytest.mark.parametrize("mode,n_readers", [("futex", 1), ("futex", 4), ("zmq", 1),
                                            ("zmq", 3), ("spin", 2)])
def test_no_lost_wakeups_under_random_pauses(procs, spawn_ctx, mode, n_readers):
    count = 1500
    # A 20 us spin budget makes nearly every pause an idle -> parked -> woken
    # transition; two chunks make the writer park on a full ring as well.
    w = MessageQueue(n_readers, n_readers, max_chunk_bytes=4096, max_chunks=2,
                     wait_mode=mode, spin_us=20)
    w._ring.park_slice_ns = wc.NO_SAFETY_NET_NS
    q = spawn_ctx.Queue()
    for r in range(n_readers):
        procs.start(wc.paused_reader, w.export_handle(), r, count, 1000 + r, q)
    w.wait_until_ready()
    rng = random.Random(7)
    for i in range(count):
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0, 0.002))
        w.enqueue(i, timeout=30)
    results = dict(q.get(timeout=120) for _ in range(n_readers))
    procs.join_all()
    assert results == {r: 0 for r in range(n_readers)}
    wakes = w.stats()["wakeups"]
    if mode == "spin":
        assert wakes == 0            # nobody ever parks
    else:
        assert wakes > 0             # the parking path really was exercised


@pytest.mark.parametrize("mode", ["futex", "zmq"])
def test_busy_pipeline_issues_no_wake_syscall(procs, spawn_ctx, mode):
    count = 3000
    # Readers spin up to 5 s before parking: back-to-back traffic never
    # leaves them idle that long, so the writer must never need to wake one.
    w = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=8, wait_mode=mode,
                     spin_us=5_000_000)
    q = spawn_ctx.Queue()
    for r in range(2):
        procs.start(wc.busy_reader, w.export_handle(), r, count, q)
    w.wait_until_ready()
    for i in range(count):
        w.enqueue(i, timeout=30)
    results = dict(q.get(timeout=120) for _ in range(2))
    procs.join_all()
    assert results == {0: count, 1: count}
    assert w.stats()["wakeups"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_while_parked(mode):
    """Parked (futex, zmq) or spinning (spin): shutdown() from another thread
    makes the blocked dequeue raise at once."""
    w, r = _pair(wait_mode=mode, spin_us=0)
    r._ring.park_slice_ns = wc.NO_SAFETY_NET_NS
    err = []

    def blocked():
        try:
            r.dequeue(indefinite=True)
        except RuntimeError as e:
            err.append(str(e))

    t = threading.Thread(target=blocked)
    t.start()
    if mode == "spin":
        time.sleep(0.2)
    else:
        _wait_for(lambda: r._ring.parked_readers == 1)
    r.shutdown()
    t.join(10)
    assert not t.is_alive() and err == ["cancelled"]


@pytest.mark.parametrize("mode", MODES)
def test_timeout_while_parked(mode):
    w, r = _pair(wait_mode=mode, spin_us=0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.3)
    assert time.monotonic() - t0 >= 0.3      # never early
    w.enqueue("after")
    assert r.dequeue(timeout=5) == "after"


def test_parked_writer_woken_by_slow_reader():
    w, r = _pair(max_chunk_bytes=1024, max_chunks=2, wait_mode="futex", spin_us=0)
    w._ring.park_slice_ns = wc.NO_SAFETY_NET_NS
    w.enqueue(0)
    w.enqueue(1)
    done = threading.Event()

    def third():
        w.enqueue(2, timeout=60)
        done.set()

    t = threading.Thread(target=third)
    t.start()
    _wait_for(lambda: r._ring.parked_writer == 1)   # the writer sleeps in the kernel
    assert not done.is_set()
    assert r.dequeue(timeout=5) == 0                # frees a chunk: must wake it
    t.join(10)
    assert done.is_set()
    assert [r.dequeue(timeout=5), r.dequeue(timeout=5)] == [1, 2]
    assert r.stats()["wakeups"] >= 1


def test_wait_mode_from_env_and_bad_values(monkeypatch):
    monkeypatch.setenv("FASTMQ_WAIT", "zmq")
    w, r = _pair()
    assert w.wait_mode == r.wait_mode == "zmq"      # readers adopt the writer's mode
    monkeypatch.setenv("FASTMQ_WAIT", "sleepy")
    with pytest.raises(ValueError, match="FASTMQ_WAIT"):
        MessageQueue(1, 1)
    monkeypatch.delenv("FASTMQ_WAIT")
    monkeypatch.setenv("FASTMQ_SPIN_US", "-3")
    with pytest.raises(ValueError, match="FASTMQ_SPIN_US"):
        MessageQueue(1, 1)
    with pytest.raises(ValueError, match="wait_mode"):
        MessageQueue(1, 1, wait_mode="nap")
