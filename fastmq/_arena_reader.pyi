from typing import Any

from fastmq._arena import ArenaEnd

def set_cow_scan(enabled: bool) -> bool: ...
def cow_scan_available() -> bool: ...

class ArenaReaderEnd(ArenaEnd):
    """A reader's end of an arena segment: maps the slots and turns slot
    descriptors into views of them."""

    reader_rank: int
    owner_pid: int
    pinned: bool
    @staticmethod
    def attach(name: str, n_reader: int, slot_bytes: int, n_slots: int,
               reader_rank: int) -> ArenaReaderEnd: ...
    def reader_refs(self, slot: int) -> int: ...
    def map_oob(self, oob: list[Any]) -> list[Any]: ...
    def flush_releases(self) -> None: ...
