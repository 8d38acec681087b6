#!/usr/bin/env bash
# Run 60, call a (from the project root on the GPU machine; $OUT comes back): the DENSE forward (no masks, 32-bit
# offsets, N compiled in) and rcp_rn at 128 columns. Their GPU tests, then an A/B under the read flush: main before
# this change (.ab/main, carried), its tiles with rcp_rn (masked-128), the table now (dense + rewiden), dense alone
# (dense-128); torch.compile and the copy once beside them.
set -u
R=$OUT
export OUT=/tmp/o W=/tmp/strictnorm-call
mkdir -p $OUT $W
bash bench/device_call.sh --first "env"
cp $W/env.log $R/env.log
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
timeout 120 python3 -m pytest -n 8 -q -rfE -p no:cacheprovider tests/test_triton.py \
  -k "dense or candidate or rewiden or rstd or 128_columns" > $R/tests.log 2>&1
tail -n 4 $R/tests.log
shapes=4096x128,16384x128,65536x128,262144x128
c=bench/candidates
STRICTNORM_BENCH_FLUSH=read timeout 270 python3 bench/ab_bench.py $OUT/ab 2 main=.ab/main masked=.,$c/masked-128.json \
  table=. dense=.,$c/dense-128.json -- --flush read --rounds 3 --shapes $shapes \
  --only "strictnorm triton fast,bytes" > $R/ab.log 2>&1
timeout 100 python3 -m strictnorm.bench --flush read --compile --rounds 3 --shapes $shapes \
  --only "torch.compile,bytes" --json $OUT/anchor.json > $OUT/anchor.log 2>&1
cp $OUT/anchor.json $R/ 2>/dev/null
tar czf $R/a.tar.gz -C /tmp o strictnorm-call
tail -n 30 $R/ab.log
grep -E "^\|" $OUT/anchor.log | head -20
