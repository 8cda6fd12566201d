"""The memory check's reading, kept in the background (fastmq._memory).

Before shared memory is taken, fastmq asks whether the host (or the
container's cgroup) has it; a reading of /proc and the cgroup files costs
about as much as copying a megabyte.  While a process has a segment open, a
thread ("fastmq-memory") takes that reading once a second and the checks
on a message's path answer from it: a fresh queue's first messages, of
every size and path, read no file.  The thread lives only while a segment
does, and a forked child starts its own.
"""
from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from fastmq import MessageQueue
from fastmq._memory import memory_readings

from _queues import background_readings, local_pair, shut
from conftest import SPAWN

MiB = 1 << 20
WATCHER = "fastmq-memory"


def _answer_of(procs, target):
    """What ``target(conn)``, run in a fresh spawned child, sends back."""
    parent, child = SPAWN.Pipe()
    procs.start(target, child)
    assert parent.poll(60), "the child did not answer"
    got = parent.recv()
    procs.join_all()
    return got


def _watchers() -> int:
    return sum(t.name == WATCHER for t in threading.enumerate())


def _first_messages():
    # A small one; ones that grow fresh chunks past their first page and
    # past the 64 KiB the ring's creation asked for; one larger than a
    # chunk (in parts to a waiting reader, or the socket); a tensor into a
    # cold arena slot.
    return [b"s" * 100, b"a" * MiB, b"b" * (3 * MiB), b"c" * (6 * MiB),
            torch.full((2 * MiB,), 7, dtype=torch.int32)]


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    return got == want


def _reader(handle, conn):
    r = MessageQueue.create_from_handle(handle, 0)
    r.wait_until_ready()
    before = memory_readings()["on_the_spot"]
    ok = all(_same(r.dequeue(timeout=60), m) for m in _first_messages())
    conn.send((ok, memory_readings()["on_the_spot"] - before))
    r.shutdown()


def test_a_fresh_queues_first_messages_read_no_memory_file(procs):
    w = MessageQueue(1, 1, max_chunk_bytes=4 * MiB, max_chunks=4, arena_slots=2,
                     arena_slot_mb=16, arena_min_mb=1, arena_prefault="off")
    parent, child = SPAWN.Pipe()
    procs.start(_reader, w.export_handle(), child)
    try:
        w.wait_until_ready()
        before = memory_readings()["on_the_spot"]
        for m in _first_messages():
            w.enqueue(m, timeout=60)
        assert parent.poll(60), "the reader did not answer"
        ok, reader_reads = parent.recv()
        writer_reads = memory_readings()["on_the_spot"] - before
        stats = w.stats()
    finally:
        w.shutdown()
    procs.join_all()
    assert ok, "the reader got other messages than were sent"
    assert stats["arena_hits"] >= 1, stats          # the tensor went through the arena
    assert (writer_reads, reader_reads) == (0, 0)


def _watcher_lifetime(conn):
    seen = [_watchers()]
    q = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2, enable_shm_tensor_arena=False)
    seen.append(_watchers())
    start = memory_readings()["background"]
    time.sleep(3.5)
    readings = memory_readings()["background"] - start
    q.shutdown()
    del q
    gc.collect()
    deadline = time.monotonic() + 10
    while _watchers() and time.monotonic() < deadline:
        time.sleep(0.05)
    seen.append(_watchers())
    conn.send((seen, readings))


def test_the_watcher_lives_while_a_segment_does_and_reads_once_a_second(procs):
    seen, readings = _answer_of(procs, _watcher_lifetime)
    # None before the first queue, one with it, none once it is gone.
    assert seen == [0, 1, 0], seen
    # About one reading a second (3.5 s: 3 or 4; scheduling may cost one).
    assert 2 <= readings <= 5, readings


def _after_arena_readers(conn):
    # An arena's readers map its segment themselves: their mappings count
    # as the others do, or closing them would leave the count short and
    # no watcher would start for the queues after.
    for _ in range(3):
        w, rs = local_pair(2, max_chunk_bytes=MiB, max_chunks=2, arena_slots=2,
                           arena_slot_mb=4, arena_min_mb=1)
        shut(w, *rs)
        del w, rs
        gc.collect()
    q = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2, enable_shm_tensor_arena=False)
    conn.send((_watchers(), background_readings(1)))
    q.shutdown()


def test_queues_after_arena_readers_still_have_a_watcher(procs):
    got = _answer_of(procs, _after_arena_readers)
    assert got == (1, True), got


def _forked_child_checks(conn):
    q = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2, enable_shm_tensor_arena=False)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        # Only the forking thread lives on: the child's own queue starts
        # its own watcher, and its checks answer from it.
        code = 1
        try:
            alone = _watchers()
            c = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2,
                             enable_shm_tensor_arena=False)
            read = background_readings(1)
            os.write(wfd, repr((alone, _watchers(), read)).encode())
            c.shutdown()
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    answer = b""
    while chunk := os.read(rfd, 1024):
        answer += chunk
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    q.shutdown()
    conn.send((answer.decode(), os.waitstatus_to_exitcode(status)))


def test_a_forked_child_starts_its_own_watcher(procs):
    answer, code = _answer_of(procs, _forked_child_checks)
    assert code == 0 and answer == "(0, 1, True)", (answer, code)


@pytest.mark.parametrize("short", [False, True])
def test_the_check_reads_on_the_spot_only_when_memory_is_near_its_limit(monkeypatch, short):
    # The kept reading answers while what it leaves covers the request
    # twice over and 256 MiB more; nearer the limit every check reads
    # afresh (memory held elsewhere may have gone since the last reading).
    from fastmq import _memory
    q = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2, enable_shm_tensor_arena=False)
    try:
        room = _memory.memory_room(0)
        assert room != 0
        if room < 0:
            pytest.skip("this host's available memory cannot be read")
        need = max(1, (room - _memory.SLACK_BYTES) // 2 - 64 * MiB) if not short else \
            (room - _memory.SLACK_BYTES) // 2 + 64 * MiB
        before = memory_readings()["on_the_spot"]
        _memory.memory_room(need)
        assert memory_readings()["on_the_spot"] - before == (1 if short else 0)
    finally:
        q.shutdown()
