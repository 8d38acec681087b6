// Runs fold.cu's fold_ring or, with STREAM_ROWS, fold_stream (one CTA at a time, THREADS std::threads each) or, with CHAIN_ROWS, fold_chain (CTAS
// CTAs at once, default 3, taking items from the counter, each waiting for its predecessor's hand-over, which
// another CTA may hold) on the CPU through shim.h, on buffers of exactly a launch's sizes and shared memory
// of exactly its bytes, so AddressSanitizer reports any access outside them. Usage: fold_emulate ROWS N SHMEM
// DIR [CTAS]: reads DIR/{a,b}.bin (rows of A_CODE's and B_CODE's dtype, bf16 by default: dy and the norm's
// input) and DIR/rstd.bin, writes the fp32 result to DIR/out.bin. WHAT, COLS & co: see fold_run.sh.
#define STRICTNORM_EMULATED 1
#ifndef A_CODE
#define A_CODE 1
#endif
#ifndef B_CODE
#define B_CODE 1
#endif
#include "shim.h"
#include "host.h"
#include "fold.cu"
#include <cstdio>
#include <cstdlib>
#include <string>


int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: fold_emulate ROWS N SHMEM DIR\n"); return 2; }
    const long long rows = atoll(argv[1]);
    const int n = atoi(argv[2]);
    const long long shmem = atoll(argv[3]);
    const std::string dir = argv[4];
    auto* a = buffer<a_t>(rows * n);
    auto* b = buffer<b_t>(rows * n);
    auto* rstd = buffer<float>(rows);
    auto* out = buffer<out_t>(n);
    auto load = [&](const char* name, void* p, long long bytes) { load_file(dir + "/" + name, p, bytes); };
    load("a.bin", a, rows * n * sizeof(a_t)), load("b.bin", b, rows * n * sizeof(b_t)), load("rstd.bin", rstd, rows * 4);
#ifdef CHAIN_ROWS
    const long long items = (rows + CHAIN_ROWS - 1) / CHAIN_ROWS * ((n + COLS - 1) / COLS);
    int* state = static_cast<int*>(aligned_alloc(16, ((2 + items * COLS * 2) * sizeof(int) + 15) / 16 * 16));
    std::memset(state, 0, (2 + items * COLS * 2) * sizeof(int));
    const int aligned = (n * sizeof(a_t)) % 16 == 0 && (n * sizeof(b_t)) % 16 == 0;  // rows start 16-byte aligned
    const int ctas = argc > 5 ? atoi(argv[5]) : 3;
    gridDim = {static_cast<unsigned>(ctas), 1, 1};
    {
        std::vector<std::unique_ptr<EmuBlock>> blocks;
        for (int c = 0; c < ctas; ++c) blocks.push_back(std::make_unique<EmuBlock>(THREADS, shmem));
        std::vector<std::thread> ts;  // every CTA's threads at once
        for (int c = 0; c < ctas; ++c)
            for (int t = 0; t < THREADS; ++t)
                ts.emplace_back([&, c, t] {
                    emu_enter(*blocks[c], c, t);
                    fold_chain(a, n, 0, 0, b, n, 0, 0, 1, 1, rstd, out, rows, n, 1, state, aligned);
                });
        for (auto& th : ts) th.join();
    }
#else
    gridDim = {static_cast<unsigned>((n + COLS - 1) / COLS), 1, 1};
#ifdef STREAM_ROWS
    auto* kernel = fold_stream;  // the same parameters
#else
    auto* kernel = fold_ring;
#endif
    EmuBlock blk(THREADS, shmem);
    for (unsigned bx = 0; bx < gridDim.x; ++bx) {  // one CTA at a time
        std::vector<std::thread> ts;
        for (int t = 0; t < THREADS; ++t)
            ts.emplace_back([&, bx, t] {
                emu_enter(blk, bx, t);
                kernel(a, n, 0, 0, b, n, 0, 0, 1, 1, rstd, out, rows, n, 1);
            });
        for (auto& th : ts) th.join();
    }
#endif
    save_file(dir + "/out.bin", out, n * sizeof(out_t));
    printf("folded %lld x %d\n", rows, n);
    return 0;
}
