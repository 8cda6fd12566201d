"""Where containers put vLLM's processes, a fastmq queue works as vLLM's
own does: a writer that is not dumpable (it changed its uid, or set
PR_SET_DUMPABLE 0), a reader with Docker's default capabilities, a /proc
mounted hidepid=2, a root reader of a non-root writer, a reader in a child
pid namespace that sees its parent's /proc; and a sidecar of the same uid
in the writer's network namespace receives nothing.

Each case runs with fastmq's class and with vLLM 0.33.0's own
(``FASTMQ_VLLM=0`` in the children).  These used to fail with fastmq: a
``PermissionError`` opening /proc/<pid>/fd, "the writer is gone" while it
ran, a handshake that waited for ever (the local socket's uid filter), and
a sidecar that received every overflow payload.

Refusals name their cause: a stranger refused by the segment door is named
in the writer's long-wait line, a subscription without a reader's
identity by the kernel's credentials, a reader in another network
namespace is told so, and a reader that must open the segments through
/proc (a handle without a door) is told why it cannot (another uid, not
dumpable, capabilities, hidepid, its own pid namespace).
"""
from __future__ import annotations

import logging
import os
import time

import pytest

import _container_children as cc
import _refused_children as rc
from conftest import SPAWN
from fastmq import MessageQueue
from fastmq._door import DoorError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="uids, capabilities and "
                                "namespaces need root")

EXPECTED = cc.summary(cc.MESSAGES)

CASES = {
    # writer setup, reader setup
    "non-dumpable writer, reader with Docker's capabilities": (("nondumpable",), ("docker_caps",)),
    "reader with fewer capabilities than the root writer": ((), ("docker_caps",)),
    "writer that changed its uid in-process, reader of that uid": (("nobody",), ("nobody",)),
    "non-dumpable writer, reader whose /proc is hidepid=2": (("nondumpable",),
                                                             ("hidepid", "docker_caps")),
    "root reader of a non-root writer": (("nobody",), ()),
    "reader in a child pid namespace that sees the host's /proc": ((), ("pidns",)),
}


@pytest.fixture
def impl_env(request, monkeypatch):
    impl = request.param
    if impl == "vllm":
        monkeypatch.setenv("FASTMQ_VLLM", "0")
        monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    return impl


def _recv(conn, timeout: float, what: str):
    if not conn.poll(timeout):
        raise AssertionError(f"no {what} within {timeout:g} s")
    return conn.recv()


@pytest.mark.parametrize("impl_env", ["fastmq", "vllm"], indirect=True)
@pytest.mark.parametrize("case", sorted(CASES))
def test_queue_works_where_vllms_works(procs, impl_env, case):
    wsetup, rsetup = CASES[case]
    w_conn, w_child = SPAWN.Pipe()
    r_conn, r_child = SPAWN.Pipe()
    procs.start(cc.writer, w_child, impl_env, wsetup)
    handle, _ = _recv(w_conn, 120, "handle")
    procs.start(cc.reader, r_child, impl_env, handle, rsetup)
    status, got = _recv(r_conn, 120, "reader's result")
    assert status == "ok", got
    assert got == EXPECTED
    assert _recv(w_conn, 60, "writer's report") == "sent"
    w_conn.send("bye")
    procs.join_all(60)


@pytest.mark.parametrize("rsetup", [("pidns",), ("hidepid", "nobody")])
def test_reader_outside_the_writers_view_learns_that_it_died(procs, rsetup):
    """A reader that cannot judge the writer by its pid (another pid
    namespace; /proc hiding it) still learns at once that it was killed."""
    w_conn, w_child = SPAWN.Pipe()
    r_conn, r_child = SPAWN.Pipe()
    writer = procs.start(cc.writer_one_then_wait, w_child,
                         ("nobody", "nondumpable") if "nobody" in rsetup else ())
    handle, _ = _recv(w_conn, 60, "handle")
    procs.start(cc.reader_until_writer_dies, r_child, handle, rsetup)
    assert _recv(r_conn, 60, "first message") == ("first", "one")
    time.sleep(0.5)         # the reader is waiting, and the writer alive: no error
    assert not r_conn.poll(0), r_conn.recv()
    writer.kill()
    status, text = _recv(r_conn, 15, "the reader's error")
    assert status == "raised" and "died" in text, text
    procs.join_all(30, expect_ok=False)     # the writer was killed


@pytest.mark.parametrize("impl_env", ["fastmq", "vllm"], indirect=True)
def test_sidecar_in_the_network_namespace_receives_nothing(procs, monkeypatch, impl_env):
    """A same-uid process of another container sharing the pod's network
    namespace (its own mount namespace, a fresh /tmp) finds the queue's
    sockets in /proc/net/unix.  fastmq's are abstract names it can reach:
    they used to hand it every payload sent over the local socket; now it
    receives nothing, and the writer names it.  vLLM's is a socket file in
    the writer's /tmp, out of its reach: it receives nothing either."""
    import tempfile

    monkeypatch.setenv("FASTMQ_PARTS", "0")    # 8 MiB messages over the socket
    w_conn, w_child = SPAWN.Pipe()
    r_conn, r_child = SPAWN.Pipe()
    procs.start(rc.sidecar_writer, w_child, impl_env)
    handle, _ = _recv(w_conn, 120, "handle")
    procs.start(cc.reader, r_child, impl_env, handle, ())
    assert _recv(w_conn, 120, "writer's handshake") == "ready"
    s_conn, s_child = SPAWN.Pipe()
    tmp = tempfile.gettempdir()
    procs.start(cc.sidecar, s_child, 4.0, tmp)
    got = {}
    while "connected" not in got:
        msg = _recv(s_conn, 60, "sidecar's connections")
        got[msg[0]] = msg[1:]
    sidecar_pid = got["pid"][0]
    names, reachable = got["connected"]
    if impl_env == "fastmq":
        assert any(n.startswith("@fastmq_") and "door" not in n for n in names), names
        assert any(n.startswith("@fastmq_door_") for n in names), names
    else:
        # It sees vLLM's socket file listed, and cannot reach it.
        ipc = handle.local_subscribe_addr
        assert ipc.startswith("ipc://" + tmp), ipc
        assert ipc[len("ipc://"):] in names, (ipc, names)
    assert reachable == [], reachable
    time.sleep(1.0)         # its subscriptions have reached the writer
    w_conn.send("send")
    status, read = _recv(r_conn, 60, "reader's result")
    assert status == "ok" and read == [(8 << 20, bytes([i])) for i in range(3)], read
    _, overflow, lines = _recv(w_conn, 60, "writer's report")
    _, received, door = _recv(s_conn, 60, "sidecar's report")
    assert received == 0
    if impl_env == "fastmq":
        assert overflow == 3
        assert door and all("does not hold this queue's handle" in d for d in door), door
        # The writer names it: the pid its socket's peer credentials give.
        assert any(f"refused a process (pid {sidecar_pid}, uid {os.getuid()})" in line
                   and "does not hold this queue's handle" in line for line in lines), lines
    w_conn.send("bye")
    procs.join_all(30)


def test_reader_without_the_key_is_refused_naming_why():
    w = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    h = w.export_handle()
    from dataclasses import replace

    with pytest.raises(DoorError, match="refused this reader its shared memory: this "
                       "process does not hold this queue's handle"):
        MessageQueue.create_from_handle(replace(h, local_key=bytes(32)), 0)
    r = MessageQueue.create_from_handle(h, 0)        # the queue still works
    w.wait_until_ready()
    r.wait_until_ready()
    w.enqueue("x")
    assert r.dequeue(timeout=10) == "x"


def test_process_group_finds_a_reader_that_cannot_inspect_the_writer_local(procs):
    """vLLM's ``create_from_process_group`` call: which ranks share the
    writer's node is probed by mapping a segment of the writer's, which
    used to go through /proc, so a non-dumpable writer's reader with
    Docker's capabilities was taken for another node's (a remote reader)."""
    import _nodes

    port = _nodes.free_port()
    conns = []
    for rank, setup in ((0, ("nondumpable",)), (1, ("docker_caps",))):
        mine, child = SPAWN.Pipe()
        conns.append(mine)
        procs.start(cc.group_rank, child, rank, port, setup)
    assert _recv(conns[0], 120, "writer's report") == ("writer", [1])
    assert _recv(conns[1], 120, "reader's report") == ("reader", {"step": 1})
    procs.join_all(60)


def test_strangers_that_connect_and_say_nothing_do_not_keep_a_reader_out():
    """A flood of connections to the writer's segment door that never ask
    (an attacker's, or a port scanner's) is answered as it comes: a
    reader attaches beside them, without waiting for them to time out."""
    import socket

    from fastmq import _door

    w = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    h = w.export_handle()
    idle = []
    try:
        for _ in range(3 * _door.MAX_PENDING):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + h.local_door_addr[1:])
            idle.append(s)
        t0 = time.monotonic()
        r = MessageQueue.create_from_handle(h, 0)
        assert time.monotonic() - t0 < _door.PEER_TIMEOUT_S
        w.wait_until_ready()
        r.wait_until_ready()
        w.enqueue("through")
        assert r.dequeue(timeout=10) == "through"
    finally:
        for s in idle:
            s.close()


def _long_wait_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "in wait_until_ready() for its readers" in r.getMessage()]


def _shutdown_after(w, seconds: float):
    import threading

    t = threading.Timer(seconds, w.shutdown)
    t.daemon = True
    t.start()
    return t


def test_a_refused_stranger_is_named_in_the_writers_long_wait_line(monkeypatch, caplog):
    """A writer that waits in wait_until_ready() for a reader that does not
    come names, in its long-wait line, the process its door refused (here a
    same-uid stranger that asked without the handle's key)."""
    import socket

    from fastmq import _door

    caplog.set_level(logging.INFO, logger="fastmq")
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "0.3")
    w = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    h = w.export_handle()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + h.local_door_addr[1:])
    s.sendall(_door._REQUEST.pack(_door._MAGIC, bytes(32), 0))
    assert b"does not hold this queue's handle" in s.recv(4096)
    s.close()
    _shutdown_after(w, 1.5)
    with pytest.raises(RuntimeError, match="cancelled"):
        w.wait_until_ready()
    del w
    lines = _long_wait_lines(caplog)
    assert lines, [r.getMessage() for r in caplog.records]
    assert all("local rank 0" in line for line in lines), lines
    want = f"; refused: pid {os.getpid()} uid {os.getuid()} (does not hold this queue's handle)"
    assert all(want in line for line in lines), lines


def test_a_plain_subscription_without_an_identity_is_named(monkeypatch, caplog):
    """A process that subscribes to the queue's local data socket with a
    plain "" (no reader's identity: a sidecar, or a reader of vLLM's own
    queue) is named by the kernel's credentials in the writer's long-wait
    line, and in the error the handshake raises for it."""
    import zmq

    from fastmq.handle import HandleMismatchError

    caplog.set_level(logging.INFO, logger="fastmq")
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "0.25")
    w = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(w.export_handle().local_subscribe_addr)
        stop = _shutdown_after(w, 10)
        with pytest.raises(HandleMismatchError) as e:
            w.wait_until_ready()
        stop.cancel()
    finally:
        sub.close(0)
        ctx.term()
    text = str(e.value)
    del w, e, stop
    me = f"pid {os.getpid()} uid {os.getuid()}"
    assert f"without a reader's identity: {me}" in text, text
    lines = _long_wait_lines(caplog)
    assert any(f"refused: {me} (subscribed to the local socket without a reader's "
               "identity)" in line for line in lines), lines


def test_a_sidecar_of_another_pid_namespace_never_fails_the_handshake(procs, monkeypatch):
    """A Kubernetes pod's sidecar shares the writer's network namespace,
    not its pid namespace: it can subscribe to the abstract socket with a
    plain "" while the writer still waits for a reader.  Its pid is none
    the writer can see (the kernel says 0), so it is no reader of the
    writer's: it is named in the long-wait line and the handshake goes on
    (it used to fail with HandleMismatchError a second later), and it
    receives nothing."""
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "0.25")
    w_conn, w_child = SPAWN.Pipe()
    procs.start(rc.contained_writer, w_child)
    assert _recv(w_conn, 60, "writer's queue") == "waiting"
    s_conn, s_child = SPAWN.Pipe()
    procs.start(cc.sidecar, s_child, 4.0)
    got = {}
    while "connected" not in got:
        msg = _recv(s_conn, 60, "sidecar's connections")
        got[msg[0]] = msg[1:]
    assert any(n.startswith("@fastmq_") and "door" not in n for n in got["connected"][0])
    time.sleep(2.5)         # past the second after which a reader's absence is judged
    w_conn.send("reader")
    _, result, lines = _recv(w_conn, 60, "writer's handshake")
    _, received, _ = _recv(s_conn, 60, "sidecar's report")
    procs.join_all(30)
    assert result == ["ok", "after"], result
    assert received == 0
    named = [ln for ln in lines if "in wait_until_ready() for its readers" in ln
             and f"a process outside this pid namespace (uid {os.getuid()}) "
                 "(subscribed to the local socket without a reader's identity)" in ln]
    assert named, lines


# A handle without a segment door (an older fastmq's): its reader opens the
# segments through /proc/<writer pid>/fd, which needs ptrace read access to
# the writer; the error names the cause this reader can see, and the fix.
PROC_CAUSES = {
    "another uid": ((), ("nobody",), "PermissionError",
                    ["it runs as another user (uid 0) than this process (uid 65534), "
                     "which lacks CAP_SYS_PTRACE"]),
    "not dumpable": (("nobody",), ("nobody",), "PermissionError",
                     ["it is not dumpable (it changed its uid, ran a setuid program or set "
                      "PR_SET_DUMPABLE 0: its /proc/"]),
    "capabilities": ((), ("docker_caps",), "PermissionError",
                     ["it holds capabilities this process lacks"]),
    "hidepid": ((), ("hidepid", "nobody"), "FileNotFoundError",
                ["/proc is mounted with hidepid=", "which hides other users' processes"]),
    "pid namespace": ((), ("own_proc",), "FileNotFoundError",
                      ["this process is in a pid namespace of its own (not the host's), "
                       "whose /proc does not show processes outside it"]),
}


@pytest.mark.parametrize("cause", sorted(PROC_CAUSES))
def test_a_reader_that_must_use_proc_is_told_the_cause_and_the_fix(procs, cause):
    from dataclasses import replace

    wsetup, rsetup, kind, says = PROC_CAUSES[cause]
    w_conn, w_child = SPAWN.Pipe()
    r_conn, r_child = SPAWN.Pipe()
    procs.start(rc.holder, w_child, wsetup)
    handle, pid = _recv(w_conn, 60, "handle")
    procs.start(rc.refused_reader, r_child, replace(handle, local_door_addr=None), rsetup)
    status, text = _recv(r_conn, 60, "reader's error")
    assert status == "error" and text.startswith(kind + ":"), text
    assert f"(pid {pid})" in text and f"/proc/{pid}/fd/" in text, text
    for s in says:
        assert s in text, text
    assert "A queue's readers get its segments from the writer itself, through its " \
        "segment door" in text, text
    w_conn.send("bye")
    procs.join_all(60)


def test_a_reader_in_another_network_namespace_is_told_so(procs):
    """The segment door is an abstract unix socket, per network namespace:
    a reader outside the writer's (``unshare -n``) cannot reach it, and is
    told where local readers must run."""
    w_conn, w_child = SPAWN.Pipe()
    r_conn, r_child = SPAWN.Pipe()
    procs.start(rc.holder, w_child, ())
    handle, pid = _recv(w_conn, 60, "handle")
    procs.start(rc.refused_reader, r_child, handle, ("netns",))
    status, text = _recv(r_conn, 60, "reader's error")
    assert status == "error" and text.startswith("DoorError:"), text
    assert f"cannot reach the writer (pid {pid})'s local socket " \
        f"{handle.local_door_addr}" in text, text
    assert "this reader is in another network namespace than the writer" in text, text
    assert "--network container:<writer>" in text and "the same pod" in text, text
    w_conn.send("bye")
    procs.join_all(60)
