#!/usr/bin/env bash
# The DeepSeek-V2 GPU check in one run (fits one device call on a warm-cache-less machine):
# the MLA preparation kernel and the Triton MLA kernels against their references, the MoE decode
# path's shared-expert split and scaled routing at real shapes, the V2-Lite preset in bf16, then
# `bench throughput --random-model deepseek-v2-lite` (decode B 1 / 16 / 64 against the floor of
# the experts each step selects plus the latent reads; prefill 8192) and
# `bench kernels --only mla` (Triton variants and FlashInfer, against the copy ceiling).
#   bash scripts/gpu_check_deepseek.sh OUT_DIR
# Send .devwheels (FlashInfer, fla). Logs, tables and JSON go to OUT_DIR.
set -uo pipefail
out=${1:-./gpu-results}
ops="tests/ops/test_mla_triton.py tests/ops/test_moe_triton.py"
cmds=(
    "kernels:150:python -m pytest -m gpu -q -rfEs -p no:cacheprovider $ops -k 'mla or shared_expert_given_itself or scaled' && python -m pytest -q -p no:cacheprovider tests/ops/test_fused.py -k mla"
    "model:90:python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/models/test_deepseek_v2_gpu.py -k lite"
    "lite:190:python -m deltaserve.cli bench throughput --random-model deepseek-v2-lite --device cuda --dtype bfloat16 --skip-prefill-context --prefill-lens 8192 --decode-batches 1,16,64 --contexts 512 --decode-steps 32 --warmup-steps 4 --repeats 3 --json $out/lite.json"
    "mla:160:python -m deltaserve.cli bench kernels --only mla --json $out/mla-kernels.json"
)
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${cmds[@]}"
status=$?
tail -n 16 "$out/lite.log"
sed -n '/^device/,$p' "$out/mla.log"
exit $status
