#!/usr/bin/env bash
# One GPU call: named jobs, on one GPU or two of one host. Usage (from the project root, on the GPU machine):
#   bash bench/device_call.sh [--wheels a|b] [--alone "JOBS"] [--first "JOBS"] [--second "JOBS"]
# --alone runs first, every GPU visible; then --first runs on GPU 0 and, beside it, --second on GPU 1 (after --first
# where there is one GPU: tests beside a timing would disturb it only through the host). Jobs, in the order given:
#   env           GPUs, clocks, versions, `strictnorm info`
#   devices       tests/test_devices.py (two GPUs: --alone)
#   suite         the GPU test suite without tests/test_cute.py, then `strictnorm verify --quick`
#   triton        the Triton tests (tests/test_triton.py, tests/test_gpu.py's Triton, batch-invariance,
#                 determinism, graph and in-place tests)
#   cute          tests/test_cute.py
#   cuda          the CUDA backend's GPU tests: its forward and backward bitwise, random shapes, the tables' row
#                 bounds, graph replay and batch invariance (~280 s with its kernels cached, ~2x where they compile)
#   pytest:EXPR   tests/ -k EXPR (EXPR without spaces; '+' stands for a space)
#   sweep-triton, sweep-cuda, sweep-cute, sweep-fold, sweep-onepass
#                 bench/sweep_*.py, configured by the SWEEP_* variables; a Triton or CUDA sweep's choices are also
#                 merged into /tmp/strictnorm-<name>-tuning.json (by padded length), which a later call on the same
#                 machine takes with TUNING_FROM_LAST=1 (and which comes back as <name>-tuning.json)
#   sweep-triton:TAG, sweep-cuda:TAG
#                 the same with the settings of $SWEEP_ENV_TAG added ("SWEEP_SHAPES=2048x4096 SWEEP_PIPELINES=1"):
#                 several sweeps in one call
#   bench         `strictnorm bench` ($BENCH_ARGS)
#   bench:TAG     the same with $BENCH_ARGS_TAG instead ("--flush read --shapes 128x4096"), its files named by the
#                 tag: several benches in one call
#   host          bench/host_breakdown.py
#   kernel-split  bench/kernel_split.py (each kernel of a forward + backward call alone, median us; $SPLIT_ARGS)
#   consumer-probe bench/consumer_probe.py (the fold consumer loops' cycles a row, one warp alone)
#   supply-probe  bench/supply_probe.py (a default fold without its adds or without its loads; SUPPLY_SHAPES)
#   pattern-probe bench/pattern_probe.py (the dW fold's column stripes read with nothing else to do; PATTERN_*)
#   partial-probe bench/partial_probe.py (the fast dW's partial-row sum in one launch or in segments; PARTIAL_*)
#   reduction-probe bench/reduction_probe.py (the Triton forward's canon_sum against tl.sum; PROBE_SHAPES, PROBE_WARPS)
#   triggers      bench/timing_probe.py --triggers: each of $TRIGGERS (default all; comma-separated) in a fresh
#                 process, the forwards timed before and after it, the GPU's clocks read between
#   exactness-probe bench/exactness_probe.py (the Triton forward's tile with each exact step relaxed, beside the
#                 backends and anchors; PROBE_SHAPES, PROBE_TILES)
#   ncu-source:M:N:CASE  bench/ncu_source.sh over one bench/ncu_probe.py case (per-instruction stall samples;
#                 NCU_SAMPLING), its tables (bench/ncu_source_table.py) in the log, the samples as -sass.csv.xz
#   strict-parts  bench/strict_parts.py (the CUDA strict backward's parts alone and together)
#   ncu           Nsight Compute over bench/ncu_probe.py $NCU_PROBE ("M N case...": one call of each case), the
#                 sections $NCU_SECTIONS (default: speed of light, occupancy, launch, warp states, scheduler, memory)
#   memcheck      compute-sanitizer over the guard-band tests ($MEMCHECK_K)
# --wheels a copies the first half of the device wheels (.device-wheels/a, carried) to /tmp/dw; --wheels b installs
# them with the second half (.device-wheels/b, carried): two calls back to back on one machine. Every job writes
# $W/<job>.log (and .json): the test jobs' logs come back as tests.log, the others as <job>.log / <job>.json (at
# most 8 files come back: name few jobs). DRY_RUN=1 prints the jobs' commands instead of running them.
set -uo pipefail
OUT=${OUT:-/tmp/strictnorm-out}
W=${W:-/tmp/strictnorm-call}
ALONE="" FIRST="" SECOND="" WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --alone) ALONE=$2; shift 2 ;;
    --first) FIRST=$2; shift 2 ;;
    --second) SECOND=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    *) echo "device_call.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# The test jobs' pytest workers share GPU 0's memory: 12-14 fit an H200's 141 GB; on an 80 GB H100 14 ran out of it
# (bench/results/2026-12-06-h100-run50, call b: one worker held 20.7 GB), 8 did not (call d)
if [ -z "${TEST_WORKERS:-}" ] && command -v nvidia-smi > /dev/null; then
  GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2> /dev/null | head -1)
  if [ "${GPU_MIB:-0}" -gt 0 ] 2> /dev/null && [ "$GPU_MIB" -lt 100000 ]; then TEST_WORKERS=8; fi
fi
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1 STRICTNORM_CACHE_DIR=/tmp/strictnorm-cache
export STRICTNORM_FAILURE_LOG="$W/failures.log"
TESTS="env devices suite triton cute cuda pytest"

# The command of one job (its log and JSON under $W).
job_command() {
  local job=$1 log="$W/${1//:/-}.log"
  case "$job" in
    env) echo "{ date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,temperature.gpu" \
              "--format=csv; python3 -c \"import torch, triton; print('torch', torch.__version__, 'triton'," \
              "triton.__version__)\"; python3 -m strictnorm.cli info; } > '$log' 2>&1" ;;
    devices) echo "timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_devices.py > '$log' 2>&1" ;;
    suite) echo "timeout ${TEST_TIMEOUT:-420} python3 -m pytest -n ${TEST_WORKERS:-14} -q -rfE -p no:cacheprovider" \
                "-k 'not every_fold_configuration' --ignore=tests/test_cute.py tests > '$log' 2>&1;" \
                "timeout 90 python3 -m strictnorm.cli verify --quick >> '$log' 2>&1" ;;
    triton) echo "timeout ${TEST_TIMEOUT:-400} python3 -m pytest -n ${TEST_WORKERS:-12} -q -rfE -p no:cacheprovider" \
                 "tests/test_triton.py tests/test_gpu.py" \
                 "-k 'triton or batch_invariance or determinism or graph_replay or in_place' > '$log' 2>&1" ;;
    cute) echo "timeout ${CUTE_TIMEOUT:-240} python3 -m pytest -n ${TEST_WORKERS:-12} -q -rfE -p no:cacheprovider" \
               "tests/test_cute.py > '$log' 2>&1" ;;
    cuda) echo "timeout ${TEST_TIMEOUT:-450} python3 -m pytest -n ${TEST_WORKERS:-14} -q -rfE -p no:cacheprovider tests" \
               "-k '(table_row_bounds and cuda) or test_cuda_forward or test_cuda_backward_bitwise or test_cuda_random" \
               "or (graph_replay and cuda) or (batch_invariance and cuda)' > '$log' 2>&1" ;;
    pytest:*) echo "timeout ${TEST_TIMEOUT:-400} python3 -m pytest -n ${TEST_WORKERS:-12} -q -rfE -p no:cacheprovider" \
                   "tests -k '$(echo "${job#pytest:}" | tr + ' ')' > '$log' 2>&1" ;;
    sweep-triton|sweep-cuda|sweep-triton:*|sweep-cuda:*)
      local name=${job#sweep-} base="$W/${job//:/-}" settings=""
      name=${name%%:*}
      [[ $job == *:* ]] && { local var="SWEEP_ENV_${job#*:}"; settings=${!var:-}; }
      echo "env $settings timeout ${SWEEP_TIMEOUT:-400} python3 bench/sweep_$name.py '$base.json' '$base-tuning.json'" \
           "> '$log' 2>&1; python3 bench/tuning_merge.py /tmp/strictnorm-$name-tuning.json '$base-tuning.json'" ;;
    sweep-cute|sweep-fold|sweep-onepass)
      echo "timeout ${SWEEP_TIMEOUT:-400} python3 bench/sweep_${job#sweep-}.py '$W/$job.json' > '$log' 2>&1" ;;
    ncu) local sections=${NCU_SECTIONS:-"SpeedOfLight Occupancy LaunchStats WarpStateStats SchedulerStats MemoryWorkloadAnalysis"}
         echo "timeout ${NCU_TIMEOUT:-300} \$(command -v ncu || echo /usr/local/cuda/bin/ncu) --profile-from-start off" \
              "--clock-control none $(printf -- '--section %s ' $sections)python3 bench/ncu_probe.py" \
              "${NCU_PROBE:-32768 4096 onepass-strict} > '$log' 2>&1" ;;
    bench|bench:*) local var="BENCH_ARGS${job#bench}" base="$W/${job//:/-}"  # bench:TAG: $BENCH_ARGS_TAG
                   var=${var/:/_}
                   echo "timeout ${BENCH_TIMEOUT:-480} python3 -m strictnorm.bench --json '$base.json'" \
                        "--markdown '$base.md' ${!var:-} > '$log' 2>&1" ;;
    host) echo "timeout 120 python3 bench/host_breakdown.py '$W/host.json' > '$log' 2>&1" ;;
    kernel-split) echo "timeout ${SPLIT_TIMEOUT:-200} python3 bench/kernel_split.py '$W/kernel-split.json'" \
                       "${SPLIT_ARGS:-} > '$log' 2>&1" ;;
    consumer-probe) echo "timeout 120 python3 bench/consumer_probe.py '$W/consumer-probe.json' > '$log' 2>&1" ;;
    reduction-probe) echo "timeout 200 python3 bench/reduction_probe.py '$W/reduction-probe.json' > '$log' 2>&1" ;;
    triggers) echo "timeout ${PROBE_TIMEOUT:-400} python3 bench/timing_probe.py --triggers ${TRIGGERS:-all}" \
                   "'$W/triggers.json' > '$log' 2>&1" ;;
    exactness-probe) echo "timeout ${PROBE_TIMEOUT:-200} python3 bench/exactness_probe.py '$W/exactness-probe.json'" \
                          "> '$log' 2>&1" ;;
    supply-probe) echo "timeout ${SUPPLY_TIMEOUT:-300} python3 bench/supply_probe.py '$W/supply-probe.json' > '$log' 2>&1" ;;
    pattern-probe) echo "timeout ${PATTERN_TIMEOUT:-300} python3 bench/pattern_probe.py '$W/pattern-probe.json'" \
                        "> '$log' 2>&1" ;;
    partial-probe) echo "timeout ${PARTIAL_TIMEOUT:-300} python3 bench/partial_probe.py '$W/partial-probe.json'" \
                        "> '$log' 2>&1" ;;
    ncu-source:*) local spec=${job#ncu-source:} base="$W/${job//:/-}"
                  echo "timeout ${NCU_TIMEOUT:-300} bash bench/ncu_source.sh '$base' ${spec//:/ } > '$log' 2>&1;" \
                       "python3 bench/ncu_source_table.py '$base-sass.csv' 40 >> '$log' 2>&1;" \
                       "xz -9 -c '$base-sass.csv' > '$OUT/${job//:/-}-sass.csv.xz'" ;;
    strict-parts) echo "timeout ${SWEEP_TIMEOUT:-400} python3 bench/strict_parts.py '$W/strict-parts.json' > '$log' 2>&1" ;;
    memcheck) echo "PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${MEMCHECK_TIMEOUT:-240}" \
                   "\$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer) --tool memcheck" \
                   "--report-api-errors no --print-limit 8 python3 -m pytest -q -p no:xdist -p no:cacheprovider" \
                   "tests/test_gpu.py -k '${MEMCHECK_K:-reads_nothing or cuda_backward_bitwise and 5120}' > '$log' 2>&1" ;;
    *) echo "echo 'device_call.sh: unknown job $job' | tee '$log' >&2" ;;
  esac
}

# Runs jobs in order with the given GPUs visible ("" for all).
run_jobs() {
  local gpus=$1 job; shift
  for job in "$@"; do
    local cmd; cmd=$(job_command "$job")
    if [ -n "${DRY_RUN:-}" ]; then
      echo "[${gpus:-all}] $cmd"
    elif [ -n "$gpus" ]; then
      CUDA_VISIBLE_DEVICES=$gpus bash -c "$cmd"
    else
      bash -c "$cmd"
    fi
  done
}

mkdir -p "$OUT" "$W"
if [ -z "${DRY_RUN:-}" ]; then
  source bench/device_cache.sh restore
  if [ "$WHEELS" = a ] && [ -d .device-wheels/a ]; then mkdir -p /tmp/dw && cp .device-wheels/a/* /tmp/dw/; fi
  if [ "$WHEELS" = b ] && [ -f .device-wheels/b/install.sh ]; then bash .device-wheels/b/install.sh > "$W/install.log" 2>&1; fi
  [ -f /tmp/dw/env.sh ] && source /tmp/dw/env.sh
  if [ -n "${TUNING_FROM_LAST:-}" ]; then
    for name in triton cuda; do
      upper=$(echo "$name" | tr a-z A-Z)
      if [ -f "/tmp/strictnorm-$name-tuning.json" ]; then
        cp "/tmp/strictnorm-$name-tuning.json" "$W/last-$name-tuning.json"
        export "STRICTNORM_${upper}_TUNING=$W/last-$name-tuning.json"
        echo "$name choices of the last call: $(tr -d '\n ' < "$W/last-$name-tuning.json")"
      fi
    done
  fi
fi
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}  # GPUS: the count to plan for (tests)
# shellcheck disable=SC2086  # job lists split on spaces
run_jobs "" $ALONE
if [ "${gpus:-0}" -gt 1 ]; then
  run_jobs 1 $SECOND &
  run_jobs 0 $FIRST
  wait
else
  run_jobs 0 $FIRST
  run_jobs 0 $SECOND
fi
[ -n "${DRY_RUN:-}" ] && exit 0

# What came back: a summary here, the files to $OUT.
tests_log="$OUT/tests.log"; : > "$tests_log"
for job in $ALONE $FIRST $SECOND; do
  log="$W/${job//:/-}.log"
  case " $TESTS " in
    *" ${job%%:*} "*)
      echo "$job: $(grep -E 'passed|failed|error' "$log" 2>/dev/null | tail -n 2 | tr '\n' ' ')"
      { echo "==== $job"; cat "$log"; } >> "$tests_log" 2>/dev/null ;;
    *)
      echo "$job: $(tail -n 1 "$log" 2>/dev/null)"
      cp "$log" "$W/${job//:/-}.json" "$OUT/" 2>/dev/null
      [[ $job == bench || $job == bench:* ]] && { cp "$W/${job//:/-}.md" "$OUT/"; tail -n 40 "$W/${job//:/-}.md"; }
      [[ $job == sweep-triton* || $job == sweep-cuda* ]] && sed -n '/best per shape/,$p' "$log"
      [ "$job" = strict-parts ] && sed -n '/copy ceiling/,$p' "$log"
      [ "$job" = host ] && cp "$W/host.json" "$OUT/" 2>/dev/null ;;
  esac
done
for name in triton cuda; do  # the choices of this call's sweeps, merged
  [[ " $ALONE $FIRST $SECOND " == *" sweep-$name"* ]] && cp "/tmp/strictnorm-$name-tuning.json" "$OUT/$name-tuning.json"
done
[ -f "$W/failures.log" ] && { echo "==== failures"; cat "$W/failures.log"; } >> "$tests_log"
bash bench/device_cache.sh save
