"""Child-process targets for the delivery tests (spawned: module level)."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import sys
import time


def payload(seq: int, size: int) -> bytes:
    """Deterministic bytes for message ``seq``: a reader can check them."""
    block = hashlib.sha256(seq.to_bytes(8, "little")).digest()
    return (block * (size // len(block) + 1))[:size]


def message(seq: int, size: int) -> dict:
    body = payload(seq, size)
    return {"seq": seq, "body": body, "sha": hashlib.sha256(body).hexdigest()}


def check(msg: dict, want_seq: int) -> None:
    if msg["seq"] != want_seq:
        raise AssertionError(f"expected message {want_seq}, got {msg['seq']}")
    if hashlib.sha256(msg["body"]).hexdigest() != msg["sha"]:
        raise AssertionError(f"message {want_seq}: payload does not match its checksum")


def _send_then_leave(make_queue, conn, sizes, how) -> None:
    """Make the writer (here, so that ``drop`` drops the only reference),
    hand its handle over ``conn``, enqueue one message per size, then leave
    as ``how`` says (see ``writer_then_exit``)."""
    mq = make_queue()
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    for seq, size in enumerate(sizes):
        mq.enqueue(message(seq, size))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "drop":
        del mq
    sys.exit(0)


def writer_then_exit(conn, sizes, how, wait_mode):
    """Create a writer for one local reader, hand its handle over ``conn``,
    enqueue one message per size, then leave: ``exit`` (sys.exit),
    ``drop`` (drop the queue, then exit) or ``kill`` (SIGKILL itself right
    after the last enqueue() returned)."""
    from fastmq import MessageQueue

    _send_then_leave(lambda: MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4,
                                          wait_mode=wait_mode, enable_shm_tensor_arena=False),
                     conn, sizes, how)


def remote_writer_then_exit(conn, sizes, how):
    """As ``writer_then_exit`` for one remote reader (TCP)."""
    from fastmq import MessageQueue

    _send_then_leave(lambda: MessageQueue(1, 0, connect_ip="127.0.0.1"), conn, sizes, how)


def stress_reader(handle, rank, seed, out):
    """Read until the writer shuts the queue down, with random short
    timeouts and naps; report (messages read, first error or None)."""
    from fastmq import MessageQueue

    rng = random.Random(seed)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    want = 0
    error = None
    try:
        while True:
            if rng.random() < 0.05:
                time.sleep(rng.uniform(0, 0.004))
            try:
                msg = mq.dequeue(timeout=rng.choice([0, 0.0005, 0.002, 0.01]))
            except TimeoutError:
                continue
            except RuntimeError as e:
                if "shut the queue down" in str(e):
                    break
                raise
            check(msg, want)
            want += 1
    except BaseException as e:  # reported, so the test shows what went wrong
        error = f"{type(e).__name__}: {e}"
    out.send((want, error))


def mark_without_payload_then_die(conn) -> None:
    """A writer whose overflow mark is published but whose payload never
    comes (a real send puts the payload in the kernel first: this is the
    case the reader's grace exists for), and whose connection stays open
    after it died: a process forked from it holds the descriptors, as any
    child the writer forked would.  Sends the holder's pid, then exits."""
    from fastmq import MessageQueue, _overflow

    os.environ["FASTMQ_PARTS"] = "0"    # the socket path, not parts
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4,
                      enable_shm_tensor_arena=False)
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    _overflow.send_message = lambda *a, **kw: None
    holder = os.fork()
    if holder == 0:
        time.sleep(60)
        os._exit(0)
    conn.send(holder)
    mq.enqueue(b"x" * (1 << 17))     # larger than a chunk: a mark on the ring
    os._exit(0)
