"""A large message through the ring's chunks in parts: the writer's cut,
when it may use them, and a reader's reassembly (chunk layout:
fastmq/_ring.pyx).  Used for a message too big for a chunk, and for one of
PARTS_MIN bytes or more with large buffers (out of band, or in-band
payloads kept by reference) that would fit one, when every reader is on
the writer's node and waiting for the next chunk (``readers_take_parts``).
Otherwise a message that fits a chunk takes one, and a larger one the
overflow socket (fastmq._overflow): remote readers, or a reader busy
elsewhere.

Why only to waiting readers: vLLM's writer may run max_chunks messages
ahead of its readers whatever their sizes, each message taking one chunk
(a large one its overflow mark).  Parts put into chunks that are merely
free would stay there, unread, while a reader is busy elsewhere, and a
later message the writer sends in vLLM's run-ahead would find no chunk.
A reader waiting for the message takes each part as it comes and, in
that same dequeue(), every part after it: the parts leave no chunk behind.

Why parts for a message that fits a chunk: its reader copies part k out
while the writer copies part k+1 in, so the two copies overlap instead of
following each other (a 16 MiB tensor to one reader: about half the time).

Why the ring and not the socket: a socket moves the payload twice through
the kernel (into the socket buffer, out into a fresh allocation per reader)
in small slices, each a wakeup of the other side.  The ring's chunks are
shared memory the writer already reserved: the writer copies each part in
once and every reader copies it out into memory it keeps for the next large
message.  And the writer never waits for a reader that is not reading,
so a large message decouples writer and readers as the socket does (a
reader busy elsewhere does not hold the writer up, and a thread that
writes and also reads the queue cannot deadlock itself).

The part stream::

    [u64 nbuf][u64 kind << 62 | len, x nbuf][buf0: the pickle stream][buf1]...

A buffer's kind says what the reader copies it into: memory of its own
(the buffer is an out-of-band buffer of the pickle), or a fresh ``bytes``
or ``bytearray`` that the unpickler takes as the object itself (a large
in-band payload the writer moved out of the stream, fastmq._sink).

cut into parts of equal size, each at most PART_BYTES (or a chunk; or
PART_BYTES_MAX for a message of more than SMALL_PARTS_MAX of them); its
head (the lengths) lies in part 0.
"""
from __future__ import annotations

import os
import struct
import time

from fastmq._piecewise import PiecewiseFile
from fastmq._recv_buffers import POOLED_MIN_BYTES, fresh_bytearray, fresh_bytes
from fastmq._ring import PART_HEAD_BYTES, CorruptChunkError
from fastmq._memory import memory_room
from fastmq._sink import KIND_BUFFER, KIND_BYTEARRAY, KIND_BYTES

# Bytes per part (with its header), at most a chunk: small enough that the
# readers' copy of one part overlaps the writer's copy of the next from a few
# MiB up, large enough that the handover per part is noise.  A message of
# many parts takes parts of up to PART_BYTES_MAX: a large message reserves
# at most that much of each chunk it passes through (80 MiB of vLLM's
# 10 x 24 MiB ring, not all of it), whatever its size.
PART_BYTES = 4 << 20
PART_BYTES_MAX = 8 << 20
# A message of more parts than this takes PART_BYTES_MAX ones: the overlap
# is won by then, and with two readers on two cores a 256 MiB message in
# 4 MiB parts (65 handovers) ran 2.5-4x slower in one run of three, in
# 8 MiB parts never (fastmq-bench, arena off, N=2).
SMALL_PARTS_MAX = 8
# Framed messages from this size up go in parts even when they fit a chunk.
PARTS_MIN = 4 << 20
# Reassembly buffers at least this large come from the reader's pool of
# reused memory; smaller ones are plain bytearrays.
POOLED_MIN = POOLED_MIN_BYTES
# Readers that have read every message so far but are not waiting yet are
# between two dequeue() calls: in fastmq-bench's tensor rows (each reader
# answers each message, then asks for the next) they came to their wait
# within microseconds, a few hundred at most.  The writer gives them this
# long per MiB of the message (at most ON_THEIR_WAY_MAX_NS) before it sends
# the message the way vLLM does: a few percent of what that way's copies
# take, so that readers busy elsewhere cost it little.
ON_THEIR_WAY_NS_PER_MIB = 16_000
ON_THEIR_WAY_MAX_NS = 4_000_000

_U64 = struct.Struct("<Q")

# A buffer's length word in the head carries its kind (fastmq._sink) in
# the top two bits: what the reader copies it into.
KIND_SHIFT = 62
_LENGTH_MASK = (1 << KIND_SHIFT) - 1


def readers_take_parts(ring, total: int, until: float | None) -> bool:
    """Whether a ``total``-byte part stream may go through ``ring`` (a
    ``RingWriter`` whose next chunk is free) now: every reader is waiting
    for the next chunk, so each takes the parts as they come and none is
    left in a chunk that a later message needs.  Readers that have read
    every chunk are given up to ``ON_THEIR_WAY_NS_PER_MIB`` (no later than
    ``until``, a ``time.monotonic()`` deadline) to come to that wait."""
    # Every chunk read first, then the waiting marks: a reader whose mark
    # is still set from its wait for a chunk now published (the last
    # message) will return that message from dequeue() and may read no
    # further; a mark seen after its read is a wait for the chunk to come.
    if ring.free_chunks() < ring.max_chunks:
        return False
    if ring.readers_waiting():
        return True
    end = time.monotonic_ns() + min(total * ON_THEIR_WAY_NS_PER_MIB >> 20,
                                    ON_THEIR_WAY_MAX_NS)
    if until is not None:
        end = min(end, int(until * 1e9))
    while time.monotonic_ns() < end:
        # Yield, not spin: on a host with fewer cores than processes the
        # reader may need this core to get to its wait.
        os.sched_yield()
        if ring.readers_waiting():
            return True
    return False


def cut_to_fit(stream: list, oob: list, kinds: list, max_chunk_bytes: int,
               free: int | None = None) -> tuple[list, int] | None:
    """``cut()`` into parts of PART_BYTES, or larger ones up to
    PART_BYTES_MAX when more than SMALL_PARTS_MAX of them, or more than
    ``free`` chunks, would be needed (None: no limit; the writer sends
    parts only to readers waiting for them, ``readers_take_parts``).  None
    when no cut fits."""
    for size in (PART_BYTES, PART_BYTES_MAX):
        parts = cut(stream, oob, kinds, min(size, max_chunk_bytes) - PART_HEAD_BYTES)
        if parts is None:
            return None
        n = len(parts[0])
        if (free is None or n <= free) and (n <= SMALL_PARTS_MAX or size == PART_BYTES_MAX):
            return parts
    return None


def cut(stream: list, oob: list, kinds: list, payload: int) -> tuple[list, int] | None:
    """``([(pieces, offset)], total)``: the parts of a message -- its pickle
    stream as ``(buffer, start, length)`` pieces, then its out-of-band
    buffers, each of a kind (``PickleSink.stream()``) -- each part a list of
    such pieces of at most ``payload`` bytes in all, and the part stream's
    length.  None when the head would not fit in part 0."""
    lens = [sum(n for _, _, n in stream), *(memoryview(f).nbytes for f in oob)]
    words = [lens[0], *(n | kind << KIND_SHIFT for n, kind in zip(lens[1:], kinds))]
    head = struct.pack(f"<{1 + len(words)}Q", len(words), *words)
    if len(head) > payload:
        return None
    # Equal parts (the last one is not a sliver that the readers wait for
    # alone), the head still whole in part 0.
    total = len(head) + sum(lens)
    payload = max(-(-total // -(-total // payload)), len(head))
    parts, pieces, room, offset = [], [], payload, 0
    for buf, first, size in ((head, 0, len(head)), *stream,
                             *((f, 0, n) for f, n in zip(oob, lens[1:]))):
        start = 0
        while start < size:
            n = min(room, size - start)
            pieces.append((buf, first + start, n))
            start += n
            room -= n
            if room == 0:
                parts.append((pieces, offset))
                offset += payload
                pieces, room = [], payload
    if pieces:
        parts.append((pieces, offset))
    return parts, total


def read_head(ring, idx: int, length: int, total: int) -> tuple[int, list, list]:
    """``(head bytes, lengths, kinds)``: the head of the part stream whose
    part 0 (``length`` bytes of a ``total``-byte stream) is in chunk
    ``idx``, every figure checked against the stream before any buffer is
    allocated or any byte past the head is read."""
    where = f"fastmq ring chunk {idx}"
    word = bytearray(8)
    if length < 8:
        raise CorruptChunkError(f"{where}: part 0 of {length} bytes holds no head")
    ring.copy_part(idx, 0, word, 0, 8)
    (n,) = _U64.unpack(word)
    head = 8 * (1 + n)
    if n < 1 or head > length or head > total:
        raise CorruptChunkError(f"{where}: a part stream names {n} buffers, which its "
                                f"{length}-byte first part cannot list")
    table = bytearray(8 * n)
    ring.copy_part(idx, 8, table, 0, 8 * n)
    words = struct.unpack(f"<{n}Q", table)
    lens = [w & _LENGTH_MASK for w in words]
    kinds = [w >> KIND_SHIFT for w in words]
    if kinds[0] != KIND_BUFFER or max(kinds) > KIND_BYTEARRAY:
        raise CorruptChunkError(f"{where}: a part stream names a buffer of unknown kind "
                                f"({kinds})")
    if head + sum(lens) != total:
        raise CorruptChunkError(f"{where}: a part stream's buffers add up to "
                                f"{head + sum(lens)} bytes, the stream is {total}")
    return head, lens, kinds


def short_of_memory(total: int) -> int | None:
    """The bytes this host has available now, if fewer than a
    ``total``-byte message needs; else None.  Asked before any page of it
    is allocated: populating more than the host has would wake the OOM
    killer rather than fail.  Through the reading kept in the background
    (fastmq._memory): no file is read here while memory is plentiful."""
    avail = memory_room(total)
    return avail if 0 <= avail < total else None


class Assembly:
    """One reader's copy of a part stream in progress.  Kept by the reader
    across dequeue() calls: a timeout between parts resumes where it was."""

    def __init__(self, total: int, pool):
        self.total = total
        self.next_index = 0
        self.received = 0
        self.frames: list = []
        # Part 0 was refused (the message is more than this host has): that
        # error was raised once; the rest of the message is passed over,
        # part by part, and the message dropped.
        self.skipping = False
        self._pool = pool
        self._spans: list = []   # (stream offset, length, frame)

    @classmethod
    def passing_over(cls, total: int, next_index: int, received: int) -> "Assembly":
        """The rest of a message this reader will not deliver (a wait in
        its middle failed): its parts are passed over, so that the next
        message starts where it should."""
        asm = cls(total, None)
        asm.next_index, asm.received, asm.skipping = next_index, received, True
        return asm

    def take(self, ring, idx: int, index: int, total: int, offset: int, length: int,
             head: tuple | None = None) -> bool:
        """Copy part ``index`` out of chunk ``idx`` (part 0: with its
        ``head``, if already read); True once the message is whole (or,
        ``skipping``, passed over).  Raises
        ``CorruptChunkError`` for a part that does not follow the last one
        or a head that lies, ``MemoryError`` for a message larger than the
        host has (then ``skipping`` while parts of it remain)."""
        where = f"fastmq ring chunk {idx}"
        if index != self.next_index or total != self.total or offset != self.received:
            raise CorruptChunkError(
                f"{where}: part {index} at offset {offset} of a {total}-byte stream does not "
                f"follow part {self.next_index - 1} (offset {self.received} of {self.total})")
        end = offset + length
        self.next_index += 1
        self.received = end
        if index == 0:
            try:
                self._open(head or read_head(ring, idx, length, total), where)
            except MemoryError:
                # A well-formed message this reader cannot hold: its other
                # parts are passed over.  (A head that lies ends the stream
                # here instead: nothing after it can be trusted to follow.)
                self.skipping = end < self.total
                self.frames, self._spans = [], []
                raise
        for at, size, frame in self._spans:
            lo, hi = max(at, offset), min(at + size, end)
            if lo < hi:
                ring.copy_part(idx, lo - offset, frame, lo - at, hi - lo)
        return end == self.total

    def _open(self, head: tuple, where: str) -> None:
        at, lens, kinds = head
        avail = short_of_memory(self.total)
        if avail is not None:
            raise MemoryError(f"fastmq: a {self.total}-byte message arrived in parts, more "
                              f"than this host has available now ({avail} bytes); it is "
                              "dropped for this reader")
        for size, kind in zip(lens, kinds):
            if kind == KIND_BYTES:
                # The object the message holds: written here, before
                # anybody else can see it.
                frame, target = fresh_bytes(size)
            elif kind == KIND_BYTEARRAY:
                frame = target = fresh_bytearray(size)
            else:
                frame = target = (self._pool.take(size) if size >= POOLED_MIN
                                  else bytearray(size))
            self.frames.append(frame)
            self._spans.append((at, size, target))
            at += size


class PartsAborted(Exception):
    """The writer stopped the part stream being read (``PartStream``)."""


class PartStream(PiecewiseFile):
    """A message's pickle stream unpickled straight out of the ring's
    chunks (``fastmq._piecewise``): a message that is its pickle stream
    alone (out-of-band buffers follow the stream, and the unpickler needs
    each one where the stream names it), read without a deadline.

    Holds the chunk of the part being read (``idx``) until the next part
    is needed; ``next_part()`` waits for that one, with the reader's
    liveness checks, and returns its chunk.  ``abandon()`` leaves the rest
    of the message to the reader's next call (``passing_over``), which it
    sets through ``keep(assembly)``."""

    def __init__(self, ring, idx: int, total: int, length: int, head: int, stream_len: int,
                 next_part, keep):
        self._ring = ring
        self.idx = idx              # the chunk held, or None
        self._next_part = next_part
        self._keep = keep
        self.total = total
        self._index = 0             # the part held
        self._start = 0             # its offset in the part stream
        self._end = length          # its length
        self._pos = head
        self._left = stream_len

    def _copy(self, target, at: int, k: int) -> None:
        self._ring.copy_part(self.idx, self._pos, target, at, k)

    def _advance(self) -> None:
        # The part held is read: its chunk goes back before the next wait,
        # so the writer can reuse it for a part still to come.
        # Called only while bytes remain: the head's lengths add up to the
        # stream (read_head) and each part must start where the last ended.
        ring, expect = self._ring, self._start + self._end
        self._release()
        self.idx = idx = self._next_part()
        aborted, index, total, offset, length = ring.part_header(idx)
        if aborted:
            raise PartsAborted()
        if index != self._index + 1 or total != self.total or offset != expect:
            raise CorruptChunkError(
                f"fastmq ring chunk {idx}: part {index} at offset {offset} of a {total}-byte "
                f"stream does not follow part {self._index} (offset {expect} of "
                f"{self.total})")
        self._index, self._start, self._end, self._pos = index, offset, length, 0

    def finish(self) -> None:
        """Pass over what is left of the message (its parts after the end
        of the pickle), then release the last chunk."""
        while self._start + self._end < self.total:
            self._advance()
        self._release()

    def abandon(self, error: BaseException) -> None:
        # A failed wait (the writer gone, shutdown()) or an interrupt: the
        # next call passes over what remains, as after a refused first
        # part.  A part that does not follow, or an abort, ends the
        # message here.
        self._release()
        rest = self._start + self._end < self.total
        if rest and not isinstance(error, (CorruptChunkError, PartsAborted)):
            self._keep(Assembly.passing_over(self.total, self._index + 1,
                                             self._start + self._end))

    def _release(self) -> None:
        if self.idx is not None:
            idx, self.idx = self.idx, None
            self._ring.release_read(idx)
