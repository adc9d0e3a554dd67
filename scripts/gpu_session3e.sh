#!/usr/bin/env bash
# GPU run 5 of session 3: the full throughput table on the final code (auto backends but triton
# attention, FlashInfer absent) and a prefill-512 profile. Everything in $OUT/run5.tar.gz.
bash .devwheels/install.sh >/dev/null 2>&1
rm -rf /tmp/site/flashinfer* /tmp/site/flashinfer_python*  # no FlashInfer JIT builds this run
export PYTHONPATH=$PWD:/tmp/site
R=$OUT/run5; mkdir -p $R
timeout 300 python -m deltaserve.cli bench throughput --random-model qwen3.5-9b \
  --skip-prefill-context --attention-backend triton --decode-steps 48 --repeats 3 \
  --json $R/tp.json >$R/tp.md 2>$R/tp.err; echo "tp rc $?"
timeout 100 python scripts/profile_step.py --attention-backend triton --prompt-len 512 \
  --decode-steps 10 >$R/prof512.txt 2>$R/prof512.err; echo "prof rc $?"
tar czf $OUT/run5.tar.gz -C $OUT run5 && rm -rf $R
