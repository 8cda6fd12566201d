from typing import Iterable

from fastmq._segment import Segment

class SlotPages:
    """The populated pages of an arena's slots, for its writer: the memory
    check before new pages, and the background pre-fault."""

    n_prefaulted: int
    n_nomem: int
    def __init__(self, segment: Segment, name: str, n_slots: int, slot_bytes: int,
                 data_off: int) -> None: ...
    def faulted_bytes(self, slot: int) -> int: ...
    def prefault(self, slots: Iterable[int], upto: int | None = ...) -> None: ...
    def idle(self) -> bool: ...
