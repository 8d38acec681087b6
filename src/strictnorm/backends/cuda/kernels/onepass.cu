// strictnorm: the RMSNorm strict backward in one pass over x and dy (dx and the strict dW together).
//
// The two-pass strict backward reads x and dy twice (the dx pass, then the dW fold). Here a persistent
// grid of co-resident CTAs (cooperative launch) owns column groups of W_COLS columns each: a power of two
// dividing P = next_pow2(N), so a group's lanes are an aligned subtree of canon_sum's tree. Every CTA walks
// all rows in blocks of ROWS rows, in order. Per block i, iteration i of every CTA:
//   B. its columns of block i (landed in a ring of tiles): each row's subtree sum of p = xh * g over the
//      group (in-thread pairwise over a lane's CPL columns, then xor shuffles: the pairwise tree),
//      published to partials[i % SLOTS][row][group]; and, in other warps meanwhile, each of its columns' dW
//      contributions folded into that column's running sum, rows in order (one thread a column: the strict
//      left fold). Then the block's arrival count arrive1[i] goes up (after a fence).
//   C. combine block i - LAG1 once every group has arrived: CTA g takes rows g, g + G_DATA, ...: the row's
//      GROUPS subtree sums (groups without data: +0.0 leaves) in the tree's order, c = sum / N, published to
//      cvals[(i - LAG1) % SLOTS][row]; arrive2[i - LAG1] goes up.
//   D. dx of block i - LAG2 once arrive2 is complete: dx = rd((g - xh * c) * rstd) for its columns, from the
//      tile still in the ring.
//   A. cp.async of block i + DEPTH into the ring.
// Every wait is on an event of an earlier iteration (LAG2 > LAG1 > 0), so co-resident CTAs cannot deadlock.
// Slots are reused without further counters (SLOTS > LAG2): block i + SLOTS's partials are written at
// iteration i + SLOTS, after that CTA waited arrive2 of block i + SLOTS - 1 - LAG2 >= i (every CTA has
// combined block i); block i + SLOTS's c values are written after arrive1[i + SLOTS], which every CTA
// signals after its dx of block i.
//
// Same bits as the reference: the row sums are canon_sum's, c = sum / N, dx and the contributions are
// rms_norm.cu's and fold.cu's expressions, and each column's fold adds the rows in ascending order.
//
// Macros: DYC, NC, WC (dtype codes of dy, the norm input z, the weight), MODE (0 llama, 1 gemma, 2 none),
// HAS_W, W_COLS (columns a CTA: 32 * CPL, CPL in 1..8), GROUPS (P / W_COLS), G_DATA (groups holding
// columns: ceil(N / W_COLS)), ROWS (rows a block, a multiple of the warps), DEPTH, LAG1, LAG2, SLOTS,
// THREADS (256). Rows of dy, z and dx are 16-byte aligned with row strides ds, zs, xs (elements). Dynamic
// shared memory: TILES * TILE_BYTES + 4 * (W_COLS + ROWS) (backend.onepass_launch).
#include "common.cuh"
#include "async.cuh"

typedef Elem<DYC>::T dy_t;
typedef Elem<NC>::T n_t;
typedef Elem<WC>::T w_t;

constexpr int WARPS = THREADS / 32;
constexpr int CPL = W_COLS / 32;  // columns a lane holds in the row sums
constexpr int TILES = LAG2 + DEPTH + 1;  // ring slots: blocks i - LAG2 ... i + DEPTH
constexpr int DY_ROW = W_COLS * sizeof(dy_t), Z_ROW = W_COLS * sizeof(n_t);
constexpr int DY_TILE = ROWS * DY_ROW, Z_TILE = ROWS * Z_ROW;
constexpr int TILE_BYTES = DY_TILE + Z_TILE + ROWS * 4;
constexpr int LEAVES = GROUPS >= 32 ? GROUPS / 32 : 1;  // subtree sums a lane combines
// Phase B: warps below FOLD_WARPS fold the dW columns (one thread a column) while the others compute the row
// sums, unless the fold takes every warp (then all do both, one after the other).
constexpr int FOLD_WARPS = W_COLS / 32;
constexpr int SUM_WARP0 = FOLD_WARPS < WARPS ? FOLD_WARPS : 0;
constexpr int SUM_WARPS = WARPS - SUM_WARP0;
constexpr int FOLD_BATCH = 8;  // rows whose contributions are computed before their adds (off the chain)
static_assert(W_COLS % 32 == 0 && CPL <= 8 && W_COLS <= THREADS, "one lane per CPL columns, one thread a column");
static_assert(ROWS % WARPS == 0 && DY_ROW % 16 == 0 && Z_ROW % 16 == 0, "block shape");
static_assert(LAG1 >= 1 && LAG2 > LAG1 && SLOTS > LAG2 && DEPTH >= 1, "pipeline");

// A wait this long means CTAs that never arrive (a bug, or a grid not co-resident): trap (a launch error)
// rather than hang the device. (The CPU emulation, far slower, sets its own.)
#ifndef WAIT_LIMIT_NS
#define WAIT_LIMIT_NS 2000000000ull
#endif

__device__ __forceinline__ float gscale(float d, float wf) {
#if HAS_W
    return __fmul_rn(d, wf);
#else
    (void)wf;
    return d;
#endif
}

// The pairwise tree over COUNT * LANES values of a warp, lane l holding [l * COUNT, (l + 1) * COUNT): in-thread
// (pair_tree), then xor shuffles with offsets below LANES; lanes below LANES get the total. Overwrites v.
template <int COUNT, int LANES>
__device__ __forceinline__ float warp_pair_tree(float* v) {
    float s = pair_tree<COUNT>(v);
#pragma unroll
    for (int off = 1; off < LANES; off *= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
    return s;
}

// Every thread's writes fenced, then one thread, fencing again (a release for the whole block, as a grid
// barrier does), counts the CTA in once all have passed the barrier.
__device__ __forceinline__ void arrive(int* counter) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1);
    }
}

// One thread polls (acquire) until every CTA has arrived, fences, and releases the block at the barrier; the
// data behind the counter is then read through L2 (__ldcg).
__device__ __forceinline__ void wait_all(const int* counter) {
    if (threadIdx.x == 0) {
        const unsigned long long start = global_ns();
        while (load_acquire(counter) < G_DATA)
            if (global_ns() - start > WAIT_LIMIT_NS) __trap();
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS) strict_bwd_onepass(
    const dy_t* __restrict__ dy, long long ds, const n_t* __restrict__ z, long long zs, const w_t* __restrict__ w,
    const float* __restrict__ rstd, n_t* __restrict__ dx, long long xs, w_t* __restrict__ dw,
    float* __restrict__ partials, float* __restrict__ cvals, int* __restrict__ arrive1, int* __restrict__ arrive2,
    long long rows, int n, float offset) {
    extern __shared__ __align__(16) unsigned char onepass_smem[];
    const int grp = blockIdx.x, col0 = grp * W_COLS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long blocks = (rows + ROWS - 1) / ROWS;
    auto tile = [&](long long b) { return onepass_smem + (b % TILES) * TILE_BYTES; };
    struct TileView {  // block b's tile in the ring: its rows of dy and z (W_COLS columns each), their rstd
        const dy_t* dy;
        const n_t* z;
        const float* rstd;
    };
    auto view = [&](long long b) {
        const unsigned char* t = tile(b);
        return TileView{reinterpret_cast<const dy_t*>(t), reinterpret_cast<const n_t*>(t + DY_TILE),
                        reinterpret_cast<const float*>(t + DY_TILE + Z_TILE)};
    };
    auto live_rows = [&](long long b) { return static_cast<int>(rows - b * ROWS < ROWS ? rows - b * ROWS : ROWS); };
    auto issue = [&](long long b) {
        unsigned char* t = tile(b);
        constexpr int DYC_CH = DY_ROW / 16, ZC_CH = Z_ROW / 16, CH = DYC_CH > ZC_CH ? DYC_CH : ZC_CH;
        for (int i = threadIdx.x; i < ROWS * CH; i += THREADS) {
            const int r = i / CH, ch = i % CH;
            const long long row = b * ROWS + r;
            if (row >= rows) break;
            if (ch < DYC_CH) copy_chunk(t + r * DY_ROW + ch * 16, dy + row * ds, col0 + ch * (16 / int(sizeof(dy_t))), n);
            if (ch < ZC_CH)
                copy_chunk(t + DY_TILE + r * Z_ROW + ch * 16, z + row * zs, col0 + ch * (16 / int(sizeof(n_t))), n);
            if (ch == 0) cp_async4(t + DY_TILE + Z_TILE + r * 4, rstd + row);
        }
    };
    // the group's effective weight (read by the row sums and dx; written before the first block's barrier)
    float* wf = reinterpret_cast<float*>(onepass_smem + TILES * TILE_BYTES);
    float* cs = wf + W_COLS;  // the c values of the block in phase D, staged once from global memory
    for (int c = threadIdx.x; c < W_COLS; c += THREADS) {
        float v = 1.0f;
#if HAS_W
        if (col0 + c < n) {
            v = __fadd_rn(Elem<WC>::widen(w[col0 + c]), offset);
#if MODE == 2
            v = round_f32<NC>(v);
#endif
        }
#endif
        wf[c] = v;
    }
    const int my_col = col0 + static_cast<int>(threadIdx.x);
    float acc = 0.0f;  // the strict dW fold of column my_col (threads below W_COLS)

    for (int d = 0; d < DEPTH; ++d) {
        if (d < blocks) issue(d);
        cp_async_commit();
    }
    for (long long i = 0; i < blocks + LAG2; ++i) {
        if (i < blocks) {  // B: block i's row subtree sums and dW contributions
            cp_async_wait<DEPTH - 1>();
            __syncthreads();
            const TileView tv = view(i);
            const dy_t* tdy = tv.dy;
            const n_t* tz = tv.z;
            const float* tr = tv.rstd;
            const int live = live_rows(i);
            float* part = partials + (i % SLOTS) * ROWS * GROUPS;
            for (int r = warp - SUM_WARP0; warp >= SUM_WARP0 && r < live; r += SUM_WARPS) {
                const float rs = tr[r];
                float p[CPL];
#pragma unroll
                for (int j = 0; j < CPL; ++j) {
                    const int c = lane * CPL + j;
                    const float xh = __fmul_rn(Elem<NC>::widen(tz[r * W_COLS + c]), rs);
                    const float v = __fmul_rn(xh, gscale(Elem<DYC>::widen(tdy[r * W_COLS + c]), wf[c]));
                    p[j] = col0 + c < n ? v : 0.0f;  // padded lanes: +0.0, as canon_sum pads
                }
                const float s = warp_pair_tree<CPL, 32>(p);
                if (lane == 0) part[r * GROUPS + grp] = s;
            }
            if (threadIdx.x < W_COLS) {
                const int c = threadIdx.x;
                auto contribution = [&](int r) {
                    return __fmul_rn(Elem<DYC>::widen(tdy[r * W_COLS + c]),
                                     normalized_as_used<MODE, NC>(Elem<NC>::widen(tz[r * W_COLS + c]), tr[r]));
                };
                int r = 0;
                for (; r + FOLD_BATCH <= live; r += FOLD_BATCH) {
                    float v[FOLD_BATCH];
#pragma unroll
                    for (int q = 0; q < FOLD_BATCH; ++q) v[q] = contribution(r + q);
#pragma unroll
                    for (int q = 0; q < FOLD_BATCH; ++q) acc = __fadd_rn(acc, v[q]);  // rows in order
                }
                for (; r < live; ++r) acc = __fadd_rn(acc, contribution(r));
            }
            arrive(arrive1 + i);
        }
        const long long j1 = i - LAG1;
        if (j1 >= 0 && j1 < blocks) {  // C: combine this CTA's rows of block j1
            wait_all(arrive1 + j1);
            const int live = live_rows(j1);
            const float* part = partials + (j1 % SLOTS) * ROWS * GROUPS;
            float* cv = cvals + (j1 % SLOTS) * ROWS;
            for (int k = 0, r = grp; r < live; ++k, r += G_DATA) {
                if (k % WARPS != warp) continue;
                float leaf[LEAVES];
#pragma unroll
                for (int q = 0; q < LEAVES; ++q) {
                    const int gq = GROUPS >= 32 ? lane * LEAVES + q : lane;
                    // written by other CTAs: read through L2 (__ldcg), never a stale L1 line of a reused slot
                    leaf[q] = gq < G_DATA ? __ldcg(part + r * GROUPS + gq) : 0.0f;  // groups without data: +0.0
                }
                const float s = warp_pair_tree<LEAVES, (GROUPS >= 32 ? 32 : GROUPS)>(leaf);
                if (lane == 0) cv[r] = __fdiv_rn(s, static_cast<float>(n));
            }
            arrive(arrive2 + j1);
        }
        const long long j2 = i - LAG2;
        if (j2 >= 0) {  // D: dx of block j2
            wait_all(arrive2 + j2);
            const TileView tv = view(j2);
            const dy_t* tdy = tv.dy;
            const n_t* tz = tv.z;
            const float* tr = tv.rstd;
            const int live = live_rows(j2);
            const float* cv = cvals + (j2 % SLOTS) * ROWS;
            for (int r = threadIdx.x; r < live; r += THREADS) cs[r] = __ldcg(cv + r);  // one L2 trip, not one a column
            __syncthreads();
            // chunks of DX_VEC columns (16 bytes of dx); consecutive threads, consecutive chunks of a row
            constexpr int DX_VEC = 16 / sizeof(n_t), CHUNKS = W_COLS / DX_VEC;
            for (int e = threadIdx.x; e < live * CHUNKS; e += THREADS) {
                const int r = e / CHUNKS, c0 = (e % CHUNKS) * DX_VEC;
                const float rs = tr[r], c = cs[r];
                __align__(16) n_t out[DX_VEC];
#pragma unroll
                for (int q = 0; q < DX_VEC; ++q) {
                    const float xh = __fmul_rn(Elem<NC>::widen(tz[r * W_COLS + c0 + q]), rs);
                    const float g = gscale(Elem<DYC>::widen(tdy[r * W_COLS + c0 + q]), wf[c0 + q]);
                    out[q] = Elem<NC>::narrow(__fmul_rn(__fsub_rn(g, __fmul_rn(xh, c)), rs));
                }
                n_t* dst = dx + (j2 * ROWS + r) * xs + col0 + c0;
                if (col0 + c0 + DX_VEC <= n) {
                    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out);
                } else {
                    for (int q = 0; q < DX_VEC && col0 + c0 + q < n; ++q) dst[q] = out[q];
                }
            }
        }
        __syncthreads();  // the ring slot refilled below held block i + DEPTH - TILES = i - LAG2 - 1
        if (i + DEPTH < blocks) issue(i + DEPTH);
        cp_async_commit();
    }
    if (threadIdx.x < W_COLS && my_col < n) dw[my_col] = Elem<WC>::narrow(acc);
}
