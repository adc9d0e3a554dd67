#!/usr/bin/env bash
# Programmatic dependent launch (deltaserve/ops/pdl.py) on one GPU, one stage per call:
#   bash scripts/gpu_check_pdl.sh OUT_DIR tests|moe|dense
# tests: the GPU tests of every kernel PDL launches (the chain test of tests/ops/test_pdl.py,
#        decode GEMMs, fused norms and gates, attention, GDN, MoE, MLA, the MoE model parity).
# moe:   `bench throughput` of qwen3.5-35b-a3b, decode batch 1 and 16 (context 512), with PDL
#        (the default) and with DELTASERVE_PDL=0, then the batch-1 profile with PDL.
# dense: the same for qwen3.5-9b at decode batch 1 / 16 / 64.
# Results under OUT_DIR (tables *.md, raw *.json, logs), archived as OUT_DIR/pdl.tar.gz.
set -uo pipefail
out=${1:-./gpu-results}
what=${2:-tests}
mkdir -p "$out"
budget=${PDL_CHECK_BUDGET_S:-540}
t_start=$SECONDS
left() { echo $((budget - (SECONDS - t_start))); }
parts() { bash scripts/gpu_parts.sh "$out" "$@" || status=1; }
status=0
bench() {  # $1: model, $2: batches, $3: tag, then env assignments
    local model=$1 batches=$2 tag=$3
    shift 3
    echo "env $* python -m deltaserve.cli bench throughput --random-model $model --device cuda \
--dtype bfloat16 --attention-backend triton --skip-prefill-context --prefill-lens 512 \
--repeats 1 --decode-batches $batches --contexts 512 --decode-steps 32 --warmup-steps 4 \
--json $out/$tag.json > $out/$tag.md"
}
case "$what" in
tests)
    parts "tests:$(left):python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_pdl.py \
tests/ops/test_decode_gemm.py tests/ops/test_decode_gemm_splitk.py tests/ops/test_fused.py \
tests/ops/test_triton_attention.py tests/ops/test_kv_writer.py tests/ops/test_triton_gdn.py \
tests/ops/test_moe_triton.py tests/ops/test_mla_triton.py tests/models/test_moe_triton_parity.py"
    ;;
moe)
    parts "moe-pdl:270:$(bench qwen3.5-35b-a3b 1,16 moe-35b-pdl)" \
        "moe-nopdl:270:$(bench qwen3.5-35b-a3b 1,16 moe-35b-nopdl DELTASERVE_PDL=0)"
    for t in moe-35b-pdl moe-35b-nopdl; do echo "== $t"; cat "$out/$t.md"; done
    if [ "$(left)" -gt 60 ]; then
        parts "profile:$(left):python scripts/profile_step.py --random-model qwen3.5-35b-a3b \
--attention-backend triton --decode-batch 1 --skip-prefill-profile > $out/profile-35b-b1.txt"
        grep -A 30 "decode B=1" "$out/profile-35b-b1.txt" | head -n 40
    fi
    ;;
dense)
    parts "dense-pdl:200:$(bench qwen3.5-9b 1,16,64 dense-9b-pdl)" \
        "dense-nopdl:200:$(bench qwen3.5-9b 1,16,64 dense-9b-nopdl DELTASERVE_PDL=0)"
    for t in dense-9b-pdl dense-9b-nopdl; do echo "== $t"; cat "$out/$t.md"; done
    ;;
*)
    echo "unknown stage $what (tests|moe|dense)"; exit 2
    ;;
esac
tar -czf "$out/pdl-$what.tar.gz" -C "$out" --exclude "*.tar.gz" . 2>/dev/null
exit $status
