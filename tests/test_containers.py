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
"""
from __future__ import annotations

import logging
import os
import time

import pytest

import _container_children as cc
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


def test_sidecar_in_the_network_namespace_receives_nothing(procs, monkeypatch, caplog):
    """A same-uid process of another container sharing the pod's network
    namespace finds the queue's abstract sockets in /proc/net/unix; it
    used to receive every payload sent over the local socket."""
    caplog.set_level(logging.WARNING, logger="fastmq")
    monkeypatch.setenv("FASTMQ_PARTS", "0")    # 8 MiB messages over the socket
    w = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4,
                     enable_shm_tensor_arena=False)
    r_conn, r_child = SPAWN.Pipe()
    procs.start(cc.reader, r_child, "fastmq", w.export_handle(), ())
    w.wait_until_ready()
    s_conn, s_child = SPAWN.Pipe()
    procs.start(cc.sidecar, s_child, 4.0)
    status, names = _recv(s_conn, 60, "sidecar's connections")
    assert any(n.startswith("@fastmq_") and "door" not in n for n in names), names
    assert any(n.startswith("@fastmq_door_") for n in names), names
    time.sleep(1.0)         # its subscriptions have reached the writer
    payloads = [bytes([i]) * (8 << 20) for i in range(3)]
    for p in payloads:
        w.enqueue(p)
    w.enqueue(None)
    status, got = _recv(r_conn, 60, "reader's result")
    assert status == "ok" and got == [(8 << 20, bytes([i])) for i in range(3)]
    assert w.stats()["overflow_messages"] == 3
    _, received, door = _recv(s_conn, 60, "sidecar's report")
    assert received == 0
    assert door and all("does not hold this queue's handle" in d for d in door), door
    assert any("refused a process" in r.message for r in caplog.records)
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
