#!/usr/bin/env bash
# The DeepSeek-V2 GPU check, in two device calls on a fresh machine (each part under its own
# limit; first-use compilation and autotuning dominate a cold run):
#   tests  the MLA preparation kernel and the Triton / FlashInfer MLA kernels against their
#          references, the MoE decode path's shared-expert split and scaled routing at real
#          shapes, then tests/models/test_deepseek_v2_gpu.py (float32 parity through the Triton
#          moe backend, the V2-Lite preset in bf16). A cold H200 took 339 s for the kernel tests.
#   bench  `bench throughput --random-model deepseek-v2-lite` with the auto `mla` backend (split
#          where FlashInfer is installed: its prefill; decode B 1 / 16 / 64 against the floor
#          of the experts each step selects plus the latent reads; prefill 512 / 2048 / 4096 /
#          8192; ~110 s on an H200) and `bench kernels --only mla` (Triton variants and
#          FlashInfer against the copy ceiling; ~90 s warm), then the same prefill lengths with
#          `--mla-backend triton` (expanded from 4096-token queries under the default
#          DELTASERVE_MLA_PREFILL=auto): the two backends' prefill in one call, from which
#          their order in auto selection and their expansion thresholds were set.
#   mixed  long prompts prefilled beside running decodes (scripts/probe_mla_mixed_steps.py)
#          through split (auto, then absorbed: FlashInfer's prefill) and triton (auto), then
#          split's prefill of 4096 and 6144 tokens absorbed (FlashInfer's) and expanded in one
#          call (its expansion threshold, 6144, was set from two calls)
#   bash scripts/gpu_check_deepseek.sh OUT_DIR [tests|bench|mixed]
# Send .devwheels (FlashInfer, fla). Logs, tables and JSON go to OUT_DIR.
set -uo pipefail
out=${1:-./gpu-results}
what=${2:-bench}
ops="tests/ops/test_mla_triton.py tests/ops/test_moe_triton.py"
if [ "$what" = tests ]; then
    cmds=(
        "kernels:380:python -m pytest -m gpu -q -rfEs -p no:cacheprovider $ops -k 'mla or shared_expert_given_itself or scaled' && python -m pytest -q -p no:cacheprovider tests/ops/test_fused.py -k mla"
        "model:200:python -m pytest -m gpu -v -rfEs -p no:cacheprovider tests/models/test_deepseek_v2_gpu.py"
    )
elif [ "$what" = mixed ]; then
    # split's prefill with FlashInfer (absorbed) and expanded, at 4096 and 6144 tokens
    p6144="python -m deltaserve.cli bench throughput --random-model deepseek-v2-lite --device cuda --dtype bfloat16 --skip-prefill-context --prefill-lens 4096,6144 --decode-batches 1 --contexts 512 --decode-steps 8 --warmup-steps 2 --repeats 3 --mla-backend split"
    cmds=(
        "mixed-split:200:python scripts/probe_mla_mixed_steps.py --mla-backend split"
        "mixed-split-absorbed:120:DELTASERVE_MLA_PREFILL=absorbed python scripts/probe_mla_mixed_steps.py --mla-backend split"
        "mixed-triton:120:python scripts/probe_mla_mixed_steps.py --mla-backend triton"
        "p6144:150:DELTASERVE_MLA_PREFILL=absorbed $p6144 --json $out/p6144-flashinfer.json && DELTASERVE_MLA_PREFILL=expanded $p6144 --json $out/p6144-expanded.json"
    )
else
    cmds=(
        "lite:260:python -m deltaserve.cli bench throughput --random-model deepseek-v2-lite --device cuda --dtype bfloat16 --skip-prefill-context --prefill-lens 512,2048,4096,8192 --decode-batches 1,16,64 --contexts 512 --decode-steps 32 --warmup-steps 4 --repeats 3 --json $out/lite.json"
        "mla:300:python -m deltaserve.cli bench kernels --only mla --json $out/mla-kernels.json"
        "triton:200:python -m deltaserve.cli bench throughput --random-model deepseek-v2-lite --device cuda --dtype bfloat16 --mla-backend triton --skip-prefill-context --prefill-lens 512,2048,4096,8192 --decode-batches 1 --contexts 512 --decode-steps 16 --warmup-steps 4 --repeats 3 --json $out/lite-triton.json"
    )
fi
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${cmds[@]}"
status=$?
if [ "$what" = mixed ]; then
    tail -n 1 "$out/mixed-split.log" "$out/mixed-split-absorbed.log" "$out/mixed-triton.log"
    grep -h "^| prefill" "$out/p6144.log"
elif [ "$what" = bench ]; then
    tail -n 16 "$out/lite.log"
    grep "^| prefill" "$out/triton.log"
    sed -n '/^device/,$p' "$out/mla.log" | grep -v triton-variant
fi
exit $status
