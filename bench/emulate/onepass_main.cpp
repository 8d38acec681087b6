// Runs onepass.cu's strict_bwd_onepass on the CPU through shim.h: every CTA at once (G_DATA of them, THREADS
// std::threads each), as the cooperative launch has them co-resident, on buffers of exactly a launch's
// sizes (AddressSanitizer reports any access outside them), rows at a pitch of whole 16-byte chunks.
// Usage: onepass_emulate ROWS N DIR OFFSET: reads DIR/{dy,z,w}.bin (rows of DYC's, NC's and WC's dtype) and
// DIR/rstd.bin, writes DIR/dx.bin and DIR/dw.bin.
#define STRICTNORM_EMULATED 1
#include "shim.h"
#include "host.h"
#include "onepass.cu"
#include <cstdio>
#include <cstdlib>
#include <string>


int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: onepass_emulate ROWS N DIR OFFSET\n"); return 2; }
    const long long rows = atoll(argv[1]);
    const int n = atoi(argv[2]);
    const std::string dir = argv[3];
    const float offset = static_cast<float>(atof(argv[4]));
    // rows at a pitch of whole 16-byte chunks, as the loader requires them (the files hold dense rows)
    const long long dpitch = (n * sizeof(dy_t) + 15) / 16 * 16 / sizeof(dy_t);
    const long long zpitch = (n * sizeof(n_t) + 15) / 16 * 16 / sizeof(n_t);
    auto* dy = buffer<dy_t>(rows * dpitch);
    auto* z = buffer<n_t>(rows * zpitch);
    auto* w = buffer<w_t>(n);
    auto* rstd = buffer<float>(rows);
    auto* dx = buffer<n_t>(rows * zpitch);
    auto* dw = buffer<w_t>(n);
    auto load = [&](const char* name, void* p, long long bytes) { load_file(dir + "/" + name, p, bytes); };
    auto save = [&](const char* name, const void* p, long long bytes) { save_file(dir + "/" + name, p, bytes); };
    auto* dense_dy = buffer<dy_t>(rows * n);
    auto* dense_z = buffer<n_t>(rows * n);
    load("dy.bin", dense_dy, rows * n * sizeof(dy_t)), load("z.bin", dense_z, rows * n * sizeof(n_t));
    load("w.bin", w, n * sizeof(w_t)), load("rstd.bin", rstd, rows * 4);
    for (long long r = 0; r < rows; ++r) {
        std::memcpy(dy + r * dpitch, dense_dy + r * n, n * sizeof(dy_t));
        std::memcpy(z + r * zpitch, dense_z + r * n, n * sizeof(n_t));
    }
    const long long blocks = (rows + ROWS - 1) / ROWS;
    auto* partials = buffer<float>(static_cast<long long>(TILES) * ROWS * GROUPS);
    auto* cvals = buffer<float>(static_cast<long long>(TILES) * ROWS);
    auto* arrive1 = buffer<int>(blocks);
    auto* arrive2 = buffer<int>(blocks);
    std::memset(arrive1, 0, blocks * sizeof(int)), std::memset(arrive2, 0, blocks * sizeof(int));
    const long long shmem = ONEPASS_SMEM;
    gridDim = {static_cast<unsigned>(G_DATA), 1, 1};
    std::vector<std::unique_ptr<EmuBlock>> ctas;
    for (int c = 0; c < G_DATA; ++c) ctas.push_back(std::make_unique<EmuBlock>(THREADS, shmem));
    std::vector<std::thread> ts;
    for (int c = 0; c < G_DATA; ++c)
        for (int t = 0; t < THREADS; ++t)
            ts.emplace_back([&, c, t] {
                emu_enter(*ctas[c], c, t);
                strict_bwd_onepass(dy, dpitch, z, zpitch, w, rstd, dx, zpitch, dw, partials, cvals, arrive1, arrive2,
                                   rows, n, offset);
            });
    for (auto& th : ts) th.join();
    for (long long r = 0; r < rows; ++r) std::memcpy(dense_z + r * n, dx + r * zpitch, n * sizeof(n_t));
    save("dx.bin", dense_z, rows * n * sizeof(n_t)), save("dw.bin", dw, n * sizeof(w_t));
    printf("one-pass backward %lld x %d\n", rows, n);
    return 0;
}
