#!/usr/bin/env bash
# The open CUDA backward failure (bench/NOTES.md), next steps in one GPU call: the guard-band tests, the
# failing test under pytest with bench/diag_plugin.py, and compute-sanitizer without torch's caching
# allocator (each tensor its own allocation: a read past a tensor is reported). Logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
SEED=${SEED:-4200501676}
K="cuda_backward_bitwise and tables-5120"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{
  date -u
  echo "== guard bands (every CUDA family, Triton)"
  timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gpu.py tests/test_triton.py -k reads_nothing \
    2>&1 | grep -E "passed|failed|Failed|read past" | head -n 40
  echo "== the failing test with the diagnostics plugin"
  STRICTNORM_TEST_SEED=$SEED timeout 120 python3 -m pytest -q -s -p diag_plugin -p no:xdist -p no:cacheprovider \
    tests/test_gpu.py -k "$K" 2>&1 | grep -E "DIAG|passed|failed|Error:" | grep -v "DIAG launch"
  for k in rms_bwd fold_ring; do
    echo "== memcheck $k, no caching allocator"
    STRICTNORM_TEST_SEED=$SEED PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 "$CS" --tool memcheck \
      --kernel-name kns=$k --print-limit 10 --show-backtrace no python3 -m pytest -q -p no:xdist -p no:cacheprovider \
      tests/test_gpu.py -k "$K" 2>&1 | grep -v "cuGetProcAddress\|^=========\s*$" | tail -n 30
  done
  date -u
} > "$OUT/repro.log" 2>&1
bash bench/device_cache.sh save
cat "$OUT/repro.log"
