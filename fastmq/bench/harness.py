"""Reader processes and the writer's side: a wrong answer or a hang fails the run."""
from __future__ import annotations

import functools
import gc
import importlib
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager

import numpy as np

MASK64 = (1 << 64) - 1


class BenchError(RuntimeError):
    """The benchmark cannot report a figure (a reader failed or hung)."""


class VerifyError(AssertionError):
    """A reader received something other than what the writer sent."""


# ---------------------------------------------------------------------------
# what readers check: payloads derive from their size, so every process builds
# the same bytes; each carries its number, so a stale or repeated chunk shows

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


def checksum(obj) -> int:
    """Wrapping 64-bit sum of a tensor's or buffer's octets: the readers' read of every byte."""
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
    """Checksum of the int64 ``arange(n_elem)`` with ``seq`` added to both ends."""
    return (n_elem * (n_elem - 1) // 2 + 2 * seq) & MASK64


# ---------------------------------------------------------------------------
# processes

class Env:
    """Readers start from a forkserver: no inherited sockets or segments, imports done once."""

    def __init__(self, preload: list[str]):
        self.ctx = mp.get_context("forkserver")
        self.usable_cpus = len(os.sched_getaffinity(0))
        self.ctx.set_forkserver_preload(preload)
        # Now: it imports the preloads while this process imports its own.
        multiprocessing.forkserver.ensure_running()

    def oversubscribed(self, n_readers: int) -> bool:
        return n_readers + 1 > self.usable_cpus


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def stop_processes(procs) -> None:
    """SIGTERM first, so readers clean up; then SIGKILL."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def _on_sigterm(signum, frame):
    # An exception, so a reader stopped early still removes its segment and ipc files.
    raise SystemExit(143)


def reader_main(impl, spec, rank: int, scenario: str, params, conn) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    # torch and vLLM live as long as the process: out of the collections closing queues runs.
    gc.freeze()
    end = None
    failed = False
    try:
        end = impl.open_reader(spec, rank)
        conn.send(("ready", end.ack_spec, os.getpid()))
        end.ready()
        result = importlib.import_module(f"fastmq.bench.{scenario}").reader_loop(end, rank,
                                                                                 params)
        conn.send(("done", result))
    except BaseException as e:  # report everything, then exit non-zero
        failed = True
        text = _describe(e)
        if end is not None:
            try:  # wake the writer waiting for this reader's answer
                end.reply(("error", rank, text), 1.0)
            except BaseException:
                pass
        try:
            conn.send(("error", text, traceback.format_exc()))
        except BaseException:
            pass
    finally:
        # The writer stopping readers must not cut this reader's cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if end is not None:
            end.close()
        conn.close()
    if failed:
        raise SystemExit(1)


def receive(recv, timeout: float, expect: int):
    try:
        return recv(timeout)
    except TimeoutError:
        raise VerifyError(f"message {expect} never arrived (waited {timeout:.0f} s): lost, "
                          "or the writer stalled") from None


def serve(end, rank: int, params, kind: str, answer, timeout: float | None = None,
          stamp: bool = False) -> dict:
    """Every scenario's reader: numbers in order, ``answer`` checks the content."""
    recv, reply, timeout = end.recv, end.reply, timeout or params.timeout_s
    now = time.clock_gettime_ns
    expect = 1
    while True:
        m = receive(recv, timeout, expect)
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


def groups(env, impls, params, progress, name: str, measure, floor=None, capacity=0):
    """Every implementation at every N, through ``measure`` or ``floor``."""
    records = []
    for n in params.readers[name]:
        for impl in impls:
            progress.start(f"{name}  {impl.name}  N={n}")
            if impl.family == "floor" and floor is not None:
                records += floor(impl, n)
                continue
            with ReaderGroup(env, impl, n, name, params, capacity) as g:
                records += measure(g)
    return records


def record(name: str, impl: str, n: int, size, unit: str, env, samples=None, scale=1.0,
           **extra) -> dict:
    return {"scenario": name, "impl": impl, "n_readers": n, "size_bytes": size, "unit": unit,
            "oversubscribed": env.oversubscribed(n) if n else False, **extra,
            **(summarize(samples, scale) if samples is not None else {})}


class ReaderGroup:
    """A writer here and ``n`` reader processes; every failure names them."""

    def __init__(self, env: Env, impl, n: int, scenario: str, params, capacity: int = 0):
        self.env, self.impl, self.n, self.scenario = env, impl, n, scenario
        self.params, self.capacity, self.timeout = params, capacity, params.timeout_s
        self.writer = None
        self.procs: list = []
        self.conns: list = []
        self.pids: list[int] = []
        self.sent = 0  # messages sent, the stop message excepted
        self._errors: dict[int, str] = {}
        self._watch = None
        self.where = f"{impl.name} ({scenario}, N={n})"

    def __enter__(self) -> "ReaderGroup":
        try:
            self._start()
        except BaseException as e:
            self._abort()
            if isinstance(e, Exception) and not isinstance(e, BenchError):
                raise BenchError(f"{self.where}: setting up failed: {_describe(e)}") from e
            raise
        return self

    def _start(self) -> None:
        self.writer = self.impl.make_writer(self.n, self.capacity)
        for rank in range(self.n):
            r, w = self.env.ctx.Pipe(duplex=False)
            p = self.env.ctx.Process(target=reader_main, daemon=True,
                                     name=f"fastmq-bench-{self.impl.name}-{rank}",
                                     args=(self.impl, self.writer.spec, rank, self.scenario,
                                           self.params, w))
            p.start()
            w.close()
            self.procs.append(p)
            self.conns.append(r)
        specs = []
        for rank in range(self.n):
            msg = self._control(rank, "start", "ready")
            specs.append(msg[1])
            self.pids.append(msg[2])
        self.writer.attach_acks(specs)
        with deadline(self.timeout, f"{self.where}: handshake with the readers"):
            self.writer.ready()
        if getattr(self.writer, "needs_watchdog", False):
            self._watch = Watchdog(self.timeout, f"{self.where}: no answer from the readers")

    def _control(self, rank: int, what: str, kind: str):
        """Reader ``rank``'s next control message; silence or an exit fails the run."""
        conn, proc = self.conns[rank], self.procs[rank]
        end = time.monotonic() + self.timeout
        while not conn.poll(0.05):
            if not proc.is_alive() and not conn.poll(0):
                proc.join(1.0)
                raise BenchError(f"{self.where}: reader {rank} exited (code "
                                 f"{proc.exitcode}) during {what}")
            if time.monotonic() > end:
                raise BenchError(f"{self.where}: reader {rank} silent for "
                                 f"{self.timeout:.0f} s during {what}")
        try:
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

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                return
            self.send(None)  # the stop message, through the queue itself
            for rank in range(self.n):
                got = self._control(rank, "stop", "done")[1]["received"]
                if got != self.sent:
                    raise BenchError(f"{self.where}: reader {rank} verified {got} messages, "
                                     f"the writer sent {self.sent}")
            for rank, p in enumerate(self.procs):
                p.join(self.timeout)
                if p.is_alive():
                    raise BenchError(f"{self.where}: reader {rank} (pid {p.pid}) did not "
                                     f"exit within {self.timeout:.0f} s")
                if p.exitcode != 0:
                    raise BenchError(f"{self.where}: reader {rank} exited with code "
                                     f"{p.exitcode}")
        finally:
            self._abort()

    def _abort(self) -> None:
        # A reader that failed is exiting on its own: let it finish cleaning up.
        end = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        stop_processes(self.procs)
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        for c in self.conns:
            c.close()
        self.conns = []
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    def send(self, obj) -> None:
        if obj is not None:
            self.sent += 1
        if self._watch is not None:
            self._watch.last = time.monotonic()
        try:
            self.writer.send(obj, self.timeout)
        except BenchError:
            raise
        except Exception as e:
            raise self.failure(f"sending failed: {_describe(e)}") from e

    def ack(self, rank: int):
        if self._watch is not None:
            self._watch.last = time.monotonic()
        try:
            a = self.writer.ack(rank, self.timeout)
        except BenchError:
            raise
        except Exception as e:
            raise self.failure(f"no answer from reader {rank} within {self.timeout:.0f} s "
                               f"(a lost message, or a stalled reader): {_describe(e)}") from e
        if type(a) is tuple and a and a[0] == "error":
            self._errors[a[1]] = a[2]
            raise BenchError(f"{self.where}: reader {a[1]} failed: {a[2]}")
        return a

    def round_trip(self, msg, *tail, free: int = 0) -> tuple[int, list]:
        """Timed send of ``msg`` until every reader answered ``("ok", seq, rank, *tail)``."""
        seq, n, ack = msg[1], self.n, self.ack
        t0 = time.perf_counter_ns()
        self.send(msg)
        acks = [ack(r) for r in range(n)]
        dt = time.perf_counter_ns() - t0
        for r, a in enumerate(acks):
            want = ("ok", seq, r, *tail)
            if type(a) is not tuple or a[:len(want)] != want or len(a) != len(want) + free:
                raise BenchError(f"{self.where}: reader {r} answered {a!r}, expected "
                                 f"{want + ('...',) * free!r}")
        return dt, acks

    def failure(self, what: str) -> BenchError:
        """A BenchError that prefers what a failed reader said about it."""
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not self._errors:
            for rank, conn in enumerate(self.conns):
                try:
                    if conn.poll(0.02) and (msg := conn.recv())[0] == "error":
                        self._errors[rank] = msg[1]
                except (EOFError, OSError):
                    pass
        if self._errors:
            rank, text = next(iter(self._errors.items()))
            return BenchError(f"{self.where}: reader {rank} failed: {text}")
        return BenchError(f"{self.where}: {what}")


# ---------------------------------------------------------------------------
# waits without a timeout

_active: dict = {}


def _on_deadline(signum, frame):
    what = _active.get("what")
    if what is not None and _active.get("fired"):
        _active.clear()
        raise BenchError(what)


@contextmanager
def deadline(seconds: float, what: str):
    """A ``Watchdog`` nobody feeds, for calls that take no timeout."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    w = Watchdog(seconds, f"{what}: no progress")
    try:
        yield
    finally:
        w.stop()


class Watchdog:
    """Interrupts a wait without a timeout by a signal to the main thread."""

    def __init__(self, seconds: float, what: str):
        self.last = time.monotonic()
        self._seconds = seconds
        self._what = what
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        signal.signal(signal.SIGUSR1, _on_deadline)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        step = min(1.0, self._seconds / 4)
        while not self._done.wait(step):
            if time.monotonic() - self.last > self._seconds:
                _active.update(what=f"{self._what} within {self._seconds:.0f} s",
                               fired=True)
                signal.pthread_kill(self._main, signal.SIGUSR1)
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        _active.clear()


# ---------------------------------------------------------------------------
# samples

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
    return {
        "samples": len(v),
        "p50": percentile(v, 50) / scale,
        "p90": percentile(v, 90) / scale,
        "p99": percentile(v, 99) / scale,
        "mean": sum(v) / len(v) / scale,
        "min": v[0] / scale,
        "max": v[-1] / scale,
    }


# vLLM's CPU build: its CPU platform, a small KV cache (GiB), no NUMA binding (it asserts
# on small VMs), one OpenMP thread per process.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_child(body, **model) -> None:
    """An engine process (``python -m``): flag/value pairs in, ``body(args, model_dir)``'s
    JSON to ``--out``; a tiny Llama config in ``model_dir``."""
    a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    from transformers import LlamaConfig

    with tempfile.TemporaryDirectory(prefix="fastmq-bench-model-") as d:
        LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                    **model).save_pretrained(d)
        result = body(a, d)
    with open(a["--out"], "w") as f:
        json.dump(result, f)


def expect_queue(cls, a: dict) -> str:
    got = cls.__module__
    if (got == "fastmq.queue") != (a["--expect"] == "fastmq"):
        raise RuntimeError(f"expected {a['--expect']}'s queue in vLLM, got {got}")
    return got


def run_engine(module: str, impl, args: list, limit: float, python: str | None = None
               ) -> dict:
    """The JSON of an engine child running ``impl``'s queue (vLLM starts its processes
    itself: they cannot be this harness's readers)."""
    expect = "fastmq" if impl.family == "fastmq" else "vllm"
    # Not this process's arena and ring settings: the engine's defaults.
    env = {k: v for k, v in os.environ.items()
           if k not in ("FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB", "FASTMQ_MAX_CHUNKS")}
    env.update(ENGINE_ENV, FASTMQ_VLLM=str(int(expect == "fastmq")))
    env["FASTMQ_WAIT"] = impl.wait_mode or env.get("FASTMQ_WAIT", "futex")
    # The engine imports the fastmq this benchmark runs.
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    what = f"{module.rsplit('.', 1)[1]} {impl.name}"
    with tempfile.TemporaryDirectory(prefix="fastmq-bench-") as d:
        out = os.path.join(d, "out.json")
        cmd = [python or sys.executable, "-m", module, *map(str, args), "--expect", expect,
               "--out", out]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{what}: no result within {limit:.0f} s")
        if proc.returncode != 0:
            raise BenchError(f"{what} failed (exit {proc.returncode}): "
                             + (proc.stderr or proc.stdout)[-2000:])
        with open(out) as f:
            return json.load(f)
