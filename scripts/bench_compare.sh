#!/usr/bin/env bash
# Engine throughput of this checkout against another version of deltaserve, in one GPU run (same
# machine, same clocks): the rows alternate between the two versions, ROUNDS times, and the
# summary gives each row's median tok/s and the ratio new / other.
#   git archive REV deltaserve | tar -x -C /tmp/other          # the other version's package
#   bash scripts/bench_compare.sh /tmp/other [OUT_DIR] [ROUNDS]
# Default rows: the Qwen3.5-9B shapes (random bf16 weights), prefill 8192, decode batch
# 1 / 16 / 64 at context 512; override with BENCH_ARGS.
set -uo pipefail
other=$1
out=${2:-./bench-compare}
rounds=${3:-2}
mkdir -p "$out"
out=$(cd "$out" && pwd)
other=$(cd "$other" && pwd)
args=${BENCH_ARGS:---random-model qwen3.5-9b --skip-prefill-context --attention-backend triton \
--prefill-lens 8192 --decode-batches 1,16,64 --contexts 512 --decode-steps 48 --repeats 3 \
--copy-bw 4.27e12 --matmul-flops 773e12}
base=${PYTHONPATH:+:$PYTHONPATH}
for r in $(seq 1 "$rounds"); do
    for side in other new; do
        dir=$PWD
        [ "$side" = other ] && dir=$other
        # NOTE: `python -m` puts the working directory first on sys.path: run from the version's
        # own directory so that its package is the one imported
        # shellcheck disable=SC2086
        (cd "$dir" && PYTHONPATH=$dir$base python -m deltaserve.cli bench throughput $args \
            --json "$out/$side-$r.json" >"$out/$side-$r.md" 2>"$out/$side-$r.log")
        echo "$side round $r: exit $?"
    done
done
python - "$out" "$rounds" <<'PY'
import json, statistics, sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])
def rows(side):
    runs = [json.loads((out / f"{side}-{r}.json").read_text())["rows"] for r in range(1, rounds + 1)]
    key = lambda row: (row["kind"], row["batch"], row["length"])
    table = {}
    for run in runs:
        for row in run:
            table.setdefault(key(row), []).append(row["tok_s"])
    return {k: statistics.median(v) for k, v in table.items()}
other, new = rows("other"), rows("new")
print(f"{'kind':<8} {'B':>4} {'len':>6} {'other tok/s':>12} {'new tok/s':>12} {'new/other':>10}")
for k in sorted(other):
    if k in new:
        print(f"{k[0]:<8} {k[1]:>4} {k[2]:>6} {other[k]:>12.1f} {new[k]:>12.1f} {new[k] / other[k]:>10.3f}")
PY
