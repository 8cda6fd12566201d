"""``tensor``: a large CPU tensor broadcast, every reader checksums every byte."""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext

import numpy as np

from fastmq.bench import impls as impls_mod
from fastmq.bench.config import MiB, tensor_reps_at
from fastmq.bench.harness import (BenchError, VerifyError, attached, bench_segment, checksum,
                                  groups, list_checksum, record, serve, tensor_expected)
from fastmq.bench.scenario import Line, Scenario, num, ratio, spread
from fastmq.shm_usage import held_bytes

NAME = "tensor"


def _notes(rs, records) -> list[str]:
    names = {r["impl"] for r in rs}
    return ["paths: +arena = the tensor arena (one copy into shared memory, readers map "
            "it); fastmq-futex / vllm without it: vLLM takes the ring for a message that "
            "fits a ring chunk (24 MiB by default); fastmq sends one of 4 MiB or more with "
            "large buffers in parts through the ring (4 to 8 MiB parts) when every reader is "
            "waiting for it (the readers, having answered the last message, are back in "
            "dequeue() within microseconds), else one chunk if it fits; a larger one, as vLLM always does, over the overflow path (the chunk "
            "marks the message, the payload goes over the ipc socket); +bytes: the same "
            "bytes as one "
            "bytes object, pickled in-band (no out-of-band buffer, no arena); +list: the same "
            f"bytes as a list of {impls_mod.LIST_ITEM}-byte bytes objects, pickled in-band "
            "(each reader sums its words in place, about a MiB at a time: no copy of the "
            "whole list). Readers receive as vLLM's workers do, with dequeue(indefinite=True): "
            "no deadline, so fastmq unpickles a large in-band list as it arrives (the ring's "
            "parts, a remote message's segments).",
            *impls_mod.remote_notes(names),
            *(["floor: one single-threaded memcpy into a pre-faulted shared segment plus "
               "every reader's read of every byte."] if "floor" in names else []),
            f"p50/min/max after {rs[0]['warmup']} warm-up messages per run, over "
            "the counted ones (16 MiB: four times as many as from 64 MiB up); first ms = "
            "the first message of a size (it also touches fresh pages): per run, the median "
            f"over {rs[0].get('first_queues', 1)} fresh queue(s), the measured one and "
            "others that send one message of each size, sizes rising; shm held = the shared "
            "memory the ring and arena hold after all sizes (fastmq.shm_usage)."]


_PATHS = (("arena", "fastmq-futex+arena", "vllm+arena"), ("arena off", "fastmq-futex", "vllm"),
          ("remote (TCP)", "fastmq-remote", "vllm-remote"),
          ("remote (TCP), +encrypt", "fastmq-remote+encrypt", "vllm-remote"),
          ("remote (TCP), +plain", "fastmq-remote+plain", "vllm-remote"),
          ("remote both ways", "fastmq-remote-both", "vllm-remote-both"),
          ("in-band bytes", "fastmq-futex+bytes", "vllm+bytes"),
          ("in-band bytes, remote (TCP)", "fastmq-remote+bytes", "vllm-remote+bytes"),
          ("in-band list", "fastmq-futex+list", "vllm+list"),
          ("in-band list, remote (TCP)", "fastmq-remote+list", "vllm-remote+list"))

SPEC = Scenario(
    NAME, "tensor: CPU tensor broadcast, every reader reads every byte; milliseconds per "
    "message (enqueue to the last reader's answer)",
    # Remote both ways adds only the small answers' TCP hop: the default security is
    # enough to show it.
    rows={"fastmq-futex+arena": "vllm+arena", "vllm+arena": None, "fastmq-futex": "vllm",
          "vllm": None, **{k: v for k, v in impls_mod.REMOTE_ROWS.items() if "-both+" not in k},
          "fastmq-futex+bytes": "vllm+bytes", "vllm+bytes": None,
          "fastmq-remote+bytes": "vllm-remote+bytes", "vllm-remote+bytes": None,
          "fastmq-futex+list": "vllm+list", "vllm+list": None,
          "fastmq-remote+list": "vllm-remote+list", "vllm-remote+list": None, "floor": "vllm"},
    columns=(("{p50} ms", lambda r: num(r["p50"])), ("runs' p50", spread),
             ("min ms", lambda r: num(r["min"])), ("max ms", lambda r: num(r["max"])),
             ("GB/s", lambda r: num(r["size_bytes"] / r["p50"] / 1e6 if r["p50"] else None)),
             ("vs vLLM", lambda r: ratio(r.get("vs_vllm"))),
             ("vs floor", lambda r: ratio(r.get("vs_floor"))),
             ("first ms", lambda r: num(r.get("first_ms"))),
             ("shm held MiB", lambda r: num(r.get("held_mib"))),
             ("messages", lambda r: str(r["samples"]))),
    floor="floor", size_header="tensor",
    # The arenas may copy with several threads; the floor's copy is one
    # memcpy on one thread.
    bounds={"floor": lambda i: not i.endswith("+arena") and not i.startswith("floor")},
    summary=(Line("large tensor through the arena, every reader reads every byte",
                  "fastmq-futex+arena", "vllm+arena", unit="ms", readme=True),),
    summary_size=64 * MiB, needs_torch=True, notes=_notes,
    grids=(("large tensors, every reader reads every byte: p50 ms, vLLM / fastmq on the "
            "same path", "arena off: vLLM sends a message that fits a ring chunk (24 MiB by "
            "default) in one, fastmq one of 4 MiB or more with large buffers in parts through the "
            "ring's chunks "
            "(the readers copy one out while the writer copies the next in); larger ones go "
            "in parts or over the overflow path (ipc socket); remote: TCP over "
            "{link} (remote both ways: the answers too), with fastmq's default security (a "
            "keyed MAC on every message), +encrypt (AES-GCM) or +plain (unauthenticated); "
            "vLLM's remote path is plain TCP.", "vLLM / fastmq ms = ratio",
            _PATHS + (("floor (one memcpy, every reader's read)", "floor", None),)),
           ("large tensors on first use: the first message of each size on a fresh queue "
            "(it also touches fresh pages), ms, vLLM / fastmq on the same path", "The same "
            "paths as above; sizes in rising order on one queue, so each size's first "
            "message is larger than any before it; per run, the median over fresh queues "
            "(the measured queue, after the smaller sizes' messages, and others that send "
            "one message of each size). The clock starts once every reader is ready: fastmq "
            "made FASTMQ_WARM_MB (16 MiB by default) of pages ready as the queue started (the "
            "arena's first slot, each remote reader's first receive buffer), vLLM none.",
            "vLLM / fastmq ms = ratio", _PATHS, "first_ms"),
           ("what the remote path's security costs on large tensors: p50 ms, +plain "
            "(unauthenticated TCP) / secured, same shape", "TCP over {link}; default "
            "security: a keyed MAC (GMAC) on every message, computed by the writer and "
            "checked by each reader; +encrypt: AES-GCM. Below 1x: what the security costs.",
            "plain / secured ms = ratio",
            (("remote (TCP), default security", "fastmq-remote", "fastmq-remote+plain"),
             ("remote (TCP), +encrypt", "fastmq-remote+encrypt", "fastmq-remote+plain")))))


def run(env, impls, params, progress) -> list[dict]:
    import torch

    def send(g, put, t, seq: int) -> float:
        """``t`` (arange, marked with ``seq``) as one message, checked at every
        reader: its ns."""
        n_elem = t.numel()
        size = n_elem * 8
        t[0], t[-1] = seq, n_elem - 1 + seq
        total = tensor_expected(n_elem, seq)
        msg, copy_ns = put(t) if put else (_payload(t, g.impl.payload), 0)
        dt, acks = g.round_trip(("tensor", seq, msg), free=2)
        for r, a in enumerate(acks):
            if a[3:] != (total, size):
                raise BenchError(
                    f"{g.where}: reader {r} read {a[4]} bytes with checksum {a[3]:#x} from "
                    f"tensor message {seq}; the writer sent {size} bytes with checksum "
                    f"{total:#x}: the tensor it received differs from what was sent")
        t[0], t[-1] = 0, n_elem - 1
        return dt + copy_ns  # the floor's one copy is part of its time

    def floor_or_not(g):
        if g.impl.family == "floor":
            return floor_buffer(max(params.tensor_sizes))
        return nullcontext()

    def measure(g):
        out, seq = [], 0
        with floor_or_not(g) as put:
            for size in params.tensor_sizes:
                samples, first = [], None
                t = torch.arange(size // 8, dtype=torch.int64)
                for rep in range(params.tensor_warmup + tensor_reps_at(params, size)):
                    seq += 1
                    dt = send(g, put, t, seq)
                    first = dt if first is None else first
                    if rep >= params.tensor_warmup:
                        samples.append(dt)
                del t
                out.append(record(
                    NAME, g.impl.name, g.n, size, "ms", env, samples, 1e6,
                    warmup=params.tensor_warmup, first_ms=[first / 1e6],
                    arena_active=getattr(g.mq, "tensor_arena", None) is not None))
        held = None if g.impl.family == "floor" else held_bytes(g.mq)["total"] / MiB
        return [dict(r, held_mib=held) for r in out]

    def first_use(g):
        # A fresh queue's first message of each size, sizes rising, nothing else.
        out = []
        with floor_or_not(g) as put:
            for seq, size in enumerate(params.tensor_sizes, 1):
                dt = send(g, put, torch.arange(size // 8, dtype=torch.int64), seq)
                out.append({"impl": g.impl.name, "n_readers": g.n, "size_bytes": size,
                            "first_ms": dt / 1e6})
        return out

    def key(r):
        return r["impl"], r["n_readers"], r["size_bytes"]

    out = groups(env, impls, params, progress, NAME, measure)
    by_key = {key(r): r for r in out}
    for q in range(1, params.tensor_first_queues):
        for f in groups(env, impls, params, progress, NAME, first_use,
                        label=f" (first use, fresh queue {q + 1})"):
            by_key[key(f)]["first_ms"].append(f["first_ms"])
    for r in out:
        r["first_ms"] = statistics.median(r["first_ms"])
        r["first_queues"] = params.tensor_first_queues
    return out


def _payload(t, kind: str):
    """The message body of an implementation's payload kind (built untimed)."""
    if kind == "tensor":
        return t
    data = t.numpy().tobytes()
    if kind == "bytes":
        return data
    step = impls_mod.LIST_ITEM
    return [data[i:i + step] for i in range(0, len(data), step)]


@contextmanager
def floor_buffer(capacity: int):
    """The floor: one memcpy into a pre-faulted segment that readers view in place (the
    small message naming it goes through fastmq's ring). Yields ``put(tensor)``: that
    message, and the copy's time."""
    with bench_segment(capacity) as seg:
        view = np.frombuffer(seg, dtype=np.uint8)
        view.fill(0)  # pre-faulted: the floor is the copy, not tmpfs allocating pages

        def put(t) -> tuple:
            t0 = time.perf_counter_ns()
            src = t.reshape(-1).numpy().view(np.uint8)
            view[:src.size] = src
            return ("floor", seg.locator, t.numel(), tuple(t.shape)), time.perf_counter_ns() - t0

        try:
            yield put
        finally:
            view = None  # a buffer exported from the segment keeps it from closing


def _answer(seq, t, _):
    import torch

    if type(t) is tuple:  # the floor: zero copy, the segment itself
        t = torch.frombuffer(attached(t[1]), dtype=torch.int64, count=t[2]).view(t[3])
    elif isinstance(t, list):  # the in-band rows (read-only: no tensor over them)
        return list_checksum(t)
    elif isinstance(t, bytes):
        return int(np.frombuffer(t, dtype=np.uint64).sum(dtype=np.uint64)), len(t)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
        raise VerifyError(f"message {seq}: expected an int64 tensor, received "
                          f"{getattr(t, 'dtype', type(t).__name__)}")
    return checksum(t), t.numel() * t.element_size()


def reader_loop(recv, reply, rank: int, params):
    # Large tensors are what a worker receives from the scheduler: its call.
    return serve(recv, reply, rank, params, "tensor", _answer, worker_call=True)
