#!/bin/sh
# Regenerate bench/RESULTS.md, bench/results.json and bench/plots/ with every
# figure the issues ask for (N = 1, 2, 4; payloads 100 B to 1 MiB; tensors 16
# to 256 MiB; 5 s idle window). About ten minutes on 2 cores. Run it on a
# quiet machine: the report flags a busy one. Extra arguments are passed on.
set -e
cd "$(dirname "$0")/.."
exec python -m fastmq.bench --full --json bench/results.json --plot bench/plots \
    --results-md bench/RESULTS.md "$@"
