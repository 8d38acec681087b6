#!/usr/bin/env bash
# Call d of run 14 as it ran (bench/cuda_pbs_call.sh of its commit; no table changed after it).
# One GPU call for the CUDA fast backward's persistent grid (run 14, call d): bench/sweep_cuda.py over the backward
# table's entries (EVEN off / on, predicated or not) at 2, 4 and 8 partial blocks an SM (SWEEP_VARIANTS=1 SWEEP_PBS;
# every configuration checked bitwise) on the first GPU; beside it, on a second GPU where there is one, the CUDA
# backward's GPU tests with every table entry at 2 partial blocks an SM (STRICTNORM_CUDA_TUNING). Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/cuda_pbs_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-pbs; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
python3 - "$W/pbs2.json" <<'PY'
import dataclasses, json, sys
from strictnorm.backends.cuda.backend import BWD_TABLE
entries = {str(p): [[bound, {**dataclasses.asdict(t), "partial_blocks_per_sm": 2}] for bound, t in table]
           for p, table in BWD_TABLE.items()}
json.dump({"bwd": entries}, open(sys.argv[1], "w"), indent=1)
PY
tests() {
  CUDA_VISIBLE_DEVICES=$second STRICTNORM_CUDA_TUNING=$W/pbs2.json timeout "${TEST_TIMEOUT:-200}" python3 -m pytest \
    -n 12 -q -rfE -p no:cacheprovider tests/test_gpu.py \
    -k "cuda_backward_bitwise or run_to_run or graph_replay or partial_sum or (cuda and special)" > "$W/tests-pbs2.log" 2>&1
}
[ "$second" = 1 ] && tests &
CUDA_VISIBLE_DEVICES=0 SWEEP_VARIANTS=1 SWEEP_PBS=2,4,8 SWEEP_DIRECTIONS=bwd \
  SWEEP_SHAPES=${SWEEP_SHAPES:-2048x4096,8192x4096,32768x4096,8192x8192,262144x128,2048x18432} \
  timeout "${SWEEP_TIMEOUT:-200}" python3 bench/sweep_cuda.py "$W/sweep-pbs.json" "$W/tuning.json" \
  > "$W/sweep-pbs.log" 2>&1
[ "$second" = 0 ] && tests
wait
sed -n '/copy ceiling/,$p' "$W/sweep-pbs.log" | head -n 60
tail -n 3 "$W/tests-pbs2.log"
cp "$W/sweep-pbs.log" "$W/sweep-pbs.json" "$W/tuning.json" "$W/tests-pbs2.log" "$W/pbs2.json" "$OUT/" 2>/dev/null
