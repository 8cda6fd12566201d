"""Hostile bytes in ring chunks and in the tensor arena's descriptors and
flags: readers raise clean errors, keep going, and the next valid message
arrives intact.

Every case is published through the real ring (``acquire_write`` yields
the chunk) and read by a real reader in this process, thousands of cases in
a few seconds.  Chunk framing::

    [u8 overflow][3 pad][u32 nbuf][u64 len x nbuf][buffers, each 8-aligned]

What a reader may raise for a corrupt chunk: ``CorruptChunkError`` when the
framing does not describe a message (our own check), ``ArenaError`` for a
forged or stale arena slot descriptor (the arena's check), else whatever
``pickle.loads`` raises for a malformed stream (``UnpicklingError``,
``EOFError``, and the ``ValueError`` / ``KeyError`` / ``IndexError`` /
``TypeError`` / ``OverflowError`` / ``AttributeError`` / ``ImportError``
family its opcodes raise), and ``TimeoutError`` when the chunk says
"overflow" but no payload comes on the socket.  Never a crash, a
``SystemError``, ``MemoryError`` or a hang.

The random bytes that pickle may parse avoid the opcodes with which a
hostile stream makes CPython's unpickler import and call by name (``c``,
``i``, ``\\x93``) or allocate a size read from the input before reading
the data (memo ``p``/``r``: a 4-byte index pre-sizes gigabytes of memo;
``B``, ``\\x8e``, ``\\x96``: bytes/bytearray of a claimed length).  Those
are pickle's own hazards with hostile input, not the queue's: the queue's
trust boundary is the user who can write the segment (docs/operations.md,
"Hostile bytes in shared memory"); the framing is what is fuzzed.  With them excluded, a ``MemoryError`` here
would be the queue's bug, so it is not accepted.
"""
from __future__ import annotations

import pickle
import random
import struct

import numpy as np
import pytest

from fastmq import CorruptChunkError, MessageQueue
from fastmq.arena import ArenaError

CHUNK = 4096
CASES = 8000

ACCEPTED = (CorruptChunkError, ArenaError, pickle.UnpicklingError, EOFError, ValueError,
            KeyError, IndexError, TypeError, OverflowError, AttributeError, ImportError)

_UNSAFE = {ord("c"), ord("i"), 0x93, ord("p"), ord("r"), ord("B"), 0x8e, 0x96}
SAFE = np.array([b for b in range(256) if b not in _UNSAFE], dtype=np.uint8)
SAFE_TEXT = "ADEFGHJKLMNOQSTUVWXYZ0123456789 "


def _align8(n: int) -> int:
    return (n + 7) & ~7


def frame(buffers: list[bytes], overflow: int = 0, nbuf: int | None = None,
          lens: list[int] | None = None) -> bytes:
    """Chunk bytes for ``buffers``; ``nbuf``/``lens`` override the header."""
    n = len(buffers)
    lens = [len(b) for b in buffers] if lens is None else lens
    head = struct.pack("<B3xI", overflow, n if nbuf is None else nbuf)
    head += b"".join(struct.pack("<Q", ln & (2**64 - 1)) for ln in lens)
    out = bytearray(head)
    off = 8 + 8 * n
    for b in buffers:
        out += bytes(_align8(off) - off)
        off = _align8(off)
        out += b
        off += len(b)
    return bytes(out)


class Fuzzer:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)

    def safe_bytes(self, n: int) -> bytes:
        return self.np.choice(SAFE, n).tobytes()

    def text(self) -> str:
        return "".join(self.rng.choices(SAFE_TEXT, k=self.rng.randrange(12)))

    def value(self, depth: int = 0):
        r = self.rng.randrange(8 if depth < 3 else 5)
        if r == 0:
            return self.rng.randrange(0x60)
        if r == 1:
            return self.text()
        if r == 2:
            return self.safe_bytes(self.rng.randrange(16))
        if r == 3:
            return self.rng.choice([None, True, False])
        if r == 4:
            return -self.rng.randrange(0x60)
        if r == 5:
            return [self.value(depth + 1) for _ in range(self.rng.randrange(4))]
        if r == 6:
            return tuple(self.value(depth + 1) for _ in range(self.rng.randrange(4)))
        return {self.text(): self.value(depth + 1) for _ in range(self.rng.randrange(4))}

    def message(self):
        """(object, framed buffers): some with out-of-band buffers."""
        obj = {"v": self.value(), "n": self.rng.randrange(0x60)}
        oob = []
        if self.rng.random() < 0.3:
            obj["b"] = [pickle.PickleBuffer(bytearray(self.safe_bytes(self.rng.randrange(64))))
                        for _ in range(self.rng.randrange(1, 4))]
        stream = pickle.dumps(obj, protocol=5, buffer_callback=lambda b: oob.append(b.raw()))
        if "b" in obj:
            obj["b"] = [bytearray(b) for b in obj["b"]]
        return obj, [stream] + [bytes(b) for b in oob]

    def length(self, cap: int) -> int:
        return self.rng.choice([
            0, 1, 7, 8, cap - 16, cap - 8, cap, cap + 1, cap * 2, 2**31, 2**32 - 1,
            2**32, 2**63, 2**64 - 1, 2**64 - 8, self.rng.randrange(cap),
            self.rng.randrange(2**64)])

    def overflow_byte(self) -> int:
        # Mostly 0 (a message follows), sometimes an overflow mark, else junk.
        return self.rng.choice([0] * 6 + [1, self.rng.randrange(2, 256)])

    def case(self) -> tuple[str, bytes, object]:
        """(kind, chunk bytes to write, expected object or None)."""
        kind = self.rng.choice(["random", "lengths", "mutated", "mutated", "valid"])
        if kind == "random":
            nbuf = self.rng.choice([0, 1, 2, 3, self.rng.randrange(1, 600),
                                    self.rng.randrange(2**32)])
            table = min(nbuf, 510)
            head = struct.pack("<B3xI", self.overflow_byte(), nbuf)
            head += b"".join(struct.pack("<Q", self.length(CHUNK)) for _ in range(table))
            return kind, head + self.safe_bytes(CHUNK - len(head)), None
        if kind == "lengths":
            n = self.rng.randrange(1, 6)
            bufs = [self.safe_bytes(self.rng.randrange(200)) for _ in range(n)]
            lens = [self.length(CHUNK) if self.rng.random() < 0.5 else len(b) for b in bufs]
            return kind, frame(bufs, lens=lens), None
        obj, bufs = self.message()
        if kind == "valid":
            return kind, frame(bufs), obj
        data = bytearray(frame(bufs))
        head_len = 8 + 8 * len(bufs)
        for _ in range(self.rng.randrange(1, 4)):
            what = self.rng.randrange(4)
            if what == 0:       # header or length table: any byte
                data[self.rng.randrange(head_len)] = self.rng.randrange(256)
            elif what == 1:     # the pickle stream or a buffer
                data[self.rng.randrange(head_len, len(data))] = int(self.np.choice(SAFE))
            elif what == 2:     # a length, shortened or stretched
                i = self.rng.randrange(len(bufs))
                ln = struct.unpack_from("<Q", data, 8 + 8 * i)[0]
                struct.pack_into("<Q", data, 8 + 8 * i,
                                 max(0, ln + self.rng.randrange(-16, 17)) & (2**64 - 1))
            else:               # a buffer count that does not match
                struct.pack_into("<I", data, 4, max(0, len(bufs) + self.rng.randrange(-2, 3)))
        return kind, bytes(data), None


def arena_case(fz: Fuzzer, writer: MessageQueue):
    """A real message whose array went to the queue's tensor arena, framed
    with random bytes in its slot descriptor (an out-of-band entry); and
    the intact message, sent next (it also hands the slot back)."""
    arr = np.frombuffer(fz.safe_bytes(fz.rng.randrange(16 << 10, 64 << 10)), dtype=np.uint8)
    bufs = writer._end.encoder.encode({"a": arr})
    writer.tensor_arena.commit()          # as enqueue() does once it is sent
    assert len(bufs) == 2 and len(bufs[1]) == 48, "the array did not go to the arena"
    desc = bytearray(bufs[1])
    for _ in range(fz.rng.randrange(1, 4)):
        desc[fz.rng.randrange(8, 48)] = fz.rng.randrange(256)
    return frame([bufs[0], bytes(desc)]), frame(bufs), arr


def test_fuzz_ring_chunks():
    writer = MessageQueue(1, 1, max_chunks=2, max_chunk_bytes=CHUNK,
                          enable_shm_tensor_arena=True, arena_slots=2, arena_slot_mb=1,
                          arena_min_mb=0.01)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready()
    reader.wait_until_ready()
    fz = Fuzzer(20240607)
    seen: dict[str, int] = {}
    for i in range(CASES):
        intact = None
        if i % 10 == 5:
            kind, expected = "arena", None
            data, intact, arr = arena_case(fz, writer)
        else:
            kind, data, expected = fz.case()
        assert len(data) <= CHUNK
        with writer.acquire_write() as buf:
            buf[:len(data)] = data
        try:
            # A forged overflow mark is recognised at once (its message id
            # was never published), so nothing here waits for a payload.
            got = reader.dequeue(timeout=0)
        except ACCEPTED as e:
            assert kind != "valid", (i, e)
            name = type(e).__name__
            seen[name] = seen.get(name, 0) + 1
        except TimeoutError:
            # An abort (kind 3) with no message before it leaves nothing to
            # read; a forged first part that holds together reads as the
            # start of a larger message, whose next part the reader waits
            # for, as it must for a real one.  The abort a writer publishes
            # after a stopped message ends that.
            assert data[0] in (2, 3), i
            if reader._end._parts is not None:
                with writer.acquire_write() as buf:
                    buf[0] = 3
            seen["waits"] = seen.get("waits", 0) + 1
        else:
            if kind == "valid":
                assert got == expected, i
            else:
                seen["decoded"] = seen.get("decoded", 0) + 1
        if intact is not None:
            with writer.acquire_write() as buf:
                buf[:len(intact)] = intact
            got = reader.dequeue(timeout=0)
            assert np.array_equal(got["a"], arr), i
            del got
        # The queue is intact: a real message (sometimes over the chunk
        # size, through the overflow socket) comes through unchanged.
        if i % 50 == 0:
            real = {"i": i, "pad": bytes(2 * CHUNK)}
        else:
            real = {"i": i, "v": fz.value()}
        writer.enqueue(real)
        assert reader.dequeue(timeout=10) == real, i
    # The cases reached both our own checks and pickle's.
    assert seen.get("CorruptChunkError", 0) > CASES // 10, seen
    assert seen.get("ArenaError", 0) > CASES // 40, seen
    assert sum(v for k, v in seen.items()
               if k not in ("CorruptChunkError", "ArenaError", "decoded")
               ) > CASES // 20, seen


# -- the tensor arena: forged descriptors and garbage flags --------------------
def test_fuzz_arena_descriptors_and_flags():
    """Slot descriptors with random bytes (real ones mutated, forged ones)
    and random bytes over the slots' flag lines: the reader's ``map_oob``
    raises ``ArenaError`` or maps a range inside the arena's slots, never
    anything else; and a real buffer still round-trips afterwards."""
    from fastmq._arena import DESC_LEN, DESC_MAGIC, layout
    from fastmq._segment import Segment
    from fastmq.arena import ArenaError, ShmTensorArena

    slot_bytes, n_slots = 1 << 16, 4
    writer = ShmTensorArena(1, slot_bytes, n_slots, min_bytes=1, prefault="off")
    reader = ShmTensorArena(*writer.handle(), reader_rank=0)
    stride, flags_off, _, _ = layout(1, n_slots, slot_bytes)
    seg = Segment.attach(writer.name)
    flags = memoryview(seg)[flags_off:flags_off + stride * n_slots]
    fz = Fuzzer(7)
    magic = struct.pack("<Q", DESC_MAGIC)
    outcomes: dict[str, int] = {}

    def check_mapped(entry, desc):
        if entry is desc:                 # not a descriptor: passed through
            return "passed"
        sb = entry.obj
        assert reader.contains(sb.address) or len(entry) == 0
        assert len(entry) == 0 or reader.contains(sb.address + len(entry) - 1)
        return "mapped"

    def round_trip(i):
        data = np.frombuffer(fz.safe_bytes(fz.rng.randrange(1, slot_bytes)), dtype=np.uint8)
        desc = writer.copy_to_slot(pickle.PickleBuffer(data))
        writer.commit()
        assert desc is not None, i
        (view,) = reader.map_oob([desc])
        assert bytes(view) == data.tobytes(), i
        view.release()
        del view
        reader.flush_releases()
        return desc

    try:
        valid = round_trip(-1)
        for i in range(3000):
            kind = fz.rng.choice(["mutated", "forged", "flags"])
            saved = None
            if kind == "mutated":
                desc = bytearray(valid)
                for _ in range(fz.rng.randrange(1, 4)):
                    desc[fz.rng.randrange(8 if fz.rng.random() < 0.9 else 0, DESC_LEN)] = \
                        fz.rng.randrange(256)
                desc = bytes(desc)
            elif kind == "forged":
                desc = magic + bytes(fz.rng.randrange(256) for _ in range(DESC_LEN - 8))
            else:
                saved = bytes(flags)
                for _ in range(fz.rng.randrange(1, 8)):
                    flags[fz.rng.randrange(len(flags))] = fz.rng.randrange(256)
                desc = valid
            try:
                (entry,) = reader.map_oob([desc])
                outcome = check_mapped(entry, desc)
                if outcome == "mapped":
                    entry.release()
                del entry
            except ArenaError:
                outcome = "ArenaError"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            reader.flush_releases()
            if saved is not None:
                flags[:] = saved          # undo, so that slots can be claimed again
            valid = round_trip(i)
    finally:
        flags.release()
        seg.close()
        reader.close()
        writer.close()
    # Every outcome was reached: refused, mapped in bounds, passed through.
    assert outcomes.get("ArenaError", 0) > 1000 and outcomes.get("mapped", 0) > 0, outcomes
    assert outcomes.get("passed", 0) > 0, outcomes


def test_a_chunk_refused_for_its_framing_hands_back_the_arena_slots_it_names():
    """A chunk whose framing fails the ring's check never reaches the
    arena's descriptor check: the slots it names stayed taken for good
    (later tensors then took the copy path).  Each bad framing here names a
    real, current publication; after the refusal the slot is free again."""
    writer = MessageQueue(1, 1, max_chunks=2, max_chunk_bytes=CHUNK,
                          enable_shm_tensor_arena=True, arena_slots=2, arena_slot_mb=1,
                          arena_min_mb=0.01)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.wait_until_ready()
        reader.wait_until_ready()
        core = writer.tensor_arena.core
        arr = np.arange(32 << 10, dtype=np.uint8)
        for bad in ("count", "length", "overflow mark"):
            bufs = writer._end.encoder.encode({"a": arr})
            writer.tensor_arena.commit()
            assert len(bufs) == 2 and len(bufs[1]) == 48, "the array did not go to the arena"
            assert len(core.free_slots()) == 1
            if bad == "count":
                data = frame(bufs, nbuf=3)
            elif bad == "length":
                data = frame(bufs, lens=[len(bufs[0]), CHUNK])
            else:
                data = frame(bufs, overflow=7)
            with writer.acquire_write() as buf:
                buf[:len(data)] = data
            with pytest.raises(CorruptChunkError):
                reader.dequeue(timeout=0)
            reader.tensor_arena.core.flush_releases()
            assert len(core.free_slots()) == 2, bad
        writer.enqueue({"a": arr})
        got = reader.dequeue(timeout=10)
        assert np.array_equal(got["a"], arr)
    finally:
        reader.shutdown()
        writer.shutdown()
