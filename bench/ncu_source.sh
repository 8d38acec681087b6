#!/usr/bin/env bash
# Per-instruction stall samples of one kernel case of bench/ncu_probe.py (Nsight Compute's source page, SASS):
#   bash bench/ncu_source.sh OUT_PREFIX M N case
# writes OUT_PREFIX.ncu-rep (SourceCounters and WarpStateStats) and OUT_PREFIX-sass.csv (the source page: each SASS
# instruction with its executed count and warp-stall samples by reason). NCU_SAMPLING=K samples every 2^(5+K) cycles
# (0 the finest; default: ncu's own choice, which leaves a kernel of a few us with a few hundred samples).
set -uo pipefail
out=$1; shift
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" STRICTNORM_CACHE_DIR=${STRICTNORM_CACHE_DIR:-/tmp/strictnorm-cache}
"$NCU" --profile-from-start off --clock-control none --section SourceCounters --section WarpStateStats \
  ${NCU_SAMPLING:+--warp-sampling-interval $NCU_SAMPLING} \
  --import-source no -f -o "$out" python3 bench/ncu_probe.py "$@" > "$out-profile.log" 2>&1
echo "ncu exit $? ($out-profile.log)"
"$NCU" -i "$out.ncu-rep" --page source --print-source sass --csv > "$out-sass.csv" 2> "$out-sass.err"
echo "source page exit $? ($(wc -l < "$out-sass.csv") lines)"
"$NCU" -i "$out.ncu-rep" --page details --print-details all > "$out-details.log" 2>&1
