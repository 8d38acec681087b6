#!/usr/bin/env bash
# The open CUDA backward failure on the GPU machine: the test's own function with diagnostics at the first
# mismatch, on the failing seed and fresh ones, then compute-sanitizer (memcheck, initcheck) over it. Logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
SEED=${SEED:-4200501676}
log="$OUT/repro.log"
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "== the test's function with diagnostics: the failing seed, then fresh seeds"
  timeout 90 python3 bench/repro_test_5120.py $SEED
  for i in $(seq ${ITER:-10}); do timeout 60 python3 bench/repro_test_5120.py $(od -An -N4 -tu4 /dev/urandom); done
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  for tool in memcheck initcheck; do
    for k in rms_bwd fold_ring; do
      echo "-- $tool $k"
      timeout ${CS_TIMEOUT:-90} "$CS" --tool $tool --kernel-name kns=$k --print-limit 8 --show-backtrace no \
        python3 bench/repro_test_5120.py $SEED 2>&1 | grep -v "^=========\s*$" | head -n 60
    done
  done
  date -u
} > "$log" 2>&1
cat "$log"
