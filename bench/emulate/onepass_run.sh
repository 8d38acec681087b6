#!/usr/bin/env bash
# onepass.cu's strict_bwd_onepass on the CPU with AddressSanitizer, every CTA at once (see shim.h,
# onepass_main.cpp). Usage: bash bench/emulate/onepass_run.sh ROWS N DIR OFFSET "MACROS" (the macros as the
# loader sets them). Needs g++ 12 or newer.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/sources.sh"
emulation_workdir
sed -e 's#extern __shared__ __align__(16) unsigned char onepass_smem\[\];#unsigned char* onepass_smem = g_dynamic_smem;#' \
    "$src/onepass.cu" > "$work/onepass.cu"
[ "$(grep -c "= g_dynamic_smem;" "$work/onepass.cu")" = 1 ] || { echo "onepass_run.sh: the shared-memory declaration changed" >&2; exit 2; }
# shellcheck disable=SC2086
build_emulator "$here" "$work" onepass_main.cpp onepass_emulate -DWAIT_LIMIT_NS=600000000000ull ${5:-}
ASAN_OPTIONS=detect_leaks=0 "$work/onepass_emulate" "$1" "$2" "$3" "$4"
