#!/usr/bin/env bash
# Run 59, call c (from the project root on the GPU machine; $OUT comes back): under the read flush, what the
# backend's rows-held-as-loaded option (TileChoice.rewiden, bench/candidates/rewiden-128.json) gains at 128 columns,
# and the exactness probe's decomposition at the candidate's tile and the table's. At most 8 files in $OUT.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 STRICTNORM_BENCH_FLUSH=read
PROBE_SHAPES=65536x128 PROBE_TILES=8x2,32x4 \
PROBE_VARIANTS="exact;x widened again;x widened again, Inductor's addressing;x widened again, Inductor's addressing, rcp_rn;x loaded again, Inductor's addressing, N constant" \
  timeout 150 python3 bench/exactness_probe.py "$OUT/c-ep.json" > "$OUT/c-ep.log" 2>&1
args=(--flush read --rounds 3 --shapes 4096x128,16384x128,65536x128,262144x128 --only "strictnorm triton fast,bytes")
for round in 1 2; do
  timeout 60 python3 -m strictnorm.bench "${args[@]}" --json "$OUT/c-main$round.json" > "/tmp/c-main$round.log" 2>&1
  STRICTNORM_TRITON_TUNING=bench/candidates/rewiden-128.json timeout 60 python3 -m strictnorm.bench "${args[@]}" \
    --json "$OUT/c-rewiden$round.json" > "/tmp/c-rewiden$round.log" 2>&1
done
tail -n 25 "$OUT/c-ep.log"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("main1", "rewiden1", "main2", "rewiden2"):
    try:
        rows = json.load(open(f"{out}/c-{name}.json"))["norm"]
    except (OSError, KeyError, ValueError) as e:
        print(name, "missing", e)
        continue
    print(f"{name:9s}", "  ".join(f"{r['M']}x{r['N']} {r['fwd_us']:.2f}" for r in rows
                                  if r["provider"] == "strictnorm triton fast"))
PY
