#!/usr/bin/env bash
# Run 60, call c: the dense test fixed (its strided case made contiguous by Tensor.to on a GPU), the targeted tests
# again, then the Triton job's tests (device_call.sh's `triton` selection) as far as the time allows, each test's
# outcome printed as it ends (-v).
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
timeout 100 python3 -m pytest -n 8 -v --tb=short -rfE -p no:cacheprovider tests/test_triton.py \
  -k "rstd or dense_forward or 128_columns or rewiden_candidate" > $OUT/tests-c1.log 2>&1
grep -cE " PASSED" $OUT/tests-c1.log; grep -E " FAILED|passed|failed" $OUT/tests-c1.log | tail -n 8
timeout 290 python3 -m pytest -n 8 -v --tb=short -rfE -p no:cacheprovider tests/test_triton.py tests/test_gpu.py \
  -k "triton or batch_invariance or determinism or graph_replay or in_place" > $OUT/tests-c2.log 2>&1
grep -cE " PASSED" $OUT/tests-c2.log; grep -E " FAILED|passed|failed" $OUT/tests-c2.log | tail -n 12
grep -E "^E " $OUT/tests-c1.log $OUT/tests-c2.log | head -n 20
