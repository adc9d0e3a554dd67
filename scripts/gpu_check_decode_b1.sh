#!/usr/bin/env bash
# Decode-step kernels of batch 1 and the rows they move, in one device call on one GPU (each
# part under its own limit, scripts/gpu_parts.sh; every row against the ceilings of its run):
#   bash scripts/gpu_check_decode_b1.sh OUT_DIR PART [PART ...]
# parts:
#   tests      the GPU tests of the one-row GEMV (ops/linear/triton_gemv.py), with the norm in
#              its launch (triton_gemv_norm.py; engines with and without it), the sampler's
#              argmax (ops/fused/argmax.py) and MLA's per-head matmul (ops/mla/triton_head_matmul.py)
#   kernels    `bench kernels --only gemm` at one row (GEMV, base kernel, cuBLAS side by side;
#              triton-gemv-norm against norm+triton on the shapes after a norm)
#   dsv2-lite  deepseek-v2-lite: prefill 1 x 512, decode batch 1 / 16 / 64 at context 512
#   moe-35b    qwen3.5-35b-a3b: the same rows (batch 64 needs an H200)
#   9b-base, 35b-base, v2-lite-base  decode batch 1 with DELTASERVE_DECODE_GEMM_KERNEL=base
#              (the base kernel at one row too); 9b-auto, 35b-auto, v2-lite-auto: the default
#              (the GEMV at one row); 9b-sepnorm, 35b-sepnorm, v2-lite-sepnorm: the default
#              with DELTASERVE_NORM_GEMV=separate (the norm kernel before the GEMV at every
#              hidden size); 9b-convgemv, 35b-convgemv: the default with
#              DELTASERVE_GDN_CONV_GEMV=fused (GDN's conv1d update in the in_proj GEMV's
#              epilogue); 9b-decodenorm, 35b-decodenorm: with DELTASERVE_GDN_DECODE_NORM=fused
#              (GDN's output norm in the delta rule's launch); 9b-both, 35b-both: both.
#              The V2-Lite batch-1 parts run `--mla-backend triton`
#              (the decode half of `split`, without FlashInfer's JIT builds for the prefill
#              row).
# A model's first run on a fresh machine compiles and tunes its kernels (2-4 minutes).
set -uo pipefail
out=${1:-./gpu-results}
shift || true
common="--skip-prefill-context --decode-steps 48 --warmup-steps 8 --repeats 3"
b1="$common --decode-batches 1 --contexts 512 --prefill-lens 512"
model_args() {
    case $1 in
        9b) echo "--random-model qwen3.5-9b --attention-backend triton" ;;
        35b) echo "--random-model qwen3.5-35b-a3b --attention-backend triton" ;;
        v2-lite) echo "--random-model deepseek-v2-lite --dtype bfloat16" ;;
        v2-lite-b1) echo "--random-model deepseek-v2-lite --dtype bfloat16 --mla-backend triton" ;;
    esac
}
b1_model() { [ "$1" = v2-lite ] && echo v2-lite-b1 || echo "$1"; }
bench="python -m deltaserve bench throughput"
specs=()
for part in "$@"; do
    case $part in
        tests) specs+=("tests:150:python -m pytest -m gpu -q -rfEs -p no:cacheprovider \
tests/ops/test_decode_gemv.py tests/ops/test_decode_gemv_norm.py \
tests/ops/test_decode_gemv_conv.py tests/ops/test_gdn_decode_norm.py \
tests/engine/test_norm_gemv_engine_gpu.py tests/ops/test_fused_argmax.py \
tests/ops/test_mla_head_matmul.py") ;;
        kernels) specs+=("kernels:150:python -m deltaserve bench kernels --only gemm \
--gemm-rows 1 --json $out/kernels.json") ;;
        dsv2-lite) specs+=("dsv2-lite:300:$bench $(model_args v2-lite) $common --prefill-lens 512 \
--decode-batches 1,16,64 --contexts 512 --json $out/dsv2-lite.json") ;;
        moe-35b) specs+=("moe-35b:300:$bench $(model_args 35b) $common --prefill-lens 512 \
--decode-batches 1,16,64 --contexts 512 --json $out/moe-35b.json") ;;
        9b-base|35b-base|v2-lite-base) specs+=("$part:240:DELTASERVE_DECODE_GEMM_KERNEL=base \
$bench $(model_args "$(b1_model "${part%-base}")") $b1 --json $out/$part.json") ;;
        9b-auto|35b-auto|v2-lite-auto) specs+=("$part:240:$bench \
$(model_args "$(b1_model "${part%-auto}")") $b1 --json $out/$part.json") ;;
        9b-sepnorm|35b-sepnorm|v2-lite-sepnorm) specs+=("$part:240:DELTASERVE_NORM_GEMV=separate \
$bench $(model_args "$(b1_model "${part%-sepnorm}")") $b1 --json $out/$part.json") ;;
        9b-convgemv|35b-convgemv) specs+=("$part:240:DELTASERVE_GDN_CONV_GEMV=fused \
$bench $(model_args "${part%-convgemv}") $b1 --json $out/$part.json") ;;
        9b-decodenorm|35b-decodenorm) specs+=("$part:240:DELTASERVE_GDN_DECODE_NORM=fused \
$bench $(model_args "${part%-decodenorm}") $b1 --json $out/$part.json") ;;
        9b-both|35b-both) specs+=("$part:240:DELTASERVE_GDN_CONV_GEMV=fused \
DELTASERVE_GDN_DECODE_NORM=fused $bench $(model_args "${part%-both}") $b1 \
--json $out/$part.json") ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${specs[@]}"
status=$?
(cd "$out" && ls ./*.json >/dev/null 2>&1 && tar -czf decode-b1-rows.tgz ./*.json && rm -f ./*.json)
grep -h "^gemm 1x" "$out/kernels.log" 2>/dev/null | grep -v "norm" | head -n 40
for part in "$@"; do
    [ "$part" = tests ] || [ "$part" = kernels ] && continue
    echo "== $part"; grep -h "^| decode\|^| prefill\|ceilings" "$out/$part.log" 2>/dev/null
done
exit $status
