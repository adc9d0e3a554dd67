#!/usr/bin/env bash
# The split-K decode GEMM's wide tiles (17..64 rows) on one GPU, in one call:
#   bash scripts/gpu_check_wide_gemm.sh OUT_DIR
# 1. GPU tests: the split-K kernel at 33 and 64 rows on the model shapes, graph replays;
# 2. scripts/probe_wide_gemm.py --sweep: the 9B shapes at 32 and 64 rows against cuBLAS;
# 3. `bench throughput` of qwen3.5-9b at decode batch 64 (contexts 512, 2048) with
#    DELTASERVE_DECODE_GEMM_MAX_ROWS=64 (the wide tiles) and =16 (cuBLAS above 16 rows).
# Results under OUT_DIR, archived as OUT_DIR/wide-gemm.tar.gz.
set -uo pipefail
out=${1:-./gpu-results}
mkdir -p "$out"
status=0
tp() {  # $1: max rows
    echo "env DELTASERVE_DECODE_GEMM_MAX_ROWS=$1 python -m deltaserve.cli bench throughput \
--random-model qwen3.5-9b --device cuda --dtype bfloat16 --attention-backend triton \
--skip-prefill-context --prefill-lens 512 --repeats 1 --decode-batches 64 --contexts 512,2048 \
--decode-steps 32 --warmup-steps 4 --json $out/dense-9b-rows$1.json > $out/dense-9b-rows$1.md"
}
bash scripts/gpu_parts.sh "$out" \
    "tests:150:python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_decode_gemm_splitk.py \
-k 'graph or (model_shapes and (33 or 64))'" \
    "probe:200:python scripts/probe_wide_gemm.py --sweep --json $out/wide-gemm.json \
> $out/wide-gemm.md" \
    "rows64:120:$(tp 64)" "rows16:120:$(tp 16)" || status=1
cat "$out/wide-gemm.md"
for t in rows64 rows16; do echo "== $t"; grep -E "ceilings|decode \|" "$out/dense-9b-$t.md"; done
tar -czf "$out/wide-gemm.tar.gz" -C "$out" --exclude "*.tar.gz" . 2>/dev/null
exit $status
