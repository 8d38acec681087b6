#!/usr/bin/env bash
# One GPU session in one go: environment, GPU test suite, verify, benchmark. Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/device_run.sh [tests|bench|all] [bench args...]
# e.g. bash bench/device_run.sh all --fold --compile   (at most 8 files come back from $OUT)
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore  # kernels compiled by an earlier call, if they travelled
[ -f /tmp/dw/env.sh ] && source /tmp/dw/env.sh
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m strictnorm.cli info
} 2>&1 | tee "$OUT/env.log"
if [[ $what == tests || $what == all ]]; then
  # the every-configuration NVRTC compile test is CI's job; here it would only spend device time
  # several workers: the run is bound by kernel compiles (CPU), not by the GPU
  STRICTNORM_FAILURE_LOG="$OUT/failures.log" timeout ${TEST_TIMEOUT:-420} python3 -m pytest -n ${TEST_WORKERS:-12} -v -rfE -p no:cacheprovider --timeout=${TEST_TIMEOUT_EACH:-300} --durations=15 \
    -k "not every_fold_configuration" ${PYTEST_ARGS:-tests} > "$OUT/gpu-tests.log" 2>&1
  tail -n 40 "$OUT/gpu-tests.log"
  timeout ${VERIFY_TIMEOUT:-90} python3 -m strictnorm.cli verify --quick > "$OUT/verify.log" 2>&1
  tail -n 3 "$OUT/verify.log"
fi
if [[ ${MEMCHECK:-0} == 1 ]]; then
  # compute-sanitizer over the guard-band tests, each tensor its own allocation (no caching allocator), so a
  # read past an input's end is reported even where the kernel discards what it read
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${MEMCHECK_TIMEOUT:-240} "$CS" --tool memcheck --report-api-errors no \
    --print-limit 8 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/test_gpu.py \
    -k "${MEMCHECK_K:-reads_nothing or cuda_backward_bitwise and 5120}" > "$OUT/memcheck.log" 2>&1
  grep -E "passed|failed|ERROR SUMMARY|Invalid|out of bounds|nearest allocation|^=========     at" "$OUT/memcheck.log" | head -n 30
fi
if [[ $what == bench || $what == all ]]; then
  # JSON rows are logged as they are measured, the tables last (bench.log); at most 8 files come back
  timeout ${BENCH_TIMEOUT:-300} python3 -m strictnorm.bench --json "$OUT/bench.json" --csv "$OUT/bench.csv" \
    --plot "$OUT/bench.png" --markdown "$OUT/bench.md" "$@" > "$OUT/bench.log" 2>&1
  tail -n 50 "$OUT/bench.log"
fi
bash bench/device_cache.sh save  # for the next call (carry .device-cache)
