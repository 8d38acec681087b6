#!/usr/bin/env bash
# One GPU call for the forward against the anchors: Nsight Compute over the forward kernels (the CUDA forward
# with and without EVEN, Triton, and Liger and Quack where their wheels are installed) at two shapes,
# then bench/sweep_cuda.py with SWEEP_VARIANTS=1 (the tables' entries with EVEN off and on,
# every configuration checked bitwise). Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/fwd_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
[ -f /tmp/dw/env.sh ] && source /tmp/dw/env.sh
cases="cuda-fwd cuda-fwd-uneven triton-fwd"
python3 -c "import liger_kernel, quack" 2>/dev/null && cases="$cases liger-fwd quack-fwd"
for shape in ${NCU_SHAPES:-32768x4096 262144x128}; do
  timeout "${NCU_TIMEOUT:-150}" bash bench/ncu_run.sh "$OUT/ncu-fwd-$shape.log" ${shape/x/ } $cases > /dev/null
  grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu-fwd-$shape.log" \
    | sed -E 's/ +/ /g' | cut -c1-110
done
SWEEP_VARIANTS=1 SWEEP_ITERS=${SWEEP_ITERS:-15} timeout "${SWEEP_TIMEOUT:-300}" python3 bench/sweep_cuda.py \
  "$OUT/sweep-variants.json" > "$OUT/sweep-variants.log" 2>&1
tail -n 20 "$OUT/sweep-variants.log"
bash bench/device_cache.sh save
