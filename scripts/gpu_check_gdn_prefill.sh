#!/usr/bin/env bash
# The GPU check of the one-launch Triton GDN prefill and the `fla` backend's short-row split, in
# one run: the kernel tests at 9B shapes (the kernel alone, fla with the split, fla alone, float32
# and bfloat16 pools, mixed row lengths 1..600), fla's own prefill tests (now also through the
# split), the engine tests (the `triton` backend against torch's, hybrid prefix caching and the
# GPU-equals-CPU tests, which now run short rows through the kernel inside `fla`), then
# `bench kernels --only gdn_prefill`
# (device and host time per layer call at 16 x 171, 1 x 171, 16 x 16, 1 x 1024 tokens: fla,
# fla-split, triton and its tiling variants), from which SHORT_ROW_MAX_TOKENS
# (deltaserve/ops/gdn/row_split.py) and the default tiling (prefill_tiling in
# deltaserve/ops/gdn/triton_prefill.py) are chosen. Logs, tables and JSON go to $1.
#   bash scripts/gpu_check_gdn_prefill.sh OUT_DIR [tests|engine|bench|all]
# Needs .devwheels (fla-core) sent along: `../shared/tools/gpu-wheels` once in the checkout.
# Budget: install ~30 s, kernel tests 150 s, engine tests 200 s, bench 200 s (each part under
# `timeout`): run the parts in separate calls if one call's 10 minutes are short.
set -uo pipefail
out=${1:-./gpu-results}
what=${2:-all}
mkdir -p "$out"
if [ -f .devwheels/install.sh ]; then
    eval "$(bash .devwheels/install.sh 2>"$out/install.log")"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/env.txt" 2>&1
git rev-parse --short HEAD >>"$out/env.txt" 2>&1
python -c "import fla; print('fla', fla.__version__)" >>"$out/env.txt" 2>&1
cat "$out/env.txt"
status=0
part() {  # part NAME SECONDS COMMAND...: run under a timeout, log to $out/NAME.log
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s (limit $secs s)"
    [ $rc -eq 0 ] || status=1
    return $rc
}
if [ "$what" = tests ] || [ "$what" = all ]; then
    part kernel-tests 150 python -m pytest -m gpu -q -rfE -p no:cacheprovider \
        tests/ops/test_triton_gdn_prefill.py tests/ops/test_fla_prefill.py \
        --junitxml="$out/kernel-tests.xml"
    tail -n 8 "$out/kernel-tests.log"
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
    part engine-tests 200 python -m pytest -m gpu -q -rfE -p no:cacheprovider \
        tests/engine/test_triton_gdn_prefill_engine.py tests/engine/test_hybrid_prefix_cache_gpu.py \
        tests/test_gpu_reference.py --junitxml="$out/engine-tests.xml"
    tail -n 8 "$out/engine-tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    part kernel-bench 200 python -m deltaserve.cli bench kernels --only gdn_prefill \
        --json "$out/gdn-prefill-kernels.json"
    sed -n '/^device/,$p' "$out/kernel-bench.log"
fi
exit $status
