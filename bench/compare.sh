#!/bin/bash
# Compare two builds of fastmq on this machine: fastmq-bench runs with the
# given arguments, the two builds taking turns ROUNDS times (so that a
# change in the machine's state falls on both), then each figure's median
# per build, side by side, with its ratio to vLLM's queue from the same run.
#
#   bench/compare.sh OLD_TREE NEW_TREE ROUNDS [fastmq-bench arguments ...]
#   e.g. bench/compare.sh /tmp/old . 3 --scenario step,tensor --readers 1 --sizes 1K
#
# Each tree is a checkout with its extension built in place
# (python setup.py build_ext --inplace); the runs and their JSON go to a
# fresh temporary folder, which the last line names.
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=$3; shift 3
out=$(mktemp -d)
cd "$out"     # not a tree: the PYTHONPATH given decides which fastmq runs
for r in $(seq 1 "$rounds"); do
  for b in old new; do
    tree=$old; [ "$b" = new ] && tree=$new
    PYTHONPATH=$tree python -m fastmq.bench "$@" --no-progress --json "$out/$b-$r.json" \
      > "$out/$b-$r.txt" 2>&1 || { echo "the $b build's run $r failed: $out/$b-$r.txt" >&2; exit 1; }
  done
done
python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for b in ("old", "new"):
    for r in range(1, rounds + 1):
        d = json.load(open(f"{out}/{b}-{r}.json"))
        for rec in d["records"]:
            key = (rec["scenario"], rec["impl"], rec.get("size_bytes"), rec["n_readers"])
            value = rec.get("p50") if rec.get("p50") is not None else rec.get("rate", rec.get("cpu_pct"))
            rows.setdefault(key, {}).setdefault(b, []).append((value, rec.get("vs_vllm")))
def med(xs, i):
    xs = [x[i] for x in xs if x[i] is not None]
    return "-" if not xs else f"{statistics.median(xs):.4g}"
print(f"medians of {rounds} runs per build (vs vLLM: vLLM's time / this row's, in the same run)")
print(f"{'scenario':10} {'implementation':22} {'size':>10} {'N':>2} {'old':>10} {'new':>10} "
      f"{'old vs vLLM':>12} {'new vs vLLM':>12}")
for (sc, impl, size, n), v in sorted(rows.items(), key=str):
    print(f"{sc:10} {impl:22} {str(size or ''):>10} {n:>2} {med(v.get('old', []), 0):>10} "
          f"{med(v.get('new', []), 0):>10} {med(v.get('old', []), 1):>12} {med(v.get('new', []), 1):>12}")
print(f"runs: {out}")
PY
