"""Reader processes and the writer's side: a wrong answer or a hang fails the run."""
from __future__ import annotations

import functools
import gc
import importlib
import multiprocessing as mp
import multiprocessing.forkserver
import os
import random
import signal
import time
from contextlib import contextmanager, suppress

import numpy as np

from fastmq.bench.impls import shutdown


class BenchError(RuntimeError):
    """The benchmark cannot report a figure (a reader failed or hung)."""


class VerifyError(AssertionError):
    """A reader received something other than what the writer sent."""


# What readers check: payloads derive from their size, so every process builds the same
# bytes; each carries its number, so a stale or repeated chunk shows.

@functools.lru_cache(maxsize=64)
def pattern(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def step_payload(seq: int, size: int) -> bytes:
    return seq.to_bytes(8, "little") + pattern(size - 8)


def check_step_payload(seq: int, payload) -> None:
    size = len(payload)
    if size < 8:
        raise VerifyError(f"message {seq}: payload of {size} bytes is too short")
    # startswith/endswith compare in place: every byte checked, nothing copied.
    if not payload.startswith(seq.to_bytes(8, "little")):
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


def checksum(t) -> int:
    """Wrapping 64-bit sum of an int64 tensor: the readers' read of every byte."""
    if not t.is_contiguous():
        raise VerifyError("received a non-contiguous tensor")
    return int(t.reshape(-1).numpy().view(np.uint64).sum(dtype=np.uint64))


# A list's check reads its items in batches of about this many bytes (see list_checksum).
CHECK_BATCH = 1 << 20


def list_checksum(items: list) -> tuple[int, int]:
    """``(checksum, nbytes)`` of a list of bytes-like items: the wrapping 64-bit sum
    of their concatenation's words, as ``checksum`` of one buffer.  Read in batches of
    about CHECK_BATCH bytes, one small buffer reused: joining the whole list first
    allocates its size again, and the round trip would then include where the machine
    finds that memory (on a VM that hands freed memory back to its host, a page touched
    for the first time since costs several times a page just freed), which is the
    benchmark's own cost, not the queue's."""
    total, nbytes, carry, i = 0, 0, b"", 0
    step = max(1, CHECK_BATCH // max(1, len(items[0]) if items else 1))
    while i < len(items):
        batch = b"".join([carry, *items[i:i + step]])
        i += step
        whole = len(batch) - len(batch) % 8
        if whole:
            total += int(np.frombuffer(batch, dtype=np.uint64, count=whole // 8)
                         .sum(dtype=np.uint64))
        nbytes += whole
        carry = batch[whole:]
    if carry:
        raise VerifyError(f"received a list of {nbytes + len(carry)} bytes in all, not a "
                          "whole number of 8-byte words")
    return total % (1 << 64), nbytes


def tensor_expected(n_elem: int, seq: int) -> int:
    """Checksum of the int64 ``arange(n_elem)`` with ``seq`` added to both ends."""
    return (n_elem * (n_elem - 1) // 2 + 2 * seq) % (1 << 64)


class Env:
    """Readers start from a forkserver: no inherited sockets or segments, imports done once."""

    def __init__(self, preload: list[str]):
        self.ctx = mp.get_context("forkserver")
        self.cpus = sorted(os.sched_getaffinity(0))
        self.usable_cpus = len(self.cpus)
        self.ctx.set_forkserver_preload(preload)
        # Now: it imports the preloads while this process imports its own.
        multiprocessing.forkserver.ensure_running()

    def oversubscribed(self, n_readers: int) -> bool:
        return n_readers + 1 > self.usable_cpus

    def reader_cpus(self, n_readers: int) -> list[int] | None:
        """The core each of ``n_readers`` readers is pinned to, or None (not pinned).

        Only where the readers and the writer outnumber the cores: there the
        scheduler's placement decided a figure (two readers sharing a core
        while the writer had the other was up to twice as fast, for every
        implementation, as a reader sharing the writer's core), so a run's
        median was a draw of placements.  Pinned, in turn, to every core but
        the first, the same way for every implementation; the writer is not
        pinned (its helper threads, fastmq's copy threads and torch's, may
        use any core), and has the first core mostly to itself."""
        if not self.oversubscribed(n_readers) or self.usable_cpus < 2:
            return None
        rest = self.cpus[1:]
        return [rest[rank % len(rest)] for rank in range(n_readers)]


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _on_sigterm(signum, frame):
    # An exception, so a reader stopped early still removes its segment and ipc files.
    raise SystemExit(143)


def reader_main(rank: int, conn, impl, handle, scenario: str, params,
                cpu: int | None = None) -> None:
    """A reader process: its scenario's ``reader_loop`` on ``impl``'s queues; a failure
    is told to the writer over ``conn`` and the answer queue.  ``cpu``: the core it is
    pinned to (``Env.reader_cpus``), before any queue starts a thread."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    # torch and vLLM live as long as the process: out of the collections closing queues runs.
    gc.freeze()
    queues: list = []
    try:
        loop = importlib.import_module(f"fastmq.bench.{scenario}").reader_loop
        queues += [impl.mq_class().create_from_handle(handle, rank), impl.queue(1, True)]
        conn.send(("ready", queues[1].export_handle()))
        for q in queues:
            q.wait_until_ready()
        # The writer times its first message only from here: a first-use
        # figure is the queue's, not the reader's own start-up.
        conn.send(("serving", time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
        conn.send(("done", loop(queues[0].dequeue, queues[1].enqueue, rank, params)))
    except SystemExit:
        raise
    except BaseException as e:
        with suppress(BaseException):  # wake the writer waiting for this reader's answer
            queues[1].enqueue(("error", rank, _describe(e)), 1.0)
        with suppress(BaseException):
            conn.send(("error", _describe(e)))
        raise SystemExit(1)
    finally:
        # The writer stopping readers must not cut this reader's cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutdown(queues)
        conn.close()


def receive(recv, timeout: float | None, expect: int):
    try:
        # No timeout: the call vLLM's workers make (dequeue(indefinite=True)); a
        # lost message then shows at the writer, which waits for answers in time.
        return recv(timeout) if timeout is not None else recv(indefinite=True)
    except TimeoutError:
        raise VerifyError(f"message {expect} never arrived (waited {timeout:.0f} s): lost, "
                          "or the writer stalled") from None


def serve(recv, reply, rank: int, params, kind: str, answer, timeout: float | None = None,
          stamp: bool = False, worker_call: bool = False) -> dict:
    """Every scenario's reader: numbers in order, ``answer`` checks the content.
    ``worker_call``: receive as vLLM's workers do, without a timeout."""
    timeout = timeout or params.timeout_s
    wait = None if worker_call else timeout
    now = time.clock_gettime_ns
    expect = 1
    while True:
        m = receive(recv, wait, expect)
        t = now(time.CLOCK_MONOTONIC) if stamp else 0
        if m is None:
            return {"received": expect - 1}
        if type(m) is not tuple or len(m) != 3 or m[0] != kind:
            raise VerifyError(f"expected a {kind} message, received {type(m).__name__}")
        expect_seq(expect, m[1])
        tail = answer(m[1], m[2], t)
        del m  # an arena slot is released when its last view dies
        reply(("ok", expect, rank, *tail), timeout)
        expect += 1


def groups(env, impls, params, progress, name: str, measure, label: str = "") -> list[dict]:
    """``measure(group)`` of every implementation at every N."""
    records = []
    for n in params.readers[name]:
        for impl in impls:
            progress.start(f"{name}{label}  {impl.name}  N={n}")
            with ReaderGroup(env, impl, n, name, params) as g:
                records += measure(g)
    return records


def record(name: str, impl: str, n: int, size, unit: str, env, samples=None, scale=1.0,
           **extra) -> dict:
    return {"scenario": name, "impl": impl, "n_readers": n, "size_bytes": size, "unit": unit,
            "oversubscribed": env.oversubscribed(n) if n else False,
            "reader_cpus": env.reader_cpus(n) if n else None, **extra,
            **(summarize(samples, scale) if samples is not None else {})}


@contextmanager
def bench_segment(size: int):
    """A floor's shared-memory segment; readers attach with its ``locator``."""
    from fastmq import segments

    seg = segments.create_segment("bench", size)
    try:
        yield seg
    finally:
        seg.close()


@functools.lru_cache(maxsize=None)
def attached(name: str):
    """A reader's mapping of the writer's ``bench_segment``, for the process's life."""
    from fastmq._segment import Segment

    return Segment.attach(name)


class ReaderGroup:
    """A writer here and ``n`` reader processes; silence, an early exit, a wrong answer or
    an error fails the run, naming them."""

    def __init__(self, env: Env, impl, n: int, scenario: str, params):
        self.env, self.impl, self.n, self.scenario, self.params = env, impl, n, scenario, params
        self.where, self.timeout = f"{impl.name} ({scenario}, N={n})", params.timeout_s
        self.mq, self.acks, self.handles, self.procs, self.conns = None, [], [], [], []
        self.sent = 0  # messages sent, the stop message excepted
        self.serving_ns: list[int] = []
        self._errors: dict[int, str] = {}

    def __enter__(self) -> "ReaderGroup":
        try:
            self.mq = self.impl.queue(self.n)
            self.handles = [self.mq.export_handle()]
            cpus = self.env.reader_cpus(self.n) or [None] * self.n
            for rank in range(self.n):
                r, w = self.env.ctx.Pipe(duplex=False)
                p = self.env.ctx.Process(target=reader_main, daemon=True, args=(
                    rank, w, self.impl, self.handles[0], self.scenario, self.params,
                    cpus[rank]))
                p.start()
                w.close()
                self.procs.append(p)
                self.conns.append(r)
            self.handles += [self._expect(rank, "start", "ready")[1] for rank in range(self.n)]
            # Remote both ways: attach as a remote reader, as vLLM's executor does.
            rank = -1 if self.impl.remote == "both" else 0
            self.acks = [self.impl.mq_class().create_from_handle(h, rank)
                         for h in self.handles[1:]]
            with deadline(self.timeout, f"{self.where}: handshake with the readers"):
                for q in (self.mq, *self.acks):
                    q.wait_until_ready()
            # Each reader's clock reading as it went to take its first message.
            self.serving_ns = [self._expect(rank, "start", "serving")[1]
                               for rank in range(self.n)]
        except BaseException as e:
            self.close()
            if isinstance(e, Exception) and not isinstance(e, BenchError):
                raise BenchError(f"{self.where}: setting up failed: {_describe(e)}") from e
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.send(None)  # the stop message, through the queue itself
                for rank in range(self.n):
                    got = self._expect(rank, "stop", "done")[1]["received"]
                    if got != self.sent:
                        raise BenchError(f"{self.where}: reader {rank} verified {got} "
                                         f"messages, the writer sent {self.sent}")
                for rank, p in enumerate(self.procs):
                    p.join(self.timeout)
                    if p.is_alive() or p.exitcode != 0:
                        raise BenchError(f"{self.where}: reader {rank} did not exit cleanly "
                                         f"(pid {p.pid}, exit code {p.exitcode})")
        finally:
            self.close()

    def _expect(self, rank: int, what: str, kind: str):
        """Reader ``rank``'s next control message, which must be ``kind``."""
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            # A process that exited closed its end: poll sees that at once.
            if not conn.poll(self.timeout):
                raise BenchError(f"{self.where}: reader {rank} silent for "
                                 f"{self.timeout:.0f} s during {what}")
            msg = conn.recv()
        except EOFError:
            proc.join(1.0)
            raise BenchError(f"{self.where}: reader {rank} exited (code "
                             f"{proc.exitcode}) during {what}") from None
        if msg[0] == "error":
            self._errors[rank] = msg[1]
            raise BenchError(f"{self.where}: reader {rank} failed during {what}: {msg[1]}")
        if msg[0] != kind:
            raise BenchError(f"{self.where}: reader {rank} sent {msg[0]!r} at {what}")
        return msg

    def failure(self, what: str) -> BenchError:
        """A BenchError that prefers what a failed reader said about it."""
        for rank, conn in enumerate(self.conns):
            with suppress(EOFError, OSError):
                if not self._errors and conn.poll(0.5) and (msg := conn.recv())[0] == "error":
                    self._errors[rank] = msg[1]
        for rank, text in self._errors.items():
            return BenchError(f"{self.where}: reader {rank} failed: {text}")
        return BenchError(f"{self.where}: {what}")

    def close(self) -> None:
        # A reader that failed is exiting on its own: let it finish cleaning up; then
        # SIGTERM, so that a reader cleans up, and SIGKILL.
        end = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
            for stop in (p.terminate, p.kill):
                if p.is_alive():
                    stop()
                    p.join(5)
        for c in self.conns:
            c.close()
        self.conns = []
        queues, self.mq, self.acks = [self.mq, *self.acks], None, []
        shutdown([q for q in queues if q is not None],
                 self.handles if self.impl.family == "vllm" else ())

    def send(self, obj) -> None:
        self.sent += obj is not None
        try:
            self.mq.enqueue(obj, self.timeout)
        except Exception as e:
            raise self.failure(f"sending failed: {_describe(e)}") from e

    def _ack(self, rank: int):
        try:
            a = self.acks[rank].dequeue(self.timeout)
        except Exception as e:
            raise self.failure(f"no answer from reader {rank} within {self.timeout:.0f} s "
                               f"(a lost message, or a stalled reader): {_describe(e)}") from e
        if type(a) is tuple and a and a[0] == "error":
            self._errors[a[1]] = a[2]
            raise BenchError(f"{self.where}: reader {a[1]} failed: {a[2]}")
        return a

    def _check(self, acks: list, seq: int, tail: tuple = (), free: int = 0) -> list:
        """Each answer is ``("ok", seq, rank, *tail)`` and ``free`` more items."""
        for r, a in enumerate(acks):
            want = ("ok", seq, r, *tail)
            if type(a) is not tuple or a[:len(want)] != want or len(a) != len(want) + free:
                raise BenchError(f"{self.where}: reader {r} answered {a!r}, expected "
                                 f"{want + ('...',) * free!r}")
        return acks

    def round_trip(self, msg, *tail, free: int = 0) -> tuple[int, list]:
        """Timed send of ``msg`` until every reader answered (``_check``)."""
        ack = self._ack
        t0 = time.perf_counter_ns()
        self.send(msg)
        acks = [ack(r) for r in range(self.n)]
        dt = time.perf_counter_ns() - t0
        return dt, self._check(acks, msg[1], tail, free)

    def command(self, payload, call) -> None:
        """A floor's batch of rounds: ``payload`` tells the readers, ``call()`` runs the
        writer's side."""
        self.send((self.scenario, self.sent + 1, payload))
        try:
            call()
        except TimeoutError as e:
            raise self.failure(str(e)) from None
        self._check([self._ack(r) for r in range(self.n)], self.sent)


@contextmanager
def deadline(seconds: float, what: str):
    """For calls that take no timeout (``wait_until_ready``): SIGALRM interrupts them."""
    def fire(signum, frame):
        raise BenchError(f"{what}: no progress within {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sample_loop(one, warmup: int, minimum: int, maximum: int, budget_s: float) -> list[int]:
    """``one()``'s results after warm-up, up to ``maximum`` or the time budget."""
    for _ in range(warmup):
        one()
    out: list[int] = []
    end = time.perf_counter() + budget_s
    while len(out) < maximum:
        out.append(one())
        if len(out) >= minimum and time.perf_counter() >= end:
            break
    return out


def percentile(sorted_values: list, p: float):
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        raise ValueError("no samples")
    k = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * p // 100) - 1))
    return sorted_values[int(k)]


def summarize(values: list, scale: float = 1.0) -> dict:
    """p50/p90/p99/mean/min/max of ``values`` divided by ``scale``."""
    v = sorted(values)
    return {"samples": len(v), "p50": percentile(v, 50) / scale,
            "p90": percentile(v, 90) / scale, "p99": percentile(v, 99) / scale,
            "mean": sum(v) / len(v) / scale, "min": v[0] / scale, "max": v[-1] / scale}
