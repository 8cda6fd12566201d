"""The remote path's security (fastmq._seal, fastmq._wire): by default the
writer, the readers and every message are authenticated; a stranger on
the port, a stranger posing as the writer and a man in the middle who
changes, drops or replays bytes are all refused with a clear error."""
from __future__ import annotations

import logging
import os
import dataclasses
import socket
import threading

import time

import pytest

from fastmq import MessageQueue, _keys, _seal, _wire
from fastmq._ring import CorruptChunkError

from _relay import through_relay


def _ready(w, readers):
    ts = [threading.Thread(target=r.wait_until_ready) for r in readers]
    for t in ts:
        t.start()
    w.wait_until_ready()
    for t in ts:
        t.join(10)


def test_authenticated_by_default_and_the_modes(monkeypatch):
    monkeypatch.delenv("FASTMQ_REMOTE_SECURITY", raising=False)
    monkeypatch.delenv("FASTMQ_CURVE", raising=False)
    h = MessageQueue(1, 0, connect_ip="127.0.0.1").export_handle()
    assert h.remote_security == "mac" and len(h.remote_key) == _keys.KEY_BYTES
    h = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security="none").export_handle()
    assert h.remote_security == "none" and h.remote_key is None
    monkeypatch.setenv("FASTMQ_REMOTE_SECURITY", "encrypt")
    assert MessageQueue(1, 0, connect_ip="127.0.0.1").export_handle().remote_security == \
        "encrypt"
    with pytest.raises(ValueError, match="FASTMQ_REMOTE_SECURITY='secret'"):
        monkeypatch.setenv("FASTMQ_REMOTE_SECURITY", "secret")
        MessageQueue(1, 0, connect_ip="127.0.0.1")
    with pytest.raises(ValueError, match="remote_security='tls'"):
        MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security="tls")
    # The earlier switch keeps its meaning: CURVE on = encrypted, off = plain.
    monkeypatch.delenv("FASTMQ_REMOTE_SECURITY")
    monkeypatch.setenv("FASTMQ_CURVE", "1")
    assert MessageQueue(1, 0, connect_ip="127.0.0.1").export_handle().remote_security == \
        "encrypt"


def test_the_key_stays_out_of_the_handles_repr():
    h = MessageQueue(1, 0, connect_ip="127.0.0.1").export_handle()
    assert h.remote_key is not None
    assert repr(h.remote_key) not in repr(h) and h.remote_key.hex() not in repr(h)


@pytest.mark.parametrize("security", ["mac", "encrypt", "none"])
def test_every_mode_carries_small_and_large_messages(security):
    np = pytest.importorskip("numpy")
    w = MessageQueue(2, 1, connect_ip="127.0.0.1", remote_security=security,
                     max_chunk_bytes=1 << 16)
    h = w.export_handle()
    local, remote = MessageQueue.create_from_handle(h, 0), MessageQueue.create_from_handle(h, 1)
    _ready(w, [local, remote])
    big = np.arange(3 << 18, dtype=np.int64)    # 6 MiB: several sealed segments
    msgs = [{"step": 1}, b"", big, "x" * 70_000]
    got = []
    t = threading.Thread(target=lambda: got.extend(remote.dequeue(timeout=30) for _ in msgs))
    t.start()
    for m in msgs:
        w.enqueue(m)
        out = local.dequeue(timeout=30)
        assert np.array_equal(out, m) if m is big else out == m
    t.join(60)
    assert got[:2] == msgs[:2] and np.array_equal(got[2], big) and got[3] == msgs[3]


def _hello(rank, pid, proof=b"\0" * _keys.PROOF_BYTES):
    return _wire.HELLO.pack(_wire.MAGIC, rank, pid, b"n" * _keys.NONCE_BYTES,
                            b"k" * _keys.PUBLIC_BYTES, proof)


@pytest.mark.parametrize("what", ["plain bytes", "a hello without the key",
                                  "a hello with a wrong proof"])
def test_a_stranger_is_not_taken_for_a_reader(caplog, what):
    """Anyone who reached the port used to be counted as the remote reader
    (and receive every message) unless CURVE was on."""
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    addr = _wire.parse_address(w.export_handle().remote_subscribe_addr)
    with caplog.at_level(logging.WARNING, logger="fastmq"):
        handshake = threading.Thread(target=w.wait_until_ready)
        handshake.start()
        stranger = socket.create_connection(addr)
        stranger.settimeout(10)
        assert stranger.recv(_wire.CHALLENGE.size)      # the challenge
        stranger.sendall({"plain bytes": b"GET / HTTP/1.0\r\n\r\n",
                          "a hello without the key": _hello(0, 1),
                          "a hello with a wrong proof": _hello(0, 1, os.urandom(32))}[what])
        assert stranger.recv(100) == b""                # closed, nothing sent
        r = MessageQueue.create_from_handle(w.export_handle(), 0)
        r.wait_until_ready()
        handshake.join(10)
    assert "refused a connection from 127.0.0.1" in caplog.text, caplog.text
    w.enqueue("for the reader only")
    assert r.dequeue(timeout=10) == "for the reader only"


def test_a_reader_with_the_wrong_key_is_refused():
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = w.export_handle()
    wrong = MessageQueue.create_from_handle(
        dataclasses.replace(h, remote_key=os.urandom(32)), 0)
    good = MessageQueue.create_from_handle(h, 0)
    errors = []

    def attach_wrong():
        try:
            wrong.wait_until_ready()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=attach_wrong)
    t.start()
    _ready(w, [good])
    t.join(10)
    assert errors and "closed the connection during the handshake" in errors[0]
    w.enqueue(1)
    assert good.dequeue(timeout=10) == 1


def test_a_stranger_posing_as_the_writer_is_refused():
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen()
    real = MessageQueue(1, 0, connect_ip="127.0.0.1").export_handle()
    h = dataclasses.replace(
        real, remote_subscribe_addr=f"tcp://127.0.0.1:{fake.getsockname()[1]}")
    r = MessageQueue.create_from_handle(h, 0)

    def pose():
        c, _ = fake.accept()
        c.sendall(_wire.CHALLENGE.pack(_wire.MAGIC, _wire.VERSION, 0, b"c" * 16,
                                       _keys.Handshake(os.urandom(32)).public))
        c.recv(_wire.HELLO.size)
        c.sendall(_wire.READY.pack(_wire.MAGIC, os.urandom(_keys.WRAPPED_BYTES)))
        c.recv(10)

    t = threading.Thread(target=pose, daemon=True)
    t.start()
    with pytest.raises(RuntimeError, match="did not prove it is this queue's writer"):
        r.wait_until_ready()
    fake.close()


def _through_middle(tamper, security="mac"):
    """A writer and a reader with a man in the middle (``_relay.Relay``)
    who hands each chunk of the writer's bytes after the handshake to
    ``tamper`` (which returns what to relay)."""
    w, r, _ = through_relay(tamper, security)
    return w, r


def _flip_last_byte(data):
    return data[:-1] + bytes([data[-1] ^ 1])


@pytest.mark.parametrize("size", [100, 3_000_000])     # sealed whole; in segments
@pytest.mark.parametrize("security", ["mac", "encrypt"])
def test_a_changed_byte_is_refused(size, security):
    w, r = _through_middle(_flip_last_byte, security)
    def send():
        try:
            w.enqueue(b"p" * size)
        except RuntimeError:
            pass    # the reader hung up on the forgery: the writer is told so

    threading.Thread(target=send, daemon=True).start()
    with pytest.raises(CorruptChunkError, match="failed authentication"):
        r.dequeue(timeout=10)


@pytest.mark.parametrize("security", ["mac", "encrypt"])
def test_a_frame_larger_than_the_caches_is_checked_before_it_is_handed_out(security):
    """A frame from STREAMING_STORE_BYTES up is checked in the reader's
    landing buffer and copied into place with streaming stores: every byte
    arrives, and a byte changed deep inside such a frame is refused."""
    import numpy as np
    from fastmq import _stream
    n = (_stream.STREAMING_STORE_BYTES + (3 << 20) + 40) // 8
    big = np.arange(n, dtype=np.int64) * 7919
    seen = [0]

    def late_flip(data):
        # One byte, well inside the frame (past its first segments).
        before, seen[0] = seen[0], seen[0] + len(data)
        at = (20 << 20) - before
        if 0 <= at < len(data):
            return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
        return data

    for tamper, ok in ((lambda data: data, True), (late_flip, False)):
        w, r = _through_middle(tamper, security)
        errors = []

        def send():
            try:
                w.enqueue(big)
            except RuntimeError as e:     # the reader hung up on the forgery
                errors.append(e)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        if ok:
            got = r.dequeue(timeout=30)
            assert got.dtype == big.dtype and np.array_equal(got, big)
        else:
            with pytest.raises(CorruptChunkError, match="failed authentication"):
                r.dequeue(timeout=30)
        if ok:
            t.join(30)
            assert not t.is_alive() and not errors
        r.shutdown()
        w.shutdown()


def test_a_replayed_message_is_refused():
    copies = []

    def replay(data):
        copies.append(data)
        return data + data if len(copies) == 1 else data

    w, r = _through_middle(replay)
    w.enqueue("pay 10")
    assert r.dequeue(timeout=10) == "pay 10"
    with pytest.raises(RuntimeError, match="repeats seal counter 1 \\(a replay\\)"):
        r.dequeue(timeout=10)


def test_without_security_a_changed_byte_goes_through():
    """What "none" means (and why it is not the default)."""
    w, r = _through_middle(lambda d: d.replace(b"10", b"99"), "none")
    w.enqueue("pay 10")
    assert r.dequeue(timeout=10) == "pay 99"


def test_tags_are_gcms():
    """fastmq._gmac (the process's libcrypto, key state kept) must give
    exactly `cryptography`'s tags, since either end may compute them
    either way: lengths around every block boundary, parts that split
    blocks, unaligned views."""
    import random
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from fastmq._gmac import Gmac, available

    assert available()    # this machine's Python has a libcrypto
    sizes = [0, 1, 15, 16, 17, 127, 128, 129, 1023, 1024, 1025, 2047, 4101, 70_000,
             (1 << 20) + 3]
    rng = random.Random(7)
    for case in range(200):
        key = rng.randbytes(32)
        counter, index = rng.getrandbits(64), rng.getrandbits(32)
        parts = [rng.randbytes(rng.choice(sizes[:-1] if case % 10 else sizes))
                 for _ in range(rng.randint(0, 9))]
        if parts and case % 3 == 0:     # a view that starts at an odd address
            parts[0] = memoryview(b"x" + bytes(parts[0]))[1:]
        want = AESGCM(key).encrypt(struct.pack("<QI", counter, index), b"", b"".join(parts))
        g = Gmac(key)
        assert g.tag(counter, index, parts) == want, [len(p) for p in parts]
        assert g.check(counter, index, [memoryview(b"".join(parts))], want)
        bad = bytearray(want)
        bad[rng.randrange(16)] ^= 1 << rng.randrange(8)
        assert not g.check(counter, index, parts, bytes(bad))
        assert not g.check(counter, index, parts, want[:15])
        if parts and any(parts):
            i = next(k for k, p in enumerate(parts) if p)
            changed = list(parts)
            changed[i] = bytes([parts[i][0] ^ 1]) + bytes(parts[i][1:])
            assert not g.check(counter, index, changed, want)
        assert not g.check(counter + 1, index, parts, want)
        assert not g.check(counter, index ^ 1, parts, want)


def test_gmac_refuses_a_bad_key():
    from fastmq._gmac import Gmac

    with pytest.raises(ValueError, match="32 bytes"):
        Gmac(b"short")


def test_no_cipher_code_of_our_own():
    """AES and GHASH come from OpenSSL (libcrypto, cryptography): no
    source of fastmq's uses the CPU's AES or carry-less multiply itself."""
    import pathlib

    import fastmq

    root = pathlib.Path(fastmq.__file__).parent
    words = ("_mm_aesenc", "_mm_clmulepi64", "aesenclast", "pclmul")
    hits = [str(p) for p in root.rglob("*") if p.suffix in (".h", ".pyx", ".pxd", ".py")
            and any(w in p.read_text(errors="ignore") for w in words)]
    assert hits == []


def test_large_tags_let_other_threads_run():
    """A large segment's tag is computed without the GIL: another Python
    thread runs while 256 MiB are tagged.

    The switch interval is made long, so the interpreter never takes the
    GIL from the tagging thread by force during the test: the other thread
    (which lets the GIL go at each of its steps) can then only run between
    the two clock readings around ``tag()`` if ``tag()`` let the GIL go."""
    import sys

    seal = _seal.Seal("mac", _keys.new_message_key())
    data = bytes(256 << 20)
    ticks, go, stop = [], threading.Event(), threading.Event()

    def count():
        go.wait()
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0)           # lets the GIL go

    interval = sys.getswitchinterval()
    t = threading.Thread(target=count)
    t.start()
    inside = 0
    try:
        sys.setswitchinterval(30.0)
        go.set()
        for counter in range(1, 6):
            t0 = time.monotonic()
            seal.tag(counter, 0, data)
            t1 = time.monotonic()
            inside = sum(t0 < x < t1 for x in ticks)
            if inside:
                break
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        t.join()
    assert inside, "no other thread ran while a 256 MiB tag was computed"


def test_an_end_tagging_through_cryptography_reads_and_is_read():
    """Where no libcrypto loads for fastmq._gmac, an end tags through
    `cryptography`: the two kinds of end talk to each other, both ways,
    small messages, headers and segments alike."""
    key = _keys.new_message_key()
    fast, slow = _seal.Seal("mac", key), _seal.Seal("mac", key)
    slow._gmac = None
    assert fast._gmac is not None
    header, body = b"h" * 28, memoryview(b"b" * 3000)
    for a, b in ((fast, slow), (slow, fast)):
        wire = memoryview(b"".join(bytes(p) for p in a.seal_whole(9, header, [body])))
        assert bytes(b.open_whole(9, wire, len(header), len(body))) == bytes(body)
        assert b.open_whole(10, wire, len(header), len(body)) is None
        assert b.check_header(9, header, a.tag_header(9, header))
        assert not b.check_header(9, header[:-1] + b"x", a.tag_header(9, header))
        segment = memoryview(bytes(range(256)) * 4099)
        part, tag = a.seal(9, 3, segment)
        assert b.matches(b.tag(9, 3, part), tag)
        assert not b.matches(b.tag(9, 4, part), tag)


@pytest.mark.parametrize("in_place", [True, False])
def test_an_encrypted_segment_opens_into_the_frame_and_a_forged_one_does_not(in_place):
    """A reader decrypts a segment straight into its frame where
    `cryptography` can (decrypt_into), else through a copy; either way a
    segment under another nonce or with a flipped byte does not check."""
    key = _keys.new_message_key()
    writer, reader = _seal.Seal("encrypt", key), _seal.Seal("encrypt", key)
    if not in_place:
        reader._decrypt_into = None
    elif reader._decrypt_into is None:
        pytest.skip("this cryptography has no AESGCM.decrypt_into")
    segment = bytes(range(256)) * 4096
    (wire,) = writer.seal(7, 2, segment)
    out = bytearray(len(segment))
    assert reader.decrypt_into(7, 2, wire, memoryview(out)) and bytes(out) == segment
    assert not reader.decrypt_into(7, 3, wire, memoryview(bytearray(len(segment))))
    bad = bytearray(wire)
    bad[100] ^= 1
    assert not reader.decrypt_into(7, 2, bytes(bad), memoryview(bytearray(len(segment))))


def test_encrypting_into_pooled_blocks_puts_the_same_bytes_on_the_wire():
    """The writer's in-place encryption (a pooled block per segment) and a
    fresh ciphertext per segment give the same wire, down to the short
    last segment, which is not pooled."""
    from fastmq._recv_buffers import BufferPool

    key = _keys.new_message_key()
    pooled, fresh = _seal.Seal("encrypt", key), _seal.Seal("encrypt", key)
    if not pooled.encrypts_into:
        pytest.skip("this cryptography has no AESGCM.encrypt_into")
    fresh._encrypt_into = None
    payload = bytes(range(251)) * (int(2.3 * _wire.SEGMENT_BYTES) // 251)
    pool = BufferPool(_wire.CIPHER_POOL_BYTES)

    def wire(seal, pool):
        m = _wire.Outgoing(seal, 5, 1, [payload], pool)
        return b"".join(bytes(p) for k in range(m.n_batches) for p in m.batch(k))

    assert wire(pooled, pool) == wire(fresh, None) == wire(pooled, pool)
    assert pool.reused >= 2      # blocks given back were taken again


def test_a_segments_tag_is_computed_once_the_segment_left():
    """Under "mac" the first segment goes out before any tag over it is
    computed (the reader checks it while the writer tags it); the wire is
    still each segment followed by its tag, which a reader accepts."""
    import numpy as np

    key = _keys.new_message_key()
    seal = _seal.Seal("mac", key)
    calls = []
    real = seal.tag      # every segment's tag ("mac": seal() tags through it too)
    seal.tag = lambda seq, index, part: calls.append(index) or real(seq, index, part)
    payload = np.arange(int(2.5 * _wire.SEGMENT_BYTES), dtype=np.uint8)
    message = _wire.Outgoing(seal, 1, 1, [payload])
    first = message.batch(0)
    assert calls == [] and sum(len(memoryview(p)) for p in first[2:]) == _wire.SEGMENT_BYTES
    rest = [message.batch(k) for k in range(1, message.n_batches)]
    assert calls == [0, 1, 2]
    wire = b"".join(bytes(p) for b in [first, *rest] for p in b)
    header = first[0]
    body = wire[len(header) + _seal.TAG_BYTES:]
    check = _seal.Seal("mac", key)
    segs = [payload[o:o + _wire.SEGMENT_BYTES] for o in range(0, len(payload), _wire.SEGMENT_BYTES)]
    off = 0
    for i, seg in enumerate(segs):
        assert body[off:off + len(seg)] == seg.tobytes()
        off += len(seg)
        assert check.matches(check.tag(1, i, seg), body[off:off + _seal.TAG_BYTES])
        off += _seal.TAG_BYTES
    assert off == len(body)
