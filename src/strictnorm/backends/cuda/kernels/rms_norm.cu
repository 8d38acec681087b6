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
// ROWS_PER_BLOCK; BACKWARD selects the backward kernel (below) instead of the forward.
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

#ifndef BACKWARD
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
#endif  // !BACKWARD

#ifdef BACKWARD
// Backward: dx = rd((g - xh * c) * rstd [+ f32(dres)], NC) per row with g = f32(dy) * wf,
// xh = z * rstd, c = canon_sum(xh * g) / N (contract, backward). Blocks stride over the rows; with
// DW_PARTIALS each row slot of a block also sums its rows' dW contributions (in row order) into
// dw_part[slot], reduced afterwards in a fixed order ("fast" dW). dx may alias dy (in place): each
// thread reads its lanes of dy before it writes them.
// Extra macros: DYC (dy's dtype code), HAS_DRES, DW_PARTIALS.
typedef Elem<DYC>::T dy_t;

extern "C" __global__ void __launch_bounds__(THREADS) rms_bwd(
    const dy_t* dy, long long ds0, long long ds1, long long dsg,
    const n_t* __restrict__ zin, long long zs0, long long zs1, long long zsg,
    const w_t* __restrict__ w, long long wsg, const float* __restrict__ rstd_in,
    const n_t* __restrict__ dres, long long es0, long long es1, long long esg,
    n_t* dx, long long xs0, long long xs1, long long xsg, float* __restrict__ dw_part,
    long long rows, int n, long long r1, long long g, float offset, int aligned) {
    __shared__ float scratch[THREADS / WARP_SIZE + 1];
    const int t = threadIdx.x % ROW_THREADS;
    const int slot = threadIdx.x / ROW_THREADS;
    const int c0 = t * CHUNK;
    float wf[CHUNK];
#if DW_PARTIALS
    float dw_acc[CHUNK];
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) dw_acc[i] = 0.0f;
#endif
    const long long stride = static_cast<long long>(gridDim.x) * ROWS_PER_BLOCK;
    // every thread runs the same number of iterations (row_tree synchronizes the block)
    const long long iters = (rows + stride - 1) / stride;
    for (long long k = 0; k < iters; ++k) {
        const long long row = k * stride + static_cast<long long>(blockIdx.x) * ROWS_PER_BLOCK + slot;
        const bool live = row < rows;
        const long long r = live ? row : 0;
        const int valid = live ? max(0, min(CHUNK, n - c0)) : 0;
        float x[CHUNK], d[CHUNK];
        load_chunk<NC>(x, zin + row_offset(r, Layout{zs0, zs1, zsg, r1, g}) + c0, valid, aligned);
        load_chunk<DYC>(d, dy + row_offset(r, Layout{ds0, ds1, dsg, r1, g}) + c0, valid, aligned);
        const float rstd = live ? rstd_in[r] : 0.0f;
#if HAS_W
        const long long wrow = PER_HEAD ? r % g : 0;
        load_chunk<WC>(wf, w + wrow * wsg + c0, valid, aligned);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            wf[i] = __fadd_rn(wf[i], offset);
#if MODE == 2
            wf[i] = round_f32<NC>(wf[i]);
#endif
        }
#endif
        float xh[CHUNK], gr[CHUNK], prod[CHUNK];
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            xh[i] = __fmul_rn(x[i], rstd);
#if HAS_W
            gr[i] = __fmul_rn(d[i], wf[i]);
#else
            gr[i] = d[i];
#endif
            prod[i] = __fmul_rn(xh[i], gr[i]);
        }
        const float c = __fdiv_rn(row_tree(chunk_tree<CHUNK>(prod), scratch), static_cast<float>(n));
        float out[CHUNK];
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = __fmul_rn(__fsub_rn(gr[i], __fmul_rn(xh[i], c)), rstd);
#if HAS_DRES
        float e[CHUNK];
        load_chunk<NC>(e, dres + row_offset(r, Layout{es0, es1, esg, r1, g}) + c0, valid, aligned);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = __fadd_rn(out[i], e[i]);
#endif
        store_chunk<NC>(dx + row_offset(r, Layout{xs0, xs1, xsg, r1, g}) + c0, out, valid, aligned);
#if DW_PARTIALS
        if (live) {
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) dw_acc[i] = __fadd_rn(dw_acc[i], __fmul_rn(d[i], normalized(x[i], rstd)));
        }
#endif
    }
#if DW_PARTIALS
    const long long part_row = static_cast<long long>(blockIdx.x) * ROWS_PER_BLOCK + slot;
    const int cols = max(0, min(CHUNK, n - c0));
#pragma unroll
    for (int i = 0; i < CHUNK; ++i)
        if (i < cols) dw_part[part_row * n + c0 + i] = dw_acc[i];
#endif
}
#endif  // BACKWARD
