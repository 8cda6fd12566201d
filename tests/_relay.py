"""A TCP relay between a remote reader and its writer, for tests that play
the network: it records every byte the writer sends and can change, drop
or cut what it forwards; and a parser of the writer's side of the wire."""
from __future__ import annotations

import dataclasses
import socket
import struct
import threading

from fastmq import _seal, _wire


def through_relay(tamper, security="mac"):
    """A writer and one remote reader with a ``Relay`` between them that
    hands each chunk of the writer's bytes after the handshake to
    ``tamper``, handshaken: ``(writer, reader, relay)``."""
    from fastmq import MessageQueue

    w = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_security=security)
    m = Relay(w.export_handle(), tamper)
    r = MessageQueue.create_from_handle(m.handle, 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join(10)
    assert not t.is_alive(), "writer handshake did not finish"
    return w, r, m


class Relay:
    """Listens where the reader is told the writer is; relays to the
    writer's real address.  ``on_writer_bytes(data) -> data`` sees the
    writer's bytes after the handshake (return b"" to drop them, None to
    cut the connection)."""

    def __init__(self, handle, on_writer_bytes=None):
        self.writer_addr = _wire.parse_address(handle.remote_subscribe_addr)
        self.on_writer_bytes = on_writer_bytes
        self.listen = socket.socket()
        self.listen.bind(("127.0.0.1", 0))
        self.listen.listen()
        self.handle = dataclasses.replace(
            handle, remote_subscribe_addr=f"tcp://127.0.0.1:{self.listen.getsockname()[1]}")
        self.from_writer = bytearray()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()

    def _run(self):
        reader, _ = self.listen.accept()
        writer = socket.create_connection(self.writer_addr)
        self._socks = [reader, writer]
        t = threading.Thread(target=self._pipe, args=(reader, writer, False), daemon=True)
        t.start()
        self._threads.append(t)
        self._pipe(writer, reader, True)

    def _pipe(self, src, dst, from_writer):
        handshake = _wire.CHALLENGE.size + _wire.READY.size
        seen = 0
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                _close(dst)
                return
            if from_writer:
                with self._lock:
                    self.from_writer += data
                if self.on_writer_bytes is not None and seen >= handshake:
                    data = self.on_writer_bytes(data)
                    if data is None:
                        _close(dst)
                        _close(src)
                        return
                seen += len(data)
            try:
                dst.sendall(data)
            except OSError:
                return

    def wire(self) -> bytes:
        with self._lock:
            return bytes(self.from_writer)

    def close(self):
        self.listen.close()
        for s in getattr(self, "_socks", []):
            _close(s)


def _close(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@dataclasses.dataclass
class WireMessage:
    kind: bytes
    counter: int
    seq: int
    start: int     # offset of its header in the writer's bytes
    end: int       # offset just past it


def parse_writer_bytes(data: bytes, security: str) -> list[WireMessage]:
    """The messages in the writer's side of one connection (the handshake
    skipped), as far as they are complete."""
    t = 0 if security == "none" else _seal.TAG_BYTES
    off = _wire.CHALLENGE.size + _wire.READY.size
    out = []
    while off + _wire.HEAD.size <= len(data):
        kind, counter, seq, n = _wire.HEAD.unpack_from(data, off)
        lengths = struct.unpack_from(f"<{n}Q", data, off + _wire.HEAD.size)
        size = _wire.HEAD.size + 8 * n
        if kind == _wire.END:
            end = off + size + t
        elif kind == _wire.WHOLE:
            end = off + size + sum(lengths) + t
        else:
            end = off + size + t + sum(length + t * -(-length // _wire.SEGMENT_BYTES)
                                       for length in lengths)
        if end > len(data):
            break
        out.append(WireMessage(kind, counter, seq, off, end))
        off = end
    return out
