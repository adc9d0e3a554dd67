#!/usr/bin/env bash
# The GPU check of the mla op family in one run: the Triton MLA kernel tests at real shapes
# (R 512, P 64, H 16 / 128, bf16, contexts to 4096, CUDA-graph replays), FlashInfer's MLA
# wrapper against the reference (skipped without flashinfer: send .devwheels), then
# `bench kernels --only mla` (B 64 / 16 / 1, context 4096, H 16 / 128, against the copy ceiling
# measured in the same run). Logs, tables and JSON go to $1.
#   bash scripts/gpu_check_mla.sh OUT_DIR [quick]
set -uo pipefail
out=${1:-./gpu-results}
quick=${2:-}
cmds=(
    "triton-tests:300:python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/ops/test_mla_triton.py -k 'not flashinfer'"
    "flashinfer-tests:200:python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/ops/test_mla_triton.py -k flashinfer"
    "mla-bench:240:python -m deltaserve.cli bench kernels --only mla ${quick:+--quick} --json $out/mla-kernels.json"
)
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${cmds[@]}"
status=$?
sed -n '/^device/,$p' "$out/mla-bench.log"
exit $status
