"""Floors: what the scenarios cost with no queue at all, in the same run.

* step ``floor``: the round trip over bare shared memory in C
  (``fastmq._floor``): the writer copies the payload into a segment and
  bumps a sequence word; each reader copies it out and answers on its own
  cache line.  ``floor+pickle``, the step's own floor: that plus pickling
  the message and one answer (what any queue of Python objects pays).
  ``floor-memcpy``: one memcpy of the payload.
* tensor ``floor``: in impls.py (one memcpy plus the readers' reads).
* wake ``floor-futex`` / ``floor-pipe``: waking a reader parked in
  ``FUTEX_WAIT`` (C), or blocked in ``os.read`` on a pipe (Python, the
  floor for a queue written in Python), after the writer slept as long as
  it does before each queue sample.

A floor measured slower than a row it bounds is marked in the report.
"""
from __future__ import annotations

import os
import pickle
import signal
import time

import numpy as np

from fastmq.bench.config import fmt_size
from fastmq.bench.harness import BenchError, _on_sigterm, summarize
from fastmq.bench.verify import pattern, step_payload

MEMCPY_WARMUP = 20
MEMCPY_SAMPLES = 500


def _floor_module():
    try:
        from fastmq import _floor
    except ImportError as e:  # built with the package; a stale in-place build lacks it
        raise BenchError("the C floor (fastmq._floor) is not built: run "
                         "`python setup.py build_ext --inplace` or reinstall fastmq "
                         f"({e})") from None
    return _floor


# How long the floor's waits spin before yielding the core between polls:
# longer than a round trip takes when every process has a core of its own
# (well under a microsecond), short enough that a writer and reader pushed
# onto one core by other work hand it over quickly; zero when the run itself
# has more processes than cores.
SPIN_NS = 2_000


def _report_failure(conn, e: BaseException) -> None:
    """Tell the parent why this reader process stops, then stop it."""
    try:
        conn.send(("error", f"{type(e).__name__}: {e}"))
    except BaseException:
        pass
    raise SystemExit(1)


def _serve_rounds(name: str, conn, run) -> None:
    """A floor reader process: attach segment ``name``, then ``run(seg, cmd)``
    for each command the parent sends, until it sends None."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    from fastmq._segment import Segment

    seg = Segment.attach(name)
    try:
        conn.send(("ready", os.getpid()))
        while (cmd := conn.recv()) is not None:
            run(seg, cmd)
            conn.send(("ok",))
    except BaseException as e:
        _report_failure(conn, e)
    finally:
        seg.close()


def floor_reader(name: str, n: int, rank: int, conn, timeout_s: float, spin_ns: int) -> None:
    """Reader process of the step floor: runs the rounds it is told to."""
    _floor = _floor_module()

    def rounds(seg, cmd) -> None:
        size, first, count = cmd
        dst = np.zeros(size, dtype=np.uint8)
        _floor.pingpong_reader(seg, n, rank, dst, first, count, timeout_s, spin_ns)

    _serve_rounds(name, conn, rounds)


def step_floor(env, n: int, params, progress) -> list[dict]:
    """The ``floor`` rows of ``step``, one per payload size."""
    from fastmq import segments
    from fastmq.bench.step import record

    _floor = _floor_module()
    sizes = params.step_sizes
    seg = segments.create_segment("bench", _floor.segment_size(n, max(sizes)),
                                  "the benchmark's floor buffer")
    procs, conns = [], []
    records = []
    spin_ns = 0 if env.oversubscribed(n) else SPIN_NS
    try:
        for rank in range(n):
            r, w = env.ctx.Pipe()
            p = env.ctx.Process(target=floor_reader, daemon=True,
                                args=(seg.name, n, rank, w, params.timeout_s, spin_ns))
            p.start()
            w.close()
            procs.append(p)
            conns.append(r)
        for rank, c in enumerate(conns):
            _expect(c, rank, "ready", params.timeout_s)
        seq = 1
        for size in sizes:
            progress.detail(fmt_size(size))
            src = np.frombuffer(pattern(size), dtype=np.uint8)
            # Warm-up rounds first; their median sizes the counted run to
            # the same time budget the queues get.
            warm = _rounds(_floor, seg, n, conns, src, seq, params.step_warmup, params, spin_ns)
            seq += params.step_warmup
            est = max(float(np.median(warm)), 1.0)
            count = int(min(params.step_max, max(params.step_min,
                                                 params.step_budget_s * 1e9 / est)))
            samples = _rounds(_floor, seg, n, conns, src, seq, count, params, spin_ns)
            seq += count
            records.append(record("floor", n, size, samples.tolist(), params.step_warmup,
                                  env.oversubscribed(n)))
            pickling = pickle_rounds(size, params.step_warmup, count)
            records.append(record("floor+pickle", n, size, (samples + pickling).tolist(),
                                  params.step_warmup, env.oversubscribed(n)))
        for c in conns:
            c.send(None)
        for rank, p in enumerate(procs):
            p.join(params.timeout_s)
            if p.is_alive() or p.exitcode != 0:
                raise BenchError(f"floor (step, N={n}): reader {rank} did not exit cleanly "
                                 f"(exit code {p.exitcode})")
    finally:
        _stop(procs, conns)
        segments.forget_segment(seg.name)
        seg.unlink()
        seg.close()
    return records


def pickle_rounds(size: int, warmup: int, count: int) -> np.ndarray:
    """Nanoseconds of ``pickle.dumps`` + ``pickle.loads`` (protocol 5) of a
    step message with a ``size``-byte payload and of its answer, per round
    (``warmup`` rounds first, not returned)."""
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


def _rounds(_floor, seg, n, conns, src, first, count, params, spin_ns):
    for c in conns:
        c.send((src.size, first, count))
    out = np.zeros(count, dtype=np.int64)
    try:
        _floor.pingpong_writer(seg, n, src, first, out, params.timeout_s, spin_ns)
    except TimeoutError as e:
        errors = [c.recv()[1] for c in conns if c.poll(0.5)]
        raise BenchError(f"floor (step, N={n}): {errors[0] if errors else e}") from None
    for rank, c in enumerate(conns):
        _expect(c, rank, "ok", params.timeout_s)
    return out


def _expect(conn, rank: int, what: str, timeout: float) -> None:
    if not conn.poll(timeout):
        raise BenchError(f"floor: reader {rank} silent for {timeout:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:
        raise BenchError(f"floor: reader {rank} exited") from None
    if msg[0] != what:
        raise BenchError(f"floor: reader {rank}: {msg[1] if len(msg) > 1 else msg}")


def memcpy_floor(sizes: list[int]) -> list[dict]:
    """``floor-memcpy``: one memcpy of each payload size (n_readers 0: no
    reader involved)."""
    _floor = _floor_module()
    records = []
    for size in sizes:
        src = np.frombuffer(pattern(size), dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        out = np.zeros(MEMCPY_WARMUP + MEMCPY_SAMPLES, dtype=np.int64)
        _floor.time_memcpy(dst, src, out)
        if dst.tobytes() != pattern(size):
            raise BenchError("floor-memcpy: the copy differs from its source")
        samples = out[MEMCPY_WARMUP:].tolist()
        records.append({"scenario": "step", "impl": "floor-memcpy", "n_readers": 0,
                        "size_bytes": size, "unit": "us", "warmup": MEMCPY_WARMUP,
                        "oversubscribed": False, **summarize(samples, 1e3),
                        "samples_ns": samples})
    return records


# ---------------------------------------------------------------------------
# wake from idle: a C futex and a Python pipe, with the writer sleeping as
# long as it does before each fastmq wake sample

def _wake_futex_reader(name: str, n: int, rank: int, conn, timeout_s: float) -> None:
    _floor = _floor_module()

    def rounds(seg, cmd) -> None:
        first, count = cmd
        _floor.wake_reader(seg, n, rank, first, count, timeout_s)

    _serve_rounds(name, conn, rounds)


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _wake_pipe_reader(stamps, answers, conn) -> None:
    """Blocked in ``os.read`` on a pipe until the writer's stamp arrives;
    answers with the latency on a pipe of its own.  (``Pipe(duplex=False)``
    is a plain ``os.pipe()``; only its file descriptors are used.)"""
    signal.signal(signal.SIGTERM, _on_sigterm)
    now, read, write = _now, os.read, os.write
    rfd, wfd = stamps.fileno(), answers.fileno()
    try:
        conn.send(("ready", os.getpid()))
        while True:
            data = read(rfd, 8)
            t1 = now()
            if len(data) != 8:  # the writer closed its end: done
                break
            write(wfd, (t1 - int.from_bytes(data, "little")).to_bytes(8, "little",
                                                                      signed=True))
        conn.send(("ok",))
    except BaseException as e:
        _report_failure(conn, e)
    finally:
        stamps.close()
        answers.close()


def _stop(procs, conns) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    for c in conns:
        c.close()


def wake_floor(env, name: str, n: int, idle_s: float, params, progress) -> list[int]:
    """One-way latencies (ns) of ``floor-futex`` or ``floor-pipe``:
    ``params.wake_warmup`` rounds without sleeping, then
    ``params.wake_samples`` rounds each after sleeping ``idle_s``."""
    if name == "floor-futex":
        return _wake_futex(env, n, idle_s, params, progress)
    if name == "floor-pipe":
        return _wake_pipe(env, n, idle_s, params, progress)
    raise ValueError(f"not a wake floor: {name!r}")


def _wake_futex(env, n, idle_s, params, progress) -> list[int]:
    from fastmq import segments

    _floor = _floor_module()
    seg = segments.create_segment("bench", _floor.wake_segment_size(n),
                                  "the benchmark's wake floor")
    procs, conns = [], []
    try:
        for rank in range(n):
            r, w = env.ctx.Pipe()
            p = env.ctx.Process(target=_wake_futex_reader, daemon=True,
                                args=(seg.name, n, rank, w, params.timeout_s))
            p.start()
            w.close()
            procs.append(p)
            conns.append(r)
        for rank, c in enumerate(conns):
            _expect(c, rank, "ready", params.timeout_s)
        out = []
        first = 1
        for rounds, idle in ((params.wake_warmup, 0.0), (params.wake_samples, idle_s)):
            if not rounds:
                continue
            progress.detail(f"{rounds} rounds, {idle:g} s idle before each")
            for c in conns:
                c.send((first, rounds))
            lat = np.zeros((rounds, n), dtype=np.int64)
            try:
                _floor.wake_writer(seg, n, first, int(idle * 1e9), lat,
                                   params.timeout_s + idle)
            except TimeoutError as e:
                errors = [c.recv()[1] for c in conns if c.poll(0.5)]
                raise BenchError(f"floor-futex (wake, N={n}): "
                                 f"{errors[0] if errors else e}") from None
            for rank, c in enumerate(conns):
                _expect(c, rank, "ok", params.timeout_s)
            first += rounds
            out = lat.reshape(-1).tolist()
        for c in conns:
            c.send(None)
        for rank, p in enumerate(procs):
            p.join(params.timeout_s)
            if p.is_alive() or p.exitcode != 0:
                raise BenchError(f"floor-futex (wake, N={n}): reader {rank} did not exit "
                                 f"cleanly (exit code {p.exitcode})")
    finally:
        _stop(procs, conns)
        segments.forget_segment(seg.name)
        seg.unlink()
        seg.close()
    return out


def _wake_pipe(env, n, idle_s, params, progress) -> list[int]:
    procs, conns, ends = [], [], []
    to_readers, from_readers = [], []
    try:
        for _ in range(n):
            stamps_r, stamps_w = env.ctx.Pipe(duplex=False)
            answers_r, answers_w = env.ctx.Pipe(duplex=False)
            ends += [stamps_r, stamps_w, answers_r, answers_w]
            r, w = env.ctx.Pipe()
            p = env.ctx.Process(target=_wake_pipe_reader, daemon=True,
                                args=(stamps_r, answers_w, w))
            p.start()
            w.close()
            stamps_r.close()
            answers_w.close()
            procs.append(p)
            conns.append(r)
            to_readers.append(stamps_w)
            from_readers.append(answers_r)
        for rank, c in enumerate(conns):
            _expect(c, rank, "ready", params.timeout_s)
        now, sleep, write = _now, time.sleep, os.write
        wfds = [c.fileno() for c in to_readers]
        rfds = [c.fileno() for c in from_readers]
        out: list[int] = []
        for i in range(params.wake_warmup + params.wake_samples):
            counted = i >= params.wake_warmup
            if counted:
                progress.detail(f"sample {i - params.wake_warmup + 1}/{params.wake_samples}")
                sleep(idle_s)
            stamp = now().to_bytes(8, "little")
            for fd in wfds:
                write(fd, stamp)
            for rank, fd in enumerate(rfds):
                data = _read_exact(fd, 8, params.timeout_s, rank)
                if counted:
                    out.append(int.from_bytes(data, "little", signed=True))
        for c in to_readers:
            c.close()
        for rank, c in enumerate(conns):
            _expect(c, rank, "ok", params.timeout_s)
        for rank, p in enumerate(procs):
            p.join(params.timeout_s)
            if p.is_alive() or p.exitcode != 0:
                raise BenchError(f"floor-pipe (wake, N={n}): reader {rank} did not exit "
                                 f"cleanly (exit code {p.exitcode})")
    finally:
        _stop(procs, conns)
        for c in ends:
            c.close()
    if any(x <= 0 for x in out):
        raise BenchError("floor-pipe: a reader saw a stamp from its future")
    return out


def _read_exact(fd: int, n: int, timeout_s: float, rank: int) -> bytes:
    import select

    if not select.select([fd], [], [], timeout_s)[0]:
        raise BenchError(f"floor-pipe: reader {rank} silent for {timeout_s:.0f} s")
    data = os.read(fd, n)
    if len(data) != n:
        raise BenchError(f"floor-pipe: reader {rank} exited")
    return data
