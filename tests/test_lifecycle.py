"""Process lifecycles around a queue: readers that exit, handshakes with
dead peers, fork children, signal handlers, racing claims and corrupt
files.  Each ends in a clear error or a clean finish: never a hang, a
false error, a corrupted parent or a file left behind."""
from __future__ import annotations

import gc
import glob
import multiprocessing as mp
import fcntl
import os
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from fastmq import MessageQueue, ReaderGoneError, _ring
from fastmq.handle import HandleMismatchError

import _lifecycle_children as lc
from _queues import local_pair, refused_in_fork_child, wait_for
from conftest import OUR_PIDS, segments_made_by

FORK = mp.get_context("fork")


def _files_of(pid: int) -> list:
    """What process ``pid`` left: files named after it (fastmq makes none),
    and any process still holding or mapping a segment it made."""
    tmp = tempfile.gettempdir()
    return sorted(glob.glob(f"/dev/shm/fastmq_{pid}_*") +
                  glob.glob(os.path.join(tmp, f"fastmq_{pid}_*"))) + sorted(
        segments_made_by([pid]).items())


def _in_thread(fn):
    """Run ``fn`` on a thread; returns (thread, box) where box gets
    ``("ok", value)`` or ``("error", exception)``."""
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as e:
            box.append(("error", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _finished(t, box, timeout, what):
    t.join(timeout)
    assert not t.is_alive(), f"{what} still blocked after {timeout} s"
    return box[0]


# -- readers that leave --------------------------------------------------------

def test_reader_that_exits_with_messages_unread_is_named(procs):
    """A reader whose process ended normally (its worker raised) used to
    release its slot to pid 0, which the writer's dead-reader check skips:
    enqueue() then blocked for ever on the full ring."""
    w = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, enable_shm_tensor_arena=False)
    parent, child = mp.Pipe()
    p = procs.start(lc.reader_then_raise, w.export_handle(), 0, child)
    w.wait_until_ready()
    pid = parent.recv()
    w.enqueue("one")
    w.enqueue("two")                  # the ring is full now
    parent.send("go")
    p.join(30)
    assert p.exitcode == 1
    t, box = _in_thread(lambda: w.enqueue("three"))
    try:
        kind, err = _finished(t, box, 15, "enqueue() to a reader that left")
    finally:
        w.shutdown()
    assert kind == "error"
    assert isinstance(err, RuntimeError)
    assert f"reader rank 0 (pid {pid})" in str(err), err


# -- the handshake -----------------------------------------------------------------

@pytest.mark.parametrize("side", ["writer", "local reader", "remote reader"])
def test_shutdown_wakes_a_blocked_handshake(side):
    """wait_until_ready() used to be a plain blocking receive: shutdown()
    from another thread could not end it."""
    if side == "remote reader":
        w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    else:
        w = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2,
                         enable_shm_tensor_arena=False)
    end = w if side == "writer" else MessageQueue.create_from_handle(w.export_handle(), 0)
    t, box = _in_thread(end.wait_until_ready)
    time.sleep(0.3)
    end.shutdown()
    kind, err = _finished(t, box, 10, "wait_until_ready() after shutdown()")
    assert kind == "error" and isinstance(err, RuntimeError) and str(err) == "cancelled", err


def test_writer_killed_during_handshake_is_named(procs):
    """A reader whose writer was SIGKILLed before the handshake used to wait
    for READY for ever."""
    parent, child = mp.Pipe()
    p = procs.start(lc.writer_killed_in_handshake, child, False)
    r = MessageQueue.create_from_handle(parent.recv(), 0)
    parent.send("attached")
    t, box = _in_thread(r.wait_until_ready)
    kind, err = _finished(t, box, 15, "a reader's handshake with a dead writer")
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    assert kind == "error" and isinstance(err, RuntimeError), err
    assert f"writer (pid {p.pid}) died" in str(err), err
    # This reader alone holds the dead writer's memory, until it lets go.
    assert set(segments_made_by([p.pid])) == {os.getpid()}
    r.shutdown()
    del r, err, box
    import gc

    gc.collect()
    assert not _files_of(p.pid)


def test_reader_dead_before_handshake_is_named(procs):
    w = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2, enable_shm_tensor_arena=False)
    parent, child = mp.Pipe()
    dead = procs.start(lc.reader_attach_and_wait, w.export_handle(), 1, child)
    assert parent.recv() == dead.pid
    dead.kill()
    dead.join(10)
    t, box = _in_thread(w.wait_until_ready)
    kind, err = _finished(t, box, 15, "the writer's handshake with a dead reader")
    assert kind == "error" and isinstance(err, ReaderGoneError), err
    assert f"local reader rank 1 (pid {dead.pid}) died" in str(err), err
    assert (err.rank, err.pid, err.how) == (1, dead.pid, "died")


def test_replaced_local_reader_is_counted_once(procs):
    """A rank-0 reader killed before the handshake and replaced by a new
    rank 0 used to be counted twice (its subscribe and its unsubscribe):
    the writer then blamed rank 1 for using vLLM's own queue."""
    w = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=4, enable_shm_tensor_arena=False)
    h = w.export_handle()
    parent, child = mp.Pipe()
    first = procs.start(lc.reader_attach_and_wait, h, 0, child)
    assert parent.recv() == first.pid
    first.kill()
    first.join(10)
    procs.procs.remove(first)
    outs = []
    for rank in (0, 1):
        a, b = mp.Pipe()
        outs.append(a)
        procs.start(lc.reader_collect, h, rank, 3, b)
    # The new rank 0 has taken over the dead one's slot.
    wait_for(lambda: w._ring.reader_state(0) == (procs.procs[0].pid, _ring.SLOT_ALIVE), 30)
    w.wait_until_ready()
    for i in range(3):
        w.enqueue(i)
    assert [o.recv() for o in outs] == [[0, 1, 2], [0, 1, 2]]
    procs.join_all()


def test_replaced_remote_reader_is_counted_once(procs):
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = w.export_handle()
    parent, child = mp.Pipe()
    first = procs.start(lc.reader_attach_and_wait, h, 0, child)
    assert parent.recv() == first.pid
    time.sleep(0.5)                  # its subscription reaches the writer
    first.kill()
    first.join(10)
    procs.procs.remove(first)
    time.sleep(0.5)                  # and its disconnect
    a, b = mp.Pipe()
    procs.start(lc.reader_collect, h, 0, 2, b)
    time.sleep(1.0)                  # the new reader has subscribed
    w.wait_until_ready()
    w.enqueue("a")
    w.enqueue("b")
    assert a.recv() == ["a", "b"]
    procs.join_all()


def test_subscriber_that_is_not_a_reader_is_not_counted():
    """A plain subscriber (not a fastmq reader) used to count as a reader,
    so the handshake could complete without the real one (even without
    authentication, remote_security="none")."""
    import zmq

    w = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security="none")
    h = w.export_handle()
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.SUB)
    stranger.setsockopt(zmq.SUBSCRIBE, b"x" * 40)
    stranger.connect(h.remote_subscribe_addr)
    try:
        t, box = _in_thread(w.wait_until_ready)
        time.sleep(0.5)
        stranger.close(0)
        assert t.is_alive(), "the handshake completed without the reader"
        r = MessageQueue.create_from_handle(h, 0)
        r.wait_until_ready()
        assert _finished(t, box, 10, "handshake")[0] == "ok"
        w.enqueue("hello")
        assert r.dequeue(timeout=10) == "hello"
    finally:
        stranger.close(0)
        ctx.term()


# -- fork children ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["return", "raise"])
def test_multiprocessing_fork_child_leaves_no_files(kind):
    """A queue created in a multiprocessing fork child (vLLM's default
    start method) used to leave its ring, arena and ipc file: the child
    ends with os._exit, which runs no atexit hook or finalizer."""
    p = FORK.Process(target=lc.create_queue_and_return, args=(kind,))
    p.start()
    OUR_PIDS.add(p.pid)
    p.join(60)
    assert p.exitcode == (0 if kind == "return" else 1)
    assert not _files_of(p.pid)


def test_a_writer_that_left_through_os_exit_leaves_nothing(procs):
    """os._exit runs no exit hook: nothing may depend on one."""
    parent, child = mp.Pipe()
    p = procs.start(lc.create_queue_then_os_exit, child)
    parent.recv()
    assert segments_made_by([p.pid])
    parent.send("go")
    p.join(30)
    assert not _files_of(p.pid)


def test_fork_child_of_a_reader_leaves_its_parent_alone():
    """A child forked from a reader that held an arena tensor used to
    release, when it exited, its parent's arena slot and reader rank: the
    parent's tensor then changed under it and its next dequeue() failed."""
    torch = pytest.importorskip("torch")
    w, (r,) = local_pair(1, max_chunk_bytes=1 << 16, max_chunks=4, arena_slots=1,
                         arena_slot_mb=2, arena_min_mb=1)
    w.enqueue({"t": torch.full((1 << 18,), 1.0)})
    t = r.dequeue(timeout=10)["t"]
    assert w.stats()["arena_hits"] == 1
    pid = os.fork()
    if pid == 0:       # a helper that never touches the queue, then exits
        try:
            del t
            gc.collect()
        finally:
            os._exit(0)
    OUR_PIDS.add(pid)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    w.enqueue({"t": torch.full((1 << 18,), 2.0)})
    assert float(t.min()) == float(t.max()) == 1.0, "the parent's tensor changed"
    assert float(r.dequeue(timeout=10)["t"][0]) == 2.0
    # Still this process's rank: no other process may attach as reader 0.
    assert w._ring.reader_state(0) == (os.getpid(), _ring.SLOT_ALIVE)


def test_shutdown_and_acquire_write_in_a_fork_child_raise():
    """A forked child's shutdown() used to close its parent's ring, and its
    acquire_write() to publish into it."""
    w, (r,) = local_pair(1, max_chunk_bytes=4096, max_chunks=2, enable_shm_tensor_arena=False)
    assert refused_in_fork_child([w.shutdown, lambda: w.acquire_write().__enter__(),
                                  lambda: r.acquire_read(timeout=0).__enter__(), r.shutdown])
    w.enqueue("still open")
    assert r.dequeue(timeout=10) == "still open"


# -- signals -----------------------------------------------------------------------------

def test_shutdown_from_a_signal_handler_between_payload_and_mark(procs, monkeypatch):
    """A signal handler that called shutdown() after an overflow payload
    left but before its ring mark: enqueue() returned while the parked
    reader had already seen "closed" and stopped without the message."""
    from fastmq._writer import QueueWriter

    monkeypatch.setenv("FASTMQ_PARTS", "0")   # the socket path, not parts
    w = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4,
                     enable_shm_tensor_arena=False)
    parent, child = mp.Pipe()
    procs.start(lc.reader_collect_until_closed, w.export_handle(), 0, child)
    w.wait_until_ready()
    w.enqueue(b"small")
    time.sleep(0.3)                     # the reader parks, waiting for more

    def on_signal(signum, frame):
        w.shutdown()
        time.sleep(0.5)                 # the parked reader sees "closed" now

    real = QueueWriter._wait_flushed

    def flushed_then_signal(*a, **kw):
        real(*a, **kw)
        os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, on_signal)
    monkeypatch.setattr(QueueWriter, "_wait_flushed", flushed_then_signal)
    try:
        try:
            w.enqueue(b"x" * 200_000)   # overflow: payload, then mark
            returned = True
        except RuntimeError:
            returned = False
    finally:
        signal.signal(signal.SIGUSR1, old)
    got = parent.recv()
    procs.join_all()
    assert got == ([b"small", b"x" * 200_000] if returned else [b"small"])


# -- claims ----------------------------------------------------------------------------------

def test_claim_of_a_dead_holders_slot_has_one_winner(procs):
    """Racing claims of a slot whose holder died: exactly one wins.  (The
    claim used to swap the pid, then store the start time: a racer could
    pair the new pid with the dead holder's start time, judge the new
    holder dead and win too.)"""
    from fastmq.ring import ShmRingBuffer

    buf = ShmRingBuffer(1, 4096, 2)
    try:
        name = buf.name
        for round_ in range(4):
            conns = []
            start_at = time.time() + 1.0
            for _ in range(3):
                a, b = mp.Pipe()
                conns.append(a)
                procs.start(lc.claim_race, name, 1, 4096, 2, 0, start_at, b)
            wins = [c.recv() for c in conns]
            assert sum(wins) == 1, f"round {round_}: {sum(wins)} processes hold one rank"
            for c in conns:
                c.send("go")
            procs.join_all()
            procs.procs.clear()
    finally:
        buf.close()


# -- corrupt files --------------------------------------------------------------------------

def _forged_ring(name: str, n_reader: int, chunk: int, n_chunks: int) -> int:
    """A memory file named like a ring, with this header; its descriptor."""
    head = bytearray(4096)
    struct.pack_into("<QII", head, 0, _ring.MAGIC, _ring.LAYOUT_VERSION, n_reader)
    struct.pack_into("<QI", head, 16, chunk, n_chunks)
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    os.write(fd, head)
    # Sealed as fastmq seals its segments: `fastmq ls` maps nothing else.
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.mark.parametrize("geometry", [(2**32 - 1, 1 << 20, 4), (1, 2**63 + 5, 2**31 + 7),
                                      (3, 2**40, 2**31 - 1), (0, 0, 0)])
def test_ls_lists_a_corrupt_ring_and_every_other_queue(geometry):
    """One fastmq segment with a valid magic and absurd geometry used to make
    `fastmq ls` die with OverflowError, listing nothing."""
    import json

    w = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, enable_shm_tensor_arena=False)
    bad = f"fastmq_{os.getpid()}_ring_{secrets.token_hex(6)}"
    fd = _forged_ring(bad, *geometry)
    try:
        for args in (["ls"], ["ls", "--json"]):
            out = subprocess.run([sys.executable, "-m", "fastmq.cli", *args],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert w.buffer.name.split(":")[0] in out.stdout
            assert bad in out.stdout
        listing = json.loads(out.stdout)
        (entry,) = [o for o in listing["other"] if o["name"] == bad]
        # Named from its header, read with pread: never mapped (a 4 KiB
        # forgery used to be mapped whole for the snapshot to say "bad
        # geometry").
        assert "its fastmq ring header puts the data at byte 0" in entry["error"], entry
    finally:
        os.close(fd)


# -- all of it at once ---------------------------------------------------------------------------

def test_stress_random_lifecycles(procs):
    """A writer and two readers per round through random lifecycles: the
    writer ends normally, shuts down from a signal handler at a random
    moment, or is SIGKILLed after a random enqueue(); each reader reads to
    the end, forks a helper that exits, raises, or is SIGKILLed after a
    random number of messages.  Every round: nothing hangs, every reader
    that stays gets exactly the messages whose enqueue() returned, the
    writer's only error names a reader that really left (or is the
    shutdown), and no process leaves a file."""
    import random

    rng = random.Random(19)
    for round_ in range(10):
        procs.procs.clear()
        n = rng.randrange(10, 40)
        sizes = [rng.choice([100, 5_000, 200_000]) for _ in range(n)]
        wplan = rng.choice(["normal", "signal", "kill"])
        rplans = [rng.choice(["all", "all", "fork", "raise", "kill"]) for _ in range(2)]
        leave = [rng.randrange(0, n) for _ in range(2)]
        wconn, child = mp.Pipe()
        writer = procs.start(lc.stress_writer, child, wplan, sizes, rng.random())
        child.close()                 # so that a killed writer's pipe reads as EOF
        h = wconn.recv()
        rconns, readers = [], []
        for rank in range(2):
            a, b = mp.Pipe()
            rconns.append(a)
            readers.append(procs.start(lc.stress_reader, h, rank, rplans[rank], leave[rank], b))
            b.close()
        where = f"round {round_}: writer {wplan}, readers {rplans} at {leave}, {n} messages"
        pids = {}
        for rank, c in enumerate(rconns):
            try:
                pids[rank] = c.recv()[1]
            except EOFError:
                writer.join(5)
                pytest.fail(f"{where}: reader {rank} died in the handshake (writer exit "
                            f"code {writer.exitcode}, says {wconn.poll(0) and wconn.recv()})")
        # The writer's word: how many enqueue() calls returned, and its error.
        returned, error = 0, None
        while wconn.poll(90):
            try:
                msg = wconn.recv()
            except EOFError:          # SIGKILLed: its last word was the count
                break
            if msg[0] == "returned":
                returned = msg[1]
            else:
                _, returned, error = msg
                break
        else:
            pytest.fail(f"{where}: the writer hung")
        reports = []
        for rank, c in enumerate(rconns):
            assert c.poll(90), f"{where}: reader {rank} hung"
            reports.append(c.recv())
        for p in [writer, *readers]:
            p.join(60)
            assert not p.is_alive(), f"{where}: process {p.pid} did not end"
        # A reader that planned to leave left only if the stream reached
        # its moment first; otherwise it ended like the others.
        left = {pids[r] for r, (_, end) in enumerate(reports) if end in ("raise", "kill")}
        for rank, (got, end) in enumerate(reports):
            if end in ("raise", "kill"):
                assert got == list(range(leave[rank])), where
                continue
            assert got == list(range(returned)), f"{where}: reader {rank} read {got}, {end!r}; sizes {sizes[:returned + 1]}"
            assert end in ("end", "cancelled") or "shut the queue down" in end or \
                "died" in end, f"{where}: reader {rank} ended with {end!r}"
        if error is not None:
            assert error == "cancelled" and wplan == "signal" or \
                any(f"(pid {pid})" in error for pid in left), f"{where}: writer error {error!r}"
        elif wplan == "normal":
            assert returned == n, where
        gc.collect()
        if wplan == "kill":
            # Its readers remove a killed writer's files when they see it
            # dead; here the last one may have left first: the next
            # writer on the host removes them.
            MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2,
                         enable_shm_tensor_arena=False)
            gc.collect()
        for p in [writer, *readers]:
            assert not _files_of(p.pid), f"{where}: files left: {_files_of(p.pid)}"
