#!/usr/bin/env bash
# One GPU-machine run: benchmarks first, then the engine's GPU tests (outputs under $OUT).
bash .devwheels/install.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
B="python -m deltaserve.cli bench"
timeout 170 $B throughput --random-model qwen3.5-9b --skip-prefill-context --attention-backend triton \
  --decode-steps 48 --repeats 2 --json $OUT/tp.json >$OUT/tp.md 2>$OUT/tp.err; echo "tp rc $?"
DELTASERVE_RUNTIME_STATS=1 DELTASERVE_RUNTIME_STATS_INTERVAL=16 timeout 80 $B throughput \
  --random-model qwen3.5-9b --skip-prefill-context --attention-backend triton --prefill-lens 512 \
  --decode-batches 1,256 --contexts 8192 --decode-steps 32 >$OUT/diag.md 2>$OUT/diag.err
echo "diag rc $?"
timeout 90 $B throughput --random-model qwen3.5-9b --skip-prefill-context --attention-backend flashinfer \
  --prefill-lens 512,8192 --decode-batches 1,64 --contexts 2048 --decode-steps 32 --repeats 2 \
  --json $OUT/tp_fi.json >$OUT/tp_fi.md 2>$OUT/tp_fi.err; echo "fi rc $?"
timeout 90 $B kernels --json $OUT/kernels.json >$OUT/kernels.md 2>$OUT/kernels.err; echo "kern rc $?"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_reference.py >$OUT/pt.txt 2>&1
echo "pt rc $?"
tail -3 $OUT/pt.txt
