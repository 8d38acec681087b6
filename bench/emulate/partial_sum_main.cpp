// Runs partial_sum.cu on the CPU through shim.h (one block at a time, SUM_THREADS std::threads each), on buffers of
// exactly a launch's sizes, so AddressSanitizer reports any access outside them. Usage: partial_sum_emulate ROWS N
// SEG_ROWS DIR: reads DIR/part.bin (ROWS x N fp32), writes DIR/out.bin (one row of OUT_CODE's dtype a segment).
#define STRICTNORM_EMULATED 1
#include "shim.h"
#include "host.h"
#include "partial_sum.cu"
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: partial_sum_emulate ROWS N SEG_ROWS DIR\n"); return 2; }
    const long long rows = atoll(argv[1]), seg_rows = atoll(argv[3]);
    const int n = atoi(argv[2]);
    const std::string dir = argv[4];
    const long long segments = (rows + seg_rows - 1) / seg_rows;
    auto* part = buffer<float>(rows * n);
    auto* out = buffer<out_t>(segments * n);
    load_file(dir + "/part.bin", part, rows * n * 4);
    gridDim = {static_cast<unsigned>((n + SUM_COLS - 1) / SUM_COLS), static_cast<unsigned>(segments), 1};
    EmuBlock blk(SUM_THREADS, 0);
    for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            std::vector<std::thread> ts;
            for (int t = 0; t < SUM_THREADS; ++t)
                ts.emplace_back([&, bx, by, t] {
                    emu_enter(blk, bx, t);
                    blockIdx.y = by;
                    partial_sum(part, rows, n, seg_rows, out);
                });
            for (auto& th : ts) th.join();
        }
    save_file(dir + "/out.bin", out, segments * n * sizeof(out_t));
    printf("summed %lld x %d in %lld segments\n", rows, n, segments);
    return 0;
}
