#!/usr/bin/env bash
# MLA's batch-1 launch fusions, each against the launches it replaces, in one device call on one
# GPU (each part under its own limit, scripts/gpu_parts.sh; every row against the ceilings of
# its run): the step preparation in one launch (ops/mla/triton_head_matmul.py
# `rope_norm_head_matmul`, DELTASERVE_MLA_PREP) and the split merge joined to W_UV
# (ops/mla/triton_merge_out.py, DELTASERVE_MLA_MERGE):
#   bash scripts/gpu_check_mla_fusions.sh OUT_DIR PART [PART ...]
# parts:
#   fused, separate  deepseek-v2-lite decode batch 1, context 512, `--mla-backend triton` (no
#                    FlashInfer JIT builds), with DELTASERVE_MLA_PREP=fused / separate
#   merge            the same with DELTASERVE_MLA_MERGE=fused (the preparation fused): against
#                    `fused`
#   tests            their GPU tests (tests/ops/test_mla_head_matmul.py -k prep,
#                    tests/ops/test_mla_merge_out.py)
# A model's first run on a fresh machine compiles and tunes its kernels (1-2 minutes).
set -uo pipefail
out=${1:-./gpu-results}
shift || true
b1="--random-model deepseek-v2-lite --dtype bfloat16 --mla-backend triton --skip-prefill-context \
--decode-steps 48 --warmup-steps 8 --repeats 3 --decode-batches 1 --contexts 512 --prefill-lens 512"
specs=()
for part in "$@"; do
    case $part in
        fused|separate) specs+=("$part:150:DELTASERVE_MLA_PREP=$part python -m deltaserve bench \
throughput $b1 --json $out/v2-lite-$part.json") ;;
        merge) specs+=("merge:150:DELTASERVE_MLA_MERGE=fused python -m deltaserve bench \
throughput $b1 --json $out/v2-lite-merge.json") ;;
        tests) specs+=("tests:90:python -m pytest -m gpu -q -rfEs -p no:cacheprovider \
tests/ops/test_mla_head_matmul.py tests/ops/test_mla_merge_out.py -k 'prep or merged'") ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${specs[@]}"
status=$?
for part in "$@"; do
    [ "$part" = tests ] && continue
    echo "== $part"; grep -h "^| decode\|ceilings" "$out/$part.log" 2>/dev/null
done
exit $status
