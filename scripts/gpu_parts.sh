#!/usr/bin/env bash
# Runs GPU check parts one after another, each under its own time limit, logs to $OUT_DIR/NAME.log:
#   bash scripts/gpu_parts.sh OUT_DIR NAME:SECONDS:COMMAND [NAME:SECONDS:COMMAND ...]
# A part past its limit gets SIGABRT (PYTHONFAULTHANDLER prints the Python stacks) and the next
# part starts even if the stuck one has not exited yet (a ptxas child may keep it alive).
# A device call brings back at most 8 files from $OUT: the exit codes and the install log stay in
# a scratch folder (the install log is printed when it is not empty), so N parts leave N logs
# plus what their commands write; the end of the run warns when $OUT holds more than 8 files.
set -uo pipefail
out=$1
shift
mkdir -p "$out"
scratch=$(mktemp -d)
if [ -f .devwheels/install.sh ] && [ -z "${DEVWHEELS_INSTALLED:-}" ]; then
    eval "$(bash .devwheels/install.sh 2>"$scratch/install.log")"
    [ -s "$scratch/install.log" ] && { echo "== install:"; tail -n 20 "$scratch/install.log"; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name --format=csv,noheader
# Tuning results carried between lent machines: with DELTASERVE_TUNING_OUT=1, after each part
# the autotuner's results (its *.autotune.json files in Triton's cache, a few KB:
# deltaserve.ops.autotune caches them) are packed into $OUT/autotune.tgz (one more of the 8
# files a call brings back); DELTASERVE_TUNING_IN=PATH (such a file, carried) unpacks them
# first, so a fresh machine compiles the chosen configuration of each tuning key instead of
# compiling and timing every one (minutes per model on a fresh H200). Triton's own cache key
# (its version, the sm_90 backend, the kernel's source, the tuning key, the configuration list)
# still decides whether a result applies; an H100 and an H200 share it, so a result tuned on one
# serves the other. Start-up benchmarks of a cold machine must run without it.
tcache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -n "${DELTASERVE_TUNING_IN:-}" ]; then
    mkdir -p "$tcache"
    tar -xzf "$DELTASERVE_TUNING_IN" -C "$tcache" || echo "WARNING: could not unpack $DELTASERVE_TUNING_IN"
    echo "tuning results in: $(find "$tcache" -name '*.autotune.json' | wc -l)"
fi
# the tree's commit: DELTASERVE_COMMIT where set (a lent machine's copy of the tree may carry
# stale git metadata: pass DELTASERVE_COMMIT=$(git rev-parse --short HEAD) from the checkout)
echo "commit ${DELTASERVE_COMMIT:-$(git log --oneline -1 | cut -c1-60) (from git)}"
status=0
for spec in "$@"; do
    name=${spec%%:*}
    rest=${spec#*:}
    secs=${rest%%:*}
    cmd=${rest#*:}
    t0=$SECONDS
    (timeout -k 5 -s ABRT "$secs" bash -c "$cmd" >"$out/$name.log" 2>&1; echo $? >"$scratch/$name.rc") &
    pid=$!
    while kill -0 $pid 2>/dev/null && [ $((SECONDS - t0)) -lt $((secs + 15)) ]; do sleep 2; done
    rc=$(cat "$scratch/$name.rc" 2>/dev/null || echo stuck)
    echo "== $name: exit $rc after $((SECONDS - t0)) s (limit $secs s)"
    [ "$rc" = 0 ] || status=1
    grep -E "passed|failed|FAILED|^ERROR" "$out/$name.log" | tail -n 6
    if [ -n "${DELTASERVE_TUNING_OUT:-}" ]; then
        (cd "$tcache" 2>/dev/null && find . -name '*.autotune.json' \
            | tar -czf "$scratch/autotune.tgz" -T - && cp "$scratch/autotune.tgz" "$out/")
    fi
done
files=$(find "$out" -type f | wc -l)
if [ "$files" -gt 8 ]; then
    echo "WARNING: $out holds $files files; a device call brings back at most 8:"
    find "$out" -type f | sort
fi
exit $status
