#!/usr/bin/env bash
# The MoE decode-step check (batch-1 decode of qwen3.5-35b-a3b, issue 12), one stage per call
# (each fits a 10-minute run):
#   bash scripts/gpu_check_moe_decode.sh OUT_DIR tests|kernels|sweep|throughput|throughput-base|profile
# tests:      GPU tests of the split-K decode GEMM, the base GEMM, the Triton moe backend (decode
#             path: shared expert in the down kernel, top-k sum in it, gate_up split over H) and
#             the MoE model parity through the Triton kernels.
# kernels:    `bench kernels --only gemm` (35B-A3B and 9B shapes: split-K as chosen, the base
#             kernel, cuBLAS) and `--only moe` (routed experts per token count).
# sweep:      `bench kernels --only gemm --gemm-sweep` (the fastest split-K configuration per
#             35B-A3B shape at 1 row, to set choose_config from).
# throughput: `bench throughput` of qwen3.5-35b-a3b (prefill 8192, decode batch 1 / 16 / 64)
#             with the split-K GEMM (the default); throughput-base: the same with
#             DELTASERVE_DECODE_GEMM_KERNEL=base (the GEMM before this work; the MoE changes stay).
# profile:    scripts/profile_step.py at decode batch 1 (kernels per step), PDL off.
set -uo pipefail
out=${1:-./gpu-results}
what=${2:-tests}
mkdir -p "$out"
if [ -f .devwheels/install.sh ]; then
    eval "$(bash .devwheels/install.sh)" >"$out/install.log" 2>&1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/env.txt" 2>&1
git rev-parse --short HEAD >>"$out/env.txt" 2>&1
status=0
throughput() {  # $1: tag
    python -m deltaserve.cli bench throughput --random-model qwen3.5-35b-a3b --device cuda \
        --dtype bfloat16 --attention-backend triton --skip-prefill-context --prefill-lens 8192 \
        --decode-batches 1,16,64 --contexts 512 --decode-steps 32 --warmup-steps 4 --repeats 3 \
        --json "$out/moe-35b-$1.json" >"$out/moe-35b-$1.md" 2>"$out/moe-35b-$1.log" || status=1
    cat "$out/moe-35b-$1.md"; tail -n 5 "$out/moe-35b-$1.log"
}
case "$what" in
tests)
    python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_decode_gemm.py \
        tests/ops/test_decode_gemm_splitk.py tests/ops/test_moe_triton.py \
        tests/models/test_moe_triton_parity.py >"$out/pytest-moe-decode-gpu.txt" 2>&1 || status=1
    tail -n 15 "$out/pytest-moe-decode-gpu.txt"
    ;;
kernels)
    python -m deltaserve.cli bench kernels --only gemm --json "$out/gemm-kernels.json" \
        >"$out/gemm-kernels.md" 2>"$out/gemm-kernels.log" || status=1
    cat "$out/gemm-kernels.md"
    python -m deltaserve.cli bench kernels --only moe --json "$out/moe-kernels.json" \
        >"$out/moe-kernels.md" 2>"$out/moe-kernels.log" || status=1
    cat "$out/moe-kernels.md"
    ;;
sweep)
    python -m deltaserve.cli bench kernels --only gemm --quick --gemm-sweep \
        --json "$out/gemm-sweep.json" >"$out/gemm-sweep.md" 2>"$out/gemm-sweep.log" || status=1
    cat "$out/gemm-sweep.md"
    ;;
throughput)
    throughput splitk
    ;;
throughput-base)
    DELTASERVE_DECODE_GEMM_KERNEL=base throughput base
    ;;
profile)
    # NOTE: with programmatic dependent launch (ops/pdl.py) a kernel's profiled time includes
    # its wait for the previous kernel, so the per-kernel table is taken with it off
    DELTASERVE_PDL=0 python scripts/profile_step.py --random-model qwen3.5-35b-a3b \
        --attention-backend triton --decode-batch 1 --skip-prefill-profile \
        >"$out/profile-b1.txt" 2>&1 || status=1
    grep -A 30 "decode B=1" "$out/profile-b1.txt" | head -n 40
    ;;
*)
    echo "unknown stage $what (tests|kernels|sweep|throughput|throughput-base|profile)"; exit 2
    ;;
esac
exit $status
