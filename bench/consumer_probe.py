"""The fold consumer's own pace: one warp folding shared-memory rows with nothing else running, in cycles a row.

Each variant folds 8 columns (lane % 8) of rows already in shared memory, 64 passes over 1024 rows, timed with the
SM's cycle counter around the loop, so that what a consumer loop costs beyond the chain of dependent adds
(the floor: one add's latency a row) shows without memory, producers or barriers waiting on it:
  chain        the adds alone, addends in registers
  column       fold.cu's fold_column over a column's rows (16-byte loads, each block's loads before the last's adds)
  stages256    the same cut into stages of 256 rows, each fully unrolled (fold_stream's consumer before SEAMLESS)
  stages256mb  the same with an mbarrier arrive and a wait on a completed phase a stage (fold_stream's handshakes)
  rowmajor     a row-major stage, one 4-byte load a row, unrolled by 16 (fold_ring's plain consumer)
Run on the GPU machine: python3 bench/consumer_probe.py [out.json]
"""

from __future__ import annotations

import json
import sys

import numpy as np

ROWS, PASSES, THREADS = 1024, 64, 256
VARIANTS = ("chain", "column", "stages256", "stages256mb", "rowmajor")

_PROBE = r"""
#include "fold.cu"
constexpr int PROBE_STRIDE = PROBE_ROWS + 4;
extern "C" __global__ void probe(float* out, unsigned long long* cycles, int passes) {
    extern __shared__ __align__(16) float buf[];  // 8 columns x PROBE_STRIDE (rowmajor: PROBE_ROWS x 8)
    __shared__ unsigned long long bar;
    for (int i = threadIdx.x; i < 8 * PROBE_STRIDE; i += blockDim.x)
        buf[i] = __uint_as_float(0x3f800000u | ((i * 2654435761u) >> 9));  // in [1, 2), never zero
    if (threadIdx.x == 0) mbar_init(&bar, 32);
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x, c = lane % 8;
    const float* col = buf + c * PROBE_STRIDE;
    float acc = 0.0f;
    float reg[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) reg[j] = col[j];
    __syncwarp();
    const unsigned long long t0 = clock64();
    for (int p = 0; p < passes; ++p) {
#if VARIANT == 0
        for (int r = 0; r < PROBE_ROWS; r += 32)
#pragma unroll
            for (int j = 0; j < 32; ++j) acc = __fadd_rn(acc, reg[j]);
#elif VARIANT == 1
        acc = fold_column<0>(acc, PROBE_ROWS, col);
#elif VARIANT == 2 || VARIANT == 3
        for (int s = 0; s < PROBE_ROWS / 256; ++s) {
            acc = fold_column<256>(acc, 256, col + s * 256);
#if VARIANT == 3
            mbar_arrive(&bar);
            mbar_wait(&bar, (p * (PROBE_ROWS / 256) + s) & 1);
#endif
        }
#else
        for (int s = 0; s < PROBE_ROWS / 256; ++s) {
            const float* stage = buf + s * 256 * 8;
#pragma unroll 16
            for (int i = 0; i < 256; ++i) acc = __fadd_rn(acc, stage[i * 8 + c]);
        }
#endif
    }
    const unsigned long long t1 = clock64();
    out[lane] = acc;
    if (lane == 0) cycles[0] = t1 - t0;
}
"""


def main() -> None:
    import torch
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch

    from strictnorm.backends.cuda.nvrtc import _BASE_OPTIONS, _kernel_dir

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    major, minor = dev.compute_capability
    clock_khz = torch.cuda.get_device_properties(0).clock_rate if hasattr(torch.cuda.get_device_properties(0),
                                                                          "clock_rate") else 0
    out = torch.empty(32, device="cuda")
    cycles = torch.zeros(1, dtype=torch.int64, device="cuda")
    shmem = 8 * (ROWS + 4) * 4
    results = []
    for v, name in enumerate(VARIANTS):
        defines = {"A_CODE": 0, "B_CODE": 0, "WHAT": 0, "SIMPLE_ROWS": 1, "VARIANT": v, "PROBE_ROWS": ROWS}
        options = ProgramOptions(arch=f"sm_{major}{minor}", define_macro=[(k, str(x)) for k, x in defines.items()],
                                 include_path=[str(_kernel_dir())], **_BASE_OPTIONS)
        kernel = Program(_PROBE, code_type="c++", options=options).compile("cubin").get_kernel("probe")
        config = LaunchConfig(grid=1, block=THREADS, shmem_size=shmem)
        per_row = []
        for _ in range(5):
            launch(stream, config, kernel, out.data_ptr(), cycles.data_ptr(), np.int32(PASSES))
            stream.sync()
            per_row.append(int(cycles.item()) / (ROWS * PASSES))
        results.append({"variant": name, "cycles_per_row": min(per_row), "runs": per_row})
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{'variant':>12} cycles/row (min of 5; SM clock {clock_khz / 1e6:.2f} GHz as reported)")
    for r in results:
        print(f"{r['variant']:>12} {r['cycles_per_row']:6.2f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"rows": ROWS, "passes": PASSES, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
