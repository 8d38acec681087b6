#!/usr/bin/env bash
# Call a of run 13 as it ran (bench/wsmem_call.sh of 4fbf5a3; its SWEEP_WSMEM knob was removed after this call).
# One GPU call for the weight-load experiments of bench/NOTES.md's plan (end of session 12): the GPU tests of the
# shared-memory weight family and of the special values (tests/test_gpu.py -k "wsmem or special"); bench/sweep_cuda.py
# over the tables' entries with W_SMEM on and off (both directions, SWEEP_VARIANTS=1 SWEEP_WSMEM=1); the CUDA
# forward's block shapes at 128 and 2048 rows with the weight held and reloaded (the full grid, not SWEEP_LEAN); the
# Triton forward with the weight loaded before the row sum (SWEEP_WFIRST=1). Every configuration is checked
# bitwise by the sweeps. One log and the JSON to $OUT: the CUDA choices as tuning.json (also /tmp/strictnorm-tuning.json),
# the Triton ones as triton-tuning.json (also /tmp/strictnorm-triton-tuning.json) for a later call on this machine.
# Usage (from the project root, on the GPU machine): bash bench/wsmem_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-wsmem; rm -rf "$W"; mkdir -p "$W"  # everything here first; a few files go to $OUT at the end
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -n "${TEST_WORKERS:-12}" -p no:cacheprovider tests/test_gpu.py \
    -k "wsmem or special" 2>&1 | tail -n 15
} > "$W/tests.log" 2>&1
cat "$W/tests.log"
SWEEP_VARIANTS=1 SWEEP_WSMEM=1 timeout "${VARIANTS_TIMEOUT:-150}" python3 bench/sweep_cuda.py "$W/sweep-wsmem.json" \
  > "$W/sweep-wsmem.log" 2>&1
sed -n '/copy ceiling/,$p' "$W/sweep-wsmem.log"
SWEEP_DIRECTIONS=fwd SWEEP_SHAPES=128x4096,2048x4096 SWEEP_MIN_THREADS=64,128,256,512 timeout "${FWD_TIMEOUT:-100}" \
  python3 bench/sweep_cuda.py "$W/sweep-fwd-small.json" > "$W/sweep-fwd-small.log" 2>&1
sed -n '/copy ceiling/,$p' "$W/sweep-fwd-small.log"
python3 bench/sweep_cuda.py --merge "$W" sweep-wsmem sweep-fwd-small > "$W/merge.log" 2>&1
cat "$W/merge.log"
SWEEP_WFIRST=1 SWEEP_DIRECTIONS=fwd SWEEP_SHAPES=${TRITON_SHAPES:-128x4096,2048x4096,8192x4096,32768x4096,262144x128} \
  timeout "${TRITON_TIMEOUT:-150}" python3 bench/sweep_triton.py "$W/sweep-triton-wfirst.json" \
  "$W/triton-tuning.json" > "$W/sweep-triton-wfirst.log" 2>&1
tail -n 25 "$W/sweep-triton-wfirst.log"
cp "$W/triton-tuning.json" /tmp/strictnorm-triton-tuning.json 2>/dev/null
cat "$W"/tests.log "$W"/sweep-wsmem.log "$W"/sweep-fwd-small.log "$W"/merge.log "$W"/sweep-triton-wfirst.log \
  > "$OUT/wsmem-call.log" 2>/dev/null
cp "$W"/sweep-*.json "$W"/tuning.json "$W"/triton-tuning.json "$OUT/" 2>/dev/null
bash bench/device_cache.sh save
