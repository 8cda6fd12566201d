from typing import Any

from fastmq._segment import Segment

MAGIC: int
LAYOUT_VERSION: int
WAIT_SPIN: int
WAIT_FUTEX: int
WAIT_ZMQ: int
READY: int
LONG_WAIT: int
WRITER_CLOSED: int
WRITER_DIED: int
READER_DIED: int
OVERFLOW: int
PICKLER_STALE: int
PARTS: int
PART_HEAD_BYTES: int

class _Pending: ...
PENDING: _Pending
SLOT_FREE: int
SLOT_ALIVE: int
SLOT_LEFT: int
SLOT_DEAD: int

class CorruptChunkError(RuntimeError): ...
class SegmentMismatchError(RuntimeError): ...

def have_futex() -> bool: ...
def layout(n_reader: int, max_chunk_bytes: int, max_chunks: int) -> tuple[int, int, int, int]: ...

class RingEnd:
    """What both ends of a ring share (see RingWriter, RingReader)."""
    segment: Segment
    n_reader: int
    max_chunks: int
    max_chunk_bytes: int
    current_idx: int
    wait_mode: int
    spin_ns: int
    warn_interval: float
    park_slice_ns: int
    owner_pid: int
    wakeups: int
    def wait_next(self, timeout: float | None = ...) -> int: ...
    def continue_wait(self) -> int: ...
    @property
    def waited(self) -> float: ...
    def cancel(self) -> None: ...
    def chunk_view(self, idx: int) -> memoryview: ...
    def meta_view(self, idx: int) -> memoryview: ...
    @property
    def parked_readers(self) -> int: ...
    @property
    def parked_writer(self) -> int: ...
    def close(self) -> None: ...

def decode_frames(stream: Any, oob: list[Any] | None = ..., arena: Any = ...) -> Any: ...
def decode_stream(file: Any, nbytes: int) -> Any: ...
