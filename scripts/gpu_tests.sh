#!/usr/bin/env bash
# The GPU tests in parts (scripts/gpu_test_parts.txt), each in its own process under its own
# time limit, so a slow part cannot take the others' results with it:
#   bash scripts/gpu_tests.sh OUT_DIR [PART ...]      (default: every part, in the file's order)
# GPU_TESTS_PART_S: each part's limit in seconds (default 480); GPU_TESTS_TEST_S: one test's
# (default 300, where pytest-timeout is installed: a test past it fails, the part goes on);
# GPU_TESTS_WORKERS: pytest-xdist processes for the parts marked `part*` (default 8);
# GPU_TESTS_TOGETHER=1: those of the named parts run as one pytest run (`gpu-together`, one
# limit), so the workers stay busy across part boundaries (all of them fitted one 10-minute call
# in two runs: kernels 322 s, tiny-model engines 327-363 s on one H200).
# Logs: OUT_DIR/gpu-<part>.log; the summary lines on stdout.
set -uo pipefail
out=${1:-./gpu-results}
shift || true
mkdir -p "$out"
part_s=${GPU_TESTS_PART_S:-480}
test_s=${GPU_TESTS_TEST_S:-300}
parts_file=scripts/gpu_test_parts.txt
mapfile -t wanted < <(if [ $# -gt 0 ]; then printf '%s\n' "$@"; else
    grep -v '^#' "$parts_file" | cut -d: -f1 | tr -d '*'; fi)
# the dev wheels first (gpu_parts.sh would install them later): the checks below need them
if [ -f .devwheels/install.sh ] && [ -z "${DEVWHEELS_INSTALLED:-}" ]; then
    eval "$(bash .devwheels/install.sh 2>"$out/install.log")"
    export PYTHONPATH DEVWHEELS_INSTALLED=1
fi
timeout_flag=""
if python -c "import pytest_timeout" 2>/dev/null; then timeout_flag="--timeout=$test_s"; fi
pytest_cmd="python -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=10 $timeout_flag"
# the server tests need the openai client; without it their files are left out, and said so
# (dropped from the file list: pytest's --ignore does not apply to files named on the command line)
skip=""
if ! python -c "import openai" 2>/dev/null; then
    echo "openai is not installed: tests/server/test_images_gpu.py left out"
    skip="tests/server/test_images_gpu.py"
fi
# a failing test's report as soon as it ends (tests/conftest.py): a part killed at its limit
# still shows why an earlier test failed
export DELTASERVE_TEST_REPORT_FAILURES=1
have_xdist=0
if python -c "import xdist" 2>/dev/null; then have_xdist=1; fi
specs=()
together=""
for part in "${wanted[@]}"; do
    line=$(grep -E "^$part\*?:" "$parts_file")
    if [ -z "$line" ]; then echo "unknown part $part"; exit 2; fi
    files=${line#*:}
    workers=""
    if [[ ${line%%:*} == *'*' ]] && [ $have_xdist = 1 ]; then
        workers="-n ${GPU_TESTS_WORKERS:-8}"
    fi
    if [ -n "$skip" ]; then files=${files//$skip/}; fi
    if [ -n "$workers" ] && [ "${GPU_TESTS_TOGETHER:-0}" = 1 ]; then
        together="$together $files"
        continue
    fi
    specs+=("gpu-$part:$part_s:$pytest_cmd $workers $files")
done
if [ -n "$together" ]; then
    specs=("gpu-together:$part_s:$pytest_cmd -n ${GPU_TESTS_WORKERS:-8} $together" "${specs[@]}")
fi
bash scripts/gpu_parts.sh "$out" "${specs[@]}"
