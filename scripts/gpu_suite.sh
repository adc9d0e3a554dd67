#!/usr/bin/env bash
# The GPU machine's run: GPU tests, then the benchmarks, everything written under $OUT.
# Usage (from the checkout root, on a GPU machine): bash scripts/gpu_suite.sh [tests|bench|all]
# (The short check, GPU tests then the 9B throughput rows: scripts/gpu_check.sh.)
# With .devwheels/ carried along, it installs fla-core and FlashInfer into /tmp/site first.
# FlashInfer JIT-builds each configuration on first use (10-60 s each): budget the time-outs.
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/deltaserve-gpu-out}
mkdir -p "$OUT"
if [ -f .devwheels/install.sh ]; then
    bash .devwheels/install.sh >"$OUT/install.log" 2>&1 || echo "devwheels install failed" >&2
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >"$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >>"$OUT/gpu.txt" 2>&1
python -c "import fla; print('fla', fla.__version__)" >>"$OUT/gpu.txt" 2>&1
python -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >>"$OUT/gpu.txt" 2>&1

if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout ${TEST_TIMEOUT:-540} python -m pytest -m gpu -q -x --no-header -p no:cacheprovider \
        ${TESTS:-tests} >"$OUT/pytest_gpu.txt" 2>&1
    echo "pytest -m gpu exit $?" >>"$OUT/pytest_gpu.txt"
    tail -5 "$OUT/pytest_gpu.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout ${BENCH_TIMEOUT:-240} python -m deltaserve.cli bench kernels ${KERNEL_ARGS:-} \
        --json "$OUT/kernels.json" >"$OUT/bench_kernels.md" 2>"$OUT/bench_kernels.err"
    echo "bench kernels exit $?" >>"$OUT/bench_kernels.md"
    timeout ${THROUGHPUT_TIMEOUT:-300} python -m deltaserve.cli bench throughput \
        ${THROUGHPUT_ARGS:---random-model qwen3.5-9b --skip-prefill-context} --json "$OUT/throughput.json" \
        >"$OUT/bench_throughput.md" 2>"$OUT/bench_throughput.err"
    echo "bench throughput exit $?" >>"$OUT/bench_throughput.md"
fi
