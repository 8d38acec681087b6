#!/usr/bin/env bash
# Call d of run 15 as it ran: bench/suite_call.sh of 86b9545, with
#   SWEEP_CHUNKS=2048,4096 SWEEP_STAGES=1,3 SWEEP_PROGRAMS=1,2 SWEEP_WARPS=4,8 TEST_TIMEOUT=430
# One GPU call (run 15, call d) after the table changes: on the second GPU (where there is one) the GPU test suite
# without tests/test_cute.py (the wheels are not installed here), with the backend's own tables; on the first,
# bench/sweep_triton.py's backward at 1024 x 65536 in column chunks (SWEEP_* as in the environment; every
# configuration checked bitwise). Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/suite_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-suite; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
export STRICTNORM_FAILURE_LOG="$W/failures.log"
source bench/device_cache.sh restore
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
checks() {
  CUDA_VISIBLE_DEVICES=$second timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -n "${TEST_WORKERS:-14}" -q -rfE \
    -p no:cacheprovider -k "not every_fold_configuration" --ignore=tests/test_cute.py tests > "$W/gpu-tests.log" 2>&1
}
if [ "$second" = 1 ]; then checks & fi
CUDA_VISIBLE_DEVICES=0 SWEEP_DIRECTIONS=bwd SWEEP_SHAPES=${SWEEP_SHAPES:-1024x65536} \
  timeout "${SWEEP_TIMEOUT:-240}" python3 bench/sweep_triton.py "$W/sweep.json" > "$W/sweep.log" 2>&1
if [ "$second" = 0 ]; then checks; fi
wait
tail -n 4 "$W/gpu-tests.log"
sed -n '/best per shape/,$p' "$W/sweep.log"
python3 - "$W/sweep.json" <<'PY'
import json, sys
rows = sorted((r for r in json.load(open(sys.argv[1]))["rows"] if "us" in r), key=lambda r: r["us"])
own = next((r for r in rows if r["default"]), None)
print("own", own and round(own["us"], 1), "| best:", [(round(r["us"], 1), r["rows"], r["num_warps"], r["chunk"],
      r["programs_per_sm"], r["stages"], r["bitwise"]) for r in rows[:6]])
PY
cat "$W/gpu-tests.log" "$W/failures.log" > "$OUT/tests.log" 2>/dev/null
cp "$W/sweep.log" "$W/sweep.json" "$OUT/" 2>/dev/null
