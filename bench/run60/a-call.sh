#!/usr/bin/env bash
# Run 60, call a (from the project root on the GPU machine; $OUT comes back): the DENSE forward (no masks, 32-bit
# offsets, N compiled in) and rcp_rn at 128 columns. Its GPU tests, then an A/B under the read flush: main (before
# this change: .ab/main, carried), the working tree's table (rcp_rn), dense-128, dense-rewiden-128, rewiden-128;
# torch.compile and the copy once beside them. Device wheels half a copied for call b.
set -u
R=$OUT
export OUT=/tmp/o W=/tmp/strictnorm-call
mkdir -p $OUT $W
bash bench/device_call.sh --wheels a --first "env"
cp $W/env.log $R/env.log
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
timeout 150 python3 -m pytest -n 8 -q -rfE -p no:cacheprovider tests/test_triton.py \
  -k "dense or candidate or rewiden or rstd" > $R/tests.log 2>&1
tail -n 4 $R/tests.log
shapes=4096x128,16384x128,65536x128,262144x128
STRICTNORM_BENCH_FLUSH=read timeout 290 python3 bench/ab_bench.py $OUT/ab 2 main=.ab/main table=. \
  dense=.,bench/candidates/dense-128.json dense-rewiden=.,bench/candidates/dense-rewiden-128.json \
  rewiden=.,bench/candidates/rewiden-128.json -- --flush read --rounds 3 --shapes $shapes \
  --only "strictnorm triton fast,bytes" > $R/ab.log 2>&1
timeout 120 python3 -m strictnorm.bench --flush read --compile --rounds 3 --shapes $shapes \
  --only "torch.compile,bytes" --json $OUT/anchor.json > $OUT/anchor.log 2>&1
cp $OUT/anchor.json $R/ 2>/dev/null
tar czf $R/a.tar.gz -C /tmp o strictnorm-call
cat $R/ab.log | tail -n 30
grep -E "^\|" $OUT/anchor.log | head -20
