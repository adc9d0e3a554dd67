#!/usr/bin/env bash
# The decode rows of the three performance issues (one GPU), each part under its own time limit
# (scripts/gpu_parts.sh), every figure against ceilings measured in its run:
#   bash scripts/gpu_check_decode_rows.sh OUT_DIR [PART ...]
# parts: dense-9b (decode batch 1 / 16 / 64, contexts 512 / 2048, prefill 1 x 512), moe-35b
# (qwen3.5-35b-a3b, batch 1 / 16 / 64 at context 512), dsv2-lite (deepseek-v2-lite, batch 1 / 16
# / 64 at context 512), gemm (the decode GEMM table at 1, 16 and 64 rows).
# On a fresh machine (cold Triton caches) a model's first start compiles and autotunes for 2-4
# minutes (fresh H200s: the V2-Lite part took 209 s in all, the 35B-A3B's did not finish in
# 180 s), so all four parts do not fit one 10-minute device call: run `dense-9b moe-35b`, then
# at once (the machine still warm, its caches kept) `dsv2-lite gemm`. The 35B-A3B's batch 64 needs an H200 (its 69 GB of weights leave
# an 80 GB card room for ~31 sequences).
set -uo pipefail
out=${1:-./gpu-results}
shift || true
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(dense-9b moe-35b dsv2-lite gemm)
common="--skip-prefill-context --decode-steps 48 --warmup-steps 8 --repeats 3"
specs=()
for part in "${parts[@]}"; do
    case $part in
        dense-9b) specs+=("dense-9b:240:python -m deltaserve bench throughput \
--random-model qwen3.5-9b --attention-backend triton $common --prefill-lens 512 \
--decode-batches 1,16,64 --contexts 512,2048 --json $out/dense-9b.json") ;;
        moe-35b) specs+=("moe-35b:300:python -m deltaserve bench throughput \
--random-model qwen3.5-35b-a3b --attention-backend triton $common --prefill-lens 512 \
--decode-batches 1,16,64 --contexts 512 --json $out/moe-35b.json") ;;
        dsv2-lite) specs+=("dsv2-lite:280:python -m deltaserve bench throughput \
--random-model deepseek-v2-lite --dtype bfloat16 $common --prefill-lens 512 \
--decode-batches 1,16,64 --contexts 512 --json $out/dsv2-lite.json") ;;
        gemm) specs+=("gemm:200:python -m deltaserve bench kernels --only gemm \
--gemm-rows 1,16,64 --json $out/gemm.json") ;;
        *) echo "unknown part $part (dense-9b, moe-35b, dsv2-lite, gemm)"; exit 2 ;;
    esac
done
bash scripts/gpu_parts.sh "$out" "${specs[@]}"
status=$?
for part in "${parts[@]}"; do grep -h "^| \(decode\|prefill\)" "$out/$part.log" 2>/dev/null; done
exit $status
