#!/usr/bin/env bash
# partial_sum.cu on the CPU with AddressSanitizer (see shim.h, partial_sum_main.cpp). Usage:
#   bash bench/emulate/partial_sum_run.sh ROWS N SEG_ROWS DIR "MACROS"   (e.g. "-DSUM_COLS=16 -DSUM_THREADS=256 -DVEC=4")
# Needs g++ 12 or newer.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/sources.sh"
emulation_workdir
cp "$src/partial_sum.cu" "$work/"
# shellcheck disable=SC2086
build_emulator "$here" "$work" partial_sum_main.cpp partial_sum_emulate ${5:-}
ASAN_OPTIONS=detect_leaks=0 "$work/partial_sum_emulate" "$1" "$2" "$3" "$4"
