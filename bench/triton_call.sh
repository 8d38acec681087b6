#!/usr/bin/env bash
# One GPU call for the Triton backend's launch shapes: bench/compile_probe.py with the device's Triton (ptxas's
# registers and spills per kernel; seconds, no GPU work), then bench/sweep_triton.py (rows a program and warps,
# each direction apart, every result bitwise against the reference) at $SWEEP_SHAPES (default: the shapes where
# the Triton kernels trail the CUDA ones). Logs and JSON to $OUT; the sweep's choices as a tuning file
# ($OUT/triton-tuning.json, and /tmp/strictnorm-triton-tuning.json for a later call on the same machine:
# STRICTNORM_TRITON_TUNING=/tmp/strictnorm-triton-tuning.json).
# Usage (from the project root, on the GPU machine): bash bench/triton_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
timeout "${PROBE_TIMEOUT:-120}" python3 bench/compile_probe.py 128 4096 8192 18432 > "$OUT/triton-probe.log" 2>&1
cat "$OUT/triton-probe.log"
SWEEP_SHAPES=${SWEEP_SHAPES:-2048x18432,8192x8192,32768x4096,2048x4096,8192x4096,262144x128,128x4096} \
  timeout "${SWEEP_TIMEOUT:-420}" python3 bench/sweep_triton.py "$OUT/sweep-triton.json" "$OUT/triton-tuning.json" \
  > "$OUT/sweep-triton.log" 2>&1
tail -n 10 "$OUT/sweep-triton.log"
cp "$OUT/triton-tuning.json" /tmp/strictnorm-triton-tuning.json && cat "$OUT/triton-tuning.json"
