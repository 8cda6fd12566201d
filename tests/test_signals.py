"""A process blocked in any fastmq wait runs its Python signal handlers at
once, on every wait mode, local and remote: vLLM's engine core and workers
shut down through SIGTERM handlers.  Every periodic re-check is stretched
to ten minutes in the blocked child, so a handler that only ran when a
slice ended would show up as a wait of minutes, not milliseconds."""
from __future__ import annotations

import os
import signal
import time

import pytest

import _signal_children as sc
from fastmq import MessageQueue

HANDLER_WITHIN_S = 10.0   # far below the stretched ten-minute slices


def _signal_and_expect_exit(proc, ready) -> None:
    assert ready.poll(60), "the child never reached its wait"
    assert ready.recv() == "armed"
    time.sleep(0.5)          # past every spin budget: parked in the kernel
    assert proc.is_alive(), "the child left its wait before the signal"
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(HANDLER_WITHIN_S)
    assert not proc.is_alive(), "the SIGTERM handler did not run while blocked"
    assert proc.exitcode == sc.SIGNALLED, proc.exitcode


@pytest.mark.parametrize("mode", ["futex", "zmq", "spin"])
def test_local_reader_blocked_in_dequeue(procs, spawn_ctx, mode):
    w = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, wait_mode=mode,
                     enable_shm_tensor_arena=False)
    mine, theirs = spawn_ctx.Pipe()
    p = procs.start(sc.reader_in_dequeue, w.export_handle(), 0, theirs)
    w.wait_until_ready()
    _signal_and_expect_exit(p, mine)
    w.shutdown()


def test_remote_reader_blocked_in_dequeue(procs, spawn_ctx):
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    mine, theirs = spawn_ctx.Pipe()
    p = procs.start(sc.reader_in_dequeue, w.export_handle(), 1, theirs)
    w.wait_until_ready()
    _signal_and_expect_exit(p, mine)
    w.shutdown()


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_reader_blocked_in_wait_until_ready(procs, spawn_ctx, remote):
    # The writer never calls wait_until_ready(): the reader waits for READY.
    w = MessageQueue(1, 0 if remote else 1, connect_ip="127.0.0.1" if remote else None,
                     enable_shm_tensor_arena=False)
    mine, theirs = spawn_ctx.Pipe()
    p = procs.start(sc.reader_in_handshake, w.export_handle(), 1 if remote else 0, theirs)
    _signal_and_expect_exit(p, mine)
    w.shutdown()


@pytest.mark.parametrize("n_local,n_remote", [(1, 0), (0, 1)], ids=["local", "remote"])
def test_writer_blocked_in_wait_until_ready(procs, spawn_ctx, n_local, n_remote):
    mine, theirs = spawn_ctx.Pipe()
    p = procs.start(sc.writer_in_handshake, theirs, n_local, n_remote)
    _signal_and_expect_exit(p, mine)


@pytest.mark.parametrize("mode", ["futex", "zmq", "spin"])
def test_writer_blocked_on_a_full_ring(procs, spawn_ctx, mode):
    mine, theirs = spawn_ctx.Pipe()
    handle_in, handle_out = spawn_ctx.Pipe()
    done_in, done_out = spawn_ctx.Pipe()
    p = procs.start(sc.writer_on_a_full_ring, theirs, handle_out, mode)
    assert handle_in.poll(60)
    procs.start(sc.idle_reader, handle_in.recv(), 0, done_out)
    _signal_and_expect_exit(p, mine)
    done_in.send("done")
