#!/usr/bin/env bash
# The MoE down kernel's expert loop (ops/moe/triton_decode_down.py `_expert_loop`, behind
# DELTASERVE_MOE_DOWN_LOOP=1) against the per-expert programs, in one device call on one GPU:
# its GPU tests, then batch-1 decode of DeepSeek-V2-Lite or the 35B-A3B with the loop offered
# to the tuner and without (same machine, alternating; each row against the ceilings of its own
# run). Parts under their own limits (scripts/gpu_parts.sh); on a fresh machine each model's
# first start compiles for minutes, so pass DELTASERVE_TUNING_IN (an autotune.tgz from an
# earlier call) where one exists. One model per call (a cold start of each takes 3-4 minutes,
# and a call brings back at most 8 files); `notests` leaves the tests out (the second call).
#   bash scripts/gpu_check_moe_down_loop.sh OUT_DIR [v2-lite|35b] [notests]
set -uo pipefail
out=${1:-./gpu-results}
shift || true
model=${1:-v2-lite}
common="--skip-prefill-context --decode-steps 48 --warmup-steps 8 --repeats 3 \
--decode-batches 1 --contexts 512 --prefill-lens 512"
case $model in
    v2-lite) bench="python -m deltaserve bench throughput --random-model deepseek-v2-lite \
--dtype bfloat16 $common" ; first=260 ;;
    35b) bench="python -m deltaserve bench throughput --random-model qwen3.5-35b-a3b \
--attention-backend triton $common" ; first=200 ;;
    *) echo "unknown model $model (v2-lite, 35b)"; exit 2 ;;
esac
specs=()
[ "${2:-}" = notests ] || specs+=("tests:150:python -m pytest -m gpu -q -rfEs \
-p no:cacheprovider tests/ops/test_moe_triton.py -k 'expert_loop or real_shapes'")
specs+=("$model-per-expert:$first:$bench --json $out/$model-per-expert.json")
specs+=("$model-loop:90:DELTASERVE_MOE_DOWN_LOOP=1 $bench --json $out/$model-loop.json")
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${specs[@]}"
status=$?
for v in per-expert loop; do
    echo "== $model $v"; grep -h "^| decode\|ceilings" "$out/$model-$v.log" 2>/dev/null | tail -n 2
done
exit $status
