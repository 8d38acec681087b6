#!/usr/bin/env bash
# One GPU call for the backward's STAGED knob (the next row copied ahead into shared memory): bench/sweep_cuda.py
# over the backward's table entries with EVEN off / predicated / unpredicated, each also staged (SWEEP_VARIANTS=1,
# SWEEP_STAGED=1), then the held block shapes staged or not at 2048 and 8192 rows of 4096 (SWEEP_LEAN=1); every
# configuration checked bitwise. The fastest per entry as a tuning file ($OUT/tuning.json and
# /tmp/strictnorm-tuning.json: STRICTNORM_CUDA_TUNING=/tmp/strictnorm-tuning.json for a later call).
# Usage (from the project root, on the GPU machine): bash bench/staged_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
export SWEEP_ITERS=${SWEEP_ITERS:-9} SWEEP_STAGED=1 SWEEP_DIRECTIONS=bwd
SWEEP_VARIANTS=1 timeout "${VARIANTS_TIMEOUT:-200}" python3 bench/sweep_cuda.py "$OUT/sweep-staged-variants.json" \
  > "$OUT/sweep-staged-variants.log" 2>&1
tail -n 10 "$OUT/sweep-staged-variants.log"
SWEEP_LEAN=1 SWEEP_MIN_THREADS=128 SWEEP_SHAPES=${LEAN_SHAPES:-2048x4096,8192x4096} timeout "${LEAN_TIMEOUT:-200}" \
  python3 bench/sweep_cuda.py "$OUT/sweep-staged-lean.json" > "$OUT/sweep-staged-lean.log" 2>&1
tail -n 4 "$OUT/sweep-staged-lean.log"
python3 bench/sweep_cuda.py --merge "$OUT" sweep-staged-variants sweep-staged-lean
