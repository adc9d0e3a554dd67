#!/usr/bin/env bash
# The `split` MLA backend (ops/mla/split_backend.py: FlashInfer's MLA for steps with prefill
# rows, the Triton decode for all-decode steps) against `flashinfer` and `triton`, in one device
# call on one GPU with FlashInfer installed (.devwheels): the GPU tests of the split backend, of
# the autotuner's graph timing and of the page tables' pinned host arrays, then
# DeepSeek-V2-Lite's rows (prefill 512 and 8192, decode batch 1 / 16 / 64 at context 512) with
# each MLA backend, each against the ceilings of its own run. The first part compiles for minutes on a fresh machine; the others reuse its kernels.
#   bash scripts/gpu_check_mla_split.sh OUT_DIR [notests]
set -uo pipefail
out=${1:-./gpu-results}
bench="python -m deltaserve bench throughput --random-model deepseek-v2-lite --dtype bfloat16 \
--skip-prefill-context --decode-steps 48 --warmup-steps 8 --repeats 3 --prefill-lens 512,8192 \
--decode-batches 1,16,64 --contexts 512"
specs=()
[ "${2:-}" = notests ] || specs+=("tests:120:python -m pytest -m gpu -q -rfEs \
-p no:cacheprovider tests/ops/test_mla_split.py tests/ops/test_graph_bench.py \
tests/ops/test_flashinfer_attention.py -k 'split or graph_bench or copy or tuning or pinned'")
specs+=("split:300:$bench --mla-backend split --json $out/split.json")
specs+=("flashinfer:150:$bench --mla-backend flashinfer --json $out/flashinfer.json")
specs+=("triton:150:$bench --mla-backend triton --json $out/triton.json")
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${specs[@]}"
status=$?
(cd "$out" && tar -czf mla-split-rows.tgz ./*.json && rm -f ./*.json)
for v in split flashinfer triton; do
    echo "== $v"; grep -h "^| decode\|^| prefill\|ceilings" "$out/$v.log" 2>/dev/null | tail -n 6
done
exit $status
