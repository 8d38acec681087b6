#!/usr/bin/env bash
# Nsight Compute over bench/ncu_probe.py (clocks left alone): bash bench/ncu_run.sh OUT.log M N case...
# NCU_SECTIONS="--section SourceCounters" adds per-instruction stall reasons (e.g. for fold-dw).
set -uo pipefail
log=$1; shift
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" STRICTNORM_CACHE_DIR=${STRICTNORM_CACHE_DIR:-/tmp/strictnorm-cache}
"$NCU" --profile-from-start off --clock-control none --print-summary none \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats ${NCU_SECTIONS:-} \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,l1tex__t_sector_hit_rate.pct,smsp__inst_executed.sum \
  python3 bench/ncu_probe.py "$@" > "$log" 2>&1
echo "ncu exit $? -> $log"; grep -E "^  [a-z_]|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|profiled" "$log" | head -n 120
