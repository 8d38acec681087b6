#!/usr/bin/env bash
# One GPU call for the backward's instruction count (bench/NOTES.md, the plan of session 12): Nsight Compute with the
# instruction mix (InstructionStats) and per-line stall and instruction counts (SourceCounters) of the backward at
# 2048 and 8192 rows of 4096 columns: the CUDA tables' kernels, the Triton kernel and, where the staged wheels are
# installed, Quack's. Logs to $OUT. Usage (from the project root, on the GPU machine): bash bench/bwd_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/bench" STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
[ -f /tmp/dw/env.sh ] && source /tmp/dw/env.sh
cases="cuda-bwd triton-bwd"
python3 -c "import quack" 2>/dev/null && cases="$cases quack-bwd"
for shape in ${BWD_SHAPES:-2048x4096 8192x4096}; do
  # shellcheck disable=SC2086
  NCU_SECTIONS="--section InstructionStats --section SourceCounters" \
    bash bench/ncu_run.sh "$OUT/ncu-bwd-$shape.log" "${shape%x*}" "${shape#*x}" $cases | head -n 40
done
