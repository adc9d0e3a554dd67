#!/usr/bin/env bash
# GPU run 2 of session 3: overlapped decode and the Triton decode GEMM (outputs under $OUT).
bash .devwheels/install.sh >/dev/null 2>&1
rm -rf /tmp/site/flashinfer* /tmp/site/flashinfer_python*  # no FlashInfer JIT builds this run
export PYTHONPATH=$PWD:/tmp/site
B="python -m deltaserve.cli bench"
T="--random-model qwen3.5-9b --skip-prefill-context --attention-backend triton --decode-steps 48"
timeout 130 $B throughput $T --decode-gemm-backend triton --prefill-lens 512,8192 \
  --decode-batches 1,16,64 --contexts 512,2048 --repeats 2 --json $OUT/tp_tri.json \
  >$OUT/tp_tri.md 2>$OUT/tp_tri.err; echo "tp triton rc $?"
timeout 110 $B throughput $T --decode-gemm-backend torch --prefill-lens 512 \
  --decode-batches 1,16,64 --contexts 512,2048 --repeats 1 --json $OUT/tp_cublas.json \
  >$OUT/tp_cublas.md 2>$OUT/tp_cublas.err; echo "tp cublas rc $?"
timeout 80 $B kernels --only gemm --json $OUT/gemm.json >$OUT/gemm.md 2>$OUT/gemm.err
echo "gemm rc $?"
DELTASERVE_RUNTIME_STATS=0 timeout 70 python scripts/profile_step.py --attention-backend triton \
  --decode-batch 64 --prompt-len 2048 --decode-steps 10 --skip-prefill-profile \
  >$OUT/prof64.txt 2>$OUT/prof64.err; echo "prof rc $?"
timeout 170 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_reference.py \
  tests/ops/test_decode_gemm.py >$OUT/pt.txt 2>&1; echo "pt rc $?"
tail -3 $OUT/pt.txt
