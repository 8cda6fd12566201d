"""Child-process targets for tests/test_containers.py's refusals: a writer
that only holds a queue open, and readers that cannot attach (another
network namespace; a handle without a segment door, whose segments are
opened through /proc/<writer>/fd) and report the error they got.
"""
from __future__ import annotations

import os

import _container_children as cc

CLONE_NEWNET = 0x40000000


def holder(conn, setup: tuple) -> None:
    """A writer (after ``setup``: "nobody", "nondumpable") that creates a
    1-reader queue, hands its handle over and holds it until told."""
    cc._prepare("fastmq")
    if "nobody" in setup:
        cc.become(cc.NOBODY)
    if "nondumpable" in setup:
        cc._check(cc._libc.prctl(cc.PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    from fastmq import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    conn.send((mq.export_handle(), os.getpid()))
    conn.recv()


def _attach(conn, handle) -> None:
    from fastmq import MessageQueue

    try:
        MessageQueue.create_from_handle(handle, 0)
        conn.send(("attached", ""))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def refused_reader(conn, handle, setup: tuple) -> None:
    """Attach as rank 0 after ``setup`` ("netns": a network namespace of
    its own; "own_proc": a child pid namespace with its own /proc; and
    those of ``_container_children.reader``); report ("error", text), or
    ("attached", "")."""
    cc._prepare("fastmq")
    if "netns" in setup:
        cc._check(cc._libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    if "hidepid" in setup:
        cc.hide_other_processes()
    if "nobody" in setup:
        cc.become(cc.NOBODY)
    if "docker_caps" in setup:
        cc.keep_only_caps(cc.DOCKER_CAPS)
    if "own_proc" in setup:
        cc.in_own_container(lambda: _attach(conn, handle))
        return
    _attach(conn, handle)


def _fastmq_log() -> list:
    """The messages the fastmq logger gives from now on (INFO and up), as
    they come: the writer's long-wait lines and its refusals."""
    import logging

    lines = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("fastmq").addHandler(_Keep(logging.INFO))
    logging.getLogger("fastmq").setLevel(logging.INFO)
    return lines


def sidecar_writer(conn, impl: str) -> None:
    """A 1-reader queue (``impl``: fastmq's or vLLM's own) of 1 MiB chunks:
    hand its handle over, wait for the reader, and on "send" send three
    8 MiB payloads (over the local socket in both) and None; report
    ("sent", overflow messages or None, fastmq's log lines)."""
    lines = _fastmq_log()
    cc._prepare(impl)
    MessageQueue = cc._queue_class(impl)
    kw = {"enable_shm_tensor_arena": False} if impl == "fastmq" else {}
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4, **kw)
    conn.send((mq.export_handle(), os.getpid()))
    mq.wait_until_ready()
    conn.send("ready")
    assert conn.recv() == "send"
    for i in range(3):
        mq.enqueue(bytes([i]) * (8 << 20))
    mq.enqueue(None)
    stats = mq.stats()["overflow_messages"] if impl == "fastmq" else None
    conn.send(("sent", stats, lines))
    conn.recv()


def contained_writer(conn) -> None:
    """A writer in a container of its own: its own pid and mount
    namespaces and /proc (the host's network namespace, shared as a pod
    shares one).  Its queue's handshake waits; on "reader" a reader in its
    process attaches; reports ("handshake", "ok" or the error, its
    long-wait lines)."""
    cc.in_own_container(lambda: _contained_writer(conn))


def _contained_writer(conn) -> None:
    import threading

    lines = _fastmq_log()
    cc._prepare("fastmq")
    from fastmq import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2,
                      enable_shm_tensor_arena=False)
    result = []

    def handshake():
        try:
            mq.wait_until_ready()
            result.append("ok")
        except BaseException as e:
            result.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=handshake)
    t.start()
    conn.send("waiting")
    assert conn.recv() == "reader"
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    r.wait_until_ready()
    t.join(30)
    if result == ["ok"]:
        mq.enqueue("after")
        result.append(r.dequeue(timeout=10))
    conn.send(("handshake", result, lines))
    r.shutdown()
    mq.shutdown()
