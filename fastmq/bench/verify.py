"""What readers check so that a fast wrong answer cannot win: message
numbers, payload bytes and whole-tensor checksums.

Payloads are derived from their size only, so the writer and every reader
build the same bytes independently; each message also carries its number,
stamped into the payload, so a stale or repeated chunk is caught too.
"""
from __future__ import annotations

import functools
import random

import numpy as np

MASK64 = (1 << 64) - 1


class VerifyError(AssertionError):
    """A reader received something other than what the writer sent."""


@functools.lru_cache(maxsize=64)
def pattern(size: int) -> bytes:
    """``size`` pseudo-random bytes, the same in every process."""
    return random.Random(size).randbytes(size)


def stamp(seq: int) -> bytes:
    return seq.to_bytes(8, "little")


def step_payload(seq: int, size: int) -> bytes:
    """The payload of step message ``seq``: its number, then fixed bytes."""
    return stamp(seq) + pattern(size - 8)


def check_step_payload(seq: int, payload) -> None:
    size = len(payload)
    if size < 8:
        raise VerifyError(f"message {seq}: payload of {size} bytes is too short")
    # startswith/endswith compare in place (memcmp): every byte is checked
    # without copying the payload.
    if not payload.startswith(stamp(seq)):
        got = int.from_bytes(bytes(payload[:8]), "little")
        raise VerifyError(f"message {seq}: payload is stamped {got} (stale or mixed-up data)")
    if not payload.endswith(pattern(size - 8)):
        raise VerifyError(f"message {seq}: the {size}-byte payload differs from what was sent")


def expect_seq(expected: int, got) -> None:
    if got == expected:
        return
    if isinstance(got, int) and got > expected:
        raise VerifyError(f"expected message {expected} but received {got}: "
                          f"{got - expected} message(s) lost")
    raise VerifyError(f"expected message {expected} but received {got!r} "
                      "(duplicated or out of order)")


def checksum(obj) -> int:
    """Wrapping 64-bit sum of every byte-octet of a tensor or buffer; reads
    every byte (this is the readers' "read every byte" work)."""
    if hasattr(obj, "numpy") and hasattr(obj, "element_size"):  # torch.Tensor
        if not obj.is_contiguous():
            raise VerifyError("received a non-contiguous tensor")
        import torch

        arr = obj.reshape(-1).view(torch.uint8).numpy()
    else:
        arr = np.frombuffer(obj, dtype=np.uint8)
    n8 = arr.size - arr.size % 8
    total = int(arr[:n8].view(np.uint64).sum(dtype=np.uint64))
    if n8 < arr.size:
        total += int(arr[n8:].sum(dtype=np.uint64))
    return total & MASK64


def tensor_expected(n_elem: int, seq: int) -> int:
    """Checksum of ``arange(n_elem)`` (int64) with ``seq`` added to its first
    and last element, as the tensor scenario sends it."""
    return (n_elem * (n_elem - 1) // 2 + 2 * seq) & MASK64
