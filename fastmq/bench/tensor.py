"""``tensor``: a large CPU tensor broadcast, every reader checksums every byte."""
from __future__ import annotations

from fastmq.bench import impls as impls_mod
from fastmq.bench.config import MiB, fmt_size
from fastmq.bench.harness import (BenchError, VerifyError, checksum, groups, record, serve,
                                  tensor_expected)
from fastmq.bench.scenario import Line, Scenario, num, ratio, spread

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

    def measure(g):
        out, seq = [], 0
        for size in params.tensor_sizes:
            progress.detail(fmt_size(size))
            n_elem = size // 8
            t = torch.arange(n_elem, dtype=torch.int64)
            samples, first = [], None
            for rep in range(params.tensor_warmup + params.tensor_reps):
                seq += 1
                t[0], t[-1] = seq, n_elem - 1 + seq
                total = tensor_expected(n_elem, seq)
                dt, acks = g.round_trip(("tensor", seq, t), free=2)
                for r, a in enumerate(acks):
                    if a[3:] != (total, size):
                        raise BenchError(
                            f"{g.where}: reader {r} read {a[4]} bytes with checksum "
                            f"{a[3]:#x} from tensor message {seq}; the writer sent "
                            f"{size} bytes with checksum {total:#x}: the tensor it "
                            "received differs from what was sent")
                first = dt if first is None else first
                if rep >= params.tensor_warmup:
                    samples.append(dt)
                t[0], t[-1] = 0, n_elem - 1
            del t
            out.append(record(NAME, g.impl.name, g.n, size, "ms", env, samples, 1e6,
                              warmup=params.tensor_warmup, first_ms=first / 1e6,
                              arena_active=getattr(g.writer, "arena_active", None)))
        return out

    return groups(env, impls, params, progress, NAME, measure,
                  capacity=max(params.tensor_sizes))


def _answer(seq, t, _):
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
        raise VerifyError(f"message {seq}: expected an int64 tensor, received "
                          f"{getattr(t, 'dtype', type(t).__name__)}")
    return checksum(t), t.numel() * t.element_size()


def reader_loop(end, rank: int, params):
    return serve(end, rank, params, "tensor", _answer)
