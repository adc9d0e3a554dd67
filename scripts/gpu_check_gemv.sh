#!/usr/bin/env bash
# The one-row GEMV (deltaserve/ops/linear/triton_gemv.py, DELTASERVE_DECODE_GEMM_KERNEL=gemv)
# against the default decode GEMM (`auto`: the base kernel), in one device call on one GPU:
# `bench kernels --only gemm` at one row on the 35B-A3B's and 9B's shapes (our kernels and
# cuBLAS side by side), then decode batch 1 of one or two models with each kernel, alternating
# auto / gemv on the same machine, each row against the ceilings of its own run; then the GPU
# tests of the GEMV (and, with `tests`, of the MLA split backend, the autotuner's graph timing
# and the page tables' pinned arrays). The first engine run of a model compiles its kernels.
#   bash scripts/gpu_check_gemv.sh OUT_DIR MODEL[,MODEL] [nokernels] [tests]
#   MODEL: 35b | v2-lite | 9b
set -uo pipefail
out=${1:-./gpu-results}
models=${2:-35b}
common="--skip-prefill-context --decode-steps 48 --warmup-steps 8 --repeats 3 \
--decode-batches 1 --contexts 512 --prefill-lens 512"
specs=()
[[ " $* " == *" nokernels "* ]] || specs+=("kernels:150:python -m deltaserve bench kernels \
--only gemm --gemm-rows 1 --json $out/kernels.json")
for model in ${models//,/ }; do
    case $model in
        35b) bench="python -m deltaserve bench throughput --random-model qwen3.5-35b-a3b \
--attention-backend triton $common" ; first=240 ;;
        v2-lite) bench="python -m deltaserve bench throughput --random-model deepseek-v2-lite \
--dtype bfloat16 --mla-backend triton $common" ; first=240 ;;
        9b) bench="python -m deltaserve bench throughput --random-model qwen3.5-9b \
--attention-backend triton $common" ; first=120 ;;
        *) echo "unknown model $model (35b, v2-lite, 9b)"; exit 2 ;;
    esac
    specs+=("$model-auto:$first:DELTASERVE_DECODE_GEMM_KERNEL=auto $bench --json $out/$model-auto.json")
    specs+=("$model-gemv:100:DELTASERVE_DECODE_GEMM_KERNEL=gemv $bench --json $out/$model-gemv.json")
done
tests="tests/ops/test_decode_gemv.py"
[[ " $* " == *" tests "* ]] && tests+=" tests/ops/test_mla_split.py tests/ops/test_graph_bench.py \
tests/ops/test_flashinfer_attention.py -k 'gemv or split or graph_bench or copy or tuning or pinned'"
specs+=("tests:120:python -m pytest -m gpu -q -rfEs -p no:cacheprovider $tests")
bash "$(dirname "$0")/gpu_parts.sh" "$out" "${specs[@]}"
status=$?
(cd "$out" && tar -czf gemv-rows.tgz ./*.json && rm -f ./*.json)
grep -h "triton-gemv\|triton-base\|cublas" "$out/kernels.log" 2>/dev/null | grep "^gemm 1x" | head -n 40
for model in ${models//,/ }; do
    for v in auto gemv; do
        echo "== $model $v"; grep -h "^| decode\|ceilings" "$out/$model-$v.log" 2>/dev/null | tail -n 2
    done
done
exit $status
