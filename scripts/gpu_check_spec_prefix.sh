#!/usr/bin/env bash
# The GPU check of speculative decoding and hybrid prefix caching, 9B shapes (random bf16):
# their GPU tests, `bench spec` (forced acceptance, tau tokens per verify step, against plain
# decode in the same engine), the DFlash drafter's block-forward cost, and the multi-turn chat
# benchmark with and without prefix caching. Logs, tables and JSON go to $1.
#   bash scripts/gpu_check_spec_prefix.sh OUT_DIR [tests|bench|serve|all]
# serve: MT_MODES picks the servers (default "cached plain"; "cached-thread" runs the engine in a
# thread of the server's process, --no-engine-process; "cached-nobuckets" turns the eager
# forwards' row buckets off, DELTASERVE_ROW_BUCKETS=0; "cached-nopiecewise" the piecewise CUDA
# graphs of short eager steps, DELTASERVE_PIECEWISE_GRAPH_TOKENS=0); MT_STEP_STATS=1 logs every step;
# MT_BENCH_ARGS adds arguments to the benchmark (e.g. "--random-range-ratio 0.5")
set -uo pipefail
out=${1:-./gpu-results}
what=${2:-all}
mkdir -p "$out"
if [ -f .devwheels/install.sh ]; then
    eval "$(bash .devwheels/install.sh)" >"$out/install.log" 2>&1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/env.txt" 2>&1
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    python -m pytest -m gpu -q -p no:cacheprovider tests/spec \
        tests/engine/test_hybrid_prefix_cache_gpu.py >"$out/pytest-spec-prefix-gpu.txt" 2>&1 \
        || status=1
    tail -n 3 "$out/pytest-spec-prefix-gpu.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python -m deltaserve.cli bench spec --random-model qwen3.5-9b --device cuda \
        --dtype bfloat16 --attention-backend triton --batches 1,4,16 --taus 1,2,4,8,16 \
        --num-speculative-tokens 15 --context 512 --steps 20 --json "$out/spec.json" \
        >"$out/spec.md" 2>"$out/spec.log" || status=1
    cat "$out/spec.md"; tail -n 3 "$out/spec.log"
    python -m deltaserve.spec.dflash.bench --preset qwen3.5-9b-dflash --batch 1 4 16 \
        --drafts 15 7 --context 1024 >"$out/dflash.md" 2>"$out/dflash.log" || status=1
    cat "$out/dflash.md"; tail -n 3 "$out/dflash.log"
fi
if [ "$what" = serve ] || [ "$what" = all ]; then
    # the GPU machine has no FastAPI / uvicorn: their wheels travel in .servewheels (appended to
    # the path, so the machine's own packages win where both have one)
    if [ -d .servewheels ]; then
        python -m pip install -q --no-index --no-deps --target /tmp/site-serve .servewheels/*.whl \
            >"$out/serve-install.log" 2>&1
        export PYTHONPATH=$PYTHONPATH:/tmp/site-serve
    fi
    # MT_MODES: the servers to run (default both); MT_STEP_STATS=1: the servers log every
    # step's phases (DELTASERVE_RUNTIME_STATS, interval 1: they sync the device, so the TTFTs
    # of such a run are a profile, not a figure)
    stats=()
    [ "${MT_STEP_STATS:-0}" = 1 ] && stats=(DELTASERVE_RUNTIME_STATS=1 DELTASERVE_RUNTIME_STATS_INTERVAL=1)
    for mode in ${MT_MODES:-cached plain}; do
        flag=""
        buckets=()
        [ "$mode" = plain ] && flag="--no-enable-prefix-caching"
        [ "$mode" = cached-thread ] && flag="--no-engine-process"
        [ "$mode" = cached-nobuckets ] && buckets=(DELTASERVE_ROW_BUCKETS=0)
        [ "$mode" = cached-nopiecewise ] && buckets=(DELTASERVE_PIECEWISE_GRAPH_TOKENS=0)
        env ${stats[@]+"${stats[@]}"} ${buckets[@]+"${buckets[@]}"} \
            python -m deltaserve.cli serve --random-model qwen3.5-9b \
            --device cuda --dtype bfloat16 \
            --attention-backend triton --max-model-len 8192 --port 8000 $flag \
            >"$out/serve-$mode.log" 2>&1 &
        pid=$!
        for _ in $(seq 240); do
            curl -sf 127.0.0.1:8000/health >/dev/null 2>&1 && break
            sleep 1
        done
        python -m deltaserve.cli bench serve --endpoint http://127.0.0.1:8000 --multi-turn 8 \
            --num-prompts 16 --concurrency 16 --system-len 1024 --input-len 128 \
            --output-len 128 ${MT_BENCH_ARGS:-} --json "$out/mt_$mode.json" \
            >"$out/mt_$mode.md" 2>&1 || status=1
        kill $pid 2>/dev/null || { echo "server ($mode) exited early:"; tail -n 30 "$out/serve-$mode.log"; }
        wait $pid 2>/dev/null
        echo "== multi-turn, prefix caching $mode"; cat "$out/mt_$mode.md"
    done
fi
exit $status
