"""fastmq-bench: ``--quick`` runs every scenario end to end and writes valid
JSON and Markdown; a broken implementation makes
the run fail instead of reporting a time; the README's figures are the ones
generated from bench/results.json; the bench runs without torch.  No figure
is asserted: numbers belong to the benchmark, not to tests."""
from __future__ import annotations

import gc
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from fastmq.bench import config, figures, harness, impls, readme, report, scenario

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _have(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


HAVE_VLLM = _have("vllm.distributed.device_communicators.shm_broadcast")


def bench(*args: str, timeout: float = 240, pythonpath: str | None = None
          ) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (pythonpath, ROOT, env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "fastmq.bench", "--no-progress", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------
# end to end

@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    paths = {"json": out / "out.json", "md": out / "RESULTS.md"}
    proc = bench("--quick", "--json", str(paths["json"]), "--results-md", str(paths["md"]))
    return proc, paths


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_quick_runs_every_scenario_and_writes_valid_json(quick_run):
    proc, paths = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(paths["json"].read_text())
    assert data["schema"] == figures.SCHEMA
    assert data["command"].startswith("python -m fastmq.bench --no-progress --quick --json ")
    m = data["machine"]
    for key in ("cpu_model", "logical_cpus", "usable_cpus", "kernel", "python"):
        assert m[key], key
    for key in ("fastmq", "torch", "pyzmq", "libzmq", "numpy"):
        assert data["versions"][key], key
    assert data["config"]["preset"] == "quick"
    measured = [s for s in config.SCENARIOS if config.preset("quick").readers[s]]

    recs = data["records"]
    assert all("samples_ns" not in r for r in recs)
    # Every remote row of both shapes, each security setting.
    remote = {"fastmq-remote", "fastmq-remote+encrypt", "fastmq-remote+plain",
              "fastmq-remote-both"}
    expected = {
        "step": {"fastmq-futex", "floor", "floor+pickle", "fastmq-remote-both+encrypt",
                 "fastmq-remote-both+plain"} | remote,
        "throughput": {"fastmq-futex"},
        "tensor": {"fastmq-futex+arena", "fastmq-futex", "floor", "fastmq-futex+bytes",
                   "fastmq-remote+bytes", "fastmq-futex+list", "fastmq-remote+list"} | remote,
        "wake": {"fastmq-futex", "floor-futex", "floor-pipe"},
    }
    if HAVE_VLLM:
        assert data["versions"]["vllm"]
        for s in ("step", "throughput", "wake"):
            expected[s] |= {"vllm"}
        expected["step"] |= {"vllm-remote", "vllm-remote-both"}
        expected["tensor"] |= {"vllm", "vllm+arena", "vllm-remote", "vllm-remote-both",
                               "vllm+bytes", "vllm-remote+bytes", "vllm+list",
                               "vllm-remote+list"}
    else:  # said so, not silently dropped
        assert any("vllm" in n and "not measured" in n for n in data["notes"])
    for s, names in expected.items():
        got = {r["impl"] for r in recs if r["scenario"] == s}
        assert got == names, (s, got)

    p = config.preset("quick")
    for r in recs:
        assert r["n_readers"] == 1, r
        assert r["runs"] == p.repeats
        if r["scenario"] == "throughput":
            assert r["rate"] > 0 and r["messages"] > 0
            assert r["rate_min"] <= r["rate"] <= r["rate_max"]
            continue
        for k in ("p50", "p90", "p99", "mean", "min", "max"):
            assert _finite(r[k]) and r[k] > 0, (r["impl"], k, r[k])
        assert r["min"] <= r["p50"] <= r["p90"] <= r["p99"] <= r["max"], r
        if r["scenario"] == "step":
            assert r["size_bytes"] in p.step_sizes
            assert r["samples"] >= p.step_min
        if r["scenario"] == "tensor":
            assert r["samples"] == config.tensor_reps_at(p, r["size_bytes"])
            assert r["size_bytes"] in p.tensor_sizes
            assert r["first_ms"] > 0
            if r["impl"] != "floor":
                assert _finite(r["vs_floor"])
        if r["scenario"] == "wake":
            assert r["samples"] == p.wake_samples  # one latency per reader per message
            assert r["idle_before_s"] >= p.wake_gap_s
            if r["impl"].startswith("floor"):
                assert r["cpu_pct"] is None and r["first_us"] is None
            else:
                assert r["cpu_pct"] >= 0 and r["cpu_window_s"] >= p.idle_window_s
                # The fresh queue's first messages, measured apart.
                assert r["first_messages"] == p.wake_first and r["first_us"] > 0
                assert _finite(r["first_vs_later"])
            if r["impl"] != "floor-pipe":
                assert _finite(r["vs_floor"])  # against the Python pipe floor

    # Ratios against vLLM come from the same run's vLLM figures on the same
    # path: arena with arena, arena off with arena off, remote with remote.
    if HAVE_VLLM:
        by = {(r["scenario"], r["impl"], r["size_bytes"]): r for r in recs}
        size = p.tensor_sizes[0]
        for scen, mine, theirs, sz in (
                ("step", "fastmq-futex", "vllm", config.KiB),
                ("step", "fastmq-remote", "vllm-remote", config.KiB),
                ("step", "fastmq-remote-both", "vllm-remote-both", config.KiB),
                ("tensor", "fastmq-futex", "vllm", size),
                ("tensor", "fastmq-futex+arena", "vllm+arena", size),
                ("tensor", "fastmq-remote", "vllm-remote", size),
                ("tensor", "fastmq-remote-both", "vllm-remote-both", size)):
            f, v = by[(scen, mine, sz)], by[(scen, theirs, sz)]
            assert f["vs_vllm"] == pytest.approx(v["p50"] / f["p50"]), (scen, mine)
            assert v["vs_vllm"] is None  # vLLM is the reference, not compared with itself

    # The summary and the notes are on stdout; every scenario's table in the
    # Markdown report (below), also when rendered again from the JSON file.
    assert "summary:" in proc.stdout and "write them with --results-md" in proc.stdout
    for s in measured:
        assert scenario.get(s).title not in proc.stdout
    # Nothing after the report: modules vLLM imports print pages of
    # "nanobind: leaked ..." at interpreter teardown, which the command skips.
    assert "nanobind" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]
    again = paths["md"].parent / "again.md"
    rendered = subprocess.run([sys.executable, "-m", "fastmq.bench", "--from-json",
                               str(paths["json"]), "--results-md", str(again)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    text = again.read_text()
    assert "(Rendered again from that run's JSON by `python -m fastmq.bench --from-json " in text
    for s in measured:
        assert f"### {scenario.get(s).title}" in text
    assert text.count("| vs vLLM |") >= len(measured)


def test_quick_output_names_no_issue_numbers_or_targets(quick_run):
    proc, paths = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in (proc.stdout, paths["md"].read_text(), paths["json"].read_text()):
        assert not re.search(r"#\d|\bissues?\b|\btargets?\b", text, re.I), \
            re.search(r".{60}(#\d|\bissues?\b|\btargets?\b).{60}", text, re.I | re.S)


def test_quick_writes_results_md_with_command_line(quick_run):
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


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not importable")
def test_remote_both_ways_runs_fastmq_and_vllm_with_several_readers(tmp_path):
    # vLLM's multi-node executor shape: each reader answers on a queue the
    # writer reads remotely (create_from_handle(handle, -1)), for both
    # queues in one run; every row against vLLM's of the same shape.
    out = tmp_path / "out.json"
    proc = bench("--quick", "--scenario", "step", "--impl",
                 "fastmq-remote-both,fastmq-remote-both+plain,vllm-remote-both",
                 "--readers", "2", "--sizes", "1K", "--timeout", "20", "--json", str(out),
                 timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    got = {r["impl"]: r for r in data["records"]}
    assert set(got) == {"fastmq-remote-both", "fastmq-remote-both+plain", "vllm-remote-both"}
    for name, r in got.items():
        assert r["n_readers"] == 2 and r["samples"] > 0, name
        if name != "vllm-remote-both":
            assert r["vs_vllm"] == pytest.approx(got["vllm-remote-both"]["p50"] / r["p50"])


def test_remote_rows_pass_fastmq_s_security_settings():
    # Default security passes no keyword; the others name theirs.
    assert impls.IMPLS["fastmq-remote"].remote_kwargs == {}
    assert impls.IMPLS["fastmq-remote-both+encrypt"].remote_kwargs == {
        "remote_security": "encrypt"}
    assert impls.IMPLS["fastmq-remote+plain"].remote_kwargs == {"remote_security": "none"}
    assert impls.REMOTE_ROWS["fastmq-remote-both+plain"] == "vllm-remote-both"


def test_floors_run_with_several_readers(tmp_path):
    # Each floor's readers are told their batch of rounds through the queue;
    # the pipe floor's readers open the writer's pipes: two readers each.
    out = tmp_path / "out.json"
    proc = bench("--quick", "--scenario", "step,wake,tensor", "--impl",
                 "floor,floor-futex,floor-pipe", "--readers", "2", "--sizes", "1K",
                 "--timeout", "20", "--json", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {(r["scenario"], r["impl"]): r for r in json.loads(out.read_text())["records"]}
    assert set(got) == {("step", "floor"), ("step", "floor+pickle"), ("tensor", "floor"),
                        ("wake", "floor-futex"), ("wake", "floor-pipe")}
    for r in got.values():
        assert r["n_readers"] == 2 and r["samples"] > 0 and r["p50"] > 0, r
    assert got[("wake", "floor-pipe")]["samples"] == 2 * config.preset("quick").wake_samples


def test_quick_is_one_run_of_every_figure():
    # CI runs --quick: one run, the fewest samples that still verify.
    p = config.preset("quick")
    assert p.repeats == 1 and config.preset("full").repeats >= 3
    # The generate scenario starts vLLM (minutes here): not in --quick.
    assert p.readers["generate"] == []
    assert all(ns == [1] for s, ns in p.readers.items() if s != "generate")


@pytest.mark.parametrize("broken, scenario, expect", [
    ("drop", "throughput", "1 message(s) lost"),        # a pipelined gap
    ("drop", "step", "message 3 never arrived"),        # a request that never came
    ("corrupt", "tensor", "the tensor it received differs from what was sent"),
])
def test_broken_implementation_fails_the_run(tmp_path, monkeypatch, capsys, broken, scenario,
                                             expect):
    from fastmq.bench.__main__ import main

    # The writer lives in this process: its third message (inside the warm-up) is lost
    # or has one byte (or its number) wrong.
    from fastmq import MessageQueue

    send, count = MessageQueue.enqueue, [0]

    def faulty(self, obj, timeout=None):
        if obj is not None:
            count[0] += 1
            if count[0] == 3:
                if broken == "drop":
                    return
                obj = _corrupt(obj)
        send(self, obj, timeout)

    monkeypatch.setattr(MessageQueue, "enqueue", faulty)
    monkeypatch.setenv("FASTMQ_VLLM", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    out = tmp_path / "out.json"
    md = tmp_path / "RESULTS.md"
    try:
        rc = main(["--quick", "--no-progress", "--scenario", scenario, "--impl",
                   "fastmq-futex", "--timeout", "3", "--json", str(out), "--results-md", str(md)])
    finally:
        gc.unfreeze()  # the run froze this process's objects, as a bench process does
    got = capsys.readouterr()
    assert rc == 1, (got.out[-2000:], got.err[-2000:])
    assert f"FAILED: fastmq-futex ({scenario}, N=1)" in got.err
    assert expect in got.err
    assert not out.exists() and not md.exists()
    assert "p50" not in got.out


def _corrupt(msg):
    msg = list(msg)
    for i, part in enumerate(msg):
        if isinstance(part, (bytes, bytearray)) and len(part) > 16:
            b = bytearray(part)
            b[len(b) // 2] ^= 0xFF
            msg[i] = bytes(b)
            return tuple(msg)
        if hasattr(part, "element_size"):  # torch.Tensor
            t = part.clone()
            t.view(-1)[t.numel() // 2] += 1
            msg[i] = t
            return tuple(msg)
    msg[1] += 1
    return tuple(msg)


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
    assert main(["--tensor-reps", "0"]) == 2
    assert main(["--link-rate", "fast"]) == 2
    assert "--link-rate 'fast': expected a rate like 10gbit" in capsys.readouterr().err


def _lo_qdiscs() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True,
                          capture_output=True, text=True).stdout


def test_link_rate_sends_the_remote_paths_through_a_shaped_link(tmp_path):
    """--link-rate: the run gets a network namespace of its own whose
    loopback is shaped; the remote paths' bytes go through the shaper (its
    counter holds every message), the report says so, and this machine's
    own loopback is left as it was."""
    before = _lo_qdiscs()
    out = tmp_path / "link.json"
    p = bench("--quick", "--scenario", "tensor", "--impl", "fastmq-remote,fastmq-remote+plain",
              "--link-rate", "10gbit", "--json", str(out), timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["link"]["rate"] == "10gbit"
    assert "tbf" in r["link"]["qdisc"] and "rate 10Gbit" in r["link"]["qdisc"]
    tensors = [x for x in r["records"] if x["scenario"] == "tensor"]
    assert {x["impl"] for x in tensors} == {"fastmq-remote", "fastmq-remote+plain"}
    moved = sum(x["size_bytes"] * (x["samples"] + x["warmup"]) for x in tensors)
    assert r["link"]["sent_bytes"] >= moved
    assert "TCP over loopback shaped to 10gbit" in p.stdout
    assert "remote (TCP), default security  16 MiB" in p.stdout   # the security cost's row
    assert _lo_qdiscs() == before


def test_list_names_every_implementation(capsys):
    from fastmq.bench.__main__ import main

    # Only the selected implementations are checked (vLLM is not imported).
    assert main(["--list", "--scenario", "step,wake", "--impl", "fastmq-futex,floor-pipe"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, ln in enumerate(out) if ln.startswith("implementations"))
    lines = {ln.split()[0]: ln for ln in out[start + 1:]}
    assert set(lines) == {"fastmq-futex", "fastmq-futex+arena",
                          "fastmq-remote", "fastmq-remote+encrypt", "fastmq-remote+plain",
                          "fastmq-remote-both", "fastmq-remote-both+encrypt",
                          "fastmq-remote-both+plain", "vllm", "vllm+arena", "vllm-remote",
                          "vllm-remote-both", "floor", "floor-futex", "floor-pipe",
                          "fastmq-futex+bytes", "vllm+bytes", "fastmq-remote+bytes",
                          "vllm-remote+bytes", "fastmq-futex+list", "vllm+list",
                          "fastmq-remote+list", "vllm-remote+list"}
    assert lines["fastmq-futex"].endswith("; step, wake; yes")
    assert lines["floor-pipe"].endswith("; wake; yes")
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
    p = harness.step_payload(7, 4096)
    harness.check_step_payload(7, p)
    with pytest.raises(harness.VerifyError, match="stamped 6"):
        harness.check_step_payload(7, harness.step_payload(6, 4096))
    b = bytearray(p)
    b[2000] ^= 1
    with pytest.raises(harness.VerifyError, match="differs"):
        harness.check_step_payload(7, bytes(b))
    with pytest.raises(harness.VerifyError, match="differs"):
        harness.check_step_payload(7, p[:-1])
    with pytest.raises(harness.VerifyError, match="2 message"):
        harness.expect_seq(3, 5)
    with pytest.raises(harness.VerifyError, match="duplicated"):
        harness.expect_seq(3, 2)


def test_tensor_checksum_reads_every_byte():
    import torch

    n = 1 << 12
    t = torch.arange(n, dtype=torch.int64)
    t[0] = 5
    t[-1] = n - 1 + 5
    assert harness.checksum(t) == harness.tensor_expected(n, 5)
    for i in (1, n // 2, n - 2):  # a change anywhere shows
        u = t.clone()
        u[i] += 1
        assert harness.checksum(u) != harness.tensor_expected(n, 5)
    # The sum wraps at 64 bits, as the expected value does.
    big = torch.full((4,), 1 << 62, dtype=torch.int64)
    assert harness.checksum(big) == (4 << 62) % (1 << 64) == 0
    with pytest.raises(harness.VerifyError, match="non-contiguous"):
        harness.checksum(torch.arange(16, dtype=torch.int64).view(4, 4).t())


def test_list_checksum_reads_every_byte_in_place(monkeypatch):
    import random
    import tracemalloc

    rnd = random.Random(7)
    data = rnd.randbytes(8 * 5000)
    cuts = sorted(rnd.sample(range(1, len(data)), 300))  # ragged items, words split
    items = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
    want = int(np.frombuffer(data, dtype=np.uint64).sum(dtype=np.uint64))
    monkeypatch.setattr(harness, "CHECK_BATCH", 1000)  # many batches, carries between them
    assert harness.list_checksum(items) == (want, len(data))
    for i in (0, len(items) // 2, len(items) - 1):  # a change anywhere shows
        bad = list(items)
        bad[i] = bytes([bad[i][0] ^ 1]) + bad[i][1:]
        assert harness.list_checksum(bad)[0] != want
    assert harness.list_checksum([]) == (0, 0)
    with pytest.raises(harness.VerifyError, match="not a whole number of 8-byte words"):
        harness.list_checksum([*items, b"abc"])
    # The whole list is never copied: a reader's check allocates about a batch.
    monkeypatch.setattr(harness, "CHECK_BATCH", 1 << 20)
    big = [bytes(1024)] * (16 << 10)  # 16 MiB
    tracemalloc.start()
    try:
        assert harness.list_checksum(big) == (0, 16 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20, peak


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


def _rec(scenario, impl, p50, size=config.KiB, n=1, **kw):
    return {"scenario": scenario, "impl": impl, "n_readers": n, "size_bytes": size,
            "p50": p50, "unit": "us", **kw}


def test_ratios_compare_like_with_like_in_one_convention():
    mib = 64 * config.MiB
    recs = [_rec("step", "vllm", 80.0), _rec("step", "fastmq-futex", 8.0),
            _rec("step", "floor", 2.0), _rec("step", "floor+pickle", 4.0),
            _rec("step", "vllm-remote", 300.0),
            _rec("step", "fastmq-remote", 150.0), _rec("step", "fastmq-remote+plain", 100.0),
            _rec("step", "vllm-remote-both", 400.0), _rec("step", "fastmq-remote-both", 800.0),
            _rec("tensor", "vllm-remote-both", 90.0, mib, 4),
            _rec("tensor", "fastmq-remote-both", 60.0, mib, 4),
            _rec("tensor", "vllm", 150.0, mib, 4), _rec("tensor", "vllm+arena", 120.0, mib, 4),
            _rec("tensor", "fastmq-futex+arena", 30.0, mib, 4),
            _rec("tensor", "fastmq-futex", 300.0, mib, 4),
            _rec("tensor", "floor", 25.0, mib, 4),
            _rec("wake", "fastmq-futex", 100.0, None), _rec("wake", "floor-pipe", 60.0, None),
            {"scenario": "throughput", "impl": "vllm", "n_readers": 1, "size_bytes": 64,
             "rate": 40e3},
            {"scenario": "throughput", "impl": "fastmq-futex", "n_readers": 1,
             "size_bytes": 64, "rate": 300e3}]
    figures.annotate(recs)
    by = {(r["scenario"], r["impl"]): r for r in recs}
    # Always the reference's time / this time: above 1 = faster.
    assert by[("step", "fastmq-futex")]["vs_vllm"] == pytest.approx(10.0)
    # The step's floor is the C round trip plus pickling, not the bare one.
    assert by[("step", "fastmq-futex")]["vs_floor"] == pytest.approx(0.5)
    assert by[("step", "fastmq-remote")]["vs_floor"] == pytest.approx(4 / 150)
    assert by[("step", "fastmq-remote")]["vs_vllm"] == pytest.approx(2.0)   # remote vs remote
    assert by[("step", "fastmq-remote+plain")]["vs_vllm"] == pytest.approx(3.0)
    # remote both ways against vLLM remote both ways, a loss shown as one
    assert by[("step", "fastmq-remote-both")]["vs_vllm"] == pytest.approx(0.5)
    assert by[("tensor", "fastmq-futex+arena")]["vs_vllm"] == pytest.approx(4.0)  # arena
    assert by[("tensor", "fastmq-futex")]["vs_vllm"] == pytest.approx(0.5)  # off vs off
    assert by[("tensor", "fastmq-futex")]["vs_floor"] == pytest.approx(25 / 300)
    assert by[("wake", "fastmq-futex")]["vs_floor"] == pytest.approx(0.6)   # pipe floor
    assert by[("throughput", "fastmq-futex")]["vs_vllm"] == pytest.approx(7.5)
    assert by[("step", "vllm")]["vs_vllm"] is None
    md = report.render(["a", "b"], [["1", "2"]], "lr", md=True)
    assert md.splitlines() == ["| a | b |", "| :--- | ---: |", "| 1 | 2 |"]
    # Both sides of every tensor path are in the summary matrix, losses too.
    for r in recs:
        r.setdefault("runs", 1)
    # The summary puts the step beside its floor, with the ratio.
    assert ["step round trip against its floor (pickling + a C round trip), 1 KiB, N=1",
            "8.00 us (fastmq-futex)", "4.00 us (floor+pickle)", "0.500x"] in report.summary_rows(recs)
    tensor = scenario.get("tensor")
    headers, rows, slower = report.grid(recs, tensor, tensor.grids[0][3], "vLLM / fastmq")
    assert ["arena", "64 MiB", "120 / 30.0 = 4.00x"] in rows
    assert ["arena off", "64 MiB", "150 / 300 = 0.500x"] in rows
    assert ["remote both ways", "64 MiB", "90.0 / 60.0 = 1.50x"] in rows
    assert ["floor (one memcpy, every reader's read)", "64 MiB", "25.0"] in rows
    # Under the table, in one sentence: the cells where fastmq is slower.
    assert slower == ["arena off 64 MiB at N=4 (0.500x)"]
    assert report.slower_text(slower) == ("Where fastmq is slower than vLLM in this table: "
                                          "arena off 64 MiB at N=4 (0.500x).")
    assert report.slower_text([]).startswith("fastmq is at or ahead of vLLM in every cell")
    # The first-use table compares the runs' first messages.
    by[("tensor", "vllm+arena")]["first_ms"], by[("tensor", "fastmq-futex+arena")]["first_ms"] \
        = 200.0, 400.0
    first = tensor.grids[1]
    assert first[4] == "first_ms"
    _, rows, slower = report.grid(recs, tensor, first[3], first[2], first[4])
    assert rows == [["arena", "64 MiB", "200 / 400 = 0.500x"]]
    assert slower == ["arena 64 MiB at N=4 (0.500x)"]
    # The summary: each remote row against vLLM's of its shape, and what the
    # default security costs against +plain (100 us / 150 us).
    rows = {r[0]: r[1:] for r in report.summary_rows(recs)}
    assert rows["step round trip, remote readers (TCP), +plain, 1 KiB, N=1"] == [
        "100 us (fastmq-remote+plain)", "300 us (vllm-remote)", "3.00x"]
    assert rows["step round trip, remote both ways (vLLM's multi-node executor shape), "
                "1 KiB, N=1"] == ["800 us (fastmq-remote-both)",
                                       "400 us (vllm-remote-both)", "0.500x"]
    assert rows["security cost: fastmq-remote against fastmq-remote+plain, step round trip, "
                "1 KiB, N=1"] == ["150 us (fastmq-remote)",
                                       "100 us (fastmq-remote+plain)", "0.667x"]


def test_repeated_runs_merge_to_the_median_with_spread():
    runs = []
    for p50, v in ((10.0, 50.0), (30.0, 60.0), (20.0, 90.0)):
        run = [_rec("step", "fastmq-futex", p50, samples=100, min=p50 / 2, max=p50 * 2,
                    p90=p50, p99=p50, mean=p50),
               _rec("step", "vllm", v, samples=100, min=v, max=v, p90=v, p99=v, mean=v)]
        figures.annotate(run)
        runs.append(run)
    merged = {r["impl"]: r for r in figures.merge(runs)}
    f = merged["fastmq-futex"]
    assert f["runs"] == 3 and f["p50"] == 20.0 and f["p50_runs"] == [10.0, 30.0, 20.0]
    assert f["samples"] == 300 and f["min"] == 5.0 and f["max"] == 60.0
    # The ratio is the quotient of the medians printed beside it (60 / 20),
    # not the median of the runs' own ratios (5, 2, 4.5), which are kept.
    assert f["vs_vllm"] == pytest.approx(3.0)
    assert f["vs_vllm_runs"] == pytest.approx([5.0, 2.0, 4.5])
    assert scenario.spread(f) == "10.0..30.0"


def test_repeated_runs_alternate_the_order_of_implementations(monkeypatch):
    # What one implementation leaves behind (memory the machine provisions
    # again, a warm cache) must not always fall to the same next one.
    import dataclasses
    import importlib

    from fastmq.bench import runner
    tensor = importlib.import_module("fastmq.bench.tensor")
    orders = []

    def fake_run(env, impls_, params, progress):
        orders.append([i.name for i in impls_])
        return [_rec("tensor", i.name, 1.0 + k, samples=5, min=1.0, max=2.0, p90=1.0,
                     p99=1.0, mean=1.0) for k, i in enumerate(impls_)]

    monkeypatch.setattr(tensor, "run", fake_run)
    params = dataclasses.replace(config.preset("quick"), repeats=3)
    a, b = "fastmq-futex+arena", "fastmq-futex"
    out = runner.run(runner.plan(["tensor"], f"{a},{b}"), params, progress=False)
    assert orders == [[a, b], [b, a], [a, b]]
    assert {r["impl"]: r["runs"] for r in out["records"]} == {a: 3, b: 3}
    assert any("reverse order" in n for n in out["notes"])


def test_a_floor_slower_than_what_it_bounds_is_marked():
    recs = [_rec("step", "floor", 300.0, config.MiB), _rec("step", "fastmq-futex", 200.0,
                                                            config.MiB),
            _rec("step", "vllm", 400.0, config.MiB),
            _rec("wake", "floor-pipe", 60.0, None), _rec("wake", "floor-futex", 50.0, None),
            _rec("wake", "fastmq-futex", 90.0, None)]
    notes = figures.check_floors(recs)
    assert recs[0]["not_a_floor"] == ["fastmq-futex"]
    assert len(notes) == 1 and notes[0].startswith("NOT A FLOOR: floor (step 1 MiB, N=1)")
    # The C futex floor bounds the pipe floor too; the pipe floor only the queues.
    assert "not_a_floor" not in recs[3] and "not_a_floor" not in recs[4]
    recs[4]["p50"] = 70.0
    assert figures.check_floors(recs)[1].startswith("NOT A FLOOR: floor-futex (wake, N=1)")
    assert recs[4]["not_a_floor"] == ["floor-pipe"]
    recs[0]["p50"], recs[4]["p50"] = 100.0, 50.0
    for r in recs:
        r.pop("not_a_floor", None)
    assert figures.check_floors(recs) == [] and not any("not_a_floor" in r for r in recs)


def _readme_block() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    a, b = text.find(readme.BEGIN), text.find(readme.END)
    assert 0 <= a < b, "README.md has no generated figures block"
    return text[a:b + len(readme.END)]


def test_readme_figures_are_generated_from_results_json():
    """The README's figures block is exactly what `fastmq-bench --readme
    bench/results.json [--readme bench/results-25gbit.json]` generates, from
    the files its first line names: nobody types a figure."""
    current = _readme_block()
    m = re.search(r"Generated by `fastmq-bench ((?:--readme \S+ )+)--update-readme README.md`",
                  current)
    assert m, "the README's figures do not name the command that generated them"
    paths = m.group(1).split()[1::2]
    assert paths[0] == "bench/results.json"
    results = [figures.load_results(os.path.join(ROOT, p)) for p in paths]
    block = readme.block(results[0], paths[0], tuple(zip(results[1:], paths[1:])))
    assert current == block, ("README.md's figures differ from the JSON files: run "
                              f"`{readme.command(paths)}`")
    # One table, at most 8 rows, no implementation names in its cells, one
    # kind of ratio; and the sentence saying where fastmq is slower.
    (headers, rows), = _md_tables(current)
    assert headers == readme.HEADERS and 0 < len(rows) <= readme.MAX_ROWS
    assert not any("(" in cell for row in rows for cell in row[1:])
    assert "fastmq is slower than vLLM (below 1x) in " in current


def test_the_slower_sentence_comes_from_the_figures():
    recs = [_rec("step", "vllm", 80.0), _rec("step", "fastmq-futex", 8.0),
            _rec("step", "vllm-remote", 80.0, config.MiB, 2),
            _rec("step", "fastmq-remote", 160.0, config.MiB, 2)]
    figures.annotate(recs)
    text = readme.slower([{"records": recs}])
    assert text == ("fastmq is slower than vLLM (below 1x) in step, 1 of 2 figures "
                    "(fastmq-remote, 1 MiB; lowest 0.500x, fastmq-remote, N=2).")
    figures.annotate(recs[:2])
    assert readme.slower([{"records": recs[:2]}]) == (
        "fastmq is faster than vLLM in every one of the 1 figures compared.")
    # The tensor rows' first messages get a sentence of their own.
    mib = 64 * config.MiB
    tensors = [dict(_rec("tensor", impl, p50, mib, 2), first_ms=first) for impl, p50, first in
               (("vllm+arena", 8.0, 30.0), ("fastmq-futex+arena", 4.0, 60.0),
                ("vllm", 50.0, 50.0), ("fastmq-futex", 40.0, 40.0))]
    figures.annotate(tensors)
    assert readme.slower([{"records": tensors}]) == (
        "fastmq is faster than vLLM in every one of the 2 figures compared. On first use (a "
        "fresh queue's first messages: of each tensor size; wake's first pass over the ring) "
        "it is slower in tensor, 1 of 2 figures (fastmq-futex+arena, 64 MiB; lowest 0.500x, "
        "fastmq-futex+arena, N=2).")
    # So are wake's: a fresh queue's first messages against vLLM's, and
    # against the same row's later ones.
    wakes = [dict(_rec("wake", impl, p50, None, 1), first_us=first) for impl, p50, first in
             (("vllm", 600.0, 900.0), ("fastmq-futex", 150.0, 300.0))]
    figures.annotate(wakes)
    mine = wakes[1]
    assert mine["first_vs_vllm"] == 3.0 and mine["first_vs_later"] == 0.5
    assert readme.slower([{"records": wakes}]).endswith(
        "On first use it is at or ahead in all 1 figures.")
    rows = report.summary_rows(wakes, readme=True)
    assert ["wake from idle, the first messages of a fresh queue, N=1", "300 us", "900 us",
            "3.00x"] in rows


def test_a_json_file_of_another_format_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**_result([]), "schema": "fastmq-bench/2"}))
    with pytest.raises(ValueError, match="not a fastmq-bench/3 JSON file"):
        figures.load_results(str(path))


def test_update_readme_replaces_only_the_block(tmp_path):
    f = tmp_path / "README.md"
    f.write_text(f"intro\n{readme.BEGIN}\nold 1.0 us\n{readme.END}\nend\n")
    assert readme.update(str(f), f"{readme.BEGIN}\nnew\n{readme.END}")
    assert f.read_text() == f"intro\n{readme.BEGIN}\nnew\n{readme.END}\nend\n"
    f.write_text("no block here\n")
    with pytest.raises(ValueError, match="no generated figures block"):
        readme.update(str(f), "x")


def test_runs_without_torch(tmp_path):
    """A plain install has no torch: the bench skips the tensor scenario and
    says so, in --list and in the report, instead of crashing."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text(
        "raise ImportError('torch is not installed (shadowed by the test)')\n")
    proc = bench("--list", "--scenario", "step,tensor", pythonpath=str(shadow), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scenario tensor: skipped: needs torch" in proc.stdout
    assert "pip install 'vllm-fastmq[torch]'" in proc.stdout
    out = tmp_path / "out.json"
    proc = bench("--quick", "--scenario", "step,tensor", "--impl", "fastmq-futex", "--json",
                 str(out), pythonpath=str(shadow), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["versions"]["torch"] is None
    assert set(data["skipped_scenarios"]) == {"tensor"}
    assert {r["scenario"] for r in data["records"]} == {"step"}
    assert any(n.startswith("Scenario tensor skipped: needs torch") for n in data["notes"])
    assert "Scenario tensor skipped: needs torch" in proc.stdout


def test_wake_floor_validates_and_measures():
    from fastmq import _floor, segments

    with pytest.raises(ValueError):
        _floor.wake_segment_size(0)
    seg = segments.create_segment("bench", _floor.wake_segment_size(1))
    try:
        out = np.zeros((2, 1), dtype=np.int64)
        with pytest.raises(ValueError, match="one column per reader"):
            _floor.wake_writer(seg, 1, 1, 0, np.zeros((2, 2), np.int64), 1.0)
        with pytest.raises(ValueError, match="numbered from 1"):
            _floor.wake_writer(seg, 1, 0, 0, out, 1.0)
        with pytest.raises(ValueError, match="rank"):
            _floor.wake_reader(seg, 1, 1, 1, 1, 1.0)
        # Nobody is parked: the writer gives up with a clear error.
        with pytest.raises(TimeoutError, match="reader 0 did not wake"):
            _floor.wake_writer(seg, 1, 1, 0, out, 0.05)
        # The round is published now: a reader sees it without sleeping.
        _floor.wake_reader(seg, 1, 0, 1, 1, 1.0)
        with pytest.raises(TimeoutError, match="reader 0 saw no round 2"):
            _floor.wake_reader(seg, 1, 0, 2, 1, 0.05)
    finally:
        seg.close()


def test_floor_pingpong_validates_its_arguments():
    from fastmq import _floor, segments

    assert _floor.segment_size(1, 100) == _floor.PAYLOAD_OFF + 100
    with pytest.raises(ValueError):
        _floor.segment_size(0, 100)
    with pytest.raises(ValueError):
        _floor.segment_size(_floor.MAX_READERS + 1, 100)
    seg = segments.create_segment("bench", _floor.segment_size(1, 64))
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
        seg.close()


def test_the_pickling_floor_times_each_round():
    from fastmq.bench import step

    out = step.pickle_rounds(config.KiB, 2, 5)
    assert out.shape == (5,) and (out > 0).all()


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
            "from fastmq.bench import impls; print(impls.IMPLS['vllm'].mq_class().__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "vllm.distributed.device_communicators.shm_broadcast"


# ---------------------------------------------------------------------------
# the arithmetic of every generated table

_QUOTIENT = re.compile(r"(\d[\d.]*) / (\d[\d.]*) = (\d[\d.]*)x")
_FIGURE = re.compile(r"(\d[\d.]*)( [kM])?")


def _figure(cell: str) -> float:
    """The first figure in a cell, ``231.8 k msg/s`` -> 231800."""
    m = _FIGURE.search(cell)
    assert m, cell
    return float(m.group(1)) * {None: 1, " k": 1e3, " M": 1e6}[m.group(2)]


def _close(printed: float, a: float, b: float) -> bool:
    # Within 3% of a / b: the figures are printed to three digits.
    return b > 0 and abs(printed - a / b) <= 0.03 * (a / b)


def _md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            tables.append((block[0], block[2:]))
            block = []
    return tables


def arithmetic_errors(text: str) -> list[str]:
    """Every ratio in ``text`` (a report, RESULTS.md, the README) that is
    not the quotient of the two figures printed beside it, in the
    direction its table states."""
    bad = []
    # ``a / b = rx`` cells: literally a / b.
    for a, b, r in _QUOTIENT.findall(text):
        if not _close(float(r), float(a), float(b)):
            bad.append(f"{a} / {b} = {r}x")
    for headers, rows in _md_tables(text):
        if headers == readme.HEADERS:
            # vLLM's figure / fastmq's (throughput: fastmq's / vLLM's).
            for fig, mine, ref, r in rows:
                a, b = _figure(mine), _figure(ref)
                if not (_close(_figure(r), a, b) if "msg/s" in mine else _close(_figure(r), b, a)):
                    bad.append(f"{fig}: {mine} against {ref} = {r}")
            continue
        if headers == ["figure", "fastmq", "compared with", "ratio"]:
            # The reference's time / fastmq's (for rates: fastmq's / the reference's).
            for fig, mine, ref, r in rows:
                if not r:
                    continue
                a, b = _figure(mine), _figure(ref)
                ok = (_close(_figure(r), a, b) if "msg/s" in mine
                      else _close(_figure(r), b, a))
                if not ok:
                    bad.append(f"{fig}: {mine} against {ref} = {r}")
        if "vs vLLM" not in headers:
            continue
        # A scenario's table: "vs vLLM" / "vs floor" against the row of the
        # reference with the same reader count and size.
        value = next(i for i, h in enumerate(headers) if h.startswith(("p50", "msgs/s")))
        impl = headers.index("implementation")
        keys = [i for i in range(value) if i != impl and headers[i] != "idle before"]
        by = {(tuple(row[i] for i in keys), row[impl].replace(" (!)", "")): row
              for row in rows}
        rate = headers[value].startswith("msgs/s")
        # The step's floor is the C round trip plus pickling where measured.
        floor = "floor+pickle" if any(k[1] == "floor+pickle" for k in by) else "floor"
        for key, row in by.items():
            for col, ref_impl in (("vs vLLM", _COUNTERPART.get(key[1], "vllm")), ("vs floor", floor),
                                  ("vs pipe floor", "floor-pipe")):
                if col not in headers or row[headers.index(col)] == "-":
                    continue
                ref = by.get((key[0], ref_impl))
                assert ref is not None, (key, col)
                a, b = _figure(row[value]), _figure(ref[value])
                r = _figure(row[headers.index(col)])
                if not (_close(r, a, b) if rate else _close(r, b, a)):
                    bad.append(f"{key} {col}: {row[value]} against {ref[value]} = "
                               f"{row[headers.index(col)]}")
    return bad


_COUNTERPART = {**scenario.get("step").rows, **scenario.get("tensor").rows}


def _merged_runs() -> list[dict]:
    """Three runs whose per-run ratios have a median far from the quotient
    of the medians (as on a busy machine)."""
    mib = 64 * config.MiB
    runs = []
    for k, (f, v) in enumerate(((10.0, 50.0), (30.0, 60.0), (20.0, 90.0))):
        run = []
        for scenario, impl, p50, size in (
                ("step", "fastmq-futex", f, config.KiB), ("step", "vllm", v, config.KiB),
                ("step", "floor", f / 4 + k, config.KiB),
                ("tensor", "fastmq-futex+arena", f, mib), ("tensor", "vllm+arena", v, mib),
                ("tensor", "fastmq-futex", v, mib), ("tensor", "vllm", f, mib),
                ("tensor", "floor", f / 5 + k, mib),
                ("wake", "fastmq-futex", f * 10, None), ("wake", "vllm", v * 10, None),
                ("wake", "floor-pipe", v, None), ("wake", "floor-futex", f, None)):
            run.append(_rec(scenario, impl, p50, size, samples=10, min=p50, max=p50, p90=p50,
                            p99=p50, mean=p50, warmup=1, first_ms=p50, idle_before_s=0.1,
                            spin_s=0.0, cpu_pct=None, cpu_window_s=1.0))
        run += [{"scenario": "throughput", "impl": "fastmq-futex", "n_readers": 1,
                 "size_bytes": 64, "rate": 1e5 * (k + 1) ** 2, "rate_min": 1.0,
                 "rate_max": 1e9, "messages": 10},
                {"scenario": "throughput", "impl": "vllm", "n_readers": 1, "size_bytes": 64,
                 "rate": 3e4 * (3 - k), "rate_min": 1.0, "rate_max": 1e9, "messages": 10}]
        figures.annotate(run)
        runs.append(run)
    return figures.merge(runs)


def _result(records: list[dict]) -> dict:
    return {"command": "python -m fastmq.bench --full", "started": "2026-01-01T00:00:00+00:00",
            "duration_s": 1.0, "config": {"preset": "full"}, "notes": ["a note"],
            "machine": {"cpu_model": "cpu", "usable_cpus": 2, "logical_cpus": 2,
                        "memory_bytes": None, "kernel": "k", "python": "3"},
            "versions": {"fastmq": "0"}, "records": records}


def test_every_generated_table_adds_up(tmp_path):
    """Each ratio printed in a report is the quotient of the two figures
    printed beside it: in the scenario tables, the summary, the tensor
    matrix; from repeated runs (where the median of the runs' ratios is not
    that quotient), from bench/results.json, and in the README."""
    merged = _result(_merged_runs())
    texts = {"terminal": report.terminal(merged), "readme block": readme.block(merged)}
    report.write_markdown(str(tmp_path / "merged.md"), merged)
    texts["RESULTS.md of repeated runs"] = (tmp_path / "merged.md").read_text()
    saved = figures.load_results(os.path.join(ROOT, "bench", "results.json"))
    report.write_markdown(str(tmp_path / "saved.md"), saved)
    texts["RESULTS.md from bench/results.json"] = (tmp_path / "saved.md").read_text()
    texts["README.md"] = open(os.path.join(ROOT, "README.md")).read()
    for name, text in texts.items():
        assert arithmetic_errors(text) == [], name
    # The checker itself catches a ratio that is not the quotient.
    assert arithmetic_errors("| a | b |\n| --- | --- |\n| x | 7.17 / 7.75 = 0.98x |\n")
    # The steady-state matrix and the first-use one.
    assert len(_QUOTIENT.findall(texts["RESULTS.md of repeated runs"])) == 4


def test_tensor_readers_receive_as_vllms_workers_do():
    # A worker takes the scheduler's broadcast with dequeue(indefinite=True):
    # no deadline, which is also what lets fastmq unpickle a long in-band
    # message as its parts come. The other scenarios' readers keep a timeout.
    from fastmq.bench import step, tensor

    p = config.preset("quick")
    calls = []

    def recv(*args, **kw):
        calls.append((args, kw))
        return None     # the end of the run

    assert tensor.reader_loop(recv, None, 0, p) == {"received": 0}
    assert step.reader_loop(recv, None, 0, p) == {"received": 0}
    assert calls == [((), {"indefinite": True}), ((p.timeout_s,), {})]


def test_first_use_is_the_median_over_fresh_queues(monkeypatch):
    # One first message per queue is one sample: each run opens more fresh
    # queues (the measured one, then ones that send one message of each
    # size) and reports the median of their first messages.
    import dataclasses
    import importlib
    from types import SimpleNamespace

    tensor = importlib.import_module("fastmq.bench.tensor")
    queues = []          # per queue: the sizes it was sent, in order
    firsts = iter([10.0, 30.0, 20.0])   # ms: each queue's first messages

    class FakeGroup:
        def __init__(self, impl, n):
            self.impl, self.n, self.mq, self.where = impl, n, None, impl.name
            self.first = next(firsts)
            queues.append([])

        def round_trip(self, msg, free):
            _, seq, t = msg
            size = t.numel() * 8
            new = size not in queues[-1]
            queues[-1].append(size)
            ack = (0, 0, 0, harness.tensor_expected(t.numel(), seq), size)
            return (self.first if new else 1.0) * 1e6, [ack]

    def fake_groups(env, impls_, params, progress, name, measure, label=""):
        return [r for i in impls_ for n in params.readers[name]
                for r in measure(FakeGroup(i, n))]

    monkeypatch.setattr(tensor, "groups", fake_groups)
    monkeypatch.setattr(tensor, "held_bytes", lambda mq: {"total": 0})
    params = dataclasses.replace(config.preset("quick"), tensor_sizes=[8 * 1024, 16 * 1024],
                                 tensor_warmup=1, tensor_reps=1, tensor_first_queues=3)
    impl = SimpleNamespace(name="fastmq-futex", family="fastmq", payload="tensor")
    env = SimpleNamespace(oversubscribed=lambda n: False, reader_cpus=lambda n: None)
    out = tensor.run(env, [impl], params, None)
    # The measured queue: warm-up and counted messages of each size; the
    # others: one message of each size, sizes rising.
    assert queues[1:] == [[8 * 1024, 16 * 1024]] * 2 and len(queues[0]) > 2
    assert [(r["size_bytes"], r["first_ms"], r["first_queues"]) for r in out] == [
        (8 * 1024, 20.0, 3), (16 * 1024, 20.0, 3)]
    assert all(r["p50"] == 1.0 for r in out)


def test_oversubscribed_readers_are_pinned_to_the_cores_the_writer_leaves():
    # More processes than cores: each reader on one core, in turn, never the
    # first; enough cores: nobody pinned (the scheduler's choice is clean).
    env = harness.Env.__new__(harness.Env)
    env.cpus, env.usable_cpus = [0, 1], 2
    assert env.reader_cpus(1) is None
    assert env.reader_cpus(2) == [1, 1] and env.reader_cpus(4) == [1, 1, 1, 1]
    env.cpus, env.usable_cpus = [2, 5, 7, 9], 4
    assert env.reader_cpus(3) is None
    assert env.reader_cpus(4) == [5, 7, 9, 5]
    env.cpus, env.usable_cpus = [3], 1
    assert env.reader_cpus(2) is None      # one core: nowhere else to go


def test_a_reader_group_pins_its_reader_processes():
    # The processes themselves, not only what the record says: N = the
    # machine's usable cores is always oversubscribed.
    env = harness.Env(["fastmq"])
    n = env.usable_cpus
    expected = env.reader_cpus(n) or [None] * n
    params = config.preset("quick")
    with harness.ReaderGroup(env, impls.IMPLS["fastmq-futex"], n, "step", params) as g:
        got = [os.sched_getaffinity(p.pid) for p in g.procs]
    assert got == [{c} if c is not None else set(env.cpus) for c in expected]
    rec = harness.record("step", "fastmq-futex", n, 1024, "us", env)
    assert rec["reader_cpus"] == env.reader_cpus(n)


def test_a_reader_group_is_entered_once_every_reader_is_serving():
    # A first-use figure times the queue, not a reader still starting up
    # (importing its scenario, attaching its answer queue): each reader says
    # when it went to take its first message, and that is before the group
    # hands itself to the writer (the harness is the same for every
    # implementation).
    env = harness.Env(["fastmq"])
    params = config.preset("quick")
    for name in ("fastmq-futex", "fastmq-remote"):
        with harness.ReaderGroup(env, impls.IMPLS[name], 2, "tensor", params) as g:
            entered = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            assert len(g.serving_ns) == 2
            assert all(0 < t <= entered for t in g.serving_ns), (name, g.serving_ns, entered)


def test_the_report_says_which_runs_were_pinned():
    from types import SimpleNamespace

    from fastmq.bench import runner

    env = SimpleNamespace(usable_cpus=2)
    recs = [{"scenario": "tensor", "impl": "vllm", "n_readers": 1, "oversubscribed": False,
             "reader_cpus": None},
            {"scenario": "tensor", "impl": "vllm", "n_readers": 2, "oversubscribed": True,
             "reader_cpus": [1, 1]}]
    notes = runner._notes(recs, config.preset("quick"), env, 0.0, 0.0)
    pinned = [n for n in notes if "pinned to one core" in n]
    assert len(pinned) == 1 and "N=2: cores 1, 1" in pinned[0]
    assert "Real generation" not in pinned[0]
    recs.append({"scenario": "generate", "impl": "vllm", "n_readers": 2,
                 "oversubscribed": True, "reader_cpus": None})
    notes = runner._notes(recs, config.preset("quick"), env, 0.0, 0.0)
    assert any("Real generation (vLLM's own workers) is not pinned" in n for n in notes)
    assert not [n for n in runner._notes(recs[:1], config.preset("quick"), env, 0.0, 0.0)
                if "pinned to one core" in n]
