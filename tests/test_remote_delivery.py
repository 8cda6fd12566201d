"""The delivery contract on the remote (TCP) and mixed paths: when
enqueue() returns, every reader gets the message; when it raises before
the commit, none does.  Shutdowns, deadlines, interrupted sends, strangers
on the port and writers that die."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import zmq

from fastmq import MessageQueue, _fanout, _wire

import _remote_children as rc
from _queues import remote_close_seen, wait_for


def _handshake(w, readers):
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    for r in readers:
        r.wait_until_ready()
    t.join(10)
    assert not t.is_alive()


def _mixed():
    """A writer with one local reader (rank 0) and one remote reader (rank 1)."""
    w = MessageQueue(2, 1, connect_ip="127.0.0.1", max_chunk_bytes=1 << 16, max_chunks=4,
                     enable_shm_tensor_arena=False)
    h = w.export_handle()
    local, remote = MessageQueue.create_from_handle(h, 0), MessageQueue.create_from_handle(h, 1)
    _handshake(w, [local, remote])
    return w, local, remote


@pytest.mark.parametrize("size", [100, 200_000])   # ring and overflow
def test_mixed_queue_shutdown_after_the_commit_delivers_to_every_reader(monkeypatch, size):
    """shutdown() on another thread after the remote send (the commit
    point) used to make the ring publish raise "cancelled": the remote
    reader had the message, the local one never got it."""
    w, local, remote = _mixed()
    real = _fanout.Fanout.push
    stopper = []

    def push_then_shutdown(self, *a, **kw):
        out = real(self, *a, **kw)
        if kw.get("until_commit") and not stopper:
            stopper.append(threading.Thread(target=w.shutdown))
            stopper[0].start()
            wait_for(lambda: w.shutting_down)
            time.sleep(0.1)        # shutdown() has cancelled the ring's waits
        return out

    monkeypatch.setattr(_fanout.Fanout, "push", push_then_shutdown)
    msg = b"m" * size
    try:
        w.enqueue(msg)
        returned = True
    except RuntimeError:
        returned = False
    stopper[0].join(10)

    def got(r):
        try:
            return r.dequeue(timeout=2) == msg
        except (TimeoutError, RuntimeError):
            return False

    assert (got(local), got(remote)) == (returned, returned)


def test_remote_enqueue_returns_only_once_the_message_left(procs):
    """With timeout=None, a shutdown() while a slow reader was still taking
    a committed message made enqueue() return; a SIGKILL right after lost
    the message."""
    parent, child = mp.Pipe()
    wproc = procs.start(rc.remote_writer_shut_down_mid_flush, child)
    h = parent.recv()
    a, b = mp.Pipe()
    rproc = procs.start(rc.remote_reader_digest, h, 0, b)
    assert a.recv() == "ready"
    os.kill(rproc.pid, signal.SIGSTOP)        # a reader that takes nothing for a while
    try:
        parent.send("go")
        time.sleep(1.5)
    finally:
        os.kill(rproc.pid, signal.SIGCONT)
    outcome = parent.recv() if parent.poll(60) else "no word"
    wproc.join(30)
    got = a.recv() if a.poll(60) else "no report"
    if outcome == "returned":
        assert got == hashlib.sha256(b"\x07" * rc.BIG).hexdigest(), got
    else:
        assert outcome.startswith("raised"), outcome
    procs.procs.remove(wproc)                 # killed itself, as planned
    procs.join_all()


@pytest.mark.parametrize("security", ["mac", "none", "encrypt"])
def test_remote_message_after_a_deadline_is_not_the_callers_memory(procs, security):
    """After enqueue(timeout) returned at its deadline with the message
    still going out (documented), the frames were still the caller's
    memory: changing the array changed what the reader received."""
    np = pytest.importorskip("numpy")
    timeout = 0.2
    w = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security=security)
    a, b = mp.Pipe()
    rproc = procs.start(rc.remote_reader_digest, w.export_handle(), 0, b)
    w.wait_until_ready()
    assert a.recv() == "ready"
    arr = np.full(rc.BIG, 1, dtype=np.uint8)
    os.kill(rproc.pid, signal.SIGSTOP)
    try:
        w.enqueue(arr, timeout=timeout)       # returns at the deadline, still queued
        arr[:] = 2                            # the caller's memory is its own again
    finally:
        os.kill(rproc.pid, signal.SIGCONT)
    assert a.recv() == hashlib.sha256(bytes(rc.BIG * b"\x01")).hexdigest()
    procs.join_all()


class _FailOnFrame:
    """Make ``sock.send`` fail once, at its ``n``-th call from now: with a
    socket error, or with the exception of a signal handler that runs right
    after that frame was queued."""

    def __init__(self, sock, n, how):
        self.sock, self.n, self.how, self.calls = sock, n, how, 0
        self.real = sock.send
        sock.send = self

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls != self.n:
            return self.real(*a, **kw)
        self.sock.send = self.real
        if self.how == "socket error":
            raise zmq.ZMQError(zmq.EAGAIN, "injected failure on a later frame")
        out = self.real(*a, **kw)
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler raises before we return
        return out


class _Interrupted(Exception):
    pass


def _raise(*_):
    raise _Interrupted()


@pytest.mark.parametrize("how", ["socket error", "signal handler"])
def test_interrupted_multipart_send_is_dropped_whole(how, monkeypatch):
    """An exception between the frames of an overflow message used to
    leave the first frames queued, glued to the next message: the next
    message was lost (as a CorruptChunkError)."""
    monkeypatch.setenv("FASTMQ_PARTS", "0")   # the socket path, not parts
    w = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4,
                     enable_shm_tensor_arena=False)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    _handshake(w, [r])
    old = signal.signal(signal.SIGUSR1, _raise)
    try:
        _FailOnFrame(w.local_socket, 2, how)   # after the header, within the payload
        with pytest.raises((zmq.ZMQError, _Interrupted)):
            w.enqueue(b"a" * 200_000)
    finally:
        signal.signal(signal.SIGUSR1, old)
    w.enqueue(b"b" * 200_000)
    w.enqueue("c")
    assert r.dequeue(timeout=10) == b"b" * 200_000
    assert r.dequeue(timeout=10) == "c"


@pytest.mark.parametrize("security", ["mac", "encrypt"])
def test_remote_send_interrupted_after_the_commit_still_delivers_the_message(
        monkeypatch, security):
    """A signal handler raising in the middle of a remote message (after
    its first bytes were written): enqueue() raises, but the message is
    committed, so the reader gets it whole, before the next one."""
    w = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security=security)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    _handshake(w, [r])
    real = _fanout._Reader.write
    calls = []

    def write_then_interrupt(self):
        n = real(self)
        calls.append(n)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)   # its handler raises here
        return n

    monkeypatch.setattr(_fanout._Reader, "write", write_then_interrupt)
    big = bytes(range(256)) * 40_000                  # several segments
    old = signal.signal(signal.SIGUSR1, _raise)
    try:
        with pytest.raises(_Interrupted) as info:
            w.enqueue(big)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert "committed" in "".join(getattr(info.value, "__notes__", []))
    monkeypatch.setattr(_fanout._Reader, "write", real)
    got = []
    t = threading.Thread(target=lambda: got.extend(r.dequeue(timeout=20) for _ in range(2)))
    t.start()
    w.enqueue("next")
    t.join(30)
    assert got == [big, "next"]


def test_a_stranger_on_the_port_breaks_nothing():
    """A connection that is not a reader (it never proves it holds the key)
    is not counted, and once the handshake is over the port is closed: a
    stranger that connected, or tries to, changes nothing for the reader."""
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    addr = _wire.parse_address(w.export_handle().remote_subscribe_addr)
    import socket
    stranger = socket.create_connection(addr)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    _handshake(w, [r])
    w.enqueue(1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(addr, timeout=5)
    stranger.close()
    w.enqueue(2)
    assert [r.dequeue(timeout=10) for _ in range(2)] == [1, 2]


def test_remote_reader_disconnect_names_the_reader():
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    r = MessageQueue.create_from_handle(w.export_handle(), 5)
    _handshake(w, [r])
    r.remote_socket.close()
    remote_close_seen(w)
    with pytest.raises(RuntimeError, match=f"remote reader rank 5 \\(pid {os.getpid()} "):
        w.enqueue("x")


def test_remote_reader_names_a_writer_that_died(procs):
    """A remote reader used to wait for ever for a writer that was killed."""
    parent, child = mp.Pipe()
    wproc = procs.start(rc.remote_writer_then_die, child)
    r = MessageQueue.create_from_handle(parent.recv(), 0)
    r.wait_until_ready()
    assert r.dequeue(timeout=10) == "last words"
    parent.send("die")
    wproc.join(10)
    procs.procs.remove(wproc)
    box = []
    t = threading.Thread(target=lambda: box.append(_catch(r.dequeue)), daemon=True)
    t.start()
    t.join(15)
    if t.is_alive():
        r.shutdown()
        t.join(5)
        pytest.fail("the remote reader still waits for a writer that died")
    assert isinstance(box[0], RuntimeError), box
    assert f"writer (pid {wproc.pid})" in str(box[0]), box[0]


def _catch(fn):
    try:
        return fn()
    except BaseException as e:
        return e
