#!/usr/bin/env bash
# The decode fusions that are off until measured, on one GPU, one stage per call:
# the decode GEMM prologues (deltaserve/ops/linear/prologue.py, DELTASERVE_DECODE_GEMM_PROLOGUE)
# and the fused GDN decode (deltaserve/ops/gdn/triton_conv_decode.py, DELTASERVE_GDN_FUSED_CONV).
#   bash scripts/gpu_check_decode_fusions.sh OUT_DIR tests|kernels|dense|moe|startup
# tests:   their GPU tests, the decode GEMMs', the fused ops' and the GDN decode's.
# kernels: `bench kernels --only gemm --quick`: each prologue in the GEMM (`triton-<op>`)
#          against the op's kernel then the GEMM (`<op>+triton`), with the plain GEMM rows;
#          `--only gdn --quick`: the decode step with its conv1d fused (`triton-fused-conv`)
#          against the two kernels (`conv+triton`).
# dense:   `bench throughput` of qwen3.5-9b, decode batch 1 / 16 (context 512): both off, each
#          alone, both on, then off and on again; then batch 64 (context 2048) off and on.
# moe:     qwen3.5-35b-a3b, decode batch 1 / 16 (context 512): the split-K decode GEMM of the
#          2048-wide shapes (the default before; DELTASERVE_DECODE_GEMM_KERNEL=splitk), the base
#          kernel (the default now), then with both fusions on; split-K and all on again.
# startup: `bench startup` of the 9B: three fresh processes with Python's bytecode caches on
#          (the machines set PYTHONDONTWRITEBYTECODE=1: every start there compiles the source
#          of torch, transformers and fla-core again; the first run writes the caches and, on a
#          fresh machine, compiles Triton's kernels), then one as the machine has it.
# Results under OUT_DIR (tables *.md, raw *.json, logs).
set -uo pipefail
out=${1:-./gpu-results}
what=${2:-tests}
mkdir -p "$out"
status=0
parts() { bash scripts/gpu_parts.sh "$out" "$@" || status=1; }
model=qwen3.5-9b
bench() {  # $1: tag, $2: batches, $3: contexts, then env assignments
    local tag=$1 batches=$2 contexts=$3
    shift 3
    echo "env $* python -m deltaserve.cli bench throughput --random-model $model \
--device cuda --dtype bfloat16 --attention-backend triton --skip-prefill-context \
--prefill-lens 512 --repeats 1 --decode-batches $batches --contexts $contexts \
--decode-steps 48 --warmup-steps 4 --json $out/$tag.json > $out/$tag.md"
}
case "$what" in
tests)
    parts "tests:540:python -m pytest -m gpu -q -p no:cacheprovider \
tests/ops/test_decode_gemm_prologue.py tests/ops/test_decode_gemm.py \
tests/ops/test_decode_gemm_splitk.py tests/ops/test_fused.py tests/ops/test_gdn_conv_decode.py \
tests/ops/test_triton_gdn.py"
    ;;
kernels)
    parts "kernels:360:python -m deltaserve.cli bench kernels --only gemm --quick \
--json $out/gemm-prologue.json > $out/gemm-prologue.md" \
        "gdn-kernels:180:python -m deltaserve.cli bench kernels --only gdn --quick \
--json $out/gdn-fused-conv.json > $out/gdn-fused-conv.md"
    cat "$out/gemm-prologue.md" "$out/gdn-fused-conv.md"
    ;;
dense)
    off="DELTASERVE_DECODE_GEMM_PROLOGUE=0 DELTASERVE_GDN_FUSED_CONV=0"
    on="DELTASERVE_DECODE_GEMM_PROLOGUE=1 DELTASERVE_GDN_FUSED_CONV=1"
    parts "off-1:120:$(bench off-1 1,16 512 $off)" \
        "prologue:120:$(bench prologue 1,16 512 DELTASERVE_DECODE_GEMM_PROLOGUE=1)" \
        "conv:120:$(bench conv 1,16 512 DELTASERVE_GDN_FUSED_CONV=1)" \
        "on-1:120:$(bench on-1 1,16 512 $on)" \
        "off-2:120:$(bench off-2 1,16 512 $off)" \
        "on-2:120:$(bench on-2 1,16 512 $on)" \
        "off-64:120:$(bench off-64 64 2048 $off)" \
        "on-64:120:$(bench on-64 64 2048 $on)"
    for t in off-1 prologue conv on-1 off-2 on-2 off-64 on-64; do echo "== $t"; cat "$out/$t.md"; done
    ;;
moe)
    model=qwen3.5-35b-a3b
    off="DELTASERVE_DECODE_GEMM_PROLOGUE=0 DELTASERVE_GDN_FUSED_CONV=0"
    on="DELTASERVE_DECODE_GEMM_PROLOGUE=1 DELTASERVE_GDN_FUSED_CONV=1"
    split="DELTASERVE_DECODE_GEMM_KERNEL=splitk"
    parts "moe-splitk-1:150:$(bench moe-splitk-1 1,16 512 $off $split)" \
        "moe-auto:150:$(bench moe-auto 1,16 512 $off)" \
        "moe-on-1:150:$(bench moe-on-1 1,16 512 $on)" \
        "moe-splitk-2:150:$(bench moe-splitk-2 1,16 512 $off $split)" \
        "moe-on-2:150:$(bench moe-on-2 1,16 512 $on)"
    for t in moe-splitk-1 moe-auto moe-on-1 moe-splitk-2 moe-on-2; do
        echo "== $t"
        cat "$out/$t.md"
    done
    ;;
startup)
    su="python -m deltaserve.cli bench startup --random-model qwen3.5-9b --dtype bfloat16 \
--attention-backend triton"
    parts "startup-pyc:420:$su --repeats 3 --env PYTHONDONTWRITEBYTECODE= \
--json $out/startup-pyc.json > $out/startup-pyc.md" \
        "startup-nopyc:150:$su --repeats 1 --json $out/startup-nopyc.json > $out/startup-nopyc.md"
    cat "$out/startup-pyc.md" "$out/startup-nopyc.md"
    ;;
*)
    echo "unknown stage $what (tests|kernels|dense|moe|startup)"
    exit 2
    ;;
esac
exit $status
