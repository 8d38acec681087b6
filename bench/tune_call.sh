#!/usr/bin/env bash
# One GPU call that settles the CUDA norm tables: bench/sweep_cuda.py with SWEEP_VARIANTS=1 (each table entry
# with EVEN off and on, both directions), then the block sizes (SWEEP_LEAN=1, SWEEP_MIN_THREADS) of the forward
# at the shapes where it trails an anchor and of the backward at the small row counts where it does. Every
# configuration is checked bitwise. The fastest of the three sweeps per shape becomes a tuning file
# ($OUT/tuning.json, and /tmp/strictnorm-tuning.json for a later call on the same machine:
# STRICTNORM_CUDA_TUNING=/tmp/strictnorm-tuning.json bash bench/device_run.sh bench ...). Eight files to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/tune_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
[ -f /tmp/dw/env.sh ] && source /tmp/dw/env.sh
export SWEEP_ITERS=${SWEEP_ITERS:-10}
SWEEP_VARIANTS=1 timeout "${VARIANTS_TIMEOUT:-200}" python3 bench/sweep_cuda.py "$OUT/sweep-variants.json" \
  > "$OUT/sweep-variants.log" 2>&1
tail -n 20 "$OUT/sweep-variants.log"
SWEEP_LEAN=1 SWEEP_DIRECTIONS=fwd SWEEP_MIN_THREADS=${FWD_MIN_THREADS:-64,128,256} \
  SWEEP_SHAPES=${FWD_SHAPES:-128x4096,2048x4096,8192x4096,32768x4096,8192x8192,262144x128} \
  timeout "${FWD_TIMEOUT:-180}" python3 bench/sweep_cuda.py "$OUT/sweep-fwd-blocks.json" \
  > "$OUT/sweep-fwd-blocks.log" 2>&1
tail -n 8 "$OUT/sweep-fwd-blocks.log"
SWEEP_LEAN=1 SWEEP_DIRECTIONS=bwd SWEEP_MIN_THREADS=${BWD_MIN_THREADS:-128} \
  SWEEP_SHAPES=${BWD_SHAPES:-128x4096,2048x4096,8192x4096} \
  timeout "${BWD_TIMEOUT:-150}" python3 bench/sweep_cuda.py "$OUT/sweep-bwd-blocks.json" \
  > "$OUT/sweep-bwd-blocks.log" 2>&1
tail -n 5 "$OUT/sweep-bwd-blocks.log"
python3 bench/sweep_cuda.py --merge "$OUT" sweep-variants sweep-fwd-blocks sweep-bwd-blocks
bash bench/device_cache.sh save
