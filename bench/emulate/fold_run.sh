#!/usr/bin/env bash
# fold.cu's fold_ring, fold_stream (-DSTREAM_ROWS) or fold_chain (-DCHAIN_ROWS) on the CPU with AddressSanitizer (see shim.h, fold_main.cpp).
# Usage: bash bench/emulate/fold_run.sh ROWS N SHMEM DIR "MACROS" [CTAS]   (the macros as the loader sets them, e.g.
#   "-DA_CODE=1 -DB_CODE=1 -DWHAT=1 -DSIMPLE_ROWS=1 -DCOLS=8 -DROWS_PER_STAGE=128 -DSTAGES=8 -DTHREADS=256
#   -DCONVERT=1 -DFULL_STAGE=1"; A_CODE and B_CODE default to bf16). Needs g++ 12 or newer.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/sources.sh"
emulation_workdir
sed -e 's#extern __shared__ __align__(16) unsigned char ring\[\];#unsigned char* ring = g_dynamic_smem;#' \
    -e 's#extern __shared__ __align__(16) unsigned char chain_smem\[\];#unsigned char* chain_smem = g_dynamic_smem;#' \
    -e 's#extern __shared__ __align__(16) unsigned char stream_smem\[\];#unsigned char* stream_smem = g_dynamic_smem;#' \
    "$src/fold.cu" > "$work/fold.cu"
[ "$(grep -c "= g_dynamic_smem;" "$work/fold.cu")" = 3 ] || { echo "fold_run.sh: a shared-memory declaration changed" >&2; exit 2; }
# shellcheck disable=SC2086
build_emulator "$here" "$work" fold_main.cpp fold_emulate ${5:-}
ASAN_OPTIONS=detect_leaks=0 "$work/fold_emulate" "$1" "$2" "$3" "$4" "${@:6}"  # 6th: fold_chain CTAs (3)
