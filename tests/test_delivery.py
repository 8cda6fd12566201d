"""The delivery contract: when enqueue() returns, every reader receives the
message, in order, exactly once -- even if the writer then exits, is
killed or shuts the queue down; when enqueue() or dequeue() raises, nothing
was delivered or consumed.  One test per way this used to break, and a
stress test that mixes them."""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest
import zmq

from fastmq import MessageQueue, ReaderGoneError, cleanup

import _delivery_children as dc
from _queues import local_pair, refused_in_fork_child, remote_close_seen, wait_for
from conftest import OUR_PIDS

MODES = ["futex", "zmq", "spin"]
CHUNK = 64 * 1024
SIZES = [100, 300_000, 2_000, 1_500_000, 50, 120_000, 30_000]   # ring and overflow


def _attach_and_handshake(w, handle, rank=0):
    r = MessageQueue.create_from_handle(handle, rank)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join(10)
    assert not t.is_alive(), "writer handshake did not finish"
    return r


def _read(r, n, timeout=30.0):
    for seq in range(n):
        dc.check(r.dequeue(timeout=timeout), seq)


@pytest.mark.parametrize("mode", MODES)
def test_dequeue_timeout_consumes_nothing(mode):
    """A dequeue(timeout) that expires between an overflow mark and its
    payload used to consume the mark; the next mark then took the stale
    payload (messages out of order, the last one lost)."""
    w, (r,) = local_pair(1, max_chunk_bytes=CHUNK, max_chunks=4, wait_mode=mode,
                         enable_shm_tensor_arena=False)
    n = 60
    sizes = [SIZES[i % len(SIZES)] for i in range(n)]

    def write():
        for seq, size in enumerate(sizes):
            w.enqueue(dc.message(seq, size), timeout=60)

    t = threading.Thread(target=write)
    t.start()
    try:
        want = 0
        end = time.monotonic() + 120
        while want < n and time.monotonic() < end:
            try:
                msg = r.dequeue(timeout=0)
            except TimeoutError:
                continue
            dc.check(msg, want)
            want += 1
        assert want == n
    finally:
        t.join(60)


def test_failed_overflow_send_delivers_nothing(monkeypatch):
    """An error on the payload socket after the ring's overflow mark used to
    leave the mark published: the reader then paired it with the next
    message's payload.  Now nothing is published, and a retry delivers the
    message once."""
    monkeypatch.setenv("FASTMQ_PARTS", "0")   # the socket path, not parts
    w, (r,) = local_pair(1, max_chunk_bytes=CHUNK, max_chunks=8,
                         enable_shm_tensor_arena=False)
    sock = w.local_socket
    real = sock.send
    calls = []

    def failing_once(*a, **kw):
        if not calls:
            calls.append(1)
            raise zmq.ZMQError(zmq.EAGAIN, "injected send failure")
        return real(*a, **kw)

    sock.send = failing_once
    with pytest.raises(zmq.ZMQError):
        w.enqueue(dc.message(0, 300_000))
    sizes = [300_000, 300_000, 100, 300_000]
    for seq, size in enumerate(sizes):
        w.enqueue(dc.message(seq, size))
    for seq in range(len(sizes)):
        dc.check(r.dequeue(timeout=10), seq)
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.2)          # the failed send delivered nothing


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_racing_enqueue(mode):
    """shutdown() on another thread used to let an enqueue() return although
    readers then stopped before its message."""
    rng = random.Random(7)
    sizes = [100, 3_000_000, 1_000_000, 6_000_000]   # ring copies up to 3 MB, then overflow
    for trial in range(20):
        w, rs = local_pair(2, max_chunk_bytes=4 << 20, max_chunks=4, wait_mode=mode,
                           enable_shm_tensor_arena=False)
        got = [[] for _ in rs]
        returned = []

        def read(i):
            while True:
                try:
                    got[i].append(rs[i].dequeue(timeout=30)["seq"])
                except RuntimeError:
                    return

        def write():
            seq = 0
            while True:
                try:
                    w.enqueue(dc.message(seq, sizes[seq % len(sizes)]))
                except RuntimeError:
                    return
                returned.append(seq)
                seq += 1

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(rs))]
        threads.append(threading.Thread(target=write))
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.001, 0.05))
        w.shutdown()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        for g in got:
            assert g == returned, f"trial {trial}: read {len(g)}, returned {len(returned)}"
        del w, rs
        gc.collect()


@pytest.mark.parametrize("how", ["exit", "drop", "kill"])
def test_writer_gone_right_after_overflow_enqueue(procs, how):
    """A writer that exits, drops its queue, or is SIGKILLed right after
    enqueue() of a large (socket) message returned: every message is still
    delivered.  (Sockets closed with linger=0 and an IO thread killed with
    the process used to lose the last payloads.)"""
    sizes = [100, 3_000_000, 200, 32_000_000]
    for trial in range(3 if how == "kill" else 1):
        parent, child = mp.Pipe()
        p = procs.start(dc.writer_then_exit, child, sizes, how, "futex")
        handle = parent.recv()
        r = MessageQueue.create_from_handle(handle, 0)
        r.wait_until_ready()
        _read(r, len(sizes))
        p.join(30)
        assert p.exitcode == (-signal.SIGKILL if how == "kill" else 0)
        del r
        gc.collect()
        cleanup()   # a killed writer leaves its files; cleanup removes a dead pid's


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_remote_writer_gone_right_after_enqueue(procs, how):
    """The same over TCP, every message authenticated (the default)."""
    sizes = [100, 32_000_000, 300]
    for trial in range(3 if how == "kill" else 1):
        parent, child = mp.Pipe()
        p = procs.start(dc.remote_writer_then_exit, child, sizes, how)
        r = MessageQueue.create_from_handle(parent.recv(), 0)
        r.wait_until_ready()
        _read(r, len(sizes))
        p.join(30)
        assert p.exitcode == (-signal.SIGKILL if how == "kill" else 0)


def test_many_outstanding_overflow_payloads(monkeypatch):
    """More payloads outstanding than ZMQ's default high-water mark (1000):
    they used to be dropped, and a mark received a later message's payload."""
    monkeypatch.setenv("FASTMQ_PARTS", "0")   # the socket path, not parts
    n = 2600
    w, (r,) = local_pair(1, max_chunk_bytes=64, max_chunks=n + 10,
                         enable_shm_tensor_arena=False)
    for seq in range(n):
        w.enqueue(dc.message(seq, 200), timeout=30)
    _read(r, n)


def test_remote_reader_far_behind_gets_backpressure():
    """A remote reader that falls behind used to lose everything past the
    high-water mark silently; now the writer waits for it."""
    n = 3000
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    r = _attach_and_handshake(w, w.export_handle())
    sent = []

    def write():
        for seq in range(n):
            w.enqueue(dc.message(seq, 40_000))   # far more than socket buffers hold
            sent.append(seq)

    wt = threading.Thread(target=write)
    wt.start()
    time.sleep(2.0)                 # the reader is 2 s behind
    _read(r, n)
    wt.join(60)
    assert len(sent) == n


def test_remote_reader_disconnect_is_an_error_not_a_gap():
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = w.export_handle()
    r = _attach_and_handshake(w, h)
    w.enqueue(dc.message(0, 10))
    dc.check(r.dequeue(timeout=10), 0)
    # The reader goes away; a new one with the same handle comes back.
    r.remote_socket.close()
    remote_close_seen(w)
    with pytest.raises(ReaderGoneError, match="disconnected") as info:
        w.enqueue(dc.message(1, 10))
    assert (info.value.rank, info.value.how) == (0, "disconnected")
    with pytest.raises(ReaderGoneError, match="disconnected"):   # and keeps refusing
        w.enqueue(dc.message(1, 10))


def test_remote_reader_after_handshake_gets_a_clear_error():
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = w.export_handle()
    r = _attach_and_handshake(w, h)
    late = MessageQueue.create_from_handle(h, 1)
    w.enqueue("x")
    assert r.dequeue(timeout=10) == "x"
    with pytest.raises(RuntimeError, match="handshake completed without this reader"):
        late.wait_until_ready()


def test_fork_child_dropping_inherited_queue_keeps_parent_sockets():
    """A child forked after the writer was created used to unlink the
    parent's live ipc socket files when it dropped its copy; a reader
    attaching later then hung.  (The sockets have no files now; the child's
    drop must still leave the parent's queue whole.)"""
    w = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    h = w.export_handle()
    pid = os.fork()
    if pid == 0:  # child: drop the inherited queue and leave at once
        try:
            del w
            gc.collect()
        finally:
            os._exit(0)
    OUR_PIDS.add(pid)
    os.waitpid(pid, 0)
    r = _attach_and_handshake(w, h)
    w.enqueue("after fork")
    assert r.dequeue(timeout=10) == "after fork"


def test_queue_used_from_forked_child_raises():
    """A writer (or reader) used from a forked child used to "send" while
    parent and child each kept their own ring position."""
    w, (r,) = local_pair(1, max_chunk_bytes=4096, max_chunks=2)
    assert refused_in_fork_child([lambda: w.enqueue("from child"),
                                  lambda: r.dequeue(timeout=0)])
    w.enqueue("parent")
    assert r.dequeue(timeout=10) == "parent"


@pytest.mark.parametrize("mode", MODES)
def test_stress_mixed_paths_timeouts_and_shutdown(procs, mode):
    """Ring and overflow messages of random sizes, three reader processes
    that nap and use short random timeouts, a writer with short random
    timeouts (retrying the same message after a TimeoutError), and a
    shutdown() from another thread at a random moment: every reader gets
    exactly the messages whose enqueue() returned, in order, intact."""
    rng = random.Random(f"stress-{mode}")
    n_readers = 3
    w = MessageQueue(n_readers, n_readers, max_chunk_bytes=128 * 1024, max_chunks=4,
                     wait_mode=mode, enable_shm_tensor_arena=False)
    outs = []
    for rank in range(n_readers):
        parent, child = mp.Pipe()
        outs.append(parent)
        procs.start(dc.stress_reader, w.export_handle(), rank, rng.random(), child)
    w.wait_until_ready()
    returned = 0
    timeouts = 0
    # shutdown() lands while enqueue() calls are in flight, after a random
    # number of messages.
    stop_after = rng.randrange(50, 350)
    reached = threading.Event()

    def stop():
        if reached.wait(120):
            time.sleep(rng.uniform(0, 0.003))
        w.shutdown()

    stopper = threading.Thread(target=stop)
    stopper.start()
    try:
        while returned < 400:
            if returned == stop_after:
                reached.set()
            size = rng.choice([64, 2_000, 40_000, 200_000, 600_000])
            try:
                w.enqueue(dc.message(returned, size),
                          timeout=rng.choice([0.0005, 0.002, 0.01, None]))
            except TimeoutError:
                timeouts += 1
                continue            # the same message again: it was not delivered
            except RuntimeError as e:
                assert str(e) == "cancelled"
                break
            returned += 1
    finally:
        reached.set()
        stopper.join(130)
    assert 0 < returned < 400, "shutdown did not race the enqueue loop"
    results = [o.recv() if o.poll(120) else ("no report", None) for o in outs]
    procs.join_all(timeout=60)
    for count, error in results:
        assert error is None, error
        assert count == returned


def test_a_mark_whose_payload_never_comes_ends_in_an_error(procs):
    """A dead writer whose connection never closes (a process it forked
    holds it) and whose overflow payload never came: the reader gives the
    payload a grace, then raises that the writer died, instead of waiting
    for the connection to close forever."""
    parent, child = mp.Pipe()
    procs.start(dc.mark_without_payload_then_die, child)
    r = MessageQueue.create_from_handle(parent.recv(), 0)
    r.wait_until_ready()
    holder = parent.recv()
    try:
        with pytest.raises(RuntimeError, match="died"):
            r.dequeue(timeout=30)
    finally:
        try:
            os.kill(holder, signal.SIGKILL)
        except ProcessLookupError:
            pass
    procs.join_all(10)
    del r
    gc.collect()
