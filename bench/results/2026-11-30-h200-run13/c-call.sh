#!/usr/bin/env bash
# Call c of run 13 as it ran (on 4fbf5a3 plus the float4 partial stores; its SWEEP_WF32 knob was removed after this
# call measured it slower). One log and the JSON to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-wf32; rm -rf "$W"; mkdir -p "$W"  # everything here first; a few files go to $OUT at the end
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -n "${TEST_WORKERS:-12}" -p no:cacheprovider tests/test_gpu.py \
    tests/test_triton.py -k "wf32 or launch_from or chunks or tile or tables" 2>&1 | tail -n 15
} > "$W/tests.log" 2>&1
cat "$W/tests.log"
timeout "${HOST_TIMEOUT:-90}" python3 bench/host_breakdown.py "$W/host.json" > "$W/host.log" 2>&1
head -n 22 "$W/host.log"
SWEEP_VARIANTS=1 SWEEP_F32=1 SWEEP_WF32=1 timeout "${VARIANTS_TIMEOUT:-120}" python3 bench/sweep_cuda.py \
  "$W/sweep-wf32-variants.json" > "$W/sweep-wf32-variants.log" 2>&1
sed -n '/per variant/,$p' "$W/sweep-wf32-variants.log"
SWEEP_SHAPES=2048x4096,8192x4096 SWEEP_DIRECTIONS=bwd SWEEP_VALUES=32 SWEEP_PBS=1,2 SWEEP_MIN_THREADS=128 SWEEP_LEAN=1 \
  SWEEP_STAGED=1 SWEEP_F32=1 SWEEP_WF32=1 timeout "${GEOMETRY_TIMEOUT:-100}" python3 bench/sweep_cuda.py \
  "$W/sweep-wf32-geometry.json" > "$W/sweep-wf32-geometry.log" 2>&1
sed -n '/copy ceiling/,/^$/p' "$W/sweep-wf32-geometry.log"
python3 bench/sweep_cuda.py --merge "$W" sweep-wf32-variants sweep-wf32-geometry > "$W/merge.log" 2>&1
cat "$W/merge.log"
SWEEP_CHUNKS=1024,2048,4096 SWEEP_DIRECTIONS=fwd SWEEP_SHAPES=${CHUNK_SHAPES:-2048x18432} \
  timeout "${TRITON_TIMEOUT:-100}" python3 bench/sweep_triton.py "$W/sweep-triton-chunks.json" \
  "$W/triton-tuning.json" > "$W/sweep-triton-chunks.log" 2>&1
tail -n 4 "$W/sweep-triton-chunks.log"
cat "$W"/tests.log "$W"/host.log "$W"/sweep-wf32-variants.log "$W"/sweep-wf32-geometry.log "$W"/merge.log \
  "$W"/sweep-triton-chunks.log > "$OUT/wf32-call.log" 2>/dev/null
cp "$W"/sweep-*.json "$W"/host.json "$W"/tuning.json "$W"/triton-tuning.json "$OUT/" 2>/dev/null
bash bench/device_cache.sh save
