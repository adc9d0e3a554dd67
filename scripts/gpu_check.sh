#!/usr/bin/env bash
# The GPU check: run from the checkout root on a CUDA machine with deltaserve's dependencies
# installed (fla-core for the GDN prefill kernels). It runs the GPU tests, then engine throughput
# on the Qwen3.5-9B shapes (random bf16 weights, no download): prefill 8192, decode batch
# 1 / 16 / 64 at contexts 512 and 2048, against floors from the copy and matmul ceilings it
# measures on this GPU. Logs, tables and JSON go to the directory $1 (default ./gpu-results).
#   bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
out=${1:-./gpu-results}
mkdir -p "$out"
if [ -f .devwheels/install.sh ]; then  # packages carried to a machine without a network
    eval "$(bash .devwheels/install.sh)" >"$out/install.log" 2>&1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    git rev-parse --short HEAD
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >"$out/env.txt" 2>&1

# every part of the GPU tests (scripts/gpu_test_parts.txt), each under its own time limit
bash scripts/gpu_tests.sh "$out" >"$out/pytest-gpu.txt" 2>&1
tests=$?
cat "$out/pytest-gpu.txt"

# Triton attention: FlashInfer, where installed, JIT-builds each shape for minutes on first use.
python -m deltaserve.cli bench throughput --random-model qwen3.5-9b --skip-prefill-context \
    --attention-backend triton --prefill-lens 8192 --decode-batches 1,16,64 --contexts 512,2048 \
    --decode-steps 48 --repeats 3 --json "$out/throughput.json" \
    >"$out/throughput.md" 2>"$out/throughput.log"
bench=$?
cat "$out/throughput.md"

echo "pytest -m gpu: exit $tests; bench throughput: exit $bench; results in $out"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
