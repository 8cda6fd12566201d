"""``fastmq-bench generate``: the command line selects it, and its records
make a table, summary rows and README rows (the measurement itself runs
vLLM's CPU build: see tests/test_vllm_generation.py and the bench run)."""
from __future__ import annotations

from fastmq.bench import config, figures, readme, report, scenario
from fastmq.bench.__main__ import build_parser, params_from_args


def _record(impl, seqs, ms, cpu):
    return {"scenario": "generate", "impl": impl, "n_readers": 2, "size_bytes": seqs,
            "unit": "ms", "oversubscribed": True, "p50": ms, "min": ms * 0.9,
            "max": ms * 1.1, "cpu_s_per_token": cpu, "tokens": 64, "samples": 5}


def _records():
    recs = [_record("fastmq-futex", 1, 5.0, 0.010), _record("vllm", 1, 7.5, 0.015),
            _record("fastmq-futex", 4, 6.0, 0.004), _record("vllm", 4, 6.6, 0.005)]
    for r in recs:
        v = next(x for x in recs if x["impl"] == "vllm" and x["size_bytes"] == r["size_bytes"])
        r["cpu_vs_vllm"] = v["cpu_s_per_token"] / r["cpu_s_per_token"]
    figures.annotate(recs)
    return figures.merge([recs])


def test_generate_is_a_scenario_selected_by_name():
    assert "generate" in config.SCENARIOS
    params, scenarios = params_from_args(build_parser().parse_args(["generate"]))
    assert scenarios == ["generate"] and params.readers["generate"] == [2]
    params, scenarios = params_from_args(build_parser().parse_args(["--scenario", "generate",
                                                                    "--readers", "3"]))
    assert params.readers["generate"] == [3]
    # Not part of the default and quick runs (engine starts take tens of seconds).
    for argv in ([], ["--quick"]):
        params, _ = params_from_args(build_parser().parse_args(argv))
        assert params.readers["generate"] == []


def test_generate_table_and_summary_rows():
    recs = _records()
    text = report.section(recs, scenario.get("generate"))
    assert "ms per token" in text and "CPU s per token" in text
    assert "| 2* | 1 sequence | fastmq-futex | 5.00 |" in text
    rows = [r for r in report.summary_rows(recs) if r[0].startswith("real generation")]
    what = "real generation (vLLM 0.32.0, CPU build)"
    assert rows[0] == [f"{what}, ms per token, 1 sequence, TP=2*", "5.00 ms (fastmq-futex)",
                       "7.50 ms (vllm)", scenario.ratio(1.5)]
    assert rows[2][0] == f"{what}, CPU s per token (engine core + workers), 1 sequence, TP=2*"
    assert rows[2][3] == scenario.ratio(1.5)
    assert any("4 sequences" in r[0] for r in rows)


def test_generate_rows_are_in_the_readme_block():
    result = {"machine": {"cpu_model": "cpu", "usable_cpus": 2}, "records": _records(),
              "command": "fastmq-bench generate", "started": "now", "notes": []}
    block = readme.block(result)
    assert ("| real generation (vLLM 0.32.0, CPU build), ms per token, 1 sequence, TP=2* | "
            "5.00 ms | 7.50 ms | 1.50x |") in block
