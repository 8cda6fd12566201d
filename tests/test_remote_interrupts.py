"""Remote readers interrupted, refusing or gone, and what each end then
says: after a failed check the writer is told at once (not left blocked on
a reader that reads no more); an exception from a signal handler between
receives leaves the message to be resumed; a message that no remote
reader took is not handed to the local ones; a forked child that drops
the writer's queue leaves the parent's connections alone; and errors name
what happened (a dropped message, a forged header, whether a message was
committed) in terms that are true."""
from __future__ import annotations

import gc
import os
import signal
import socket
import struct
import threading
import time

import pytest

from fastmq import ReaderGoneError
from fastmq._ring import CorruptChunkError

from _queues import local_pair
from _relay import through_relay


def _close(w, r, m):
    m.close()
    r.shutdown()
    w.shutdown()


def test_a_reader_that_refused_a_forgery_hangs_up_and_the_writer_names_it():
    flipped = []

    def flip_first(data):
        if not flipped:
            flipped.append(1)
            return data[:-1] + bytes([data[-1] ^ 1])
        return data

    w, r, m = through_relay(flip_first)
    try:
        w.enqueue("pay 10")
        with pytest.raises(CorruptChunkError, match="failed authentication"):
            r.dequeue(timeout=10)
        # vLLM's enqueue() has no deadline: were the reader to keep its
        # connection open and read no more, the writer would block for
        # good once the sockets filled, and report nothing.
        errors = []

        def send():
            try:
                for _ in range(64):
                    w.enqueue(b"x" * (4 << 20))
            except RuntimeError as e:
                errors.append(e)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(30)
        assert not sender.is_alive(), "the writer blocked on a reader that stopped reading"
        assert errors and isinstance(errors[0], ReaderGoneError), errors
    finally:
        _close(w, r, m)


class _Alarm(Exception):
    pass


def test_a_signal_handlers_exception_between_receives_leaves_the_message_to_resume():
    # The second half of a 3 MB message comes a second late; the handler
    # raises while the reader waits for it.  Both messages still arrive,
    # whole and in order (the writer's enqueue() returned for both).
    late = []

    def slow_second_half(data):
        late.append(len(data))
        if sum(late) > 1_500_000 and len(late) < 10_000 and not hasattr(slow_second_half, "slept"):
            slow_second_half.slept = True
            time.sleep(1.0)
        return data

    def on_alarm(signum, frame):
        raise _Alarm()

    w, r, m = through_relay(slow_second_half)
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        big = b"A" * 3_000_000
        sender = threading.Thread(target=lambda: (w.enqueue(big), w.enqueue("second")),
                                  daemon=True)
        sender.start()
        signal.setitimer(signal.ITIMER_REAL, 0.4)
        with pytest.raises(_Alarm):
            r.dequeue(timeout=10)
        assert r.dequeue(timeout=10) == big
        assert r.dequeue(timeout=10) == "second"
        sender.join(10)
        assert not sender.is_alive()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        _close(w, r, m)


def test_a_dropped_message_is_named_as_dropped():
    # The relay drops the second message whole (it travels in one piece).
    count = []

    def drop_second(data):
        count.append(1)
        return b"" if len(count) == 2 else data

    w, r, m = through_relay(drop_second)
    try:
        w.enqueue("one")
        assert r.dequeue(timeout=10) == "one"
        w.enqueue("two")
        time.sleep(0.2)      # so that "two" and "three" cross the relay apart
        w.enqueue("three")
        with pytest.raises(RuntimeError, match="expected message 2 .* but received message 3: "
                                               "messages were dropped on the way"):
            r.dequeue(timeout=10)
    finally:
        _close(w, r, m)


def test_a_forged_header_is_not_taken_at_its_word():
    # A header that fails its check is named by what the reader knows
    # (the message after the last one taken), not by the number it claims.
    def forge_seq(data):
        # HEAD: kind (4 bytes), seal counter (u64), sequence number (u64), ...
        return data[:12] + (2130706433).to_bytes(8, "little") + data[20:]

    w, r, m = through_relay(forge_seq)
    try:
        w.enqueue("one")
        with pytest.raises(CorruptChunkError) as e:
            r.dequeue(timeout=10)
        assert "the message after message 0" in str(e.value)
        assert "2130706433" not in str(e.value)
    finally:
        _close(w, r, m)


def test_a_message_no_remote_reader_took_is_not_published_to_the_local_ones():
    # The remote reader's connection resets (a reader killed with unread
    # data) after the writer's last check and before the message's first
    # byte: nothing is committed, enqueue() raises without the committed
    # note, and the local reader does not get the message either.
    w, (local, remote) = local_pair(1, 1, remote_security="none")
    fanout = w._end.fanout
    checked = fanout.check_readers

    def check_then_reset():
        checked()
        sock = remote._end.stream.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        time.sleep(0.2)

    fanout.check_readers = check_then_reset
    try:
        with pytest.raises(ReaderGoneError) as e:
            w.enqueue("to nobody", timeout=5)
        assert not getattr(e.value, "__notes__", None)
        with pytest.raises(TimeoutError):
            local.dequeue(timeout=0.5)
    finally:
        fanout.check_readers = checked
        for q in (local, remote, w):
            q.shutdown()


def test_a_forked_child_dropping_the_writer_leaves_its_remote_readers_alone():
    # The child's copy of the queue is dropped (and the child leaves): no
    # end of the stream, nor any byte, goes from it into the parent's
    # connections, and the remote reader gets the parent's next message.
    w, (remote,) = local_pair(0, 1)
    w.enqueue("before", timeout=10)
    assert remote.dequeue(timeout=10) == "before"
    pid = os.fork()
    if pid == 0:
        try:
            del w, remote
            gc.collect()
        finally:
            os._exit(0)
    try:
        os.waitpid(pid, 0)
        w.enqueue("after", timeout=10)
        assert remote.dequeue(timeout=10) == "after"
    finally:
        remote.shutdown()
        w.shutdown()


def test_a_failed_enqueue_is_not_called_committed_because_of_the_next_one():
    # Thread A's message cannot be pickled: nothing of it is sent.  Thread
    # B's next message takes the number A never used; if A asked whether
    # its message was committed after letting go of the send lock, B's
    # first byte would make A's exception say "committed" (and its caller
    # not retry a message nobody got).
    w, (remote,) = local_pair(0, 1, remote_security="none")
    fanout = w._end.fanout
    asked = fanout.committed

    def committed(seq):
        if threading.current_thread().name == "A":
            time.sleep(0.3)         # a thread switch here lets B go first
        return asked(seq)

    fanout.committed = committed
    notes = []

    def a():
        try:
            w.enqueue(lambda: None)
        except Exception as e:
            notes.append(getattr(e, "__notes__", None))

    try:
        ta = threading.Thread(target=a, name="A")
        ta.start()
        time.sleep(0.1)
        w.enqueue("B's message", timeout=10)
        ta.join(10)
        assert notes == [None]
        assert remote.dequeue(timeout=10) == "B's message"
    finally:
        fanout.committed = asked
        remote.shutdown()
        w.shutdown()
