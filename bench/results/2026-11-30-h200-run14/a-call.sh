#!/usr/bin/env bash
# Call a of run 14 as it ran (bench/pipeline_call.sh).
# One GPU call for the Triton backward's pipelining (run 14, call a): bench/sweep_triton.py with SWEEP_PIPELINES=1
# (each shape's backward tile with 1x and 2x its warps, 2 or 4 programs an SM, plain / the next block prefetched into
# registers / the loop's loads in 2 or 3 shared-memory stages; every configuration checked bitwise) on the first GPU;
# beside it, on a second GPU where there is one (else after it), the GPU test suite without test_cute.py (the Triton
# kernels' loads reordered and launched directly since the last run), `strictnorm verify --quick` and the host
# breakdown. Stages the first half of the device wheels in /tmp/dw for the next call. Logs and JSON to $OUT; the
# Triton choices as triton-tuning.json (also /tmp/strictnorm-triton-tuning.json for a later call on this machine).
# Usage (from the project root, on the GPU machine): bash bench/pipeline_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-pipelines; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
if [ -d .device-wheels/a ]; then mkdir -p /tmp/dw && cp .device-wheels/a/* /tmp/dw/; fi
{
  date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null || true
} > "$W/env.log" 2>&1
cat "$W/env.log"
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
checks() {
  export CUDA_VISIBLE_DEVICES=$second
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -n "${TEST_WORKERS:-12}" -q -rfE -p no:cacheprovider \
    --timeout=300 --durations=10 -k "not every_fold_configuration" --ignore=tests/test_cute.py tests \
    > "$W/gpu-tests.log" 2>&1
  timeout 90 python3 -m strictnorm.cli verify --quick > "$W/verify.log" 2>&1
  timeout 120 python3 bench/host_breakdown.py "$W/host.json" > "$W/host.log" 2>&1
}
if [ "$second" = 1 ]; then checks & fi
CUDA_VISIBLE_DEVICES=0 SWEEP_PIPELINES=1 SWEEP_DIRECTIONS=bwd \
  SWEEP_SHAPES=${SWEEP_SHAPES:-128x4096,2048x4096,8192x4096,32768x4096,8192x8192,2048x18432,262144x128} \
  timeout "${SWEEP_TIMEOUT:-420}" python3 bench/sweep_triton.py "$W/sweep-triton-pipelines.json" \
  "$W/triton-tuning.json" > "$W/sweep-triton-pipelines.log" 2>&1
if [ "$second" = 0 ]; then checks; fi
wait
cp "$W/triton-tuning.json" /tmp/strictnorm-triton-tuning.json 2>/dev/null
tail -n 4 "$W/gpu-tests.log"; tail -n 2 "$W/verify.log"; grep -i triton "$W/host.log"
sed -n '/best per shape/,$p' "$W/sweep-triton-pipelines.log"
cat "$W/env.log" "$W/gpu-tests.log" "$W/verify.log" "$W/host.log" > "$OUT/tests.log" 2>/dev/null
cp "$W/sweep-triton-pipelines.log" "$W/sweep-triton-pipelines.json" "$W/triton-tuning.json" "$W/host.json" "$OUT/" \
  2>/dev/null
bash bench/device_cache.sh save
