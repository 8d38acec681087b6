#!/usr/bin/env bash
# One GPU call for the one-pass strict backward (kernels/onepass.cu; bench/NOTES.md, "Next GPU session"): its GPU
# tests (bits at six shapes, a CUDA graph), then bench/overlap_probe.py at the shapes where it applies, its "one
# pass" column against the two-pass strict backward. Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/onepass_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -n 8 -v -rfE -p no:cacheprovider --timeout=200 tests/test_gpu.py \
  -k "onepass" > "$OUT/onepass-tests.log" 2>&1
grep -E "passed|failed|PASSED|FAILED" "$OUT/onepass-tests.log" | tail -n 10
OVERLAP_SHAPES=${OVERLAP_SHAPES:-32768x4096,16384x4096,8192x8192,2048x18432,65536x1024} timeout ${PROBE_TIMEOUT:-240} \
  python3 bench/overlap_probe.py "$OUT/onepass-probe.json" > "$OUT/onepass-probe.log" 2>&1
tail -n 14 "$OUT/onepass-probe.log"
bash bench/device_cache.sh save
