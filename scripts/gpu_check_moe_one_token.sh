#!/usr/bin/env bash
# The one-token MoE kernels (ops/moe/triton_decode_one_token.py) against the tile kernels, in
# one device call on one GPU (each part under its own limit, scripts/gpu_parts.sh; every row
# against the ceilings of its run):
#   bash scripts/gpu_check_moe_one_token.sh OUT_DIR PART [PART ...]
# parts:
#   tests        their GPU tests (tests/ops/test_moe_one_token.py)
#   probe        scripts/probe_moe_one_token.py: one layer of each shape, both kernel choices
#                (op time, GB/s, per-kernel times, the tuners' choices)
#   kernels      `bench kernels --only moe --moe-tokens 1` (triton = the one-token kernels,
#                triton-tile = the tile kernels, 35B-A3B's layer)
#   35b-gemv, 35b-tile, v2-lite-gemv, v2-lite-tile
#                decode batch 1, context 512, with DELTASERVE_MOE_ONE_TOKEN=gemv / tile (V2-Lite
#                with `--mla-backend triton`: no FlashInfer JIT builds)
# A model's first run on a fresh machine compiles and tunes its kernels (2-4 minutes).
set -uo pipefail
out=${1:-./gpu-results}
shift || true
b1="--skip-prefill-context --decode-steps 48 --warmup-steps 8 --repeats 3 --decode-batches 1 \
--contexts 512 --prefill-lens 512"
model_args() {
    case $1 in
        35b) echo "--random-model qwen3.5-35b-a3b --attention-backend triton" ;;
        v2-lite) echo "--random-model deepseek-v2-lite --dtype bfloat16 --mla-backend triton" ;;
    esac
}
specs=()
for part in "$@"; do
    case $part in
        tests) specs+=("tests:150:python -m pytest -m gpu -q -rfEs -p no:cacheprovider \
tests/ops/test_moe_one_token.py") ;;
        probe) specs+=("probe:150:python scripts/probe_moe_one_token.py --json $out/probe.json") ;;
        kernels) specs+=("kernels:150:python -m deltaserve bench kernels --only moe \
--moe-tokens 1 --json $out/kernels.json") ;;
        35b-gemv|35b-tile|v2-lite-gemv|v2-lite-tile) specs+=("$part:270:\
DELTASERVE_MOE_ONE_TOKEN=${part##*-} python -m deltaserve bench throughput \
$(model_args "${part%-*}") $b1 --json $out/$part.json") ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${specs[@]}"
status=$?
(cd "$out" && ls ./*.json >/dev/null 2>&1 && tar -czf moe-one-token.tgz ./*.json && rm -f ./*.json)
grep -h "^| .* | triton\(-tile\)\? |" "$out/kernels.log" 2>/dev/null | head -n 4
grep -h "us/layer" "$out/probe.log" 2>/dev/null
for part in "$@"; do
    [ "$part" = tests ] || [ "$part" = kernels ] && continue
    echo "== $part"; grep -h "^| decode\|ceilings" "$out/$part.log" 2>/dev/null
done
exit $status
