// strictnorm: the fast dW's sum of fp32 partial rows (R, N) -> (N,), in one fixed order (deterministic; not the
// strict fold, which fold.cu computes from the rows themselves).
//
// Block (x, s) sums columns [x * SUM_COLS, (x + 1) * SUM_COLS) of the rows [s * seg_rows, (s + 1) * seg_rows) of its
// segment: thread (group, lane) adds rows start + group, start + group + GROUPS, ... of VEC adjacent columns (16-byte
// loads with VEC = 4), each column its own left fold from +0.0; then each column's GROUPS group sums are added in
// group order, from +0.0, and stored as row s of the output (rounded once to OUT_CODE's dtype). With several
// segments the host sums the segment rows again with one segment. Rows are dense (row r at r * n), 16-byte aligned
// with VEC = 4 (then N % 4 == 0). Nothing is read before wait_prerequisites: a launch with programmatic stream
// serialization may start this grid before the one writing `part` has finished.
//
// Macros: SUM_COLS, SUM_THREADS, VEC (1 or 4), OUT_CODE (default fp32).
#include "common.cuh"

#ifndef OUT_CODE
#define OUT_CODE 0
#endif
typedef Elem<OUT_CODE>::T out_t;
constexpr int LANES = SUM_COLS / VEC;  // threads across a row segment of the block's columns
constexpr int GROUPS = SUM_THREADS / LANES;  // rows in flight at once
static_assert(SUM_COLS % VEC == 0 && SUM_THREADS % LANES == 0 && SUM_THREADS >= SUM_COLS, "block shape");

extern "C" __global__ void __launch_bounds__(SUM_THREADS) partial_sum(const float* __restrict__ part, long long rows,
                                                                       int n, long long seg_rows,
                                                                       out_t* __restrict__ out) {
    __shared__ float sums[GROUPS][SUM_COLS];
    wait_prerequisites();  // launched as a dependent of the backward: its partial rows first (common.cuh)
    const int lane = threadIdx.x % LANES, group = threadIdx.x / LANES;
    const int col = blockIdx.x * SUM_COLS + lane * VEC;
    const long long start = static_cast<long long>(blockIdx.y) * seg_rows;
    const long long end = start + seg_rows < rows ? start + seg_rows : rows;
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    if (col < n) {  // with VEC = 4 and N % 4 == 0, all four columns
        const float* p = part + col;
#pragma unroll 4
        for (long long r = start + group; r < end; r += GROUPS) {
            float val[VEC];
            if constexpr (VEC == 4) {
                const float4 q = *reinterpret_cast<const float4*>(p + r * n);
                val[0] = q.x, val[1] = q.y, val[2] = q.z, val[3] = q.w;
            } else {
                val[0] = p[r * n];
            }
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], val[v]);
        }
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) sums[group][lane * VEC + v] = acc[v];
    __syncthreads();
    if (threadIdx.x < SUM_COLS) {
        const int c = blockIdx.x * SUM_COLS + threadIdx.x;
        float s = 0.0f;
#pragma unroll 8
        for (int g = 0; g < GROUPS; ++g) s = __fadd_rn(s, sums[g][threadIdx.x]);
        if (c < n) out[static_cast<long long>(blockIdx.y) * n + c] = Elem<OUT_CODE>::narrow(s);
    }
}
