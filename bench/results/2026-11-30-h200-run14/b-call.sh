#!/usr/bin/env bash
# Call b of run 14 as it ran (bench/anchored_call.sh of 552859a; the cute prefetch it measured lost and was
# removed with STRICTNORM_CUTE_TUNING after this call).
# One GPU call after bench/pipeline_call.sh (run 14, call b): installs the device wheels (the second half travels
# with this call), then on the first GPU bench/sweep_cute.py over the backward's register prefetch (SWEEP_VARIANTS
# "hold" and "hold + prefetch"; every configuration checked bitwise), which turns the prefetch on for what follows
# where it is faster on the geometric mean of the backward shapes (STRICTNORM_CUTE_TUNING), and the anchored bench
# (`strictnorm bench`, every anchor) with the Triton choices of the last call (STRICTNORM_TRITON_TUNING, from
# .device-cache/triton-tuning.json); beside it on a second GPU: tests/test_cute.py with and without the prefetch,
# and the Triton GPU tests with those Triton choices. Logs and JSON to $OUT.
# Usage (from the project root, on the GPU machine): bash bench/anchored_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}; mkdir -p "$OUT"
W=/tmp/strictnorm-anchored; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
source bench/device_cache.sh restore
[ -f .device-wheels/b/install.sh ] && bash .device-wheels/b/install.sh > "$W/install.log" 2>&1
[ -f /tmp/dw/env.sh ] && source /tmp/dw/env.sh
python3 -c "import cutlass, quack, liger_kernel; print('wheels ok')" 2>&1 | tail -n 1
[ -f .device-cache/triton-tuning.json ] && export STRICTNORM_TRITON_TUNING=$PWD/.device-cache/triton-tuning.json
echo "{}" > "$W/cute-off.json"; echo '{"backward_prefetch": true}' > "$W/cute-prefetch.json"
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
checks() {
  export CUDA_VISIBLE_DEVICES=$second
  for v in off prefetch; do
    STRICTNORM_CUTE_TUNING=$W/cute-$v.json timeout 300 python3 -m pytest -n 12 -q -rfE -p no:cacheprovider \
      tests/test_cute.py > "$W/cute-tests-$v.log" 2>&1
  done
  timeout 300 python3 -m pytest -n 12 -q -rfE -p no:cacheprovider tests/test_triton.py tests/test_gpu.py \
    -k "triton or batch_invariance or determinism or graph_replay or in_place" > "$W/triton-tests.log" 2>&1
}
if [ "$second" = 1 ]; then checks & fi
CUDA_VISIBLE_DEVICES=0 SWEEP_VARIANTS="hold,hold + prefetch" timeout 240 python3 bench/sweep_cute.py \
  "$W/sweep-cute-prefetch.json" > "$W/sweep-cute-prefetch.log" 2>&1
python3 - "$W" <<'PY' > "$W/cute-choice.log" 2>&1
import json, math, shutil, sys
w = sys.argv[1]
rows = json.load(open(f"{w}/sweep-cute-prefetch.json"))["rows"]
bwd = {(r["M"], r["N"], r["variant"]): r for r in rows if r["direction"] == "bwd" and r.get("bitwise") and "us" in r}
ratios = [bwd[(m, n, "hold + prefetch")]["us"] / bwd[(m, n, "hold")]["us"] for (m, n, v) in bwd
          if v == "hold" and (m, n, "hold + prefetch") in bwd]
gm = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("inf")
on = gm < 1 and all(r.get("bitwise") for r in rows)
shutil.copy(f"{w}/cute-{'prefetch' if on else 'off'}.json", f"{w}/cute-tuning.json")
print(f"cute backward prefetch / hold, geometric mean over {len(ratios)} shapes: {gm:.3f} -> prefetch {on}")
PY
cat "$W/cute-choice.log"
CUDA_VISIBLE_DEVICES=0 STRICTNORM_CUTE_TUNING=$W/cute-tuning.json timeout "${BENCH_TIMEOUT:-330}" \
  python3 -m strictnorm.bench --json "$W/bench.json" --markdown "$W/bench.md" > "$W/bench.log" 2>&1
if [ "$second" = 0 ]; then checks; fi
wait
sed -n '/copy ceiling/,$p' "$W/sweep-cute-prefetch.log"
for f in "$W"/cute-tests-*.log "$W/triton-tests.log"; do echo "$f: $(tail -n 1 "$f")"; done
tail -n 40 "$W/bench.md"
cat "$W/cute-choice.log" "$W"/cute-tests-*.log "$W/triton-tests.log" > "$OUT/tests.log" 2>/dev/null
cp "$W/sweep-cute-prefetch.log" "$W/sweep-cute-prefetch.json" "$W/bench.json" "$W/bench.md" "$W/bench.log" \
  "$W/cute-tuning.json" "$OUT/" 2>/dev/null
bash bench/device_cache.sh save
