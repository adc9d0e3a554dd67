#!/usr/bin/env bash
# The MoE GPU check: the `moe` backends' GPU tests (Triton and grouped_mm against the torch
# reference, CUDA-graph replay, model-level parity, the routing recorder), the per-backend kernel
# benchmark at Qwen3.5-35B-A3B's shapes, then (with `throughput`) engine throughput of the
# qwen3.5-35b-a3b random model against its MoE floors (needs about 75 GB of GPU memory: an H200).
#   bash scripts/gpu_check_moe.sh OUT_DIR [tests|throughput|all]
set -uo pipefail
out=${1:-./gpu-results}
what=${2:-all}
mkdir -p "$out"
if [ -f .devwheels/install.sh ]; then
    eval "$(bash .devwheels/install.sh)" >"$out/install.log" 2>&1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/env.txt" 2>&1
git rev-parse --short HEAD >>"$out/env.txt" 2>&1
status=0
if [ "$what" != throughput ]; then
    python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_moe_triton.py \
        tests/ops/test_moe_grouped_mm.py tests/models/test_moe_triton_parity.py \
        tests/bench/test_moe_floors_gpu.py >"$out/pytest-moe-gpu.txt" 2>&1 || status=1
    tail -n 3 "$out/pytest-moe-gpu.txt"
    python -m deltaserve.cli bench kernels --only moe --json "$out/moe-kernels.json" \
        >"$out/moe-kernels.md" 2>"$out/moe-kernels.log" || status=1
    cat "$out/moe-kernels.md"
fi
if [ "$what" != tests ]; then
    python -m deltaserve.cli bench throughput --random-model qwen3.5-35b-a3b --device cuda \
        --dtype bfloat16 --attention-backend triton --skip-prefill-context --prefill-lens 8192 \
        --decode-batches 1,16,64 --contexts 512 --decode-steps 32 --warmup-steps 4 --repeats 3 \
        --json "$out/moe-35b.json" >"$out/moe-35b.md" 2>"$out/moe-35b.log" || status=1
    cat "$out/moe-35b.md"; tail -n 5 "$out/moe-35b.log"
fi
exit $status
