"""``ShmRingBuffer``: the ring segment of a queue, with vLLM's surface,
over one ring end (``fastmq._ring_writer.RingWriter`` or
``fastmq._ring_reader.RingReader``); and the rings open in this process, so
that an error can name a peer process that is gone (``dead_peers_note``).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

from fastmq import _config, _proc
from fastmq._ring import RingEnd, layout
from fastmq._ring_reader import RingReader
from fastmq._ring_writer import RingWriter
from fastmq._segment import Segment, memory_available, shm_full_error
from fastmq.segments import create_segment


# Every ring end open in this process (weak; an end leaves on close), so
# that a queue that fails can say which other process sharing this
# process's queues is gone (``dead_peers_note``).
_open_rings: "weakref.WeakSet[ShmRingBuffer]" = weakref.WeakSet()


def dead_peers() -> dict[int, list[str]]:
    """``{pid: [role, ...]}`` of the processes this process shares a ring
    with that are no longer running: readers of the rings it writes, and
    writers that neither closed their ring nor are alive."""
    out: dict[int, list[str]] = {}
    for buf in list(_open_rings):
        ring = buf.ring
        if ring is None or buf.closed:
            continue
        if isinstance(ring, RingWriter):
            for r in range(ring.n_reader):
                pid, started = ring.reader_identity(r)
                if pid and not _proc.is_alive(pid, started):
                    out.setdefault(pid, []).append(f"reader {r} of {buf.name}")
        else:
            pid = ring.writer_pid
            if not ring.writer_closed and not ring.writer_alive():
                out.setdefault(pid, []).append(f"writer of {buf.name}")
    return out


def dead_peers_note() -> str:
    """``"; ..."`` naming the processes ``dead_peers`` finds, or ``""``.

    A queue whose writer shut it down cannot tell why; in vLLM that is
    usually the executor reacting to another worker's death, and the
    worker to name is that one."""
    gone = dead_peers()
    if not gone:
        return ""
    return "; a process sharing queues with this one is gone: " + ", ".join(
        f"pid {pid} ({', '.join(roles)})" for pid, roles in sorted(gone.items()))


class ShmRingBuffer:
    """The ring segment of a ``MessageQueue`` (vLLM-compatible surface).

    ``ShmRingBuffer(n_reader, max_chunk_bytes, max_chunks)`` creates a ring
    (``ShmFullError`` if the host has not the memory for all of it; its
    chunks take memory as messages first reach them);
    passing ``name`` (the creator's ``name``, a segment locator) describes an
    existing one, which ``attach_reader`` maps (pickling an instance does
    exactly that on the other side).  As in vLLM, a name that cannot be
    mapped here is no error until it is used, because handles are also
    unpickled on other nodes where the segment never is.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int,
        max_chunks: int,
        name: str | None = None,
        *,
        wait_mode: str | None = None,
        spin_us: float | None = None,
    ):
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.metadata_size = 1 + n_reader
        self.total_bytes_of_buffer = layout(n_reader, max_chunk_bytes, max_chunks)[3]
        self.ring: RingEnd | None = None
        self.segment: Segment | None = None
        if name is None:
            self.is_creator = True
            seg = create_segment("ring", self.total_bytes_of_buffer)
            try:
                # The memory must be there now (a clear error here, not
                # later), but is taken as messages first reach each chunk
                # (RingWriter): a ring holds what it carried, as vLLM's does
                # (and each chunk's first page from the start).
                avail = memory_available()
                if 0 <= avail < self.total_bytes_of_buffer:
                    raise shm_full_error(
                        f"the message queue ring ({max_chunks} x "
                        f"{max_chunk_bytes / (1 << 20):g} MiB chunks)",
                        self.total_bytes_of_buffer, seg.name)
                pid, started = _proc.me()
                self.ring = RingWriter.create(
                    seg, n_reader, max_chunk_bytes, max_chunks,
                    _config.wait_mode_code(wait_mode),
                    int(_config.spin_us(spin_us) * 1000), pid, started,
                    _proc.pid_namespace(), checked=True,
                )
            except BaseException:
                seg.close()
                raise
            self.segment = seg
            self._name = seg.locator
            _open_rings.add(self)
        else:
            # Mapped by attach_reader(): a handle is also unpickled on other
            # nodes, where it is never used, and mapping it there would
            # hold the writer's memory for nothing.
            self.is_creator = False
            self._name = name
        self.closed = False

    def attach_reader(self, reader_rank: int) -> RingReader:
        """Map the ring and take reader ``reader_rank``'s slot.
        FileNotFoundError when its writer is gone or not on this host."""
        if self.segment is None:
            self.segment = Segment.attach(self._name)
        self.ring = RingReader.attach(self.segment, self.n_reader, self.max_chunk_bytes,
                                     self.max_chunks, reader_rank)
        _open_rings.add(self)
        return self.ring

    @property
    def name(self) -> str:
        return self._name

    def handle(self) -> tuple[int, int, int, str]:
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self._name)

    def __reduce__(self):
        return (self.__class__, self.handle())

    @contextmanager
    def get_data(self, current_idx: int) -> Iterator[memoryview]:
        """A view of chunk ``current_idx``'s bytes."""
        with self._ring_any().chunk_view(current_idx) as buf:
            yield buf

    @contextmanager
    def get_metadata(self, current_idx: int) -> Iterator[memoryview]:
        """A view of chunk ``current_idx``'s flags: [written, read x n_reader]."""
        with self._ring_any().meta_view(current_idx) as buf:
            yield buf

    def _ring_any(self) -> RingEnd:
        if self.ring is None:
            self.attach_reader(0)
        return self.ring

    def close(self) -> None:
        # First: dead_peers() must never read a closed ring's header.
        self.closed = True
        _open_rings.discard(self)
        if self.ring is not None:
            self.ring.close()
        if self.segment is not None:
            self.segment.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
