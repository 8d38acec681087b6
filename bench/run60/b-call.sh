#!/usr/bin/env bash
# Run 60, call b (right after call a, on the same machine): the Triton GPU tests with the new table (dense + rewiden at
# 128 columns, rcp_rn in every forward).
set -u
R=$OUT
export OUT=/tmp/o W=/tmp/strictnorm-call
mkdir -p $OUT $W
TEST_TIMEOUT=530 bash bench/device_call.sh --first "triton"
cp $W/triton.log $R/tests-triton.log 2>/dev/null
cp $W/failures.log $R/ 2>/dev/null
tail -n 25 $R/tests-triton.log
