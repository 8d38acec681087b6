#!/usr/bin/env bash
# Run 60, call b: call a's targeted tests ran past their limit with 3 failures unnamed; again, each test's outcome
# printed as it ends (-v), the fast ones first.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
timeout 170 python3 -m pytest -n 12 -v --tb=short -rfE -p no:cacheprovider tests/test_triton.py \
  -k "rstd or dense_forward or 128_columns or rewiden_candidate" > $OUT/tests-b1.log 2>&1
grep -E "FAILED|passed|failed" $OUT/tests-b1.log | tail -n 12
timeout 220 python3 -m pytest -n 12 -v --tb=short -rfE -p no:cacheprovider tests/test_triton.py \
  -k "candidate_tiles" > $OUT/tests-b2.log 2>&1
grep -E "FAILED|passed|failed" $OUT/tests-b2.log | tail -n 12
grep -E "^E " $OUT/tests-b1.log $OUT/tests-b2.log | head -n 20
