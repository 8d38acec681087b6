#!/usr/bin/env bash
# Call c of run 14 as it ran (bench/forward_pipeline_call.sh of e8a06f2; the forward's prefetch and stages it
# measured lost everywhere and were removed after this call).
# One GPU call for the Triton forward's pipelining (run 14, call c): bench/sweep_triton.py with SWEEP_PIPELINES=1
# SWEEP_DIRECTIONS=fwd (each shape's forward tile, and the general one, with 1x and 2x its warps, 2 or 4 programs an SM,
# plain / the next block prefetched into registers / 2 or 3 shared-memory stages; every configuration checked bitwise)
# on the first GPU, then `strictnorm bench` (the Triton and CUDA backends and F.rms_norm; the anchors' wheels are not
# on this machine) with the sweep's choices (STRICTNORM_TRITON_TUNING). On a second GPU where there is one: the
# Triton tests (test_triton.py, the GPU suite's Triton tests) with the committed table, then with the sweep's choices.
# Logs and JSON to $OUT. Usage (from the project root, on the GPU machine): bash bench/forward_pipeline_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-fwd-pipelines; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
triton_tests() {  # $1: log name; STRICTNORM_TRITON_TUNING as the caller sets it
  CUDA_VISIBLE_DEVICES=$second timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -n 12 -q -rfE -p no:cacheprovider \
    tests/test_triton.py tests/test_gpu.py -k "triton or batch_invariance or determinism or graph_replay" \
    > "$W/$1.log" 2>&1
}
[ "$second" = 1 ] && triton_tests triton-tests-table &
CUDA_VISIBLE_DEVICES=0 SWEEP_PIPELINES=1 SWEEP_DIRECTIONS=fwd \
  SWEEP_SHAPES=${SWEEP_SHAPES:-128x4096,2048x4096,8192x4096,32768x4096,8192x8192,262144x128} \
  timeout "${SWEEP_TIMEOUT:-330}" python3 bench/sweep_triton.py "$W/sweep-triton-fwd-pipelines.json" \
  "$W/triton-tuning.json" > "$W/sweep-triton-fwd-pipelines.log" 2>&1
wait
# the backward's entries as committed, the forward's from this sweep
python3 - "$W/triton-tuning.json" <<'PY'
import json, sys
path = sys.argv[1]
tuning = json.load(open(path))
tuning["bwd"] = {}
json.dump(tuning, open(path, "w"), indent=1)
PY
export STRICTNORM_TRITON_TUNING=$W/triton-tuning.json
triton_tests triton-tests-tuned &
CUDA_VISIBLE_DEVICES=0 timeout "${BENCH_TIMEOUT:-150}" python3 -m strictnorm.bench --rounds 1 \
  --only "strictnorm triton,strictnorm cuda fast,F.rms_norm" --json "$W/bench.json" --markdown "$W/bench.md" \
  > "$W/bench.log" 2>&1
wait
sed -n '/best per shape/,$p' "$W/sweep-triton-fwd-pipelines.log"
for f in "$W"/triton-tests-*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
grep -E "^\|" "$W/bench.md" | head -n 40
cat "$W"/triton-tests-*.log > "$OUT/tests.log" 2>/dev/null
cp "$W/sweep-triton-fwd-pipelines.log" "$W/sweep-triton-fwd-pipelines.json" "$W/triton-tuning.json" "$W/bench.json" \
  "$W/bench.md" "$W/bench.log" "$OUT/" 2>/dev/null
