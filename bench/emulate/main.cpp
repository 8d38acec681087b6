// Runs rms_norm.cu's backward (BACKWARD) or forward on the CPU through shim.h, on buffers of exactly the
// sizes a launch passes (so AddressSanitizer sees any access past them), row group by row group.
// Usage: emulate ROWS N [DIR [OFFSET]] (built with -DEMU_WALK, one block walks every row group). Dtypes: bf16
// rows and weight (XC = NC = WC = DYC = 1); see run.sh for the macros. With DIR, the inputs are read from
// DIR/{x,res,w,dy,rstd}.bin (raw little-endian bits; the backward reads x as its z and res as its dres) and the
// outputs written to DIR/{out,rstd_out,z}.bin; with DW_PARTIALS the backward's fast-dW partial rows too, each launch's
// after the one before (DW_COMBINE: one a launch, else RPB), to DIR/dw_part.bin.
#define STRICTNORM_EMULATED 1
#include "shim.h"
#include "host.h"
#include "rms_norm.cu"
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>


int main(int argc, char** argv) {
    const long long rows = argc > 1 ? atoll(argv[1]) : 1;
    const int n = argc > 2 ? atoi(argv[2]) : 5120;
    const char* dir = argc > 3 ? argv[3] : nullptr;
    const float offset = argc > 4 ? static_cast<float>(atof(argv[4])) : 0.5f;
    const float eps = argc > 5 ? strtof(argv[5], nullptr) : 1e-6f;  // the forward's
    std::mt19937 rng(42);
    std::normal_distribution<float> nd;
    auto fill = [&](long long count, float scale) {
        auto* p = buffer<unsigned short>(count);
        for (long long i = 0; i < count; ++i) p[i] = emu_bf16_rn(nd(rng) * scale);
        return p;
    };
    unsigned short *x = fill(rows * n, 1.0f), *dy = fill(rows * n, 1.0f), *w = fill(n, 0.1f);
    unsigned short *res = fill(rows * n, 1.0f), *out = buffer<unsigned short>(rows * n);
    unsigned short *z = buffer<unsigned short>(rows * n);
    float* rstd = buffer<float>(rows);
    for (long long i = 0; i < rows; ++i) rstd[i] = 1.0f;
    auto path = [&](const char* name) { return std::string(dir) + "/" + name; };
    auto load = [&](const char* name, void* p, long long bytes) { load_file(path(name), p, bytes); };
    auto save = [&](const char* name, const void* p, long long bytes) { save_file(path(name), p, bytes); };
    if (dir) {
        load("x.bin", x, rows * n * 2), load("res.bin", res, rows * n * 2), load("w.bin", w, n * 2);
        load("dy.bin", dy, rows * n * 2), load("rstd.bin", rstd, rows * 4);
    }
    const int threads = TPR * RPB;
#ifdef EMU_WALK
    const long long per_launch = rows;  // one block striding over every row group, as a persistent grid's blocks do
#else
    const long long per_launch = RPB;  // each row group as a launch of one block
#endif
    const long long launches = (rows + per_launch - 1) / per_launch;
#if defined(BACKWARD) && DW_PARTIALS
    const long long part_rows = DW_COMBINE ? 1 : RPB;  // a launch's partial rows
    float* part = buffer<float>(launches * part_rows * n);
    const long long dyn_bytes = DW_COMBINE || DW_SMEM || !HOLD ? 4LL * RPB * n : 0;  // the host's shared memory
#else
    const long long part_rows = 0;
    float* part = rstd;  // an unused pointer, as the host passes one
    const long long dyn_bytes = 0;
#endif
#if defined(BACKWARD) && STAGED
    EmuBlock blk(threads, 2LL * STAGE_CHUNKS * THREADS * 16);
#else
    EmuBlock blk(threads, dyn_bytes);
#endif
    for (long long b = 0; b * per_launch < rows; ++b) {
        const long long off = b * per_launch * n, live = std::min<long long>(per_launch, rows - b * per_launch);
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
            ts.emplace_back([&, t] {
                emu_enter(blk, 0, t);
#ifdef BACKWARD
                rms_bwd(reinterpret_cast<const dy_t*>(dy + off), n, 0, 0, reinterpret_cast<const n_t*>(x + off), n, 0, 0,
                        reinterpret_cast<const w_t*>(w), 0, rstd + b * per_launch, reinterpret_cast<const n_t*>(res + off), n,
                        0, 0, reinterpret_cast<n_t*>(out + off), n, 0, 0, part + b * part_rows * n, live, n, 1, 1,
                        offset, 1);
#else
                rms_fwd(reinterpret_cast<const x_t*>(x + off), n, 0, 0, reinterpret_cast<const r_t*>(res + off), n, 0, 0,
                        reinterpret_cast<n_t*>(z + off), reinterpret_cast<const w_t*>(w), 0,
                        reinterpret_cast<y_t*>(out + off), rstd + b * per_launch, live, n, 1, 1, eps, offset, 1);
#endif
            });
        for (auto& th : ts) th.join();
    }
    if (dir) save("out.bin", out, rows * n * 2), save("rstd_out.bin", rstd, rows * 4), save("z.bin", z, rows * n * 2);
    if (dir && part_rows) save("dw_part.bin", part, launches * part_rows * n * 4);
    long long nan = 0;
    for (long long i = 0; i < rows * n; ++i) nan += std::isnan(__uint_as_float(unsigned(out[i]) << 16));
    printf("%lld x %d: %lld NaN outputs, out[0] = %g\n", rows, n, nan, __uint_as_float(unsigned(out[0]) << 16));
    return 0;
}
