#!/usr/bin/env bash
# rms_norm.cu on the CPU with AddressSanitizer (see shim.h): any access outside the buffers of a launch is
# reported with the source line. Usage: bash bench/emulate/run.sh ROWS N "MACROS" [DIR [OFFSET [EPS]]] (main.cpp)
#   e.g. bash bench/emulate/run.sh 409 5120 "-DMODE=1 -DPIECE=8 -DTPR=256 -DK=4 -DRPB=1 -DHOLD=1 -DHOLD_W=1
#        -DBACKWARD=1 -DHAS_DRES=1 -DDW_PARTIALS=0 -DDW_SMEM=0"   (bf16 everything; per-head weights not covered)
# Needs g++ 12 or newer (C++20 barriers, _Float16).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/sources.sh"
emulation_workdir
cp "$src/rms_norm.cu" "$work/"
base="-DXC=1 -DRC=1 -DNC=1 -DWC=1 -DYC=1 -DDYC=1 -DHAS_W=1 -DPER_HEAD=0"
[[ "${3:-}" == *HAS_RES* ]] || base="$base -DHAS_RES=0"
# shellcheck disable=SC2086
build_emulator "$here" "$work" main.cpp emulate $base ${3:-}
ASAN_OPTIONS=detect_leaks=0 "$work/emulate" "${1:-1}" "${2:-5120}" "${@:4}"
