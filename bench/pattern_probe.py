"""How fast the strict dW fold's access pattern can be read at all: a column stripe a CTA, every row of it.

fold_stream's converters read dy and x (bf16, rows N apart) in stripes of COLS columns a CTA (32 at 4096 columns:
64 bytes of each row, 128 CTAs), and at 32768 x 4096 the fold moves 2.79 TB/s with DRAM at 58% of its peak and the L2
at 77% of its throughput (run 24, ncu), its converters stalled right after their own loads (run 25). This probe reads
the same bytes in the same stripes with nothing else to do (no conversion, no shared memory, no consumer): each lane
issues DEPTH 16-byte loads of dy and DEPTH of x (consecutive lanes the chunks of a row segment, then the next rows),
folds them into an xor it never stores, and goes on. If its best rate is the fold's, the pattern (64-byte row segments
per CTA) is the limit and the next step is a different mapping of rows and columns to CTAs; if it reaches the copy
rate, the converters' structure is.
    python3 bench/pattern_probe.py [out.json]
PATTERN_SHAPES=MxN,... (default 32768x4096,8192x8192), PATTERN_COLS (default 16,32,64,N: N = whole rows a CTA, its
rows split over the CTAs), PATTERN_WARPS (4,8,16), PATTERN_DEPTH (4,8,16), PATTERN_RING (default 0: loads into
registers; k > 0: stripe_stage, cp.async copies into k shared-memory slots a warp, then read from there; shapes whose
slots exceed the device's shared memory are left out). Kernel-only µs, GB/s of the bytes read.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from strictnorm.backends.cuda import nvrtc
from strictnorm.bench import Timer, copy_ceiling_gbps

SOURCE = r"""
#include "async.cuh"  // cp_async16, cp_async_commit, cp_async_wait (stripe_stage)
// CTA (x, y) reads column chunks [x * STRIPE, (x + 1) * STRIPE) (16-byte chunks) of rows [y * rows / gridDim.y, ...)
// of a and b, as items of one 16-byte load a lane: item i is chunk group i % GROUPS of row group i / GROUPS (lane l:
// chunk l % LANES_PER_ROW of the group, row l / LANES_PER_ROW of the group), so that consecutive items run along a
// row's segment first (whole rows: a copy's pattern) and a stripe of 32 or fewer chunks is fold_stream's (a row
// group's segments at once). A warp takes DEPTH consecutive items an iteration, its loads of a and b all issued
// before any is used; the warps of a CTA take turns.
constexpr int LANES_PER_ROW = STRIPE < 32 ? STRIPE : 32;
constexpr int ROWS_PER_LOAD = 32 / LANES_PER_ROW;
constexpr int GROUPS = STRIPE / LANES_PER_ROW;  // chunk groups a row segment
// A 16-byte read-only load and the xor that uses it, both kept in program order (asm volatile), so that all of an
// iteration's loads issue before the first use: with plain C++ ptxas moved each load next to its use, about two a
// lane in flight whatever DEPTH (run 26's SASS).
__device__ __forceinline__ uint4 load16(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned xor16(unsigned acc, uint4 v) {
    unsigned r;
    asm volatile("{\n.reg .b32 t;\nxor.b32 t, %1, %2;\nxor.b32 t, t, %3;\nxor.b32 t, t, %4;\nxor.b32 %0, t, %5;\n}"
                 : "=r"(r) : "r"(acc), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
    return r;
}
// Item i's chunk for this lane, counted in 16-byte chunks from the tensor's start; in: whether the item exists.
__device__ __forceinline__ long long item_chunk(long long i, long long r_begin, long long r_end, long long items,
                                                long long row_chunks, long long col0, int lane, bool& in) {
    const long long r = r_begin + i / GROUPS * ROWS_PER_LOAD + lane / LANES_PER_ROW;
    in = i < items && r < r_end;
    return in ? r * row_chunks + col0 + i % GROUPS * LANES_PER_ROW : 0;
}
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) stripe_read(const uint4* __restrict__ a,
                                                                    const uint4* __restrict__ b, long long rows,
                                                                    long long row_chunks, unsigned* __restrict__ out) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const long long r_begin = rows * blockIdx.y / gridDim.y, r_end = rows * (blockIdx.y + 1) / gridDim.y;
    const long long items = (r_end - r_begin + ROWS_PER_LOAD - 1) / ROWS_PER_LOAD * GROUPS;
    const long long col0 = static_cast<long long>(blockIdx.x) * STRIPE + lane % LANES_PER_ROW;
    unsigned acc = 0;
    for (long long i0 = static_cast<long long>(warp) * DEPTH; i0 < items; i0 += static_cast<long long>(WARPS) * DEPTH) {
        uint4 va[DEPTH], vb[DEPTH];
#pragma unroll
        for (int k = 0; k < DEPTH; ++k) {
            bool in;
            const long long at = item_chunk(i0 + k, r_begin, r_end, items, row_chunks, col0, lane, in);
            va[k] = load16(a + at);  // chunk 0 where the item does not exist (in range; its bytes xor twice: no effect)
            vb[k] = load16(b + at);
            if (!in) vb[k] = va[k];
        }
        __syncwarp();  // a scheduling barrier for ptxas: every load above issues before any use below
#pragma unroll
        for (int k = 0; k < DEPTH; ++k)
            acc = xor16(xor16(acc, va[k]), vb[k]);
    }
    if (acc == 0x9e3779b9u) out[threadIdx.x] = acc;  // practically never: keeps the loads
}

// The same items staged through shared memory: each warp keeps RING slots of DEPTH items (a and b) of its own, fills
// them with 16-byte cp.async copies (LDGSTS: no register holds a byte in flight), and reads a slot (16-byte shared
// loads, as a converter would before converting) once its copies have landed, then fills it again RING iterations
// ahead. Bytes in flight a warp: up to RING * DEPTH * 1 KB, against DEPTH * 1 KB in registers above.
#ifdef RING
extern "C" __global__ void __launch_bounds__(WARPS * 32) stripe_stage(const uint4* __restrict__ a,
                                                                     const uint4* __restrict__ b, long long rows,
                                                                     long long row_chunks, unsigned* __restrict__ out) {
    extern __shared__ __align__(16) uint4 ring[];  // [WARPS][RING][2][DEPTH][32]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint4* mine = ring + static_cast<long long>(warp) * RING * 2 * DEPTH * 32;
    const long long r_begin = rows * blockIdx.y / gridDim.y, r_end = rows * (blockIdx.y + 1) / gridDim.y;
    const long long items = (r_end - r_begin + ROWS_PER_LOAD - 1) / ROWS_PER_LOAD * GROUPS;
    const long long col0 = static_cast<long long>(blockIdx.x) * STRIPE + lane % LANES_PER_ROW;
    const long long step = static_cast<long long>(WARPS) * DEPTH;
    // iteration t's items into slot t % RING (an empty commit group past the end keeps the wait's count right)
    auto fill = [&](long long t) {
        const long long i0 = static_cast<long long>(warp) * DEPTH + t * step;
        uint4* slot = mine + (t % RING) * 2 * DEPTH * 32;
#pragma unroll
        for (int k = 0; k < DEPTH; ++k) {
            bool in;
            const long long at = item_chunk(i0 + k, r_begin, r_end, items, row_chunks, col0, lane, in);
            cp_async16(slot + k * 32 + lane, a + at, in ? 16 : 0);
            cp_async16(slot + (DEPTH + k) * 32 + lane, b + at, in ? 16 : 0);
        }
        cp_async_commit();
    };
    const long long iterations = (items - static_cast<long long>(warp) * DEPTH + step - 1) / step;
    for (int t = 0; t < RING - 1; ++t) fill(t);
    unsigned acc = 0;
    for (long long t = 0; t < iterations; ++t) {
        fill(t + RING - 1);
        cp_async_wait<RING - 1>();  // iteration t's copies (this lane's) landed
        const uint4* slot = mine + (t % RING) * 2 * DEPTH * 32;
#pragma unroll
        for (int k = 0; k < 2 * DEPTH; ++k) {
            const uint4 v = slot[k * 32 + lane];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    if (acc == 0x9e3779b9u) out[threadIdx.x] = acc;
}
#endif
"""


def _ints(var: str, default: str) -> list[str]:
    return [v for v in os.environ.get(var, default).split(",") if v]


def compile_probe(stripe: int, warps: int, depth: int, arch: str = "sm_90", ring: int = 0) -> bytes:
    """The probe's cubin for one configuration (NVRTC; no GPU needed); ring > 0 adds stripe_stage with that many
    slots a warp."""
    defines = {"STRIPE": stripe, "WARPS": warps, "DEPTH": depth} | ({"RING": ring} if ring else {})
    return nvrtc.compile_source(SOURCE, "pattern_probe", arch, defines)


def ring_bytes(warps: int, depth: int, ring: int) -> int:
    """stripe_stage's shared memory: RING slots of DEPTH 16-byte items of a and b for every lane of every warp."""
    return warps * ring * 2 * depth * 32 * 16


def main() -> None:
    from cuda.core import Device, ObjectCode

    dev = torch.device("cuda")
    timer = Timer(dev, iters=9)
    ceiling = copy_ceiling_gbps(dev)
    cdev = Device(torch.cuda.current_device())
    cdev.set_current()
    major, minor = cdev.compute_capability
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.zeros(1024, dtype=torch.int32, device=dev)
    smem_optin = torch.cuda.get_device_properties(dev).shared_memory_per_block_optin
    rows_out = []
    for shape in _ints("PATTERN_SHAPES", "32768x4096,8192x8192"):
        m, n = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        a, b = (torch.randn(m, n, device=dev, generator=g).bfloat16() for _ in range(2))
        row_chunks = n * 2 // 16
        for cols_text in _ints("PATTERN_COLS", "16,32,64,N"):
            cols = n if cols_text == "N" else int(cols_text)
            stripe = cols * 2 // 16  # 16-byte chunks a CTA's row segment
            stripes = row_chunks // stripe
            splits = max(1, -(-sms // stripes)) if cols == n else 1  # whole rows: the rows split over the SMs
            for warps in (int(v) for v in _ints("PATTERN_WARPS", "4,8,16")):
                for depth in (int(v) for v in _ints("PATTERN_DEPTH", "4,8,16")):
                    for ring in (int(v) for v in _ints("PATTERN_RING", "0")):
                        shmem = ring_bytes(warps, depth, ring)
                        if shmem > smem_optin:
                            continue
                        cubin = compile_probe(stripe, warps, depth, f"sm_{major}{minor}", ring)
                        module = ObjectCode.from_cubin(cubin, name="pattern_probe")
                        kernel = nvrtc.LoadedKernel(module,
                                                    module.get_kernel("stripe_stage" if ring else "stripe_read"))
                        if shmem > 48 * 1024:
                            kernel.allow_dynamic_shared(shmem)
                        stream = nvrtc.current_stream(torch.cuda.current_device())
                        args = (a.data_ptr(), b.data_ptr(), m, row_chunks, out.data_ptr())

                        def run(k=kernel, s=stream, grid=(stripes, splits, 1), block=warps * 32, shmem=shmem,
                                args=args):
                            k.launch(s, grid, block, shmem, *args)

                        us = timer.kernel_us(run)
                        gbps = 2 * a.numel() * 2 / us / 1e3
                        row = {"M": m, "N": n, "cols": cols, "ctas": stripes * splits, "warps": warps,
                               "depth": depth, "ring": ring, "us": us, "GBps": gbps, "frac_copy": gbps / ceiling}
                        rows_out.append(row)
                        print(json.dumps(row), flush=True)
    print(f"\ncopy ceiling {ceiling:.0f} GB/s (read + write); reads of dy and x, bf16 (ring 0: into registers):")
    print(f"{'M x N':>12} {'cols':>5} {'CTAs':>5} {'warps':>5} {'depth':>5} {'ring':>4} {'us':>8} {'GB/s':>7}"
          f" {'of copy':>7}")
    for r in rows_out:
        print(f"{r['M']:>6}x{r['N']:<5} {r['cols']:5d} {r['ctas']:5d} {r['warps']:5d} {r['depth']:5d} {r['ring']:4d}"
              f" {r['us']:8.1f} {r['GBps']:7.0f} {r['frac_copy']:7.2f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": ceiling, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
