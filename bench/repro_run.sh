#!/usr/bin/env bash
# The open CUDA backward failure on the GPU machine: the failing test under pytest with bench/diag_plugin.py
# (diagnostics at the first mismatch), on the failing seed and fresh ones, with and without CUDA_LAUNCH_BLOCKING.
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
SEED=${SEED:-4200501676}
K="cuda_backward_bitwise and tables-5120"
t() { timeout 120 python3 -m pytest -q -s -p diag_plugin -p no:xdist -p no:cacheprovider tests/test_gpu.py -k "$K" 2>&1 |
      grep -E "DIAG|passed|failed|Error:" ; }
{
  date -u
  echo "== seed $SEED"; STRICTNORM_TEST_SEED=$SEED t
  date -u
} > "$OUT/repro.log" 2>&1
cat "$OUT/repro.log"
