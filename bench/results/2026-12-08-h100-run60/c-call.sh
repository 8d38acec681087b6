#!/usr/bin/env bash
# Run 60, call c (written after the table went back to its tiles and rcp_rn became a tile knob): the targeted tests
# that call a's limit cut (3 failures unnamed; the dense test's strided case, made contiguous by Tensor.to on a GPU,
# was found by reading and fixed), each outcome printed as it ends (-v).
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
timeout 240 python3 -m pytest -n 12 -v --tb=short -rfE -p no:cacheprovider tests/test_triton.py \
  -k "rstd or dense_forward or 128_columns or rewiden_candidate or rcp or candidate_tiles" > $OUT/tests-c.log 2>&1
grep -cE " PASSED" $OUT/tests-c.log; grep -E " FAILED|passed|failed" $OUT/tests-c.log | tail -n 12
grep -E "^E " $OUT/tests-c.log | head -n 20
