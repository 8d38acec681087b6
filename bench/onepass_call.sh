#!/usr/bin/env bash
# One GPU call for the one-pass strict backward (kernels/onepass.cu; bench/NOTES.md): its GPU tests (bits at six
# shapes, a CUDA graph), then bench/sweep_onepass.py (its knobs at four shapes against the two-pass strict
# backward, every configuration checked bitwise). EXTRA_TESTS="pytest args" runs more tests first, one process
# (no workers), failures in full. Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/onepass_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
if [ -n "${EXTRA_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout ${EXTRA_TIMEOUT:-120} python3 -m pytest -q -p no:xdist -p no:cacheprovider -rfE $EXTRA_TESTS \
    > "$OUT/extra-tests.log" 2>&1
  grep -E "passed|failed|Error|differs" "$OUT/extra-tests.log" | tail -n 12
fi
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -n 8 -v -rfE -p no:cacheprovider --timeout=200 tests/test_gpu.py \
  -k "onepass" > "$OUT/onepass-tests.log" 2>&1
grep -E "passed|failed|PASSED|FAILED" "$OUT/onepass-tests.log" | tail -n 10
timeout ${SWEEP_TIMEOUT:-240} python3 bench/sweep_onepass.py "$OUT/onepass-sweep.json" > "$OUT/onepass-sweep.log" 2>&1
tail -n 28 "$OUT/onepass-sweep.log"
bash bench/device_cache.sh save
