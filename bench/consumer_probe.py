"""The fold consumer's own pace: one warp folding shared-memory rows with nothing else running, in cycles a row.

Each variant folds 8 columns (lane % 8) of rows already in shared memory, 64 passes over 1024 rows, timed with the
SM's cycle counter around the loop, so that what a consumer loop costs beyond the chain of dependent adds
(the floor: one add's latency a row) shows without memory, producers or barriers waiting on it:
  chain        the adds alone, addends in registers
  column       fold.cu's fold_column over a column's rows (16-byte loads, each block's loads before the last's adds)
  stages256    the same cut into stages of 256 rows, each fully unrolled (fold_stream's consumer before SEAMLESS)
  stages256mb  the same with an mbarrier arrive and a wait on a completed phase a stage (fold_stream's handshakes)
  rowmajor     a row-major stage, one 4-byte load a row, unrolled by 16 (fold_ring's plain consumer)
  column+sts   column, while six warps on the other three SM sub-partitions store to shared memory without pause
  column+ldg   column, while those warps stream 16-byte global loads into shared memory (as fold_stream's converters)
Run on the GPU machine: python3 bench/consumer_probe.py [out.json]
"""

from __future__ import annotations

import json
import sys

import numpy as np

ROWS, PASSES, THREADS = 1024, 64, 256
VARIANTS = ("chain", "column", "stages256", "stages256mb", "rowmajor", "column+sts", "column+ldg")

_PROBE = r"""
#include "fold.cu"
constexpr int PROBE_STRIDE = PROBE_ROWS + 4;
extern "C" __global__ void probe(float* out, unsigned long long* cycles, int passes, const float4* src,
                                 long long src_mask) {
    extern __shared__ __align__(16) float buf[];  // 8 columns x PROBE_STRIDE (rowmajor: PROBE_ROWS x 8)
    __shared__ unsigned long long bar;
    __shared__ float scratch[6][16 * 33];  // the busy warps' stores (static + dynamic: under 48 KB)
    __shared__ volatile int done;
    for (int i = threadIdx.x; i < 8 * PROBE_STRIDE; i += blockDim.x)
        buf[i] = __uint_as_float(0x3f800000u | ((i * 2654435761u) >> 9));  // in [1, 2), never zero
    if (threadIdx.x == 0) mbar_init(&bar, 32), done = 0;
    __syncthreads();
    const int warp = threadIdx.x / 32;
#if VARIANT >= 5
    if (warp > 0 && warp % 4 != 0) {  // busy on sub-partitions 1-3 until the consumer is done
        const int b = warp - 1 - warp / 4, l = threadIdx.x % 32;
        float* mine = scratch[b];
        long long at = (static_cast<long long>(b) * 32 + l) * 8;
        float v = l;
        while (!done) {
#if VARIANT == 6
            float4 q[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) q[k] = src[(at + k * 6 * 32 * 8) & src_mask];
            at = (at + 4 * 6 * 32 * 8) & src_mask;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                mine[(4 * k) * 33 + l] = q[k].x, mine[(4 * k + 1) * 33 + l] = q[k].y;
                mine[(4 * k + 2) * 33 + l] = q[k].z, mine[(4 * k + 3) * 33 + l] = q[k].w;
            }
#else
#pragma unroll
            for (int k = 0; k < 16; ++k) mine[k * 33 + l] = v + k;
            v = v + 1.0f;
#endif
        }
        __syncwarp();
        out[32 + b] = mine[(l % 16) * 33 + (l + 1) % 32];  // the stores are read: none is dropped as dead
        return;
    }
#endif
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
#elif VARIANT == 1 || VARIANT >= 5
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
    done = 1;
    out[lane] = acc;
    if (lane == 0) cycles[0] = t1 - t0;
}
"""


def compile_variant(variant: int, arch: str) -> bytes:
    """The probe kernel of VARIANTS[variant], compiled by NVRTC for arch (e.g. "sm_90"; no GPU needed)."""
    from strictnorm.backends.cuda.nvrtc import compile_source

    defines = {"A_CODE": 0, "B_CODE": 0, "WHAT": 0, "SIMPLE_ROWS": 1, "VARIANT": variant, "PROBE_ROWS": ROWS}
    return compile_source(_PROBE, "consumer_probe", arch, defines)


def main() -> None:
    import torch
    from cuda.core import Device, LaunchConfig, ObjectCode, launch

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    major, minor = dev.compute_capability
    clock_khz = torch.cuda.get_device_properties(0).clock_rate if hasattr(torch.cuda.get_device_properties(0),
                                                                          "clock_rate") else 0
    out = torch.empty(64, device="cuda")
    cycles = torch.zeros(1, dtype=torch.int64, device="cuda")
    src = torch.randn(64 << 20, device="cuda")  # 256 MB (a power of two: 16-byte loads masked) past L2
    shmem = 8 * (ROWS + 4) * 4
    results = []
    for v, name in enumerate(VARIANTS):
        kernel = ObjectCode.from_cubin(compile_variant(v, f"sm_{major}{minor}")).get_kernel("probe")
        config = LaunchConfig(grid=1, block=THREADS, shmem_size=shmem)
        per_row = []
        for _ in range(5):
            launch(stream, config, kernel, out.data_ptr(), cycles.data_ptr(), np.int32(PASSES), src.data_ptr(),
                   np.int64(src.numel() // 4 - 1))
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
