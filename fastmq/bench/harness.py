"""Reader processes and the writer's side of one measured run, under the
rules that keep a figure honest: readers come from a clean forkserver (no
inherited sockets or segments); nothing is timed before the handshake or
during warm-up; every blocking call has a timeout; a reader that fails
(a lost, stale or corrupted message included) answers with its error, so
the run stops instead of reporting a time; readers stop through the queue
itself and must exit.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import subprocess
import tempfile
import threading
import time
import json
import traceback
from contextlib import contextmanager


class BenchError(RuntimeError):
    """The benchmark cannot report a figure (a reader failed or hung)."""


# ---------------------------------------------------------------------------
# processes

class Env:
    """The multiprocessing context readers are started from."""

    def __init__(self, start_method: str = "forkserver", preload: list[str] | None = None,
                 timeout_s: float = 60.0):
        self.ctx = mp.get_context(start_method)
        self.start_method = start_method
        self.timeout_s = timeout_s
        self.usable_cpus = len(os.sched_getaffinity(0))
        if start_method == "forkserver":
            self.ctx.set_forkserver_preload(preload or [])
            # Start it now: it imports the preloads while the main process
            # imports its own (in parallel on two cores).
            multiprocessing.forkserver.ensure_running()

    def oversubscribed(self, n_readers: int) -> bool:
        """More busy processes (1 writer + N readers) than usable cores."""
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
    # Turn SIGTERM into an exception so a reader that is stopped early still
    # runs its cleanup (its answer queue's segment and ipc files).
    raise SystemExit(143)


def reader_main(impl, spec, rank: int, scenario: str, params, conn) -> None:
    """Entry point of reader process ``rank``: attach, run the scenario's
    ``reader_loop``, report through ``conn``."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Everything imported so far (torch, vLLM) lives for the whole process:
    # keep it out of the collections that closing the queues runs.
    gc.freeze()
    end = None
    failed = False
    try:
        end = impl.open_reader(spec, rank)
        conn.send(("ready", end.ack_spec, os.getpid()))
        end.ready()
        loop = importlib.import_module(f"fastmq.bench.{scenario}").reader_loop
        result = loop(end, rank, params)
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
        # Cleanup (this reader's answer queue: segment, ipc files) must not
        # be cut short by the writer stopping readers.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if end is not None:
            end.close()
        conn.close()
    if failed:
        raise SystemExit(1)


def receive(recv, timeout: float, expect: int):
    """``recv(timeout)``, naming the message that did not come."""
    try:
        return recv(timeout)
    except TimeoutError:
        from fastmq.bench.verify import VerifyError

        raise VerifyError(f"message {expect} never arrived (waited {timeout:.0f} s): lost, "
                          "or the writer stalled") from None


class ReaderGroup:
    """One writer (this process) and ``n`` reader processes of ``impl``
    running ``scenario``.  Use as a context manager; ``send``/``ack`` map
    every failure to ``BenchError`` naming the implementation and reader."""

    def __init__(self, env: Env, impl, n: int, scenario: str, params, capacity: int = 0):
        self.env = env
        self.impl = impl
        self.n = n
        self.scenario = scenario
        self.params = params
        self.capacity = capacity
        self.timeout = params.timeout_s
        self.writer = None
        self.procs: list = []
        self.conns: list = []
        self.pids: list[int] = []
        self.results: list = [None] * n
        self.sent = 0  # messages sent, the stop message excepted
        self._errors: dict[int, str] = {}
        self._watch = None

    @property
    def where(self) -> str:
        return f"{self.impl.name} ({self.scenario}, N={self.n})"

    def __enter__(self) -> "ReaderGroup":
        try:
            self._start()
        except BenchError:
            self._abort()
            raise
        except Exception as e:
            self._abort()
            raise BenchError(f"{self.where}: setting up failed: {_describe(e)}") from e
        except BaseException:
            self._abort()
            raise
        return self

    def _start(self) -> None:
        ctx = self.env.ctx
        self.writer = self.impl.make_writer(self.n, self.capacity)
        for rank in range(self.n):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=reader_main, daemon=True,
                            name=f"fastmq-bench-{self.impl.name}-{rank}",
                            args=(self.impl, self.writer.spec, rank, self.scenario,
                                  self.params, w))
            p.start()
            w.close()
            self.procs.append(p)
            self.conns.append(r)
        specs = []
        for rank in range(self.n):
            msg = self._control(rank, "start")
            if msg[0] != "ready":
                raise BenchError(f"{self.where}: reader {rank} sent {msg[0]!r} at start")
            specs.append(msg[1])
            self.pids.append(msg[2])
        self.writer.attach_acks(specs)
        with deadline(self.timeout, f"{self.where}: handshake with the readers"):
            self.writer.ready()
        if getattr(self.writer, "needs_watchdog", False):
            self._watch = Watchdog(self.timeout, f"{self.where}: no answer from the readers")

    def _control(self, rank: int, what: str):
        """Next message from reader ``rank``'s control pipe; a reader that
        exits or stays silent for the timeout fails the run."""
        conn, proc = self.conns[rank], self.procs[rank]
        end = time.monotonic() + self.timeout
        while True:
            if conn.poll(0.05):
                try:
                    msg = conn.recv()
                except EOFError:
                    proc.join(1.0)
                    raise BenchError(f"{self.where}: reader {rank} exited (code "
                                     f"{proc.exitcode}) during {what}") from None
                if msg[0] == "error":
                    self._errors[rank] = msg[1]
                    raise BenchError(f"{self.where}: reader {rank} failed during {what}: "
                                     f"{msg[1]}")
                return msg
            if not proc.is_alive() and not conn.poll(0):
                proc.join(1.0)
                raise BenchError(f"{self.where}: reader {rank} exited (code "
                                 f"{proc.exitcode}) during {what}")
            if time.monotonic() > end:
                raise BenchError(f"{self.where}: reader {rank} silent for "
                                 f"{self.timeout:.0f} s during {what}")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abort()
            return
        try:
            self.send(None)  # the stop message, through the queue itself
            for rank in range(self.n):
                msg = self._control(rank, "stop")
                if msg[0] != "done":
                    raise BenchError(f"{self.where}: reader {rank} sent {msg[0]!r} at stop")
                self.results[rank] = msg[1]
                got = msg[1]["received"]
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
        """Stop whatever still runs, join every reader, close the writer."""
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

    def failure(self, what: str) -> BenchError:
        """A BenchError that prefers what a failed reader said about it."""
        deadline_ = time.monotonic() + 1.0
        while time.monotonic() < deadline_ and not self._errors:
            for rank, conn in enumerate(self.conns):
                try:
                    if conn.poll(0.02):
                        msg = conn.recv()
                        if msg[0] == "error":
                            self._errors[rank] = msg[1]
                except (EOFError, OSError):
                    pass
        if self._errors:
            rank, text = next(iter(self._errors.items()))
            return BenchError(f"{self.where}: reader {rank} failed: {text}")
        return BenchError(f"{self.where}: {what}")

    def bad_ack(self, rank: int, got, expected) -> BenchError:
        return BenchError(f"{self.where}: reader {rank} answered {got!r}, expected {expected!r}")


# ---------------------------------------------------------------------------
# a deadline for calls that take no timeout (the queues' handshakes)

_active: dict = {}


def _on_deadline(signum, frame):
    what = _active.get("what")
    if what is not None and _active.get("fired"):
        _active.clear()
        raise BenchError(what)


@contextmanager
def deadline(seconds: float, what: str):
    """Raise ``BenchError`` in the main thread if the block takes longer than
    ``seconds`` (a ``Watchdog`` nobody feeds)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    w = Watchdog(seconds, f"{what}: no progress")
    try:
        yield
    finally:
        w.stop()


class Watchdog:
    """For waits without a timeout (a blocking ``recv``, the queues'
    handshakes): if ``last`` (set before each wait) is older than
    ``seconds``, a watcher thread signals the main thread, whose handler
    raises ``BenchError`` there; that interrupts a blocking socket call
    (pyzmq and the ring waits check for signals)."""

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
    """Run ``one()`` ``warmup`` times (discarded), then collect its results
    until ``maximum``, or past ``budget_s`` once ``minimum`` are in."""
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


def run_child_scenario(module: str, args: list, env: dict, limit: float, what: str,
                       python: str | None = None) -> dict:
    """Run ``python -m module args --out FILE`` (a scenario whose processes
    cannot be this harness's readers: vLLM's executor, a real engine) and
    return the JSON it wrote; ``BenchError`` naming ``what`` if it fails or
    says nothing within ``limit`` seconds."""
    import sys

    with tempfile.TemporaryDirectory(prefix="fastmq-bench-") as d:
        out = os.path.join(d, "out.json")
        cmd = [python or sys.executable, "-m", module, *map(str, args), "--out", out]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{what}: no result within {limit:.0f} s")
        if proc.returncode != 0:
            raise BenchError(f"{what} failed (exit {proc.returncode}): "
                             + (proc.stderr or proc.stdout)[-2000:])
        with open(out) as f:
            return json.load(f)
