"""A process forked from a queue's process inherits its ends.  Only the
process that owns a queue changes it: the child can neither take an arena
slot nor run the handshake on the inherited end, and what it inherited
(the writer's connections to remote readers, its listener, the segments'
descriptors) lives no longer than the owner does."""
from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastmq import MessageQueue, WriterGoneError

from _queues import local_pair, refused_in_fork_child


def test_a_forked_child_can_neither_take_an_arena_slot_nor_run_the_handshake():
    w, (r,) = local_pair(1, max_chunk_bytes=1 << 20, max_chunks=4)
    try:
        assert refused_in_fork_child([lambda: w.empty_tensor((1 << 20,), torch.float32),
                                      lambda: w.wait_until_ready()])
        # The parent's arena and handshake are as they were.
        t = w.empty_tensor((1 << 20,), torch.float32)
        t.fill_(1.0)
        w.enqueue(t, timeout=10)
        assert float(r.dequeue(timeout=10).sum()) == float(1 << 20)
    finally:
        r.shutdown()
        w.shutdown()


_WRITER = r"""
import base64, os, pickle, sys, time
from fastmq import MessageQueue
w = MessageQueue(1, 0, connect_ip="127.0.0.1")
print(base64.b64encode(pickle.dumps(w.export_handle())).decode(), flush=True)
w.wait_until_ready()
w.enqueue("hello")
helper = os.fork()
if helper == 0:        # a helper the writer forked: it never touches the queue
    time.sleep(60)
    os._exit(0)
print(helper, flush=True)
time.sleep(60)
"""


def test_a_writers_forked_helper_does_not_keep_its_connections_alive():
    # The writer dies (SIGKILL) while a process it forked still runs: the
    # remote reader learns at once, as it does without the helper (the
    # helper's inherited copy of the connection would keep it open).
    p = subprocess.Popen([sys.executable, "-c", _WRITER], stdout=subprocess.PIPE, text=True)
    helper = None
    r = None
    try:
        handle = pickle.loads(base64.b64decode(p.stdout.readline()))
        r = MessageQueue.create_from_handle(handle, 0)
        r.wait_until_ready()
        assert r.dequeue(timeout=10) == "hello"
        helper = int(p.stdout.readline())
        p.kill()
        p.wait()
        started = time.monotonic()
        with pytest.raises(WriterGoneError):
            r.dequeue(timeout=5)
        assert time.monotonic() - started < 4
    finally:
        if helper is not None:
            try:
                os.kill(helper, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.kill()
        p.wait()
        if r is not None:
            r.shutdown()
