"""fastmq-bench: ``--quick`` runs every scenario end to end and writes valid
JSON, Markdown and (with matplotlib) plots; a broken implementation makes
the run fail instead of reporting a time.  No figure is asserted: numbers
belong to the benchmark, not to tests."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from fastmq.bench import config, harness, report, verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _have(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


HAVE_VLLM = _have("vllm.distributed.device_communicators.shm_broadcast")
HAVE_MPL = _have("matplotlib")


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "fastmq.bench", "--no-progress", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------
# end to end

@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    paths = {"json": out / "out.json", "md": out / "RESULTS.md", "plots": out / "plots"}
    proc = bench("--quick", "--json", str(paths["json"]), "--plot", str(paths["plots"]),
                 "--results-md", str(paths["md"]))
    return proc, paths


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_quick_runs_every_scenario_and_writes_valid_json(quick_run):
    proc, paths = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(paths["json"].read_text())
    assert data["schema"] == "fastmq-bench/1"
    assert data["command"].startswith("python -m fastmq.bench --no-progress --quick --json ")
    m = data["machine"]
    for key in ("cpu_model", "logical_cpus", "usable_cpus", "kernel", "python"):
        assert m[key], key
    for key in ("fastmq", "torch", "pyzmq", "libzmq", "numpy"):
        assert data["versions"][key], key
    assert data["config"]["preset"] == "quick"
    assert set(data["scenario_seconds"]) == set(config.SCENARIOS)
    measured = [s for s in config.SCENARIOS if config.preset("quick").readers[s]]

    recs = data["records"]
    assert all("samples_ns" not in r for r in recs)  # only with --raw
    expected = {
        "step": {"fastmq-futex", "fastmq-zmq", "fastmq-spin", "pyzmq", "floor", "floor-memcpy"},
        "throughput": {"fastmq-futex", "fastmq-zmq", "fastmq-spin", "pyzmq"},
        "tensor": {"fastmq-futex+arena", "fastmq-futex", "pyzmq", "floor"},
        "wake": {"fastmq-futex", "fastmq-zmq", "fastmq-spin", "pyzmq"},
    }
    if HAVE_VLLM:
        assert data["versions"]["vllm"]
        for s in ("step", "throughput", "wake"):
            expected[s] |= {"vllm"}
        expected["tensor"] |= {"vllm", "vllm+arena"}
    else:  # said so, not silently dropped
        assert any("vllm" in n and "not measured" in n for n in data["notes"])
    for s, impls in expected.items():
        got = {r["impl"] for r in recs if r["scenario"] == s}
        assert got == impls, (s, got)

    p = config.preset("quick")
    for r in recs:
        assert r["n_readers"] in (0, 1), r
        if r["scenario"] == "throughput":
            assert r["rate"] > 0 and r["messages"] > 0
            assert r["rate_min"] <= r["rate"] <= r["rate_max"]
            continue
        for k in ("p50", "p90", "p99", "mean", "min", "max"):
            assert _finite(r[k]) and r[k] > 0, (r["impl"], k, r[k])
        assert r["min"] <= r["p50"] <= r["p90"] <= r["p99"] <= r["max"], r
        if r["scenario"] == "step":
            assert r["size_bytes"] in p.step_sizes
            assert r["samples"] >= (p.step_min if r["impl"] != "floor-memcpy" else 1)
        if r["scenario"] == "tensor":
            assert r["samples"] == p.tensor_reps and r["size_bytes"] in p.tensor_sizes
            assert r["first_ms"] > 0
            assert _finite(r["x_floor"])
        if r["scenario"] == "wake":
            assert r["samples"] == p.wake_samples  # one latency per reader per message
            assert r["cpu_pct"] >= 0 and r["cpu_window_s"] >= p.idle_window_s
            assert r["idle_before_s"] >= p.wake_gap_s

    # Ratios against vLLM come from the same run's vLLM figures.
    if HAVE_VLLM:
        by = {(r["scenario"], r["impl"], r["size_bytes"]): r for r in recs}
        f, v = by[("step", "fastmq-futex", config.KiB)], by[("step", "vllm", config.KiB)]
        assert f["vs_vllm"] == pytest.approx(v["p50"] / f["p50"])
        assert v["vs_vllm"] == pytest.approx(1.0)
        t = by[("tensor", "fastmq-futex", p.tensor_sizes[0])]
        va = by[("tensor", "vllm+arena", p.tensor_sizes[0])]
        assert t["vs_vllm_arena"] == pytest.approx(va["p50"] / t["p50"])

    # The terminal table is on stdout, ratios and all.
    for s in measured:
        assert report.TITLES[s].split(":")[0] + ":" in proc.stdout
    assert "vs vLLM" in proc.stdout


def test_quick_writes_results_md_with_command_line_and_plots(quick_run):
    proc, paths = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = paths["md"].read_text().splitlines()
    # The exact command line comes first.
    assert md[0] == "# fastmq benchmark results"
    fence = md.index("```")
    assert md[fence + 1].startswith("python -m fastmq.bench --no-progress --quick ")
    assert f"--results-md {paths['md']}" in md[fence + 1]
    text = "\n".join(md)
    for s in config.SCENARIOS:
        if config.preset("quick").readers[s]:
            assert f"### {s}:" in text
    assert "| N | payload | implementation |" in text
    data = json.loads(paths["json"].read_text())
    if HAVE_MPL:
        names = sorted(os.listdir(paths["plots"]))
        assert names == sorted(["step_latency.png", "step_vs_size.png", "tensor_vs_size.png",
                                "wake_latency.png", "throughput.png"])
        for n in names:
            assert (paths["plots"] / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"(plots/{n})" in text
        assert len(data["plots"]) == 5
    else:
        assert not paths["plots"].exists()
        assert any("matplotlib is not installed" in n for n in data["notes"])


@pytest.mark.parametrize("broken, scenario, expect", [
    ("drop", "throughput", "1 message(s) lost"),        # a pipelined gap
    ("drop", "step", "message 3 never arrived"),        # a request that never came
    ("corrupt", "tensor", "the tensor it received differs from what was sent"),
])
def test_broken_implementation_fails_the_run(tmp_path, broken, scenario, expect):
    out = tmp_path / "out.json"
    md = tmp_path / "RESULTS.md"
    proc = bench("--quick", "--scenario", scenario, "--impl", "fastmq-futex",
                 "--broken", broken, "--timeout", "3", "--json", str(out),
                 "--results-md", str(md), timeout=120)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"FAILED: broken-{broken} ({scenario}, N=1)" in proc.stderr
    assert expect in proc.stderr
    # No figure at all, not even for the working implementation.
    assert not out.exists() and not md.exists()
    assert "p50" not in proc.stdout


def test_usage_errors_exit_2_without_running(capsys):
    from fastmq.bench.__main__ import main

    assert main(["--scenario", "nope"]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err
    assert main(["--impl", "fastmq-foo"]) == 2
    assert "unknown implementation(s) fastmq-foo" in capsys.readouterr().err
    assert main(["--sizes", "8"]) == 2
    assert main(["--readers", "0"]) == 2
    assert main(["--tensor-sizes", "1000001"]) == 2
    assert main(["--idle-window", "0"]) == 2


def test_list_names_every_implementation(capsys):
    from fastmq.bench.__main__ import main

    # Only the selected implementations are checked (vLLM is not imported).
    assert main(["--list", "--scenario", "step,wake", "--impl", "fastmq-zmq,pyzmq"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert set(lines) == {"fastmq-futex", "fastmq-zmq", "fastmq-spin", "fastmq-futex+arena",
                          "vllm", "vllm+arena", "pyzmq", "floor"}
    assert lines["fastmq-zmq"].endswith("; step, wake; yes")
    assert lines["pyzmq"].endswith("; step, wake; yes")
    assert lines["vllm"].endswith("; not selected; not checked")


# ---------------------------------------------------------------------------
# the pieces

def test_sizes_parse_and_format():
    assert config.parse_size("100") == 100
    assert config.parse_size("1K") == config.parse_size("1KiB") == 1024
    assert config.parse_size("16M") == 16 << 20
    assert config.parse_size("1.5K") == 1536
    for bad in ("", "x", "-1", "0", "1.3"):
        with pytest.raises(ValueError):
            config.parse_size(bad)
    assert config.fmt_size(100) == "100 B"
    assert config.fmt_size(64 << 10) == "64 KiB"
    assert config.fmt_size(256 << 20) == "256 MiB"


def test_step_payload_check_catches_stale_and_corrupted_payloads():
    p = verify.step_payload(7, 4096)
    verify.check_step_payload(7, p)
    with pytest.raises(verify.VerifyError, match="stamped 6"):
        verify.check_step_payload(7, verify.step_payload(6, 4096))
    b = bytearray(p)
    b[2000] ^= 1
    with pytest.raises(verify.VerifyError, match="differs"):
        verify.check_step_payload(7, bytes(b))
    with pytest.raises(verify.VerifyError, match="differs"):
        verify.check_step_payload(7, p[:-1])
    with pytest.raises(verify.VerifyError, match="2 message"):
        verify.expect_seq(3, 5)
    with pytest.raises(verify.VerifyError, match="duplicated"):
        verify.expect_seq(3, 2)


def test_tensor_checksum_reads_every_byte():
    import torch

    n = 1 << 12
    t = torch.arange(n, dtype=torch.int64)
    t[0] = 5
    t[-1] = n - 1 + 5
    assert verify.checksum(t) == verify.tensor_expected(n, 5)
    for i in (1, n // 2, n - 2):  # a change anywhere shows
        u = t.clone()
        u[i] += 1
        assert verify.checksum(u) != verify.tensor_expected(n, 5)
    # Buffers whose length is not a multiple of 8 count their tail bytes.
    assert verify.checksum(b"\x01" * 9) == 0x0101010101010101 + 1


def test_percentiles_are_nearest_rank():
    v = list(range(1, 101))
    assert harness.percentile(v, 50) == 50
    assert harness.percentile(v, 99) == 99
    assert harness.percentile([3], 99) == 3
    s = harness.summarize([4000, 1000, 2000, 3000], 1e3)
    assert s == {"samples": 4, "p50": 2.0, "p90": 4.0, "p99": 4.0, "mean": 2.5,
                 "min": 1.0, "max": 4.0}
    with pytest.raises(ValueError):
        harness.percentile([], 50)


def test_ratios_and_targets_from_records():
    def rec(scenario, impl, p50, size=config.KiB, n=1, **kw):
        return {"scenario": scenario, "impl": impl, "n_readers": n, "size_bytes": size,
                "p50": p50, **kw}

    mib = 128 * config.MiB
    recs = [rec("step", "vllm", 80.0), rec("step", "fastmq-futex", 8.0),
            rec("step", "fastmq-spin", 7.5),
            rec("tensor", "vllm", 150.0, mib, 4), rec("tensor", "vllm+arena", 120.0, mib, 4),
            rec("tensor", "fastmq-futex+arena", 30.0, mib, 4),
            rec("tensor", "floor", 25.0, mib, 4)]
    report.annotate(recs)
    assert recs[1]["vs_vllm"] == pytest.approx(10.0)
    assert recs[5]["vs_vllm"] == pytest.approx(5.0)
    assert recs[5]["vs_vllm_arena"] == pytest.approx(4.0)
    assert recs[5]["x_floor"] == pytest.approx(1.2)
    got = {t["what"]: t["met"] for t in report.targets(recs)}
    assert got == {
        "step 1 KiB N=1: fastmq p50 / vLLM p50": True,
        "step 1 KiB N=1: fastmq futex p50 / pure spinning p50": True,   # 8 / 7.5 = 1.07
        "tensor 128 MiB N=4: fastmq+arena / floor": True,
        "tensor 128 MiB N=4: vllm / fastmq+arena": True,
        "tensor 128 MiB N=4: vllm+arena / fastmq+arena": True,
    }
    recs[1]["p50"] = 30.0
    assert not report.targets(recs)[0]["met"]
    md = report.render(["a", "b"], [["1", "2"]], "lr", md=True)
    assert md.splitlines() == ["| a | b |", "| :--- | ---: |", "| 1 | 2 |"]


def test_floor_pingpong_and_memcpy_validate_their_arguments():
    from fastmq import _floor, segments

    assert _floor.segment_size(1, 100) == _floor.PAYLOAD_OFF + 100
    with pytest.raises(ValueError):
        _floor.segment_size(0, 100)
    with pytest.raises(ValueError):
        _floor.segment_size(_floor.MAX_READERS + 1, 100)
    seg = segments.create_segment("bench", _floor.segment_size(1, 64), "test")
    try:
        out = np.zeros(3, dtype=np.int64)
        with pytest.raises(ValueError, match="does not fit"):
            _floor.pingpong_writer(seg, 1, np.zeros(65, np.uint8), 1, out, 1.0)
        with pytest.raises(ValueError, match="rank"):
            _floor.pingpong_reader(seg, 1, 1, np.zeros(8, np.uint8), 1, 1, 1.0)
        # Nobody answers: the writer gives up with a clear error.
        with pytest.raises(TimeoutError, match="reader 0 did not answer"):
            _floor.pingpong_writer(seg, 1, np.zeros(64, np.uint8), 1, out, 0.05)
    finally:
        segments.forget_segment(seg.name)
        seg.unlink()
        seg.close()
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    out = np.zeros(5, dtype=np.int64)
    _floor.time_memcpy(dst, src, out)
    assert (dst == src).all() and (out >= 0).all()
    with pytest.raises(ValueError):
        _floor.time_memcpy(np.zeros(10, np.uint8), src, out)


def test_deadline_interrupts_a_blocking_socket_call():
    import time

    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.bind("inproc://fastmq-bench-deadline")
    try:
        with harness.deadline(5.0, "not reached"):
            pass  # finishing in time raises nothing, now or later
        time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(harness.BenchError, match="waiting for nothing: no progress within"):
            with harness.deadline(0.3, "waiting for nothing"):
                s.recv()  # nobody sends: blocks until the deadline interrupts it
        assert time.monotonic() - t0 < 30
    finally:
        s.close(linger=0)
        ctx.term()


def test_vllm_baseline_is_vllms_own_queue():
    """With fastmq's .pth hook installed, the baseline must still be vLLM's
    class (the bench turns the hook off for itself and its children)."""
    import subprocess
    import sys

    code = ("from fastmq.bench.__main__ import main; main(['--list']); "
            "from fastmq.bench import impls; print(impls._vllm_mq().__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "vllm.distributed.device_communicators.shm_broadcast"
