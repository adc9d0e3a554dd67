#!/usr/bin/env bash
# GPU run 3 of session 3: the full throughput table on the final code, the decode GEMM bench and
# the engine's GPU tests. Everything lands in $OUT/run3.tar.gz (few files come back per run).
bash .devwheels/install.sh >/dev/null 2>&1
rm -rf /tmp/site/flashinfer* /tmp/site/flashinfer_python*  # no FlashInfer JIT builds this run
export PYTHONPATH=$PWD:/tmp/site
R=$OUT/run3; mkdir -p $R
B="python -m deltaserve.cli bench"
timeout 230 $B throughput --random-model qwen3.5-9b --skip-prefill-context \
  --attention-backend triton --decode-steps 48 --repeats 2 --json $R/tp.json \
  >$R/tp.md 2>$R/tp.err; echo "tp rc $?"
timeout 60 $B kernels --only gemm --json $R/gemm.json >$R/gemm.md 2>$R/gemm.err
echo "gemm rc $?"
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_reference.py \
  tests/ops/test_decode_gemm.py >$R/pt.txt 2>&1; echo "pt rc $?"
tail -3 $R/pt.txt
tar czf $OUT/run3.tar.gz -C $OUT run3 && rm -rf $R
