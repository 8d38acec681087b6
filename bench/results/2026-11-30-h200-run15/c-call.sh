#!/usr/bin/env bash
# Call c of run 15 as it ran: bench/anchored_chunks_call.sh of 60ed98a.
# One GPU call right after bench/chunks_call.sh (run 15, call b): installs the device wheels (the second half travels
# with this call), takes the Triton choices of the last call's sweep (/tmp/strictnorm-triton-tuning.json, where that
# call ran on this machine), then on the first GPU bench/sweep_cute.py over the cute backward's blocks an SM
# (SWEEP_BLOCKS) and the anchored bench (`strictnorm bench`, every anchor); beside them, on the second GPU, the cute
# part of the two-GPU tests (both GPUs visible, before the bench), tests/test_cute.py and the GPU test suite without it
# (those Triton choices). Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/anchored_chunks_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-anchored; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
export STRICTNORM_FAILURE_LOG="$W/failures.log"
source bench/device_cache.sh restore
[ -f .device-wheels/b/install.sh ] && bash .device-wheels/b/install.sh > "$W/install.log" 2>&1
[ -f /tmp/dw/env.sh ] && source /tmp/dw/env.sh
python3 -c "import cutlass, quack, liger_kernel; print('wheels ok')" 2>&1 | tail -n 1
if [ -f /tmp/strictnorm-triton-tuning.json ]; then
  cp /tmp/strictnorm-triton-tuning.json "$W/triton-tuning.json"
  export STRICTNORM_TRITON_TUNING=$W/triton-tuning.json
  echo "Triton choices: $(tr -d '\n ' < "$W/triton-tuning.json")"
else
  echo "no Triton choices from the last call: the backend's own table"
fi
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_devices.py -k cute \
  > "$W/devices-cute-tests.log" 2>&1 &
devices=$!
checks() {
  wait "$devices"
  export CUDA_VISIBLE_DEVICES=$second
  timeout 200 python3 -m pytest -n 12 -q -rfE -p no:cacheprovider tests/test_cute.py > "$W/cute-tests.log" 2>&1
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -n 14 -q -rfE -p no:cacheprovider \
    -k "not every_fold_configuration" --ignore=tests/test_cute.py tests > "$W/gpu-tests.log" 2>&1
}
if [ "$second" = 1 ]; then checks & fi
CUDA_VISIBLE_DEVICES=0 SWEEP_VARIANTS=hold SWEEP_BLOCKS=2,4 SWEEP_SHAPES=2048x4096,8192x4096,32768x4096,8192x8192 \
  timeout 120 python3 bench/sweep_cute.py "$W/sweep-cute-blocks.json" > "$W/sweep-cute-blocks.log" 2>&1
wait "$devices"
CUDA_VISIBLE_DEVICES=0 timeout "${BENCH_TIMEOUT:-330}" \
  python3 -m strictnorm.bench --json "$W/bench.json" --markdown "$W/bench.md" > "$W/bench.log" 2>&1
if [ "$second" = 0 ]; then checks; fi
wait
sed -n '/copy ceiling/,$p' "$W/sweep-cute-blocks.log" | tail -n 20
for f in "$W/devices-cute-tests.log" "$W/cute-tests.log" "$W/gpu-tests.log"; do echo "$f: $(tail -n 1 "$f")"; done
tail -n 40 "$W/bench.md"
cat "$W/devices-cute-tests.log" "$W/cute-tests.log" "$W/gpu-tests.log" "$W/failures.log" > "$OUT/tests.log" 2>/dev/null
cp "$W/sweep-cute-blocks.log" "$W/sweep-cute-blocks.json" "$W/bench.json" "$W/bench.md" "$W/bench.log" \
  "$W/triton-tuning.json" "$OUT/" 2>/dev/null
