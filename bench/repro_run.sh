#!/usr/bin/env bash
# The open CUDA backward failure on the GPU machine: the test's calls on many seeds, the failing test alone,
# and compute-sanitizer (memcheck, racecheck, initcheck) over strictnorm's kernels. Logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
SEED=${SEED:-4200501676}
log="$OUT/repro.log"
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== repro: the failing seed, then fresh seeds"
  timeout ${REPRO_TIMEOUT:-120} python3 bench/repro_bwd_5120.py ${ITER:-30} $SEED
  timeout ${REPRO_TIMEOUT:-120} python3 bench/repro_bwd_5120.py ${ITER:-30}
  echo "== the test alone with the failing seed, three times"
  for i in 1 2 3; do
    STRICTNORM_TEST_SEED=$SEED timeout 90 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/test_gpu.py \
      -k "cuda_backward_bitwise and tables-5120" 2>&1 | tail -n 3
  done
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  echo "== compute-sanitizer: $CS"
  for tool in memcheck racecheck initcheck synccheck; do
    for k in rms_bwd fold_ring; do
      echo "-- $tool $k"
      timeout ${CS_TIMEOUT:-80} "$CS" --tool $tool --kernel-name kns=$k --print-limit 20 \
        python3 bench/repro_bwd_5120.py 0 $SEED 2>&1 | tail -n 25
    done
  done
  date -u
} > "$log" 2>&1
tail -n 120 "$log"
