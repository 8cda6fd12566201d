"""Child-process targets for the remote delivery tests (spawnable)."""
from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

BIG = 64 << 20


def remote_writer_shut_down_mid_flush(conn):
    """A remote writer: once told to, enqueue() a message far larger than
    the socket buffers (the reader is stopped) while another thread calls
    shutdown(); report how enqueue() ended, then die at once."""
    from fastmq import MessageQueue

    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    conn.recv()
    threading.Timer(0.3, mq.shutdown).start()
    try:
        mq.enqueue(b"\x07" * BIG)
        conn.send("returned")
    except RuntimeError as e:
        conn.send(f"raised {e}")
    os.kill(os.getpid(), signal.SIGKILL)


def remote_writer_then_die(conn):
    """A remote writer that sends one message, then dies (SIGKILL)."""
    from fastmq import MessageQueue

    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    mq.enqueue("last words")
    conn.recv()
    os.kill(os.getpid(), signal.SIGKILL)


def remote_reader_digest(handle, rank, conn):
    """Handshake, say so, then read one message and send back its digest
    (or the error)."""
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    conn.send("ready")
    try:
        msg = mq.dequeue(timeout=20)
        data = msg if isinstance(msg, bytes) else bytes(memoryview(msg))
        conn.send(hashlib.sha256(data).hexdigest())
    except Exception as e:
        conn.send(f"error {e!r}")
    time.sleep(0.1)


def writer_short_of_descriptors(conn):
    """A remote writer whose process may open only a few more descriptors
    than it holds, so that accepting strangers soon fails (EMFILE); reports
    the CPU time its wait_until_ready() took, then sends one message."""
    import logging
    import resource

    from fastmq import MessageQueue

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("fastmq").addHandler(handler)
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    held = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 4, hard))
    conn.send(mq.export_handle())
    cpu = time.process_time()
    mq.wait_until_ready()
    cpu = time.process_time() - cpu
    mq.enqueue("admitted")
    conn.send((cpu, seen))
    time.sleep(0.5)
