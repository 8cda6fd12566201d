from typing import Any

from fastmq._segment import Segment

MAGIC: int
DESC_MAGIC: int
LAYOUT_VERSION: int
READERS_ISOLATED: int
READERS_SHARED: int
DESC_LEN: int
PAGE: int
DATA_ALIGN: int

class ArenaError(RuntimeError): ...

def layout(n_reader: int, n_slots: int, slot_bytes: int) -> tuple[int, int, int, int]: ...
def is_descriptor(obj: Any) -> bool: ...

class ArenaEnd:
    """One process's end of an arena segment: its mapping, geometry and flag
    lines (the base of ``ArenaWriterEnd`` and ``ArenaReaderEnd``)."""

    name: str
    segment: Segment
    n_reader: int
    n_slots: int
    slot_bytes: int
    total_bytes: int
    flags_off: int
    data_off: int
    token: int
    closed: bool
    isolated: bool
    @property
    def address(self) -> int: ...
    @property
    def data_address(self) -> int: ...
    def slot_state(self, slot: int) -> tuple[int, int, list[int]]: ...
    def free_slots(self) -> list[int]: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, int]: ...

class SlotBuffer:
    """A writable view of (part of) one arena slot; releases it when freed."""

    nbytes: int
    slot: int
    def __len__(self) -> int: ...
    @property
    def address(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...
