"""The remote path against someone on the network between the nodes: the
root of trust never crosses the wire in the clear, nonces never repeat
(whatever exception interrupts a send), the end of the stream is
authenticated, nothing a stranger sends stalls or aborts the writer's
handshake, and both ends hold to the same limits."""
from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback

import pytest

import fastmq
from fastmq import MessageQueue, _fanout, _keys, _seal, _wire
from fastmq._ring import CorruptChunkError

from _queues import wait_for
from _relay import Relay, parse_writer_bytes

SECRET = "a deployment secret of enough length"


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch):
    monkeypatch.delenv(_keys.SECRET_ENV, raising=False)
    monkeypatch.delenv(_keys.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv("FASTMQ_REMOTE_SECURITY", raising=False)


def _ready(w, readers):
    box = []

    def attach(r):
        try:
            r.wait_until_ready()
        except BaseException as e:
            box.append(e)

    ts = [threading.Thread(target=attach, args=(r,)) for r in readers]
    for t in ts:
        t.start()
    w.wait_until_ready()
    for t in ts:
        t.join(10)
    assert not box, box


def _remote(security="mac", relay=None, **kw):
    """A writer with one remote reader (through ``relay(handle)`` if given)."""
    w = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security=security, **kw)
    h = pickle.loads(pickle.dumps(w.export_handle()))
    rel = relay(h) if relay is not None else None
    r = MessageQueue.create_from_handle(rel.handle if rel else h, 0)
    _ready(w, [r])
    return w, r, rel


def _catch(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except BaseException as e:
        return e


# -- the root of trust ------------------------------------------------------------
def test_with_a_deployment_secret_the_handle_holds_no_key(monkeypatch):
    monkeypatch.setenv(_keys.SECRET_ENV, SECRET)
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = w.export_handle()
    assert h.remote_key is None and len(h.remote_salt) == _keys.SALT_BYTES
    # Nothing in the pickled handle opens the stream without the secret.
    blob = pickle.dumps(h)
    monkeypatch.delenv(_keys.SECRET_ENV)
    with pytest.raises(RuntimeError, match="derives its keys from a deployment secret"):
        MessageQueue.create_from_handle(pickle.loads(blob), 0)
    monkeypatch.setenv(_keys.SECRET_ENV, "another secret, just as long")
    with pytest.raises(RuntimeError, match="not the one the queue's writer uses"):
        MessageQueue.create_from_handle(pickle.loads(blob), 0)
    monkeypatch.setenv(_keys.SECRET_ENV, SECRET)
    r = MessageQueue.create_from_handle(pickle.loads(blob), 0)
    _ready(w, [r])
    w.enqueue({"step": 1})
    assert r.dequeue(timeout=10) == {"step": 1}


@pytest.mark.parametrize("security", ["mac", "none"])
def test_a_reader_with_the_secret_refuses_a_handle_that_does_not_use_it(monkeypatch, security):
    # The setup channel is not trusted: a handle changed on it could point
    # a reader at someone else's writer, with a key of its own in the handle
    # or plain TCP.  A reader that holds the deployment secret refuses both.
    w = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security=security)   # no secret here
    blob = pickle.dumps(w.export_handle())
    monkeypatch.setenv(_keys.SECRET_ENV, SECRET)
    try:
        match = ("asks for plain, unauthenticated TCP" if security == "none"
                 else "did not derive its key from one")
        with pytest.raises(RuntimeError, match=match):
            MessageQueue.create_from_handle(pickle.loads(blob), 0)
        if security == "none":
            # Plain TCP stays possible where this process asks for it too.
            monkeypatch.setenv("FASTMQ_REMOTE_SECURITY", "none")
            r = MessageQueue.create_from_handle(pickle.loads(blob), 0)
            _ready(w, [r])
            w.enqueue("plain")
            assert r.dequeue(timeout=10) == "plain"
            r.shutdown()
    finally:
        w.shutdown()


def test_the_secret_from_a_file_and_what_is_refused(monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET.encode() + b"\n")
    path.chmod(0o600)       # owner only: a secret others may read is refused
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(path))
    assert _keys.deployment_secret() == SECRET.encode()
    w, r, _ = _remote()
    assert w.export_handle().remote_key is None
    w.enqueue("from the file's secret")
    assert r.dequeue(timeout=10) == "from the file's secret"
    monkeypatch.setenv(_keys.SECRET_ENV, SECRET)
    with pytest.raises(ValueError, match="both FASTMQ_SECRET and FASTMQ_SECRET_FILE"):
        MessageQueue(1, 0, connect_ip="127.0.0.1")
    monkeypatch.delenv(_keys.SECRET_FILE_ENV)
    monkeypatch.setenv(_keys.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        MessageQueue(1, 0, connect_ip="127.0.0.1")
    monkeypatch.delenv(_keys.SECRET_ENV)
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot be read"):
        MessageQueue(1, 0, connect_ip="127.0.0.1")


def _keys_from_the_handle(h) -> list[bytes]:
    """Every message key someone who saw the handle could try: the key it
    carries, and what earlier versions derived from it."""
    key = h.remote_key
    return [key] + [hmac.digest(key, b"fastmq remote path: messages " + m, "sha256")
                    for m in (b"mac", b"encrypt")] + \
        [_keys.hkdf(key, None, info) for info in (b"fastmq handshake", b"fastmq messages")]


def _opens_under(key, message: bytes, security) -> bool:
    """Whether ``message`` (one WHOLE message's bytes) opens under ``key``
    with either nonce layout (this version's and the earlier one's)."""
    kind, counter, seq, n = _wire.HEAD.unpack_from(message, 0)
    size = _wire.HEAD.size + 8 * n
    seal = _seal.Seal(security, key)
    if seal.open_whole(counter, memoryview(message), size,
                       len(message) - size - _seal.TAG_BYTES) is not None:
        return True
    # (earlier versions sealed under the sequence number)
    return seal.open_whole(seq, memoryview(message), size,
                           len(message) - size - _seal.TAG_BYTES) is not None


@pytest.mark.parametrize("security", ["encrypt", "mac"])
def test_the_setup_traffic_and_a_recorded_session_open_nothing(security):
    """Whoever recorded the setup traffic (the pickled handle, which vLLM
    sends over its unencrypted process group) and the whole session
    cannot read ("encrypt") or forge ("mac") the queue's messages: the
    message key is random and reached each reader under an X25519 key of
    that connection alone.  It used to be derived from the handle's key."""
    w, r, relay = _remote(security, relay=Relay)
    secret_words = b"the pickle every reader unpickles"
    w.enqueue(secret_words)
    assert r.dequeue(timeout=10) == secret_words
    wire = relay.wire()
    (msg,) = parse_writer_bytes(wire, security)
    message = wire[msg.start:msg.end]
    if security == "encrypt":
        assert secret_words not in wire
    h = w.export_handle()
    assert _opens_under(w.remote_socket.seal.key, message, security)   # the check can tell
    assert not any(_opens_under(k, message, security) for k in _keys_from_the_handle(h))
    relay.close()


def test_the_startup_line_says_what_the_keys_rest_on(monkeypatch, caplog):
    monkeypatch.setattr(_keys, "_logged_trust", False)
    with caplog.at_level(logging.INFO, logger="fastmq"):
        MessageQueue(1, 0, connect_ip="127.0.0.1")
    (line,) = [r for r in caplog.records if "travels in the queue's handle" in r.getMessage()]
    assert line.levelno == logging.WARNING and "FASTMQ_SECRET" in line.getMessage()
    caplog.clear()
    monkeypatch.setattr(_keys, "_logged_trust", False)
    monkeypatch.setenv(_keys.SECRET_ENV, SECRET)
    with caplog.at_level(logging.INFO, logger="fastmq"):
        MessageQueue(1, 0, connect_ip="127.0.0.1")
    assert "derived from the deployment secret" in caplog.text


# -- nonces, whatever interrupts a send ---------------------------------------------
class _Injected(Exception):
    pass


class _RaiseAt:
    """A trace function that raises ``_Injected`` at the ``k``-th bytecode
    run in fastmq's own Python code: what a signal handler's exception
    does at that point.  Raising ends the tracing, so it happens once."""

    root = os.path.dirname(fastmq.__file__)

    def __init__(self, k: int):
        self.k, self.n = k, 0

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(self.root):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.n += 1
            if self.n == self.k:
                raise _Injected(self.k)
        return self


def _on_the_way_out(e: BaseException) -> bool:
    """Whether ``e`` was raised in enqueue()'s own frames (the façade's and
    the writer's), not in anything they call: any such exception that
    finds the message sent came after every step of the send, on the way
    back to the caller (inside the send, the writer notes the commit)."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    code = frames[-2]      # (the last is the tracer's, which raised it)
    return code.co_name in ("enqueue", "_enqueue_remote") and \
        os.path.basename(code.co_filename) in ("queue.py", "_writer.py", "_writer_remote.py")


def _committed(e: BaseException) -> bool:
    return any("committed" in n for n in getattr(e, "__notes__", ()))


@pytest.mark.parametrize("security", ["mac", "encrypt"])
def test_an_exception_anywhere_in_a_send_repeats_no_nonce_and_loses_nothing(procs, security):
    """An exception at every bytecode of fastmq's send path, for a small
    message and a segmented one, on a queue with a local and a remote
    reader: each reader gets exactly the messages whose enqueue()
    returned or raised saying the message was committed, in order, once;
    and on the wire no seal counter (the nonce) is used twice.

    It used to be possible for an exception to land between sendmsg and
    the line that recorded it: the message was dropped as unsent though
    the reader had it, and the next one went out under the same nonce.
    (In a child process: the tracer's exceptions keep frames alive.)"""
    import multiprocessing as mp

    parent, child = mp.Pipe()
    procs.start(_send_with_an_exception_everywhere, security, child)
    assert parent.poll(240), "the injecting child did not finish"
    result = parent.recv()
    procs.join_all(30)
    assert not isinstance(result, str), result
    expected, got, outcomes, counters = result
    assert got["local"] == expected
    assert got["remote"] == expected
    # Every kind of outcome happened, so the run went through the commit.
    assert all(outcomes.values()), outcomes
    assert len(counters) == len(expected) + 1
    assert len(set(counters)) == len(counters), "a seal counter (nonce) was used twice"


def _send_with_an_exception_everywhere(security, conn):
    try:
        conn.send(_inject_everywhere(security))
    except BaseException:
        conn.send(traceback.format_exc())


def _inject_everywhere(security):
    w = MessageQueue(2, 1, connect_ip="127.0.0.1", remote_security=security,
                     max_chunk_bytes=1 << 16, enable_shm_tensor_arena=False)
    h = w.export_handle()
    fanout = w.remote_socket
    relay = Relay(h)
    local = MessageQueue.create_from_handle(h, 0)
    remote = MessageQueue.create_from_handle(relay.handle, 1)
    _ready(w, [local, remote])
    got = {"local": [], "remote": []}

    def read(name, r):
        while True:
            m = r.dequeue(timeout=120)
            if m == "done":
                return
            got[name].append(m)

    readers = [threading.Thread(target=read, args=(n, r), daemon=True)
               for n, r in (("local", local), ("remote", remote))]
    for t in readers:
        t.start()
    expected, outcomes = [], {"returned": 0, "committed": 0, "dropped": 0}
    for size in (100, int(1.5 * _wire.SEGMENT_BYTES)):
        k = 0
        while True:
            k += 1
            msg = (b"%d/%d:" % (size, k)).ljust(size, b".")
            trace = _RaiseAt(k)
            seq = fanout.next_seq
            sys.settrace(trace)
            try:
                w.enqueue(msg, timeout=60)
                outcome = "returned"
            except _Injected as e:
                outcome = "committed" if _committed(e) else "dropped"
                if outcome == "dropped" and fanout.next_seq != seq:
                    # Sent, yet no note: only enqueue()'s own frames on
                    # their way back to the caller, once every step of
                    # the send was done, may raise so (the same as an
                    # exception right after it returned: nothing can
                    # tell the two apart).
                    assert _on_the_way_out(e), traceback.format_exception(e)
                    outcome = "returned"
            finally:
                sys.settrace(None)
            outcomes[outcome] += 1
            if outcome != "dropped":
                expected.append(msg)
            if trace.n < k:          # the send ended before the k-th bytecode
                break
    w.enqueue("done")
    for t in readers:
        t.join(120)
    assert not any(t.is_alive() for t in readers)
    counters = [m.counter for m in parse_writer_bytes(relay.wire(), security)]
    relay.close()
    return expected, got, outcomes, counters


# -- strangers on the port ------------------------------------------------------------
def test_a_silent_stranger_is_dropped_at_its_deadline(monkeypatch):
    monkeypatch.setattr(_fanout, "UNPROVEN_DEADLINE_S", 0.3)
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    addr = _wire.parse_address(w.export_handle().remote_subscribe_addr)
    t = threading.Thread(target=w.wait_until_ready, daemon=True)
    t.start()
    slow = socket.create_connection(addr, timeout=10)
    assert slow.recv(_wire.CHALLENGE.size)
    slow.sendall(b"FM")          # a hello, one byte a while
    assert slow.recv(10) == b""  # dropped, not waited for
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    r.wait_until_ready()
    t.join(10)
    w.enqueue(1)
    assert r.dequeue(timeout=10) == 1


def test_a_flood_of_strangers_neither_locks_out_the_reader_nor_floods_the_log(caplog):
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    addr = _wire.parse_address(w.export_handle().remote_subscribe_addr)
    with caplog.at_level(logging.WARNING, logger="fastmq"):
        t = threading.Thread(target=w.wait_until_ready, daemon=True)
        t.start()
        strangers = []
        for i in range(_fanout.MAX_UNPROVEN + 40):
            s = socket.create_connection(addr, timeout=10)
            if i % 2:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            strangers.append(s)
        r = MessageQueue.create_from_handle(w.export_handle(), 0)
        r.wait_until_ready()
        t.join(10)
        assert not t.is_alive()
    for s in strangers:
        s.close()
    w.enqueue("through")
    assert r.dequeue(timeout=10) == "through"
    refusals = [x for x in caplog.records if "remote port" in x.getMessage()]
    assert 1 <= len(refusals) <= 2, [x.getMessage() for x in refusals]


def test_running_out_of_descriptors_neither_spins_nor_locks_out_the_reader(procs):
    """A writer whose process has no descriptor left for the next
    connection used to retry the failing accept at full speed (and never
    admit the reader): it now drops the oldest unproven connection and
    backs off."""
    import multiprocessing as mp

    import _remote_children as rc

    parent, child = mp.Pipe()
    procs.start(rc.writer_short_of_descriptors, child)
    h = parent.recv()
    addr = _wire.parse_address(h.remote_subscribe_addr)
    strangers = [socket.create_connection(addr, timeout=10) for _ in range(12)]
    time.sleep(1.0)                    # the writer is out of descriptors now
    r = MessageQueue.create_from_handle(h, 0)
    t = threading.Thread(target=r.wait_until_ready, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        r.shutdown()
        pytest.fail("the writer never admitted the reader")
    assert r.dequeue(timeout=30) == "admitted"
    cpu_s, refusals = parent.recv()
    procs.join_all(30)
    assert any("ran out of file descriptors" in m or "Too many open files" in m
               for m in refusals), refusals   # it did run out
    for s in strangers:
        s.close()
    # Waiting 1 s and more with accept failing: a spinning writer burns a
    # core throughout; one that backs off, a small part of it.
    assert cpu_s < 0.5, cpu_s


def _knock_with_zmq(addr, stop):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    socks = []
    for _ in range(2):
        s = ctx.socket(zmq.SUB)
        s.linger = 0
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.RECONNECT_IVL, 50)
        s.connect(addr)
        socks.append(s)
    stop.wait()
    ctx.destroy(linger=0)


def test_zmq_peers_are_named_but_never_end_the_handshake(caplog):
    """Two ZMQ subscribers knocking (and reconnecting) on the writer's port
    for more than a second used to make wait_until_ready() raise, blaming
    vLLM's queue: anyone could abort a vLLM engine's start-up so."""
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = w.export_handle()
    stop = threading.Event()
    knock = threading.Thread(target=_knock_with_zmq, args=(h.remote_subscribe_addr, stop))
    knock.start()
    box = []
    with caplog.at_level(logging.WARNING, logger="fastmq"):
        t = threading.Thread(target=lambda: box.append(_catch(w.wait_until_ready)))
        t.start()
        time.sleep(1.5)
        assert t.is_alive() and not box, box
        r = MessageQueue.create_from_handle(h, 0)
        r.wait_until_ready()
        t.join(10)
    stop.set()
    knock.join(10)
    assert box == [None]
    assert "speaks ZMQ" in caplog.text and "vLLM's own MessageQueue" in caplog.text
    w.enqueue("fastmq reader")
    assert r.dequeue(timeout=10) == "fastmq reader"


def test_a_cancelled_handshake_names_the_zmq_peer_and_enqueue_then_raises():
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    stop = threading.Event()
    knock = threading.Thread(target=_knock_with_zmq,
                             args=(w.export_handle().remote_subscribe_addr, stop))
    knock.start()
    box = []
    t = threading.Thread(target=lambda: box.append(_catch(w.wait_until_ready)))
    t.start()
    try:
        wait_for(lambda: w.remote_socket.zmq_peer is not None)
        w.shutdown()
        t.join(10)
    finally:
        stop.set()
        knock.join(10)
    (e,) = box
    assert isinstance(e, RuntimeError) and str(e) == "cancelled"
    assert "vLLM's own MessageQueue" in "".join(e.__notes__)


def test_after_a_failed_handshake_enqueue_raises():
    """A handshake that raised (here: a signal handler's exception) used to
    leave a queue whose enqueue() returned with no reader connected."""
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    with pytest.raises(RuntimeError, match="wait_until_ready\\(\\) has not returned"):
        w.enqueue("to nobody")
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Injected()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Injected):
            w.wait_until_ready()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="wait_until_ready\\(\\) raised"):
            w.enqueue("to nobody")


# -- the end of the stream -------------------------------------------------------------
def test_a_clean_close_is_told_from_a_cut():
    w, r, _ = _remote()
    w.enqueue("last")
    assert r.dequeue(timeout=10) == "last"
    w.remote_socket.close()
    for _ in range(2):
        e = _catch(r.dequeue, timeout=10)
        assert isinstance(e, RuntimeError) and "shut the queue down after message 1" in str(e)


class _DropLast:
    """Relays the writer's bytes, but holds back each message until the
    next one starts; the last message is dropped, and then either the
    connection is cut or the end of the stream is passed on."""

    def __init__(self, security, pass_end):
        self.security, self.pass_end = security, pass_end
        self.buf = b""

    def __call__(self, data):
        self.buf += data
        pre = _wire.CHALLENGE.size + _wire.READY.size
        msgs = parse_writer_bytes(b"\0" * pre + self.buf, self.security)
        out, used = b"", 0
        for m, after in zip(msgs, msgs[1:]):
            if m.kind != _wire.END and after.kind != _wire.END:
                out += self.buf[m.start - pre:m.end - pre]   # not the last: passed on
                used = m.end - pre
        if msgs and msgs[-1].kind == _wire.END:
            if not self.pass_end:
                return None
            out += self.buf[msgs[-1].start - pre:msgs[-1].end - pre]
            used = len(self.buf)
        self.buf = self.buf[used:]
        return out


@pytest.mark.parametrize("pass_end", [False, True], ids=["cut", "end passed on"])
def test_a_dropped_tail_is_named(pass_end):
    """Someone on the path who drops the last messages (whose enqueue()
    returned) and closes the connection used to leave the reader with the
    very error of a clean close after the message before."""
    drop = _DropLast("mac", pass_end)
    w, r, relay = _remote("mac", relay=lambda h: Relay(h, drop))
    for i in range(3):
        w.enqueue(i)
    assert [r.dequeue(timeout=10) for _ in range(2)] == [0, 1]
    w.remote_socket.close()
    e = _catch(r.dequeue, timeout=10)
    assert isinstance(e, RuntimeError), e
    assert "shut the queue down" not in str(e)
    if pass_end:
        assert "closed the queue after message 3, but this reader received only up to " \
            "message 2" in str(e) and "dropped on the way" in str(e)
    else:
        assert "was cut before the writer closed the queue" in str(e)
        assert "message 2 was the last received" in str(e)
    relay.close()


# -- limits at both ends ----------------------------------------------------------------
def test_the_writer_refuses_a_message_a_reader_would_refuse():
    w, r, _ = _remote()
    buf = memoryview(bytearray(1 << 20))
    too_many = [pickle.PickleBuffer(buf) for _ in range(_wire.MAX_FRAMES + 1)]
    with pytest.raises(ValueError, match=f"more than a remote reader takes \\({_wire.MAX_FRAMES}"):
        w.enqueue(too_many)
    w.enqueue("still usable")
    assert r.dequeue(timeout=10) == "still usable"


def test_a_writer_that_hangs_up_before_the_readers_answer_is_named():
    """The writer sent its challenge and was gone (a reset) before the
    reader answered: the answer's send failed with a raw ConnectionError
    instead of the error that names the writer and says why."""
    import struct

    from fastmq import _stream

    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen()
    stream = _stream.Stream(f"tcp://127.0.0.1:{fake.getsockname()[1]}", False, "none", None, 0)
    c, _ = fake.accept()
    try:
        stream.start_hello()
        time.sleep(0.2)      # connected: the reader waits for the challenge
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.sendall(_wire.CHALLENGE.pack(_wire.MAGIC, _wire.VERSION, _wire.MODE_CODES["none"],
                                       bytes(16), bytes(32)))
        c.close()            # a reset: the challenge stays readable, the answer fails
        e = _catch(stream.handshake)
        assert type(e) is RuntimeError, repr(e)
        assert "closed the connection during the handshake" in str(e), e
        # A second wait raises again: it used to return as if ready.
        again = _catch(stream.handshake)
        assert type(again) is RuntimeError and "during the handshake" in str(again), again
    finally:
        stream.close()
        fake.close()


def test_a_forged_header_is_named_malformed_not_a_dead_writer():
    """A header whose frame table cannot fit the reader's inbox used to be
    reported as the writer's death while the connection was still open."""
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen()
    h = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security="none").export_handle()
    h = dataclasses.replace(h, remote_subscribe_addr=f"tcp://127.0.0.1:{fake.getsockname()[1]}")
    r = MessageQueue.create_from_handle(h, 0)
    c, _ = fake.accept()
    c.sendall(_wire.CHALLENGE.pack(_wire.MAGIC, _wire.VERSION, _wire.MODE_CODES["none"],
                                   bytes(16), bytes(32)))
    c.recv(_wire.HELLO.size)
    c.sendall(_wire.READY.pack(_wire.MAGIC, bytes(_keys.WRAPPED_BYTES)))
    r.wait_until_ready()
    c.sendall(_wire.HEAD.pack(_wire.SEGMENTED, 1, 1, 40_000) + bytes(8 * 40_000))
    e = _catch(r.dequeue, timeout=10)
    assert isinstance(e, CorruptChunkError) and "malformed message header" in str(e), e
    assert "died" not in str(e)
    e = _catch(r.dequeue, timeout=1)
    assert isinstance(e, RuntimeError) and "failed a check earlier" in str(e), e
    c.close()
    fake.close()
