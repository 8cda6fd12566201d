"""A pickle stream unpickled as its pieces arrive: the file object that
``pickle.Unpickler`` reads (``read``, ``readinto``, ``readline``) over a
message that comes in pieces -- the ring's parts (``fastmq._parts.
PartStream``) or a remote message's checked segments (``fastmq._stream.
SegmentStream``) -- and the one way a reader unpickles from it.

Why: reassembling such a message first writes all of it to memory of its
size (fresh pages the first time) and reads it back to unpickle it.  The
unpickler asks for a frame (64 KiB) at a time; copied from the piece into a
small object, it is still in the cache when the unpickler reads it.

Why only for a reader that waits without a deadline (vLLM's workers:
``dequeue(indefinite=True)``): an unpickler cannot be suspended, so a
timeout in the middle of a message could only drop it.  With a deadline
the message is reassembled, and a timeout keeps what came.

A source (a subclass) makes its next piece current in ``_advance()``
(``_pos``, ``_end``: the bytes of it not read yet) and copies out of it in
``_copy()``; ``failed`` is set when its own receive or wait raised;
``finish()`` consumes the rest of the message; ``abandon()`` leaves what
remains to be passed over by the reader's next call.
"""
from __future__ import annotations

from typing import Any

from fastmq._recv_buffers import fresh_bytes
from fastmq._serde import decode_stream


class PiecewiseFile:
    """``pickle.Unpickler``'s file over ``_left`` bytes that arrive in
    pieces (see the module's docstring for what a subclass provides)."""

    _left = 0       # bytes of the pickle stream not read yet
    _pos = 0        # the next byte of the current piece...
    _end = 0        # ...and its end
    failed = False

    def read(self, n: int = -1) -> bytes:
        n = self._left if n is None or n < 0 else min(n, self._left)
        obj, target = fresh_bytes(n)
        self._fill(target, n)
        return obj

    def readinto(self, buf) -> int:
        with memoryview(buf) as view, view.cast("B") as out:
            n = min(out.nbytes, self._left)
            self._fill(out, n)
        return n

    def readline(self) -> bytes:
        # Only the text opcodes of protocols 0-3 read lines; fastmq pickles
        # with protocol 5, so a byte at a time is enough here.
        line = bytearray()
        while self._left and not line.endswith(b"\n"):
            line += self.read(1)
        return bytes(line)

    def _fill(self, target, n: int) -> None:
        at = 0
        while at < n:
            if self._pos == self._end:
                try:
                    self._advance()
                except BaseException:
                    self.failed = True
                    raise
            k = min(n - at, self._end - self._pos)
            self._copy(target, at, k)
            self._pos += k
            self._left -= k
            at += k

    def _advance(self) -> None:
        raise NotImplementedError

    def _copy(self, target, at: int, k: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def abandon(self, error: BaseException) -> None:
        raise NotImplementedError


def unpickle(source: PiecewiseFile) -> Any:
    """The object ``source`` carries.  The message is consumed to its end
    whatever the unpickler does: after an error of its own (a class this
    process cannot import, say) the rest is consumed before it is raised,
    so the next call starts at the next message, as after reassembly.  When
    the source itself failed (a wait, a check), or on an interrupt, the
    source is abandoned instead (``abandon``)."""
    try:
        try:
            obj = decode_stream(source, source._left)
        except Exception:
            if source.failed:
                raise
            source.finish()
            raise
        source.finish()
        return obj
    except BaseException as e:
        source.abandon(e)
        raise
