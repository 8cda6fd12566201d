"""``tensor``: a large CPU tensor broadcast to N readers that each read
every byte of it.

The writer sends ``("tensor", seq, t)`` where ``t`` is an int64
``arange`` with ``seq`` added to its first and last element; each reader
computes a 64-bit checksum over all of the tensor's bytes (the "read every
byte" work, and the check that it received the right tensor), drops its
references (so an arena slot can be released) and answers with the
checksum.  The figure is the writer's time from ``enqueue`` to the last
answer.  ``floor`` is one memcpy plus the same reads, in the same run.
"""
from __future__ import annotations

import time

from fastmq.bench import impls as impls_mod
from fastmq.bench.config import MiB, fmt_size
from fastmq.bench.harness import BenchError, ReaderGroup, receive, summarize
from fastmq.bench.scenario import Line, Scenario, num, ratio, spread
from fastmq.bench.verify import VerifyError, checksum, expect_seq, tensor_expected

NAME = "tensor"


def _notes(rs, records) -> list[str]:
    names = {r["impl"] for r in rs}
    return ["paths: +arena = the tensor arena (one copy into shared memory, readers map "
            "it); fastmq-futex / vllm without it: the ring for a message that fits a ring "
            "chunk (24 MiB by default), the overflow path above (the chunk marks the "
            "message, the payload goes over the ipc socket).",
            *impls_mod.remote_notes(names),
            *(["floor: one single-threaded memcpy into a pre-faulted shared segment plus "
               "every reader's read of every byte."] if "floor" in names else []),
            f"p50/min/max over the messages after {rs[0]['warmup']} warm-up messages per "
            "run; first ms = the very first message of a run, which also pays for touching "
            "fresh shared-memory pages."]


def _gbps(r) -> str:
    return num(r["size_bytes"] / (r["p50"] / 1e3) / 1e9 if r["p50"] > 0 else None)


_REMOTE = ("fastmq-remote", "fastmq-remote+encrypt", "fastmq-remote+plain")
SPEC = Scenario(
    NAME, "tensor: CPU tensor broadcast, every reader reads every byte; milliseconds per "
    "message (enqueue to the last reader's answer)",
    impls=("fastmq-futex+arena", "vllm+arena", "fastmq-futex", "vllm", *_REMOTE,
           "vllm-remote",
           # Remote both ways adds only the small answers' TCP hop: the
           # default security is enough to show it.
           "fastmq-remote-both", "vllm-remote-both", "pyzmq", "floor"),
    rows={"fastmq-futex+arena": "vllm+arena", "vllm+arena": None, "fastmq-futex": "vllm",
          "vllm": None, **impls_mod.REMOTE_ROWS, "pyzmq": "vllm", "floor": "vllm"},
    columns=(("{p50} ms", lambda r: num(r["p50"])), ("runs' p50", spread),
             ("min ms", lambda r: num(r["min"])), ("max ms", lambda r: num(r["max"])),
             ("GB/s", _gbps), ("vs vLLM", lambda r: ratio(r.get("vs_vllm"))),
             ("vs floor", lambda r: ratio(r.get("vs_floor"))),
             ("first ms", lambda r: num(r.get("first_ms"))),
             ("messages", lambda r: str(r["samples"]))),
    floor="floor", size_header="tensor",
    # The arenas may copy with several threads; the floor's copy is one
    # memcpy on one thread.
    bounds={"floor": lambda i: not i.endswith("+arena") and not i.startswith("floor")},
    summary=(Line("large tensor through the arena, every reader reads every byte",
                  "fastmq-futex+arena", "vllm+arena", unit="ms", readme=True),),
    summary_size=64 * MiB, needs_torch=True, notes=_notes,
    grids=(("large tensors, every reader reads every byte: p50 ms, vLLM / fastmq on the "
            "same path", "arena off: a message larger than a ring chunk (24 MiB by default) "
            "takes the overflow path (ipc socket), a smaller one the ring; remote: TCP over "
            "{link} (remote both ways: the answers too), with fastmq's default security (a "
            "keyed MAC on every message), +encrypt (AES-GCM) or +plain (unauthenticated); "
            "vLLM's remote path is plain TCP.", "vLLM / fastmq ms = ratio",
            (("arena", "fastmq-futex+arena", "vllm+arena"),
             ("arena off", "fastmq-futex", "vllm"),
             ("remote (TCP)", "fastmq-remote", "vllm-remote"),
             ("remote (TCP), +encrypt", "fastmq-remote+encrypt", "vllm-remote"),
             ("remote (TCP), +plain", "fastmq-remote+plain", "vllm-remote"),
             ("remote both ways", "fastmq-remote-both", "vllm-remote-both"))),
           ("what the remote path's security costs on large tensors: p50 ms, +plain "
            "(unauthenticated TCP) / secured, same shape", "TCP over {link}; default "
            "security: a keyed MAC (GMAC) on every message, computed by the writer and "
            "checked by each reader; +encrypt: AES-GCM. Below 1x: what the security costs.",
            "plain / secured ms = ratio",
            (("remote (TCP), default security", "fastmq-remote", "fastmq-remote+plain"),
             ("remote (TCP), +encrypt", "fastmq-remote+encrypt", "fastmq-remote+plain")))))


def run(env, impls, params, progress) -> list[dict]:
    import torch

    records = []
    for n in params.readers[NAME]:
        for impl in impls:
            progress.start(f"tensor  {impl.name}  N={n}")
            with ReaderGroup(env, impl, n, NAME, params,
                             capacity=max(params.tensor_sizes)) as g:
                seq = 0
                for size in params.tensor_sizes:
                    progress.detail(fmt_size(size))
                    n_elem = size // 8
                    t = torch.arange(n_elem, dtype=torch.int64)
                    samples, first = [], None
                    for rep in range(params.tensor_warmup + params.tensor_reps):
                        seq += 1
                        t[0] = seq
                        t[-1] = n_elem - 1 + seq
                        total = tensor_expected(n_elem, seq)
                        t0 = time.perf_counter_ns()
                        g.send(("tensor", seq, t))
                        acks = [g.ack(r) for r in range(n)]
                        dt = time.perf_counter_ns() - t0
                        for r, a in enumerate(acks):
                            want = ("ok", seq, r, total, size)
                            if a[:3] == want[:3] and a[3:] != want[3:]:
                                raise BenchError(
                                    f"{g.where}: reader {r} read {a[4]} bytes with checksum "
                                    f"{a[3]:#x} from tensor message {seq}; the writer sent "
                                    f"{size} bytes with checksum {total:#x}: the tensor it "
                                    "received differs from what was sent")
                            if a != want:
                                raise g.bad_ack(r, a, want)
                        if first is None:
                            first = dt
                        if rep >= params.tensor_warmup:
                            samples.append(dt)
                        # Restore the pattern for the next message.
                        t[0] = 0
                        t[-1] = n_elem - 1
                    del t
                    records.append({
                        "scenario": NAME, "impl": impl.name, "n_readers": n,
                        "size_bytes": size, "unit": "ms", "warmup": params.tensor_warmup,
                        "oversubscribed": env.oversubscribed(n),
                        "arena_active": getattr(g.writer, "arena_active", None),
                        "first_ms": first / 1e6,
                        **summarize(samples, 1e6), "samples_ns": samples,
                    })
    return records


def reader_loop(end, rank: int, params):
    import torch

    recv, reply, timeout = end.recv, end.reply, params.timeout_s
    expect = 1
    while True:
        m = receive(recv, timeout, expect)
        if m is None:
            return {"received": expect - 1}
        if type(m) is not tuple or len(m) != 3 or m[0] != "tensor":
            raise VerifyError(f"expected a tensor message, received {type(m).__name__}")
        seq, t = m[1], m[2]
        expect_seq(expect, seq)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise VerifyError(f"message {seq}: expected an int64 tensor, received "
                              f"{getattr(t, 'dtype', type(t).__name__)}")
        total = checksum(t)
        nbytes = t.numel() * t.element_size()
        # Let go of the tensor before answering: an arena slot is released
        # when its last view dies.
        del t, m
        reply(("ok", seq, rank, total, nbytes), timeout)
        expect += 1

