"""A remote reader's spin window: it spins (yielding its core) before it
waits in the kernel, and while the bytes of a message keep coming the
window restarts, so a large message is not taken one kernel wakeup per
socket-buffer refill."""
from __future__ import annotations

import threading
import time

from fastmq import _stream, _wire

from _queues import fanout_and_stream

MiB = 1 << 20


def _connected_pair(spin_s: float):
    return fanout_and_stream("none", spin_s)


def _wire_bytes(fan, payload, seq: int = 1) -> bytes:
    """Message ``seq``'s bytes on the wire, as ``fan`` would send them."""
    m = _wire.Outgoing(fan.seal, seq, seq, [payload])
    return b"".join(bytes(p) for k in range(m.n_batches) for p in m.batch(k))


def _waits_during(stream, monkeypatch, send) -> tuple[list, int]:
    """The frames ``stream`` receives while ``send`` runs in a thread, and
    how many times it waited in the kernel meanwhile."""
    waits = 0
    real_wait = _wire.wait

    def counting_wait(*args):
        nonlocal waits
        waits += 1
        return real_wait(*args)

    monkeypatch.setattr(_wire, "wait", counting_wait)
    t = threading.Thread(target=send)
    t.start()
    try:
        frames = stream.recv(time.monotonic() + 30)
    finally:
        t.join()
    return frames, waits


def test_the_window_restarts_while_a_large_message_keeps_arriving(monkeypatch):
    fan, stream = _connected_pair(spin_s=0.2)
    try:
        payload = bytes(range(256)) * (2 * MiB // 256)
        wire = _wire_bytes(fan, payload)
        sock = fan.readers[0].sock
        sock.setblocking(True)

        def send():
            # 64 pieces, 10 ms apart: 0.6 s in all, three spin windows, but
            # never a gap of one.
            step = -(-len(wire) // 64)
            for off in range(0, len(wire), step):
                sock.sendall(wire[off:off + step])
                time.sleep(0.01)

        frames, waits = _waits_during(stream, monkeypatch, send)
        assert bytes(frames[0]) == payload
        # Counted: without the restart, every gap after the first 0.2 s is a
        # kernel wait (about 40 of them).
        assert waits <= 5, waits
    finally:
        stream.close()
        fan.close()


def test_a_reader_idle_past_its_window_waits_in_the_kernel(monkeypatch):
    fan, stream = _connected_pair(spin_s=0.01)
    try:
        wire = _wire_bytes(fan, b"late")
        sock = fan.readers[0].sock

        def send():
            time.sleep(0.5)
            sock.sendall(wire)

        frames, waits = _waits_during(stream, monkeypatch, send)
        assert bytes(frames[0]) == b"late"
        assert waits >= 1    # it parked rather than spin for half a second
    finally:
        stream.close()
        fan.close()


def test_a_reader_whose_messages_come_late_stops_spinning_for_them(monkeypatch):
    """Messages further apart than the window: after LONG_WAITS of them the
    reader waits for the next in the kernel at once (no spin: its core is
    another process's meanwhile); one that comes within the window brings
    the spin back."""
    fan, stream = _connected_pair(spin_s=0.05)
    try:
        sock = fan.readers[0].sock
        sock.setblocking(True)
        yields = 0
        real_yield = _stream.os.sched_yield

        def counting_yield():
            nonlocal yields
            yields += 1
            real_yield()

        monkeypatch.setattr(_stream.os, "sched_yield", counting_yield)
        seq = 0

        def take(delay_s: float) -> int:
            """Message ``seq`` sent ``delay_s`` after the reader starts
            waiting (0: before): the reader's yields while it waited."""
            nonlocal seq, yields
            seq += 1
            wire = _wire_bytes(fan, b"m%d" % seq, seq)
            t = None
            if delay_s:
                t = threading.Timer(delay_s, sock.sendall, (wire,))
                t.start()
            else:
                sock.sendall(wire)
            yields = 0
            try:
                frames = stream.recv(time.monotonic() + 30)
            finally:
                if t is not None:
                    t.join()
            assert bytes(frames[0]) == b"m%d" % seq
            return yields

        late = [take(0.2) for _ in range(_stream.LONG_WAITS + 2)]
        assert all(late[:_stream.LONG_WAITS]), late       # spun first, each time
        assert late[_stream.LONG_WAITS:] == [0, 0], late   # then waited at once
        assert take(0) == 0          # already there: a short wait...
        assert take(0.2) > 0         # ...and the next late one is spun for again
    finally:
        stream.close()
        fan.close()
