# Sourced by the emulation scripts (after setting `here`, their folder): emulation_workdir sets src (the kernels'
# sources) and work (a temporary folder, removed on exit) with the emulated headers in it; emulated_headers SRC WORK
# puts the kernels' headers from SRC into WORK, common.cuh with its inline-PTX conversions replaced by C++ ones (bf16 rounding on the bit pattern,
# _Float16 for fp16) that shim.h and the host compiler understand.
emulated_headers() {
    local src=$1 work=$2 h
    for h in "$src"/*.cuh; do cp "$h" "$work/"; done
    sed -e 's#asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));#h = emu_bf16_rn(v);#' \
        -e 's#asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));#{ _Float16 hv; std::memcpy(\&hv, \&v, 2); f = (float)hv; }#' \
        -e 's#asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));#{ _Float16 hv = (_Float16)v; std::memcpy(\&h, \&hv, 2); }#' \
        "$src/common.cuh" > "$work/common.cuh"
}

# build_emulator HERE WORK MAIN OUT [FLAGS...] compiles the emulator MAIN (a .cpp in HERE) against the sources in
# WORK into WORK/OUT: C++20 (barriers), no contraction (fp32 ops as written), AddressSanitizer.
build_emulator() {
    local here=$1 work=$2 main=$3 out=$4
    shift 4
    g++ -std=c++20 -O1 -g -ffp-contract=off -fsanitize=address -fno-omit-frame-pointer -pthread -I"$work" -I"$here" \
        "$@" "$here/$main" -o "$work/$out"
}

emulation_workdir() {
    src="$here/../../src/strictnorm/backends/cuda/kernels"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    emulated_headers "$src" "$work"
}
