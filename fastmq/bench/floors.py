"""What each scenario costs with no queue at all, measured in the same run."""
from __future__ import annotations

import os
import select
import signal
import time
from contextlib import contextmanager

import numpy as np

from fastmq.bench.config import fmt_size
from fastmq.bench.harness import (BenchError, _on_sigterm, pattern, record, step_payload,
                                  stop_processes)

MEMCPY_WARMUP = 20
MEMCPY_SAMPLES = 500
# Spin before yielding the core: longer than a round trip with a core each,
# short enough to hand one shared core over quickly (0 when oversubscribed).
SPIN_NS = 2_000


def _floor_module():
    try:
        from fastmq import _floor
    except ImportError as e:  # a stale in-place build lacks it
        raise BenchError("the C floor (fastmq._floor) is not built: run "
                         "`python setup.py build_ext --inplace` or reinstall fastmq "
                         f"({e})") from None
    return _floor


def _report_failure(conn, e: BaseException) -> None:
    try:
        conn.send(("error", f"{type(e).__name__}: {e}"))
    except BaseException:
        pass
    raise SystemExit(1)


def _serve(name: str, conn, kind: str, n: int, rank: int, timeout_s: float,
           spin_ns: int = 0) -> None:
    """A C floor reader process: runs each command's rounds until None."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    from fastmq._segment import Segment

    _floor = _floor_module()
    seg = Segment.attach(name)
    try:
        conn.send(("ready", os.getpid()))
        while (cmd := conn.recv()) is not None:
            if kind == "step":
                size, first, count = cmd
                _floor.pingpong_reader(seg, n, rank, np.zeros(size, dtype=np.uint8), first,
                                       count, timeout_s, spin_ns)
            else:
                _floor.wake_reader(seg, n, rank, *cmd, timeout_s)
            conn.send(("ok",))
    except BaseException as e:
        _report_failure(conn, e)
    finally:
        seg.close()


def _expect(conn, rank: int, what: str, timeout: float) -> None:
    if not conn.poll(timeout):
        raise BenchError(f"floor: reader {rank} silent for {timeout:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:
        raise BenchError(f"floor: reader {rank} exited") from None
    if msg[0] != what:
        raise BenchError(f"floor: reader {rank}: {msg[1] if len(msg) > 1 else msg}")


@contextmanager
def _readers(env, n: int, what: str, timeout_s: float, start, stop=None):
    """``n`` ready reader processes, stopped on exit; each must exit 0."""
    procs, conns = [], []
    try:
        for rank in range(n):
            r, w = env.ctx.Pipe()
            p = start(rank, w)
            w.close()
            procs.append(p)
            conns.append(r)
        for rank, c in enumerate(conns):
            _expect(c, rank, "ready", timeout_s)
        yield conns
        if stop:
            stop()
            for rank, c in enumerate(conns):
                _expect(c, rank, "ok", timeout_s)
        else:
            for c in conns:
                c.send(None)
        for rank, p in enumerate(procs):
            p.join(timeout_s)
            if p.is_alive() or p.exitcode != 0:
                raise BenchError(f"{what}: reader {rank} did not exit cleanly "
                                 f"(exit code {p.exitcode})")
    finally:
        stop_processes(procs)
        for c in conns:
            c.close()


@contextmanager
def _c_floor(env, kind: str, n: int, size: int, params, spin_ns: int = 0):
    from fastmq import segments

    seg = segments.create_segment("bench", size, "the benchmark's floor buffer")

    def start(rank, w):
        p = env.ctx.Process(target=_serve, daemon=True,
                            args=(seg.name, w, kind, n, rank, params.timeout_s, spin_ns))
        p.start()
        return p

    what = "floor (step" if kind == "step" else "floor-futex (wake"
    try:
        with _readers(env, n, f"{what}, N={n})", params.timeout_s, start) as conns:
            yield seg, conns
    finally:
        segments.forget_segment(seg.name)
        seg.unlink()
        seg.close()


def _run_c(conns, what: str, timeout_s: float, cmd, call) -> None:
    """Send every reader ``cmd``, run the writer's ``call()``, collect the oks."""
    for c in conns:
        c.send(cmd)
    try:
        call()
    except TimeoutError as e:
        errors = [c.recv()[1] for c in conns if c.poll(0.5)]
        raise BenchError(f"{what}: {errors[0] if errors else e}") from None
    for rank, c in enumerate(conns):
        _expect(c, rank, "ok", timeout_s)


def step_floor(env, n: int, params, progress) -> list[dict]:
    """The ``floor`` and ``floor+pickle`` rows of ``step``, one per payload size."""
    _floor = _floor_module()
    sizes = params.step_sizes
    spin_ns = 0 if env.oversubscribed(n) else SPIN_NS
    records = []
    with _c_floor(env, "step", n, _floor.segment_size(n, max(sizes)), params,
                  spin_ns) as (seg, conns):
        seq = 1

        def rounds(src, count):
            nonlocal seq
            out = np.zeros(count, dtype=np.int64)
            _run_c(conns, f"floor (step, N={n})", params.timeout_s, (src.size, seq, count),
                   lambda: _floor.pingpong_writer(seg, n, src, seq, out, params.timeout_s,
                                                  spin_ns))
            seq += count
            return out

        for size in sizes:
            progress.detail(fmt_size(size))
            src = np.frombuffer(pattern(size), dtype=np.uint8)
            # The warm-up's median sizes the counted run to the queues' time budget.
            est = max(float(np.median(rounds(src, params.step_warmup))), 1.0)
            count = int(min(params.step_max, max(params.step_min,
                                                 params.step_budget_s * 1e9 / est)))
            samples = rounds(src, count)
            pickling = pickle_rounds(size, params.step_warmup, count)
            for name, s in (("floor", samples), ("floor+pickle", samples + pickling)):
                records.append(record("step", name, n, size, "us", env, s.tolist(), 1e3,
                                      warmup=params.step_warmup))
    return records


def pickle_rounds(size: int, warmup: int, count: int) -> np.ndarray:
    """Nanoseconds per round of pickling a step message and its answer both ways."""
    import pickle

    dumps, loads, now = pickle.dumps, pickle.loads, time.perf_counter_ns
    out = np.zeros(count, dtype=np.int64)
    for i in range(warmup + count):
        seq = i + 1
        msg = ("step", seq, step_payload(seq, size))
        ack = ("ok", seq, 0)
        t0 = now()
        got = loads(dumps(msg, protocol=5))
        answer = loads(dumps(ack, protocol=5))
        dt = now() - t0
        if got[1] != seq or answer != ack:
            raise BenchError("floor+pickle: a message changed in pickling")
        if i >= warmup:
            out[i - warmup] = dt
    return out


def memcpy_floor(sizes: list[int]) -> list[dict]:
    """``floor-memcpy``: one memcpy of each payload size (no reader: N=0)."""
    _floor = _floor_module()
    records = []
    for size in sizes:
        src = np.frombuffer(pattern(size), dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        out = np.zeros(MEMCPY_WARMUP + MEMCPY_SAMPLES, dtype=np.int64)
        _floor.time_memcpy(dst, src, out)
        if dst.tobytes() != pattern(size):
            raise BenchError("floor-memcpy: the copy differs from its source")
        records.append(record("step", "floor-memcpy", 0, size, "us", None,
                              out[MEMCPY_WARMUP:].tolist(), 1e3, warmup=MEMCPY_WARMUP))
    return records


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _wake_pipe_reader(stamps, answers, conn) -> None:
    """Blocked in os.read until the stamp arrives; answers the latency."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    now, read, write = _now, os.read, os.write
    rfd, wfd = stamps.fileno(), answers.fileno()
    try:
        conn.send(("ready", os.getpid()))
        while len(data := read(rfd, 8)) == 8:  # short: the writer closed its end
            t1 = now()
            write(wfd, (t1 - int.from_bytes(data, "little")).to_bytes(8, "little",
                                                                      signed=True))
        conn.send(("ok",))
    except BaseException as e:
        _report_failure(conn, e)
    finally:
        stamps.close()
        answers.close()


def wake_futex(env, n, idle_s, params, progress) -> list[int]:
    """One-way latencies (ns): warm-up rounds, then rounds after ``idle_s`` asleep."""
    _floor = _floor_module()
    out = []
    with _c_floor(env, "wake", n, _floor.wake_segment_size(n), params) as (seg, conns):
        first = 1
        for rounds, idle in ((params.wake_warmup, 0.0), (params.wake_samples, idle_s)):
            if not rounds:
                continue
            progress.detail(f"{rounds} rounds, {idle:g} s idle before each")
            lat = np.zeros((rounds, n), dtype=np.int64)
            _run_c(conns, f"floor-futex (wake, N={n})", params.timeout_s, (first, rounds),
                   lambda: _floor.wake_writer(seg, n, first, int(idle * 1e9), lat,
                                              params.timeout_s + idle))
            first += rounds
            out = lat.reshape(-1).tolist()
    return out


def wake_pipe(env, n, idle_s, params, progress) -> list[int]:
    ends, to_readers, from_readers = [], [], []

    def start(rank, w):
        stamps_r, stamps_w = env.ctx.Pipe(duplex=False)
        answers_r, answers_w = env.ctx.Pipe(duplex=False)
        ends.extend([stamps_r, stamps_w, answers_r, answers_w])
        p = env.ctx.Process(target=_wake_pipe_reader, daemon=True,
                            args=(stamps_r, answers_w, w))
        p.start()
        stamps_r.close()
        answers_w.close()
        to_readers.append(stamps_w)
        from_readers.append(answers_r)
        return p

    def stop():
        for c in to_readers:
            c.close()

    out: list[int] = []
    try:
        with _readers(env, n, f"floor-pipe (wake, N={n})", params.timeout_s, start, stop):
            now, sleep, write = _now, time.sleep, os.write
            wfds = [c.fileno() for c in to_readers]
            rfds = [c.fileno() for c in from_readers]
            for i in range(params.wake_warmup + params.wake_samples):
                counted = i >= params.wake_warmup
                if counted:
                    progress.detail(f"sample {i - params.wake_warmup + 1}/"
                                    f"{params.wake_samples}")
                    sleep(idle_s)
                stamp = now().to_bytes(8, "little")
                for fd in wfds:
                    write(fd, stamp)
                for rank, fd in enumerate(rfds):
                    if not select.select([fd], [], [], params.timeout_s)[0]:
                        raise BenchError(f"floor-pipe: reader {rank} silent for "
                                         f"{params.timeout_s:.0f} s")
                    data = os.read(fd, 8)
                    if len(data) != 8:
                        raise BenchError(f"floor-pipe: reader {rank} exited")
                    if counted:
                        out.append(int.from_bytes(data, "little", signed=True))
    finally:
        for c in ends:
            c.close()
    if any(x <= 0 for x in out):
        raise BenchError("floor-pipe: a reader saw a stamp from its future")
    return out
