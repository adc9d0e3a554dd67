#!/usr/bin/env bash
# The autotuner's two timing methods (deltaserve/ops/graph_bench.py: `graph`, the default, and
# Triton's per-launch `events`) compared in the engine, in one device call on one GPU: the
# graph timing's GPU tests, then decode batch 1 of one model tuned afresh by each method
# (DELTASERVE_AUTOTUNE_CACHE=0: nothing reused from the disk cache), alternating
# events / graph / events / graph on the same machine, each row against the ceilings of its
# own run. The first part compiles every configuration (minutes on a fresh machine); the
# later ones reuse the compiled kernels and only time them.
#   bash scripts/gpu_check_autotune_bench.sh OUT_DIR [35b|v2-lite|9b] [notests]
set -uo pipefail
out=${1:-./gpu-results}
model=${2:-35b}
common="--skip-prefill-context --decode-steps 48 --warmup-steps 8 --repeats 3 \
--decode-batches 1 --contexts 512 --prefill-lens 512"
case $model in
    35b) bench="python -m deltaserve bench throughput --random-model qwen3.5-35b-a3b \
--attention-backend triton $common" ; first=240 ;;
    v2-lite) bench="python -m deltaserve bench throughput --random-model deepseek-v2-lite \
--dtype bfloat16 --mla-backend triton $common" ; first=280 ;;
    9b) bench="python -m deltaserve bench throughput --random-model qwen3.5-9b \
--attention-backend triton $common" ; first=120 ;;
    *) echo "unknown model $model (35b, v2-lite, 9b)"; exit 2 ;;
esac
specs=()
[ "${3:-}" = notests ] || specs+=("tests:60:python -m pytest -m gpu -q -rfEs \
-p no:cacheprovider tests/ops/test_graph_bench.py")
fresh="DELTASERVE_AUTOTUNE_CACHE=0"
specs+=("$model-events-1:$first:$fresh DELTASERVE_AUTOTUNE_BENCH=events $bench --json $out/$model-events-1.json")
specs+=("$model-graph-1:100:$fresh DELTASERVE_AUTOTUNE_BENCH=graph $bench --json $out/$model-graph-1.json")
specs+=("$model-events-2:100:$fresh DELTASERVE_AUTOTUNE_BENCH=events $bench --json $out/$model-events-2.json")
specs+=("$model-graph-2:100:$fresh DELTASERVE_AUTOTUNE_BENCH=graph $bench --json $out/$model-graph-2.json")
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${specs[@]}"
status=$?
# one archive of the JSON rows (a device call brings back at most 8 files)
(cd "$out" && tar -czf "$model-rows.tgz" ./*.json && rm -f ./*.json)
for v in events-1 graph-1 events-2 graph-2; do
    echo "== $model $v"; grep -h "^| decode\|ceilings" "$out/$model-$v.log" 2>/dev/null | tail -n 2
done
exit $status
