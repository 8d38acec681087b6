// strictnorm: RMSNorm forward (and fused residual add) with the contract's exact bits.
//
// Each row is handled by ROW_THREADS threads; thread t owns the contiguous, aligned chunk of CHUNK
// lanes [t*CHUNK, (t+1)*CHUNK) of the row padded to P = ROW_THREADS*CHUNK lanes (zeros past N).
// canon_sum is then, exactly: the in-thread pairwise tree over the chunk, xor-shuffles with
// offsets 1, 2, 4, 8, 16 (adjacent
// threads first), and a pairwise tree over the row's warps. No lane past P exists, so no extra
// +0.0 ever touches a sum. Every operation is a single rounded IEEE op (__fadd_rn, __fmul_rn,
// __fdiv_rn, __fsqrt_rn); the loader also disables contraction and flush-to-zero.
//
// Macros: XC, RC, NC, WC, YC (dtype codes of x, residual, the norm input z, weight, y), MODE
// (0 llama, 1 gemma, 2 none), HAS_W, PER_HEAD, HAS_RES, CHUNK (lanes per thread), ROW_THREADS,
// ROWS_PER_BLOCK.
#include "common.cuh"

typedef Elem<XC>::T x_t;
typedef Elem<RC>::T r_t;
typedef Elem<NC>::T n_t;
typedef Elem<WC>::T w_t;
typedef Elem<YC>::T y_t;
constexpr int THREADS = ROW_THREADS * ROWS_PER_BLOCK;
constexpr int WARP_SIZE = 32;

// Loads lanes [0, CHUNK) of a chunk, widened; lanes at or past `valid` read as +0.0. 16-byte vector
// loads when the chunk is whole and `aligned` (pointer and strides checked by the host).
template <int CODE>
__device__ __forceinline__ void load_chunk(float* out, const typename Elem<CODE>::T* p, int valid, bool aligned) {
    typedef typename Elem<CODE>::T t;
    constexpr int PER = 16 / sizeof(t);
    if constexpr (CHUNK % PER == 0) {
        if (aligned && valid == CHUNK) {
#pragma unroll
            for (int k = 0; k < CHUNK / PER; ++k) {
                const uint4 u = reinterpret_cast<const uint4*>(p)[k];
                const t* e = reinterpret_cast<const t*>(&u);
#pragma unroll
                for (int j = 0; j < PER; ++j) out[k * PER + j] = Elem<CODE>::widen(e[j]);
            }
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = i < valid ? Elem<CODE>::widen(p[i]) : 0.0f;
}

template <int CODE>
__device__ __forceinline__ void store_chunk(typename Elem<CODE>::T* p, const float* v, int valid, bool aligned) {
    typedef typename Elem<CODE>::T t;
    constexpr int PER = 16 / sizeof(t);
    if constexpr (CHUNK % PER == 0) {
        if (aligned && valid == CHUNK) {
#pragma unroll
            for (int k = 0; k < CHUNK / PER; ++k) {
                uint4 u;
                t* e = reinterpret_cast<t*>(&u);
#pragma unroll
                for (int j = 0; j < PER; ++j) e[j] = Elem<CODE>::narrow(v[k * PER + j]);
                reinterpret_cast<uint4*>(p)[k] = u;
            }
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < CHUNK; ++i)
        if (i < valid) p[i] = Elem<CODE>::narrow(v[i]);
}

// Pairwise adjacent-first tree over the chunk: level by level, lanes (2j, 2j+1) -> j. A template
// recursion, so that every index is a compile-time constant and the chunk stays in registers.
template <int WIDTH>
__device__ __forceinline__ float chunk_tree(float* v) {
    if constexpr (WIDTH == 1) {
        return v[0];
    } else {
#pragma unroll
        for (int j = 0; j < WIDTH / 2; ++j) v[j] = __fadd_rn(v[2 * j], v[2 * j + 1]);
        return chunk_tree<WIDTH / 2>(v);
    }
}

// Sum of one value per thread over the ROW_THREADS threads of a row, adjacent threads first;
// every thread of the row gets the total. All threads of the block must call it (it may synchronize).
__device__ __forceinline__ float row_tree(float v, float* scratch) {
    constexpr int IN_WARP = ROW_THREADS < WARP_SIZE ? ROW_THREADS : WARP_SIZE;
#pragma unroll
    for (int off = 1; off < IN_WARP; off <<= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
    if constexpr (ROW_THREADS > WARP_SIZE) {
        constexpr int WARPS_PER_ROW = ROW_THREADS / WARP_SIZE;
        const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
        __syncthreads();  // scratch may still be read by a previous call
        if (lane == 0) scratch[warp] = v;
        __syncthreads();
        // lanes [0, WARPS_PER_ROW) take the row's warp sums; xor offsets below WARPS_PER_ROW never
        // mix them with the other lanes, which only combine zeros among themselves
        float u = lane < WARPS_PER_ROW ? scratch[(warp / WARPS_PER_ROW) * WARPS_PER_ROW + lane] : 0.0f;
#pragma unroll
        for (int off = 1; off < WARPS_PER_ROW; off <<= 1) u = __fadd_rn(u, __shfl_xor_sync(0xffffffffu, u, off));
        v = __shfl_sync(0xffffffffu, u, 0);
    }
    return v;
}

// The normalized value as y's scaling step uses it (contract, forward step 3).
__device__ __forceinline__ float normalized(float x, float rstd) {
#if MODE == 1
    return __fmul_rn(x, rstd);
#elif MODE == 0
    return round_f32<NC>(__fmul_rn(x, rstd));
#else
    return round_f32<NC>(__fmul_rn(x, round_f32<NC>(rstd)));
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS) rms_fwd(
    const x_t* __restrict__ x, long long xs0, long long xs1, long long xsg,
    const r_t* __restrict__ res, long long rs0, long long rs1, long long rsg, n_t* __restrict__ z,
    const w_t* __restrict__ w, long long wsg, y_t* __restrict__ y, float* __restrict__ rstd_out,
    long long rows, int n, long long r1, long long g, float eps, float offset, int aligned) {
    __shared__ float scratch[THREADS / WARP_SIZE + 1];
    const int t = threadIdx.x % ROW_THREADS;
    const long long row = static_cast<long long>(blockIdx.x) * ROWS_PER_BLOCK + threadIdx.x / ROW_THREADS;
    const bool live = row < rows;
    const long long r = live ? row : 0;
    const int c0 = t * CHUNK;
    const int valid = live ? max(0, min(CHUNK, n - c0)) : 0;

    float v[CHUNK];
    load_chunk<XC>(v, x + row_offset(r, Layout{xs0, xs1, xsg, r1, g}) + c0, valid, aligned);
#if HAS_RES
    float rv[CHUNK];
    load_chunk<RC>(rv, res + row_offset(r, Layout{rs0, rs1, rsg, r1, g}) + c0, valid, aligned);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) v[i] = round_f32<NC>(__fadd_rn(v[i], rv[i]));
    store_chunk<NC>(z + r * n + c0, v, valid, aligned);
#endif
    float sq[CHUNK];
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) sq[i] = __fmul_rn(v[i], v[i]);
    const float ss = row_tree(chunk_tree<CHUNK>(sq), scratch);
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(n)), eps)));
    if (live && t == 0) rstd_out[row] = rstd;

    float out[CHUNK];
#if HAS_W
    float wf[CHUNK];
    const long long wrow = PER_HEAD ? r % g : 0;
    load_chunk<WC>(wf, w + wrow * wsg + c0, valid, aligned);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
        wf[i] = __fadd_rn(wf[i], offset);  // the offset is added in fp32
#if MODE == 2
        wf[i] = round_f32<NC>(wf[i]);
#endif
    }
#endif
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
        out[i] = normalized(v[i], rstd);
#if HAS_W
        out[i] = __fmul_rn(out[i], wf[i]);
#if MODE == 2
        out[i] = round_f32<NC>(out[i]);
#endif
#endif
    }
    store_chunk<YC>(y + r * n + c0, out, valid, aligned);
}
