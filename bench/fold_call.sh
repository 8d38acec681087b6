#!/usr/bin/env bash
# One GPU call for the strict fold's new shapes (bench/NOTES.md, "Next GPU session"): their GPU tests, then
# the sweep of one family of configurations on the 262144 x 128 folds. Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/fold_call.sh [chain|smem|ring]
set -uo pipefail
knobs=${1:-chain}
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -n 8 -v -rfE -p no:cacheprovider --timeout=200 tests/test_gpu.py \
  -k "fold_chain or rings_past or fold_equals or adversarial" > "$OUT/fold-tests.log" 2>&1
grep -E "passed|failed" "$OUT/fold-tests.log" | tail -n 3
SWEEP_FOLD_KNOBS=$knobs SWEEP_FOLD_CASES="strict dW 262144,fold 262144" timeout ${SWEEP_TIMEOUT:-300} \
  python3 bench/sweep_fold.py "$OUT/sweep-fold-$knobs.json" > "$OUT/sweep-fold-$knobs.log" 2>&1
tail -n 6 "$OUT/sweep-fold-$knobs.log"
bash bench/device_cache.sh save
