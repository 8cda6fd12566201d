"""The shared-memory tensor arena's Python surface: sizing, the
``ArenaWriter`` and ``ArenaReader`` ends (``ShmTensorArena`` makes either),
and the per-process registry of attached arenas.  The mechanism is in
Cython: the layout, flags and lifetimes in ``fastmq._arena``, the copy and
the descriptors in ``fastmq._arena_writer``, mapping and releases in
``fastmq._arena_reader``; how a queue uses it is in ``fastmq.queue``.

The design is explained in docs/design.md, section "Tensor arena".

On by default for queues whose readers are all on this node; off with
``FASTMQ_ARENA=0`` or ``MessageQueue(..., enable_shm_tensor_arena=False)``.
Sizing, each from a keyword argument of ``MessageQueue``, else the
environment, else the default:

======================  =============================  ===========  ========================
keyword                 environment                    default      meaning
======================  =============================  ===========  ========================
``arena_slots``         ``FASTMQ_ARENA_SLOTS``         8            large buffers in flight
``arena_slot_mb``       ``FASTMQ_ARENA_SLOT_MB``       256          largest buffer in a slot
``arena_min_mb``        ``FASTMQ_ARENA_MIN_MB``        8            smallest buffer in a slot
``arena_prefault``      ``FASTMQ_ARENA_PREFAULT``      ahead        ahead / off / all / N slots
``arena_copy_threads``  ``FASTMQ_ARENA_COPY_THREADS``  cpus/2, 2-4  threads of one large copy
``arena_readers``       ``FASTMQ_ARENA_READERS``       isolated     isolated / shared
======================  =============================  ===========  ========================

``ahead``: the first slot's first ``FASTMQ_WARM_MB`` (16) at creation, and
after a copy into cold pages (or the first buffer), the slot the next buffer
would take gets twice as many pages populated in the background (a larger
buffer than any before then takes that slot), by a thread that runs only on
an otherwise idle core (``SCHED_IDLE``; never whole slots); ``all`` or
``N``: whole slots at creation.  Inside vLLM on a CUDA platform the
scheduler broadcast's readers default to ``shared`` (``fastmq.vllm``).

Readers adopt the writer's geometry from ``Handle.tensor_arena_handle`` and
the reader mode from the arena's header.  ``isolated``: each reader maps
the slots copy-on-write, so an in-place write to a received tensor is
private to that reader (its pages are copied on the first write and
dropped when the slot is released).  ``shared``: readers map the slots
shared and writable, which skips those copies and lets a CUDA reader
page-lock the arena, but one reader's in-place write changes what every
other reader, later messages' readers included, and the writer see.
"""
from __future__ import annotations

import logging
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from fastmq import _config, _cuda, segments
from fastmq._config import default_copy_threads
from fastmq._arena import ArenaError, SlotBuffer, is_descriptor, layout
from fastmq._arena_reader import ArenaReaderEnd
from fastmq._arena_writer import ArenaWriterEnd

logger = logging.getLogger("fastmq")

MiB = 1 << 20
PAGE = 4096
DEFAULT_SLOTS = 8
DEFAULT_SLOT_MB = 256.0
DEFAULT_MIN_MB = 8.0
# A copy is split across threads only in parts of at least this size: below
# it, creating a thread costs more than the memory bandwidth it adds.
COPY_MIN_PART = 4 * MiB
PREFAULT_MODES = ("ahead", "off", "all")
READER_MODES = ("isolated", "shared")

OPTION_NAMES = ("arena_slots", "arena_slot_mb", "arena_min_mb", "arena_prefault",
                "arena_copy_threads", "arena_readers")


# -- sizing ------------------------------------------------------------------
@dataclass(frozen=True)
class ArenaSizing:
    n_slots: int
    slot_bytes: int
    min_bytes: int
    prefault: str | int
    copy_threads: int
    readers: str = "isolated"


def _int_option(options: dict, key: str, env: str, default: int, minimum: int) -> int:
    if key in options and options[key] is not None:
        v = options[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{key}={v!r} must be an integer of at least {minimum}")
        return v
    return _config.env_int(env, default, minimum=minimum)


def _mb_option(options: dict, key: str, env: str, default: float, positive: bool) -> float:
    if key in options and options[key] is not None:
        v = options[key]
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
              and (v > 0 if positive else v >= 0))
        if not ok:
            raise ValueError(f"{key}={v!r} must be a {'positive' if positive else 'non-negative'} "
                             "number of MiB")
        return float(v)
    v = _config.env_float(env, default, minimum=0.0)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{env}={os.environ.get(env)!r} must be a "
                         f"{'positive' if positive else 'non-negative'} finite number of MiB")
    return v


def _prefault_option(options: dict) -> str | int:
    if "arena_prefault" in options and options["arena_prefault"] is not None:
        raw, name = options["arena_prefault"], "arena_prefault"
    else:
        raw, name = os.environ.get("FASTMQ_ARENA_PREFAULT"), "FASTMQ_ARENA_PREFAULT"
        if raw is None or raw.strip() == "":
            return "ahead"
    if isinstance(raw, bool):
        raise ValueError(f"{name}={raw!r} must be one of {PREFAULT_MODES} or a slot count")
    if isinstance(raw, int):
        value: Any = raw
    else:
        value = str(raw).strip().lower()
        if value not in PREFAULT_MODES:
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"{name}={raw!r} must be one of {PREFAULT_MODES} or a "
                                 "slot count") from None
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    return value


def _readers_option(options: dict) -> str:
    if "arena_readers" in options and options["arena_readers"] is not None:
        raw, name = options["arena_readers"], "arena_readers"
    else:
        raw, name = os.environ.get("FASTMQ_ARENA_READERS"), "FASTMQ_ARENA_READERS"
        if raw is None or raw.strip() == "":
            return "isolated"
    value = raw.strip().lower() if isinstance(raw, str) else raw
    if value not in READER_MODES:
        raise ValueError(f"{name}={raw!r} must be one of {READER_MODES}")
    return value


def sizing(options: dict | None = None) -> ArenaSizing:
    """Resolve the arena's geometry: keyword arguments, then environment,
    then defaults.  A bad value raises ``ValueError`` naming its source; an
    unknown keyword raises ``TypeError``."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unexpected arguments {unknown} (arena options are {list(OPTION_NAMES)})")
    n_slots = _int_option(options, "arena_slots", "FASTMQ_ARENA_SLOTS", DEFAULT_SLOTS, 1)
    if n_slots > 65536:
        raise ValueError(f"arena slot count {n_slots} is above the limit of 65536")
    slot_mb = _mb_option(options, "arena_slot_mb", "FASTMQ_ARENA_SLOT_MB", DEFAULT_SLOT_MB, True)
    min_mb = _mb_option(options, "arena_min_mb", "FASTMQ_ARENA_MIN_MB", DEFAULT_MIN_MB, False)
    copy_threads = _int_option(options, "arena_copy_threads", "FASTMQ_ARENA_COPY_THREADS",
                               default_copy_threads(), 1)
    slot_bytes = -(-int(math.ceil(slot_mb * MiB)) // PAGE) * PAGE   # whole pages
    return ArenaSizing(n_slots=n_slots, slot_bytes=slot_bytes,
                       min_bytes=max(1, int(min_mb * MiB)),
                       prefault=_prefault_option(options),
                       copy_threads=min(copy_threads, 16),
                       readers=_readers_option(options))


def wanted(enable: Any) -> tuple[bool, bool]:
    """(on, explicitly requested) from the constructor argument and
    ``FASTMQ_ARENA``.  ``False`` or ``FASTMQ_ARENA=0`` turns it off (the
    variable wins over ``True``: it is the operator's switch)."""
    env_on = _config.env_bool("FASTMQ_ARENA", True)
    raw = os.environ.get("FASTMQ_ARENA", "").strip()
    if (enable is not None and not enable) or not env_on:
        return False, False
    return True, bool(enable) or raw != ""


# -- registry ------------------------------------------------------------------
# Reader ends attached in this process, by segment name.  Weak: an entry
# disappears with the last reference to that end (its queue and any view
# over its slots), with no removal needed on shutdown(), which may run on a
# different thread than an in-flight dequeue().
_ARENAS: "weakref.WeakValueDictionary[str, ArenaReader]" = weakref.WeakValueDictionary()
# Why an arena named in a handle could not be attached here (deferred: the
# queue still works; a message that uses the arena then raises this).
_ATTACH_ERRORS: dict[str, str] = {}


def attached(name: str) -> "ArenaReader | None":
    """The reader end of arena ``name`` attached in this process, if any."""
    return _ARENAS.get(name)


def attach_error(name: str) -> str | None:
    return _ATTACH_ERRORS.get(name)


# -- ends ------------------------------------------------------------------------
def _close_writer(core: ArenaWriterEnd) -> None:
    # The mapping and descriptor go with the last reference to the core
    # (the encoder, a writer-side view); the memory once the readers'
    # mappings have gone too.
    core.close()


class ShmTensorArena:
    """One process's end of a tensor arena (vLLM's ``ShmTensorArena``
    surface): an ``ArenaWriter`` or an ``ArenaReader``.

    ``ShmTensorArena(n_reader, slot_bytes, n_slots)`` creates an arena and
    returns its ``ArenaWriter`` (``readers="shared"`` lets readers write
    each other's tensors, see the module docstring); with ``name`` and
    ``reader_rank`` it attaches and returns ``ArenaReader`` ``reader_rank``.
    Either holds its Cython end (the mapping and flags) as ``core``: an
    ``ArenaWriterEnd`` or an ``ArenaReaderEnd``.
    """

    is_creator: bool
    core: ArenaWriterEnd | ArenaReaderEnd
    name: str
    n_reader: int
    slot_bytes: int
    n_slots: int
    reader_rank: int
    readers: str

    def __new__(cls, n_reader: int, slot_bytes: int = int(DEFAULT_SLOT_MB * MiB),
                n_slots: int = DEFAULT_SLOTS, name: str | None = None, reader_rank: int = -1,
                *, min_bytes: int = int(DEFAULT_MIN_MB * MiB), prefault: str | int = "ahead",
                copy_threads: int | None = None, readers: str = "isolated"):
        role = ArenaWriter if name is None else ArenaReader
        if not issubclass(role, cls):
            raise TypeError(f"{cls.__name__}(..., name={name!r}) would be an {role.__name__}")
        if name is None:
            return ArenaWriter._create(n_reader, slot_bytes, n_slots, min_bytes=min_bytes,
                                       prefault=prefault, copy_threads=copy_threads,
                                       readers=readers)
        return ArenaReader._attach(name, n_reader, slot_bytes, n_slots, reader_rank)

    # No __init__: the object is complete when __new__ returns it, and
    # object.__init__ ignores the constructor's arguments.

    def _set_end(self, core: ArenaWriterEnd | ArenaReaderEnd, name: str, n_reader: int,
                 slot_bytes: int, n_slots: int, reader_rank: int) -> None:
        self.n_reader = n_reader
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.reader_rank = reader_rank
        self.core = core
        # The segment's locator: what a handle carries, what a reader
        # attaches with and the key of this process's attached arenas.
        self.name = name
        self.readers = "isolated" if core.isolated else "shared"

    def handle(self) -> tuple[int, int, int, str]:
        """What readers attach with: ``(n_reader, slot_bytes, n_slots, name)``."""
        return (self.n_reader, self.slot_bytes, self.n_slots, self.name)

    def stats(self) -> dict:
        return self.core.stats()

    @property
    def address(self) -> int:
        return self.core.address

    @property
    def total_bytes(self) -> int:
        return self.core.total_bytes

    def contains(self, address: int) -> bool:
        """True if ``address`` lies inside this process's mapping of the slots."""
        start = self.core.data_address
        return start <= address < start + self.slot_bytes * self.n_slots

    def __repr__(self) -> str:
        role = "writer" if self.is_creator else f"reader {self.reader_rank}"
        return (f"<ShmTensorArena {self.name!r} {role} {self.n_slots} x "
                f"{self.slot_bytes / MiB:g} MiB, readers {self.readers}>")


class ArenaWriter(ShmTensorArena):
    """The writer's end: creates the segment, copies large buffers into
    slots while a message is pickled, and lets go of the segment when
    closed or collected."""

    is_creator = True

    @classmethod
    def _create(cls, n_reader: int, slot_bytes: int, n_slots: int, *, min_bytes: int,
                prefault: str | int, copy_threads: int | None, readers: str) -> "ArenaWriter":
        if prefault not in PREFAULT_MODES and not (isinstance(prefault, int) and prefault >= 0):
            raise ValueError(f"prefault={prefault!r} must be one of {PREFAULT_MODES} or a "
                             "slot count")
        if readers not in READER_MODES:
            raise ValueError(f"readers={readers!r} must be one of {READER_MODES}")
        warm = _config.warm_bytes() if prefault == "ahead" else 0
        total = layout(n_reader, n_slots, slot_bytes)[3]
        # Its pages are allocated as slots are first used (pre-faulted), so
        # creating it takes no memory.
        seg = segments.create_segment("arena", total)
        try:
            core = ArenaWriterEnd.create(seg, n_reader, n_slots, slot_bytes, min_bytes,
                                         copy_threads or default_copy_threads(), COPY_MIN_PART,
                                         prefault != "off", readers == "shared")
        except BaseException:
            seg.close()
            raise
        self = object.__new__(cls)
        self._set_end(core, seg.locator, n_reader, slot_bytes, n_slots, -1)
        self.min_bytes = core.min_bytes
        self._finalizer = weakref.finalize(self, _close_writer, core)
        if prefault == "all":
            core.prefault(range(n_slots))
        elif isinstance(prefault, int) and prefault > 0:
            core.prefault(range(min(prefault, n_slots)))
        elif warm:
            core.warm_first(warm)
        return self

    # The pickler calls these per object and per buffer: they hand out the
    # core's bound methods, so no Python frame sits on that path.
    @property
    def reducer_override(self) -> Callable[[Any], Any]:
        """The pickler's ``reducer_override`` (see ``ArenaWriterEnd.reducer_override``)."""
        return self.core.reducer_override

    @property
    def copy_to_slot(self) -> Callable[[Any], "bytes | None"]:
        """``copy_to_slot(buf)``: copies a large ``PickleBuffer`` into a free
        slot and returns its slot descriptor, or None (the buffer takes the
        normal path)."""
        return self.core.copy_to_slot

    # Once per message: the queue's writer takes these bound methods once.
    @property
    def commit(self) -> Callable[[], None]:
        """``commit()`` after a message is sent: its slots stay with the readers."""
        return self.core.commit

    @property
    def abort(self) -> Callable[[], None]:
        """``abort()`` when a message is not sent: its slots are free again."""
        return self.core.abort

    def reserve(self, nbytes: int) -> SlotBuffer | None:
        """A writable ``SlotBuffer`` of ``nbytes`` in a free slot, or None."""
        return self.core.reserve(nbytes)

    def empty_tensor(self, shape, dtype=None):
        """An uninitialised CPU tensor inside a free slot (sending it copies
        nothing), or None if no slot is free or it does not fit one.  Do not
        modify it after sending it until the readers are done with it: they
        read this very memory."""
        import torch

        if dtype is None:
            dtype = torch.get_default_dtype()
        size = torch.Size((shape,) if isinstance(shape, int) else shape)
        nbytes = size.numel() * dtype.itemsize
        buf = self.core.reserve(nbytes)
        if buf is None:
            return None
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(size)

    def close(self) -> None:
        """Stop background work and refuse new buffers now (also done when
        this object is collected); the memory goes with the last mapping."""
        self._finalizer()


class ArenaReader(ShmTensorArena):
    """A reader's end: maps the slots and turns the slot descriptors of a
    received message into views of them."""

    is_creator = False

    @classmethod
    def _attach(cls, name: str, n_reader: int, slot_bytes: int, n_slots: int,
                reader_rank: int) -> "ArenaReader":
        core = ArenaReaderEnd.attach(name, n_reader, slot_bytes, n_slots, reader_rank)
        core.set_cuda_source(_cuda)
        self = object.__new__(cls)
        self._set_end(core, name, n_reader, slot_bytes, n_slots, reader_rank)
        _ARENAS[name] = self
        _ATTACH_ERRORS.pop(name, None)
        return self

    # Once per message: the queue's reader takes these bound methods once.
    @property
    def map_oob(self) -> Callable[[list], list]:
        """``map_oob(oob)``: a received message's out-of-band list with each
        slot descriptor replaced by a ``SlotBuffer`` over its slot;
        ``ArenaError`` for a stale or forged one."""
        return self.core.map_oob

    @property
    def flush_releases(self) -> Callable[[], None]:
        """``flush_releases()``: hand back slots whose last view died
        (CUDA-event gated where this process pinned the arena)."""
        return self.core.flush_releases

    def close(self) -> None:
        self.core.close()


class MissingArenaReader:
    """The reader end of an arena named in a handle that this reader could
    not attach: the queue keeps working, and only a message that actually
    uses the arena raises, with the original reason (vLLM defers it the
    same way)."""

    def __init__(self, name: str, error: BaseException):
        self.name = name
        self.error = f"{type(error).__name__}: {error}"
        _ATTACH_ERRORS[name] = self.error

    def map_oob(self, oob: list) -> list:
        for b in oob:
            if is_descriptor(b):
                raise ArenaError(f"message uses tensor arena {self.name!r}, which this reader "
                                 f"could not attach ({self.error})")
        return oob

    def flush_releases(self) -> None:
        pass

    def stats(self) -> dict:
        return {"arena_attached": 0}

    def close(self) -> None:
        pass


# -- queue integration -----------------------------------------------------------
def create_for_queue(enable: Any, options: dict, n_local_reader: int,
                     n_remote_reader: int) -> "ArenaWriter | None":
    """The writer's arena for a new ``MessageQueue``, or None: off, no local
    readers, or a remote reader (it receives pickled bytes over TCP and
    could not map slots).  Options are validated even when the arena is off.
    A default-on arena that cannot be created is skipped with a warning; an
    explicitly requested one raises."""
    size = sizing(options)
    on, explicit = wanted(enable)
    if not on or n_local_reader == 0 or n_remote_reader > 0:
        return None
    try:
        return ShmTensorArena(n_local_reader, size.slot_bytes, size.n_slots,
                              min_bytes=size.min_bytes, prefault=size.prefault,
                              copy_threads=size.copy_threads, readers=size.readers)
    except OSError as e:
        if explicit:
            raise
        # str(e), not e: a record holding the exception would keep its
        # frames (and through them the caller's objects) alive.
        logger.warning("fastmq: this queue runs without a tensor arena: %s", str(e))
        return None


def attach_for_queue(handle: Any,
                     reader_rank: int) -> "ArenaReader | MissingArenaReader | None":
    ah = getattr(handle, "tensor_arena_handle", None)
    if ah is None:
        return None
    name = ah[3] if isinstance(ah, tuple) and len(ah) == 4 else repr(ah)
    try:
        if not (isinstance(ah, tuple) and len(ah) == 4):
            raise ArenaError(f"tensor_arena_handle {ah!r} is not (n_reader, slot_bytes, "
                             "n_slots, name)")
        n_reader, slot_bytes, n_slots, name = ah
        return ShmTensorArena(n_reader, slot_bytes, n_slots, name=name, reader_rank=reader_rank)
    except Exception as e:
        logger.warning("fastmq: reader %d cannot attach tensor arena %s (%s: %s); messages "
                       "that use it will fail", reader_rank, name, type(e).__name__, str(e))
        return MissingArenaReader(name, e)


__all__ = ["ShmTensorArena", "ArenaWriter", "ArenaReader", "MissingArenaReader", "ArenaError",
           "SlotBuffer", "ArenaSizing", "sizing", "wanted", "attached",
           "attach_error", "create_for_queue", "attach_for_queue", "is_descriptor"]
