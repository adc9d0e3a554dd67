#!/usr/bin/env bash
# The GPU check of FlashInfer's GDN decode backend (`--gdn-decode-backend flashinfer`), in one
# run: its kernel tests with the printing probe (bf16-state output question), the GDN kernel
# benchmark (ours / FlashInfer / fla-core, batch 1..512, float32 and bfloat16 pools, against the
# copy ceiling measured in the same run), engine throughput at 9B shapes triton vs flashinfer
# (decode batch 1 / 16 / 64 / 256), then the engine tests (graphs, eager, overlap, prefix cache,
# speculative decoding, bf16 pool). Logs, tables and JSON go to $1.
#   bash scripts/gpu_check_flashinfer_gdn.sh OUT_DIR [tests|bench|throughput|engine|all]
# Needs the CuTe DSL runtime (FlashInfer's GDN kernels) installed beside .devwheels on the GPU
# machine; .devwheels/install.sh installs it when its parts are present.
# Budget (each part under `timeout`; most of the test time is FlashInfer compiling its CuTe DSL
# kernels, one per shape / tile variant, 1-5 s each on a fresh machine): kernel tests 150 s,
# kernel bench 90 s, throughput 2 x 75 s, engine tests 100 s, install ~30 s: 8.7 minutes at
# most. If a part times out, rerun it alone: `... OUT tests`, `OUT bench`, `OUT throughput`,
# `OUT engine`.
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
python - >>"$out/env.txt" 2>&1 <<'PY'
import torch
from deltaserve.backend_checks import check_flashinfer_gdn
from deltaserve.cache.spec import GDNSpec
from deltaserve.capabilities import Capabilities
for state in (torch.float32, torch.bfloat16):
    caps = Capabilities(torch.device("cuda"), torch.bfloat16, state, 16, (),
                        (GDNSpec(16, 32, 128, 128, 4),))
    print(f"flashinfer gdn_decode, {state} pool:", check_flashinfer_gdn(caps) or "able")
PY
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
    part kernel-tests 150 python -m pytest -m gpu -q -s -rfE -p no:cacheprovider \
        tests/ops/test_flashinfer_gdn.py --junitxml="$out/kernel-tests.xml"
    tail -n 3 "$out/kernel-tests.log"
    grep PROBE "$out/kernel-tests.log" | tee "$out/probe.txt"
    python - "$out/probe.txt" "$out/probe.json" <<'PY'
import json, re, sys
rows = []
for line in open(sys.argv[1]):
    errs = dict(re.findall(r"(output rel err|state rel err|vs [\w ]+?):? ([0-9][0-9.e+-]*|inf)", line))
    rows.append(dict(line=line.strip(), **{k: float(v) for k, v in errs.items()}))
json.dump(rows, open(sys.argv[2], "w"), indent=1)
PY
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    part kernel-bench 90 python -m deltaserve.cli bench kernels --only gdn \
        --json "$out/gdn-kernels.json"
    sed -n '/^device/,$p' "$out/kernel-bench.log"
fi
if [ "$what" = throughput ] || [ "$what" = all ]; then
    for backend in triton flashinfer; do
        part "throughput-$backend" 75 python -m deltaserve.cli bench throughput \
            --random-model qwen3.5-9b --device cuda --dtype bfloat16 \
            --attention-backend triton --gdn-decode-backend "$backend" \
            --prefill-lens 512 --skip-prefill-context --decode-batches 1,16,64,256 \
            --contexts 512 --decode-steps 32 --warmup-steps 4 --repeats 1 \
            --json "$out/throughput-$backend.json"
        grep -E "^\|" "$out/throughput-$backend.log"
        grep -E "gdn_decode|error|Error" "$out/throughput-$backend.log" | head -n 5
    done
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
    part engine-tests 100 python -m pytest -m gpu -q -rfE -p no:cacheprovider \
        tests/engine/test_flashinfer_gdn_engine_gpu.py --junitxml="$out/engine-tests.xml"
    tail -n 5 "$out/engine-tests.log"
fi
exit $status
