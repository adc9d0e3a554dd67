#!/usr/bin/env bash
# GPU run 4 of session 3: decode with the Triton decode GEMM against cuBLAS end to end, the
# overlapped-decode GPU tests, a batch-1 profile. Everything lands in $OUT/run4.tar.gz.
bash .devwheels/install.sh >/dev/null 2>&1
rm -rf /tmp/site/flashinfer* /tmp/site/flashinfer_python*  # no FlashInfer JIT builds this run
export PYTHONPATH=$PWD:/tmp/site
R=$OUT/run4; mkdir -p $R
B="python -m deltaserve.cli bench"
T="--random-model qwen3.5-9b --skip-prefill-context --attention-backend triton --decode-steps 48"
for g in triton torch; do
  timeout 100 $B throughput $T --decode-gemm-backend $g --prefill-lens 512 --decode-batches 1,16 \
    --contexts 512 --repeats 1 --json $R/tp_$g.json >$R/tp_$g.md 2>$R/tp_$g.err; echo "tp $g rc $?"
done
timeout 210 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_reference.py \
  tests/ops/test_decode_gemm.py -k "overlapped or decode_gemm or graph_decode_equals_eager_and_cpu[qwen3_5_r2_g3] or graph_decode_equals_eager_and_cpu[qwen3_g5]" \
  >$R/pt.txt 2>&1; echo "pt rc $?"
tail -3 $R/pt.txt
DELTASERVE_RUNTIME_STATS=0 timeout 70 python scripts/profile_step.py --attention-backend triton \
  --decode-gemm-backend triton --decode-batch 1 --prompt-len 512 --decode-steps 20 \
  --skip-prefill-profile >$R/prof1.txt 2>$R/prof1.err; echo "prof rc $?"
tar czf $OUT/run4.tar.gz -C $OUT run4 && rm -rf $R
