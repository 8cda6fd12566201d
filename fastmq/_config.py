"""Environment knobs, parsed in one place so a bad value names its variable."""
from __future__ import annotations

import os

WAIT_MODES = {"spin": 0, "futex": 1, "zmq": 2}


# Beyond any count or MiB figure a machine holds, and small enough that
# what is computed from it (bytes, nanoseconds) fits the C integers it goes
# into: a larger value is refused here, naming its variable, instead of an
# OverflowError deep inside.
ENV_INT_MAX = (1 << 31) - 1
ENV_FLOAT_MAX = 1e9


def env_int(name: str, default: int | None, minimum: int = 0) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    if value > ENV_INT_MAX:
        raise ValueError(f"{name}={raw!r} is out of range (at most {ENV_INT_MAX})")
    return value


def env_float(name: str, default: float | None, minimum: float = 0.0) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value >= minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    if not value <= ENV_FLOAT_MAX:
        raise ValueError(f"{name}={raw!r} is out of range (a finite number, at most "
                         f"{ENV_FLOAT_MAX:g})")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def default_wait_mode() -> str:
    """``FASTMQ_WAIT``; futex where the kernel has it, else zmq."""
    from fastmq._ring import have_futex

    raw = os.environ.get("FASTMQ_WAIT", "").strip().lower()
    if not raw:
        return "futex" if have_futex() else "zmq"
    if raw not in WAIT_MODES:
        raise ValueError(f"FASTMQ_WAIT={raw!r} is not one of {sorted(WAIT_MODES)}")
    if raw == "futex" and not have_futex():
        raise ValueError("FASTMQ_WAIT=futex but this system has no futex support")
    return raw


def wait_mode_code(mode: str | None) -> int:
    if mode is None:
        mode = default_wait_mode()
    if mode not in WAIT_MODES:
        raise ValueError(f"wait_mode={mode!r} is not one of {sorted(WAIT_MODES)}")
    from fastmq._ring import have_futex

    if mode == "futex" and not have_futex():
        raise ValueError("wait_mode='futex' but this system has no futex support")
    return WAIT_MODES[mode]


# How long a reader spins before parking.  Long enough to cover the gap
# between two scheduler steps in a busy pipeline, short enough that an idle
# reader costs well under 1% of a core (one spin per message).
DEFAULT_SPIN_US = 2000


def spin_us(value: float | None) -> float:
    if value is None:
        return env_float("FASTMQ_SPIN_US", DEFAULT_SPIN_US)
    if not 0 <= value <= ENV_FLOAT_MAX:
        raise ValueError(f"spin_us must be a number of microseconds in 0..{ENV_FLOAT_MAX:g}, "
                         f"got {value!r}")
    return value


# Memory a reader keeps to receive the next large frames into (a remote
# reader's, or a message in parts), once the caller dropped the earlier
# ones (fastmq._recv_buffers).  Enough for a
# step's large tensors; what a burst needed beyond it goes back.
DEFAULT_REMOTE_BUFFERS_MB = 512


def default_copy_threads() -> int:
    """Half the CPUs this process may use, at least 2 (where there are
    two), at most 4: the threads of one large copy into the arena, and of
    populating a large fresh receive buffer.  A copy into pages already in
    place is bound by memory bandwidth, which one thread nearly saturates
    on a small VM; fresh pages are bound by the page faults, which two
    threads take at nearly twice the rate (measured on 2 vCPUs: 64 MiB in
    about 30 ms instead of 60); a big host with several memory channels
    needs a few threads, and its readers need cores too."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(min(cpus, 2), min(4, cpus // 2))


# Memory made ready when a queue starts, so that its first large message
# does not wait for the kernel to allocate and zero fresh pages (where
# readers share a core, a large share of that message's time): the arena's
# first slot (the writer's, in the background) and each remote reader's
# first receive buffer (while it connects).  Twice the arena's default
# smallest buffer; what the traffic needs beyond it is populated as it
# comes.
DEFAULT_WARM_MB = 16


def warm_bytes() -> int:
    """``FASTMQ_WARM_MB`` (MiB; 0: none), in bytes."""
    return env_int("FASTMQ_WARM_MB", DEFAULT_WARM_MB) << 20


def remote_buffers_bytes() -> int:
    """``FASTMQ_REMOTE_BUFFERS_MB`` (MiB; 0 keeps none), in bytes."""
    return env_int("FASTMQ_REMOTE_BUFFERS_MB", DEFAULT_REMOTE_BUFFERS_MB) << 20


def warning_interval() -> float:
    """vLLM's ``VLLM_RINGBUFFER_WARNING_INTERVAL`` (seconds, default 60)."""
    return env_float("VLLM_RINGBUFFER_WARNING_INTERVAL", 60.0)


# vLLM's text for a wait longer than warning_interval(); fastmq appends who
# it is waiting for.
LONG_WAIT_TIME_LOG_MSG = (
    "No available shared memory broadcast block found "
    "in %d seconds. This typically happens "
    "when some processes are hanging or doing some "
    "time-consuming work (e.g. compilation, "
    "weight/kv cache quantization)."
)


def ring_geometry(max_chunk_bytes: int, max_chunks: int) -> tuple[int, int]:
    """A new ring's chunk size and count: ``FASTMQ_MAX_CHUNK_MB`` and
    ``FASTMQ_MAX_CHUNKS`` override the arguments."""
    mb = env_int("FASTMQ_MAX_CHUNK_MB", None, minimum=1)
    n = env_int("FASTMQ_MAX_CHUNKS", None, minimum=1)
    return (mb << 20 if mb is not None else max_chunk_bytes,
            n if n is not None else max_chunks)


# How long a remote peer may stay silent (no byte, no heartbeat, no TCP
# acknowledgement) before it is declared gone: its node died, or the link
# or a firewall drops everything, and no FIN or reset will ever come.
# Long enough for a busy process's heartbeat thread to get the GIL, short
# enough that a vLLM node whose engine's node died ends by itself.
DEFAULT_PEER_TIMEOUT_S = 10.0
MIN_PEER_TIMEOUT_S = 1.0    # TCP's keepalive timers count whole seconds


def peer_timeout_s() -> float:
    """``FASTMQ_PEER_TIMEOUT_S``: seconds of silence after which a remote
    peer is declared gone (at least 1)."""
    return env_float("FASTMQ_PEER_TIMEOUT_S", DEFAULT_PEER_TIMEOUT_S,
                     minimum=MIN_PEER_TIMEOUT_S)
