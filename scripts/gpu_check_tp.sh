#!/usr/bin/env bash
# The tensor-parallel GPU check, for a machine with 2 (or 4) GPUs. NVLink multicast is off for
# every process (see deltaserve/distributed/parallel_state.py). Parts, in order of importance,
# each under its own time limit and all within one overall budget (TP_CHECK_BUDGET_S, default
# 1500 s: more than one device call's 600 s, so pass a smaller one there; a part that would not
# have 60 s left is skipped, saying so). On a fresh machine every part pays the kernels' first-use
# compilation and autotuning: on two H100s the 27B TP=1 bench took 84 s and TP=2 did not finish
# inside 100 s, so run the parts in separate calls (`tests`, `dense`, `moe`) with these limits.
#   tests  pytest -m gpu tests/distributed, each test in its own process: TP=2 (NCCL, the
#          symmetric-memory kernels, decode graphs, overlapped decode) equals TP=1 in float32,
#          the eager path, replicated kv heads, shutdown within a bound
#   dense  --random-model qwen3.5-27b, decode B=1/16/64 at TP=2, TP=1 (and TP=4 with 4 GPUs;
#          TP_DENSE_SIZES picks sizes and all-reduce modes, e.g. "1 2:oneshot")
#   moe    --random-model qwen3.5-35b-a3b at TP=2; qwen3-next-80b-a3b and qwen3.5-122b-a10b each
#          at the smallest TP of 2/4 whose bf16 shard fits in 85% of one GPU (both fit 2 H200s;
#          skipped otherwise); TP_MOE_PRESETS picks presets, TP_MOE_LIMIT_S their limit (300 s)
#   profile  rank 0's kernel and host tables of a 27B decode step (scripts/profile_step.py) at
#          TP=$TP_PROFILE_SIZE (default: every GPU) and batch $TP_PROFILE_BATCH (default 16): the
#          lead for TP=4's batch 16 / 64 rows far below their floor
# Each bench writes OUT/<name>.json (rows with tok/s, % of the per-GPU floor, all-reduce time
# per decode step, control message cost), OUT/<name>.md and OUT/<name>.log.
#   bash scripts/gpu_check_tp.sh OUT_DIR [all|tests|dense|moe]
set -uo pipefail
out=${1:-./gpu-results-tp}
what=${2:-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a part past its limit gets SIGABRT: every Python process dumps its threads' stacks to its log
export PYTHONFAULTHANDLER=1
if [ -f .devwheels/install.sh ]; then
    eval "$(bash .devwheels/install.sh)" >"$out/install.log" 2>&1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    git rev-parse --short HEAD
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
} >"$out/env.txt" 2>&1
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
deadline=$((SECONDS + ${TP_CHECK_BUDGET_S:-1500}))
status=0

# run NAME LIMIT_S CMD...: CMD under min(LIMIT_S, time left), output to OUT/NAME.{md,log}
run() {
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS - 5))
    if [ "$left" -lt 60 ]; then
        echo "$name: skipped, ${left}s left of the budget" | tee -a "$out/skipped.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS
    timeout -s ABRT -k 10 "$limit" "$@" >"$out/$name.md" 2>"$out/$name.log"
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - start))s (limit ${limit}s)" | tee -a "$out/parts.txt"
    [ "$rc" -ne 0 ] && status=1
}

bench() {  # bench NAME LIMIT_S PRESET TP
    run "$1" "$2" python -m deltaserve.cli bench throughput --random-model "$3" --device cuda \
        --dtype bfloat16 --attention-backend triton --tensor-parallel-size "$4" \
        --prefill-lens 512 --decode-batches 1,16,64 --contexts 512 --decode-steps 32 \
        --warmup-steps 4 --repeats 1 --json "$out/$1.json"
    tail -n 12 "$out/$1.md"
    grep -v "^\s*$" "$out/$1.log" | tail -n 25
}

if [ "$what" = all ] || [ "$what" = tests ]; then
    # each GPU test in its own process: only the first TP engine of a process sets up the
    # symmetric-memory kernels (symm_all_reduce.py says why), so each test's TP engine runs them
    ids=$(python -m pytest -m gpu -q --collect-only -p no:cacheprovider tests/distributed |
        grep '::')
    i=0
    for id in $ids; do
        i=$((i + 1))
        run "pytest-tp-gpu-$i" 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider "$id"
        echo "$id: $(tail -n 1 "$out/pytest-tp-gpu-$i.md")"
        if [ "$i" = 1 ]; then  # the first again with the one-shot kernel alone
            DELTASERVE_TP_ALL_REDUCE=oneshot run pytest-tp-gpu-oneshot 200 python -m pytest \
                -m gpu -q -rfEs -p no:cacheprovider "$id"
            echo "$id (oneshot): $(tail -n 1 "$out/pytest-tp-gpu-oneshot.md")"
        fi
    done
fi
if [ "$what" = all ] || [ "$what" = dense ]; then
    # TP_DENSE_SIZES: the TP sizes to run, in order, each N or N:MODE (DELTASERVE_TP_ALL_REDUCE
    # for that run, e.g. 2:oneshot); default 2 1 (and 4 with 4 GPUs)
    sizes=${TP_DENSE_SIZES:-2 1$([ "$ngpu" -ge 4 ] && echo " 4")}
    for entry in $sizes; do
        n=${entry%%:*}
        mode=auto
        [ "$entry" != "$n" ] && mode=${entry#*:}
        name=qwen3.5-27b-tp$n$([ "$mode" != auto ] && echo "-$mode")
        DELTASERVE_TP_ALL_REDUCE=$mode bench "$name" 240 qwen3.5-27b "$n"
    done
fi
if [ "$what" = all ] || [ "$what" = moe ]; then
    # TP_MOE_PRESETS: which presets to run, in order (default all three); the 35B at TP=2, each
    # larger one at the smallest TP of 2 / 4 whose bf16 shard fits in 85% of one GPU
    for preset in ${TP_MOE_PRESETS:-qwen3.5-35b-a3b qwen3-next-80b-a3b qwen3.5-122b-a10b}; do
        if [ "$preset" = qwen3.5-35b-a3b ]; then
            bench qwen3.5-35b-a3b-tp2 240 qwen3.5-35b-a3b 2
            continue
        fi
        tp=$(python - "$preset" <<'EOF'
import sys

import torch

from deltaserve.bench.memory import random_model_bytes

need = random_model_bytes(sys.argv[1], torch.bfloat16)
per_gpu = torch.cuda.get_device_properties(0).total_memory
n = torch.cuda.device_count()
print(next((tp for tp in (2, 4) if tp <= n and need / tp <= 0.85 * per_gpu), 0))
EOF
)
        if [ "${tp:-0}" -gt 0 ]; then
            bench "$preset-tp$tp" "${TP_MOE_LIMIT_S:-300}" "$preset" "$tp"
        else
            echo "$preset: skipped, its bf16 weights do not fit $ngpu of these GPUs" |
                tee -a "$out/skipped.txt"
        fi
    done
fi
if [ "$what" = profile ]; then
    n=${TP_PROFILE_SIZE:-$ngpu}
    b=${TP_PROFILE_BATCH:-16}
    run "profile-27b-tp$n-b$b" 300 python scripts/profile_step.py --random-model qwen3.5-27b \
        --tensor-parallel-size "$n" --decode-batch "$b" --attention-backend triton \
        --skip-prefill-profile
    grep -A 30 "^decode B=" "$out/profile-27b-tp$n-b$b.md" | head -n 60
fi
exit $status
