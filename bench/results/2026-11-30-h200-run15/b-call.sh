#!/usr/bin/env bash
# Call b of run 15 as it ran: bench/chunks_call.sh of 5dff73c, with
#   SKIP_DEVICES=1 SWEEP_CHUNKS=2048,4096 SWEEP_STAGES=1,2,3 SWEEP_PROGRAMS=1,2 SWEEP_WARPS=4,8,16 CHUNKED_TUNING='{"fwd": {"32768": {"rows": 1, "num_warps": 8, "chunk": 4096, "stages": 2}}, "bwd": {"32768": {"rows": 2, "num_warps": 8, "chunk": 2048, "programs_per_sm": 2, "stages": 2}, "65536": {"rows": 1, "num_warps": 8, "chunk": 2048, "programs_per_sm": 2, "stages": 3}}}'
# One GPU call (run 15, call a), on a machine with two GPUs: first tests/test_devices.py with both GPUs visible
# (tensors on a GPU that is not the current one); then on the first GPU bench/sweep_triton.py at 2048 x 18432 with
# rows in column chunks (SWEEP_CHUNKS, both directions; every configuration checked bitwise) and beside it, on the
# second GPU, the Triton GPU tests with the backward in column chunks at P = 32768 and 65536 (a tuning file). Stages
# the first half of the device wheels in /tmp/dw for the next call, and leaves the sweep's choices in
# /tmp/strictnorm-triton-tuning.json for it. Logs and JSON to $OUT.
# Call c: SKIP_DEVICES=1, the tests' choices in CHUNKED_TUNING, the sweep's in SWEEP_CHUNKS, SWEEP_STAGES, SWEEP_PROGRAMS
# and SWEEP_WARPS (bench/sweep_triton.py).
# Usage (from the project root, on the GPU machine): bash bench/chunks_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-chunks; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
export STRICTNORM_FAILURE_LOG="$W/failures.log"
source bench/device_cache.sh restore
if [ -d .device-wheels/a ]; then mkdir -p /tmp/dw && cp .device-wheels/a/* /tmp/dw/; fi
{
  date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$W/env.log" 2>&1
cat "$W/env.log"
if [ -z "${SKIP_DEVICES:-}" ]; then
  timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_devices.py > "$W/devices-tests.log" 2>&1
fi
# the tests' choices: $CHUNKED_TUNING, else one row of 8 warps in chunks of 2048 lanes
if [ -n "${CHUNKED_TUNING:-}" ]; then
  echo "$CHUNKED_TUNING" > "$W/chunked.json"
else
  cat > "$W/chunked.json" <<'JSON'
{"bwd": {"32768": {"rows": 1, "num_warps": 8, "chunk": 2048, "programs_per_sm": 2},
         "65536": {"rows": 1, "num_warps": 8, "chunk": 2048, "programs_per_sm": 2}}}
JSON
fi
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
checks() {
  CUDA_VISIBLE_DEVICES=$second STRICTNORM_TRITON_TUNING=$W/chunked.json timeout "${TEST_TIMEOUT:-400}" \
    python3 -m pytest -n 12 -q -rfE -p no:cacheprovider tests/test_triton.py tests/test_gpu.py \
    -k "triton or batch_invariance or determinism or graph_replay or in_place" > "$W/triton-chunked-tests.log" 2>&1
}
if [ "$second" = 1 ]; then checks & fi
CUDA_VISIBLE_DEVICES=0 SWEEP_SHAPES=${SWEEP_SHAPES:-2048x18432} SWEEP_CHUNKS=${SWEEP_CHUNKS:-1024,2048,4096} \
  timeout "${SWEEP_TIMEOUT:-400}" python3 bench/sweep_triton.py "$W/sweep-chunks.json" "$W/triton-tuning.json" \
  > "$W/sweep-chunks.log" 2>&1
if [ "$second" = 0 ]; then checks; fi
wait
cp "$W/triton-tuning.json" /tmp/strictnorm-triton-tuning.json 2>/dev/null
tail -n 3 "$W/devices-tests.log" 2>/dev/null; tail -n 3 "$W/triton-chunked-tests.log"; cat "$W/chunked.json"
python3 - "$W/sweep-chunks.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for d in ("fwd", "bwd"):
    ok = sorted((r for r in rows if r["direction"] == d and "us" in r), key=lambda r: r["us"])
    own = next((r for r in ok if r["default"]), None)
    print(d, "own", own and round(own["us"], 1), "| best:", [(round(r["us"], 1), r["rows"], r["num_warps"], r["chunk"],
          r["programs_per_sm"], r["bitwise"]) for r in ok[:6]])
print("all bitwise:", all(r.get("bitwise") for r in rows), len(rows), "rows")
PY
cat "$W/triton-tuning.json" 2>/dev/null
cat "$W/env.log" "$W/devices-tests.log" "$W/chunked.json" "$W/triton-chunked-tests.log" "$W/failures.log" \
  > "$OUT/tests.log" 2>/dev/null
cp "$W/sweep-chunks.log" "$W/sweep-chunks.json" "$W/triton-tuning.json" "$OUT/" 2>/dev/null
bash bench/device_cache.sh save
