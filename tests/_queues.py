"""Building handshaken queues inside one test process."""
from __future__ import annotations

import os
import pickle
import signal
import threading
import time

from fastmq import MessageQueue


def local_pair(n_local: int = 1, n_remote: int = 0, **kw):
    """A writer and ``n_local`` in-process local readers (ranks first),
    then ``n_remote`` remote ones over loopback TCP, handshaken.  The
    handle goes through pickle, as it does between processes."""
    n_local += n_remote
    if n_remote:
        kw.setdefault("connect_ip", "127.0.0.1")
    w = MessageQueue(n_local, n_local - n_remote, **kw)
    h = pickle.loads(pickle.dumps(w.export_handle()))
    rs = [MessageQueue.create_from_handle(h, r) for r in range(n_local)]
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    for r in rs:
        r.wait_until_ready()
    t.join(10)
    assert not t.is_alive(), "writer handshake did not finish"
    return w, rs


def fanout_and_stream(security: str = "none", spin_s: float = 0.0):
    """A writer's fan-out and one remote reader's stream (rank 0),
    handshaken over loopback in this process, under ``security``."""
    from fastmq import _fanout, _keys, _stream

    psk = _keys.new_writer_trust(security)["psk"]
    fan = _fanout.Fanout("127.0.0.1", False, security, psk)
    stream = _stream.Stream(fan.address, False, security, psk, 0)
    stream.spin_s = spin_s
    stream.start_hello()
    deadline = time.monotonic() + 10
    while not fan.handshake_step(1):
        assert time.monotonic() < deadline, "the handshake did not complete"
        time.sleep(0.001)
    stream.handshake()
    return fan, stream


def assert_delivers(w, readers, obj="still usable") -> None:
    """The queue still works: ``obj`` from ``w`` reaches every reader."""
    w.enqueue(obj, timeout=10)
    assert [r.dequeue(timeout=10) for r in readers] == [obj] * len(readers)


def shut(*queues) -> None:
    for q in queues:
        q.shutdown()


def wait_for(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def background_readings(more: int = 0, timeout: float = 10.0) -> bool:
    """Wait until the memory watcher (fastmq._memory) has taken ``more``
    readings beyond those taken so far (``more`` 2: one begun after this
    call, whole); whether it did within ``timeout``."""
    from fastmq._memory import memory_readings

    want = memory_readings()["background"] + more
    end = time.monotonic() + timeout
    while memory_readings()["background"] < want:
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def refused_in_fork_child(calls) -> bool:
    """Run each of ``calls`` in a forked child of this process: True if
    every one raised the fork ``RuntimeError`` there (the child touches
    nothing else, and leaves through os._exit)."""
    from conftest import OUR_PIDS

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)      # a call that hangs ends the child: not refused
            refused = []
            for call in calls:
                try:
                    call()
                    refused.append(False)
                except RuntimeError as e:
                    refused.append("fork" in str(e))
            code = 0 if all(refused) else 2
        finally:
            os._exit(code)
    OUR_PIDS.add(pid)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def remote_close_seen(w, timeout: float = 10.0) -> None:
    """Wait until writer ``w``'s connection to its (first) remote reader
    shows that reader's close."""
    import select

    sock = w.remote_socket.readers[0].sock
    wait_for(lambda: select.select([sock], [], [], 0)[0], timeout=timeout)
