// strictnorm: the RMSNorm strict backward in one pass over x and dy (dx and the strict dW together).
//
// The two-pass strict backward reads x and dy twice (the dx pass, then the dW fold). Here a persistent
// grid of co-resident CTAs (cooperative launch) owns column groups of W_COLS columns each: a power of two
// dividing P = next_pow2(N), so a group's lanes are an aligned subtree of canon_sum's tree. Every CTA walks
// all rows in blocks of ROWS rows, in order, with four kinds of warps, each on its own loop over the blocks
// (warp specialization), handing blocks to each other through shared-memory barriers (mbarrier):
//   B (B_WARPS warps): block b's rows of dy, z and rstd land in a ring of TILES tiles (cp.async, DEPTH blocks
//      ahead, issued by these threads); each row's subtree sum of p = xh * g over the group ((row, slice)
//      pairs of SW columns: an in-thread pairwise tree, then xor shuffles over the row's SL slices), published
//      to partials[b % TILES][row][group], then arrive1[b] goes up; every element's dW contribution, stored
//      to one of two shared buffers for the fold.
//   fold (FOLD_WARPS warps, one thread a column): each block's contributions added to the column's running
//      sum, rows in order (the strict left fold).
//   C (C_WARPS combine warps, block b taken by warp b % C_WARPS): block b once every group has published it
//      (arrive1[b]): this CTA's rows of it (rows g, g + G_DATA, ...): the row's GROUPS subtree sums (groups
//      without data: +0.0 leaves) in the tree's order, c = sum / N, published to cvals[b % TILES][row];
//      arrive2[b] goes up.
//   D (DX_WARPS warps in DX_GROUPS groups, block b taken by group b % DX_GROUPS): block b once arrive2[b] is
//      complete: its c values staged in shared memory, then dx = rd((g - xh * c) * rstd) for the group's
//      columns from the tile, which is then free for block b + TILES.
// Several combine warps and dx groups take turns so that one block's round trips through L2 (a poll, the
// loads behind it) overlap the next block's instead of adding up.
// Per block the roles overlap: B works on block b + 1 while the fold adds block b and D writes an earlier
// block's dx. Waits: B on its own copies, on the fold having emptied the contributions buffer (block b - 2)
// and, before loading block b + DEPTH, on D having freed its tile (block b + DEPTH - TILES); the fold on B;
// D on arrive2 and on B's tile; C on arrive1. Every wait of a CTA for block b needs only work on blocks
// before b (D of block b + DEPTH - TILES needs B of that block in every CTA), so co-resident CTAs cannot
// deadlock. Global slots (partials, cvals: TILES of each) are reused safely: B writes block b's partials
// after loading block b, which waited for D of block b - TILES here, hence for every CTA's combine of it
// (arrive2); C writes block b's c values after arrive1[b], so after every CTA's B of block b, which followed
// its D of block b - TILES (the tile was freed). A counter is raised by one thread with release semantics
// after its warps' barrier and polled by one thread with acquire loads before its warps' barrier, as a grid
// barrier does it.
//
// Same bits as the reference: the row sums are canon_sum's, c = sum / N, dx and the contributions are
// rms_norm.cu's and fold.cu's expressions, and each column's fold adds the rows in ascending order.
//
// Macros: DYC, NC, WC (dtype codes of dy, the norm input z, the weight), MODE (0 llama, 1 gemma, 2 none),
// HAS_W, W_COLS (columns a CTA, a multiple of 32, at most 256), GROUPS (P / W_COLS), G_DATA (groups holding
// columns: ceil(N / W_COLS)), ROWS (rows a block), SL (slices a row in the row sums; SW = W_COLS / SL columns
// a slice, 16-byte multiples of both dtypes, at most 32), DEPTH (blocks loaded ahead), TILES (ring slots, more
// than DEPTH, a multiple of DX_GROUPS), B_WARPS, DX_WARPS, DX_GROUPS (dividing DX_WARPS), C_WARPS;
// THREADS = 32 * (FOLD_WARPS + B_WARPS + DX_WARPS + C_WARPS). Rows of dy, z and dx
// are 16-byte aligned with row strides ds, zs, xs (elements). Dynamic shared memory: ONEPASS_SMEM bytes
// (backend.onepass_launch computes the same).
#include "common.cuh"
#include "async.cuh"

typedef Elem<DYC>::T dy_t;
typedef Elem<NC>::T n_t;
typedef Elem<WC>::T w_t;

constexpr int FOLD_WARPS = W_COLS / 32;  // one thread a column
constexpr int B_T0 = FOLD_WARPS * 32, B_THREADS = B_WARPS * 32;
constexpr int DX_T0 = B_T0 + B_THREADS, DX_THREADS = DX_WARPS * 32;
constexpr int DX_GROUP = DX_THREADS / DX_GROUPS;  // threads of a dx group
constexpr int COMBINE_WARP0 = (DX_T0 + DX_THREADS) / 32;  // the last C_WARPS warps
static_assert(THREADS == 32 * (COMBINE_WARP0 + C_WARPS), "warp roles");
static_assert(DX_WARPS % DX_GROUPS == 0 && TILES % DX_GROUPS == 0 && DX_GROUPS <= 14, "dx groups: whole warps, a "
              "tile slot always served by one group, a named barrier each");
constexpr int SW = W_COLS / SL;  // columns a (row, slice) pair of the row sums
// a tile's rows 16 bytes apart beyond their data: a warp's threads read different rows, at banks spread out
constexpr int DY_ROW = W_COLS * sizeof(dy_t), Z_ROW = W_COLS * sizeof(n_t);
constexpr int DY_PITCH = DY_ROW + 16, Z_PITCH = Z_ROW + 16;
constexpr int DY_TILE = ROWS * DY_PITCH, Z_TILE = ROWS * Z_PITCH;
constexpr int TILE_BYTES = DY_TILE + Z_TILE + ROWS * 4;
constexpr int C_PITCH = W_COLS + 4;  // floats: the contributions' rows, padded so (row, slice) stores spread over banks
constexpr int CONTRIB_BYTES = ROWS * C_PITCH * 4;
constexpr int MBARS = 2 * TILES + 4;  // landed[TILES], freed[TILES], full[2], empty[2]
constexpr int MBAR_OFFSET = TILES * TILE_BYTES + 2 * CONTRIB_BYTES + 4 * (W_COLS + DX_GROUPS * ROWS);
constexpr int ONEPASS_SMEM = MBAR_OFFSET + 8 * MBARS;
constexpr int LEAVES = GROUPS >= 32 ? GROUPS / 32 : 1;  // subtree sums a lane combines
constexpr int DX_VEC = 16 / (sizeof(n_t) < sizeof(dy_t) ? sizeof(n_t) : sizeof(dy_t));  // columns a dx chunk
static_assert(W_COLS % 32 == 0 && W_COLS <= 256 && 32 % SL == 0, "one thread a column; a row's slices in a warp");
static_assert(SW <= 32 && (SW * sizeof(dy_t)) % 16 == 0 && (SW * sizeof(n_t)) % 16 == 0, "slices of 16-byte loads");
static_assert((ROWS * SL) % 32 == 0 && ROWS % 4 == 0 && B_WARPS >= 1 && DX_WARPS >= 1, "block shape");
static_assert(W_COLS % DX_VEC == 0, "whole dx chunks");
static_assert(DEPTH >= 1 && TILES > DEPTH, "ring");
static_assert(MBAR_OFFSET % 8 == 0, "mbarrier alignment");

// A wait this long means CTAs that never arrive (a bug, or a grid not co-resident): trap (a launch error)
// rather than hang the device. (The CPU emulation, far slower, sets its own.)
#ifndef WAIT_LIMIT_NS
#define WAIT_LIMIT_NS 2000000000ull
#endif

// The pairwise tree over COUNT * LANES values of a warp, lane l holding [l * COUNT, (l + 1) * COUNT): in-thread
// (pair_tree), then xor shuffles with offsets below LANES; lanes of an aligned run of LANES get its total.
template <int COUNT, int LANES>
__device__ __forceinline__ float warp_pair_tree(float* v) {
    float s = pair_tree<COUNT>(v);
#pragma unroll
    for (int off = 1; off < LANES; off *= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
    return s;
}

// The calling thread polls (acquire) until every CTA has arrived; the caller's barrier then releases the
// threads that read the data behind the counter (through L2, __ldcg).
__device__ __forceinline__ void poll_all(const int* counter) {
    const unsigned long long start = global_ns();
    while (load_acquire(counter) < G_DATA)
        if (global_ns() - start > WAIT_LIMIT_NS) __trap();
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
        const unsigned char* dy;
        const unsigned char* z;
        const float* rstd;
    };
    auto view = [&](long long b) {
        const unsigned char* t = tile(b);
        return TileView{t, t + DY_TILE, reinterpret_cast<const float*>(t + DY_TILE + Z_TILE)};
    };
    auto live_rows = [&](long long b) { return static_cast<int>(rows - b * ROWS < ROWS ? rows - b * ROWS : ROWS); };
    float* contrib = reinterpret_cast<float*>(onepass_smem + TILES * TILE_BYTES);  // [2][ROWS][C_PITCH]
    float* wf = contrib + 2 * ROWS * C_PITCH;  // the group's effective weight (row sums and dx)
    float* cs_all = wf + W_COLS;  // per dx group: the c values of its block, staged once from global memory
    unsigned long long* landed = reinterpret_cast<unsigned long long*>(onepass_smem + MBAR_OFFSET);  // B -> D
    unsigned long long* freed = landed + TILES;  // D -> B: a tile read for the last time
    unsigned long long* full = freed + TILES;  // B -> fold: a contributions buffer written
    unsigned long long* empty = full + 2;  // fold -> B: a contributions buffer added
    for (int c = threadIdx.x; c < W_COLS; c += THREADS) {
        float v = 1.0f;
#if HAS_W
        if (col0 + c < n) {
            v = effective_weight_of<MODE, NC>(Elem<WC>::widen(w[col0 + c]), offset);
        }
#endif
        wf[c] = v;
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < TILES; ++s) mbar_init(landed + s, B_THREADS), mbar_init(freed + s, DX_GROUP);
        for (int k = 0; k < 2; ++k) mbar_init(full + k, B_THREADS), mbar_init(empty + k, 32 * FOLD_WARPS);
    }
    __syncthreads();  // the weights and the barriers, for every warp

    if (warp >= COMBINE_WARP0) {  // C: this warp's turns
        for (long long j = warp - COMBINE_WARP0; j < blocks; j += C_WARPS) {
            if (lane == 0) poll_all(arrive1 + j);
            __syncwarp();
            const int live = live_rows(j);
            const float* part = partials + (j % TILES) * ROWS * GROUPS;
            float* cv = cvals + (j % TILES) * ROWS;
            for (int r = grp; r < live; r += G_DATA) {
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
            if (lane == 0) add_release(arrive2 + j, 1);  // lane 0 wrote every c value itself
        }
    } else if (warp < FOLD_WARPS) {  // fold: block after block, rows in order
        float acc = 0.0f;
        for (long long i = 0; i < blocks; ++i) {
            mbar_wait(full + (i & 1), mbar_use_parity(i, 2));
            const int live = live_rows(i);
            const float* col = contrib + (i & 1) * ROWS * C_PITCH + threadIdx.x;
            // batches of rows, the next batch's loads issued before this batch's adds: the chain of adds waits
            // for no load
            constexpr int BATCH = 8;
            const int whole = live / BATCH * BATCH;
            float cur[BATCH], nxt[BATCH];
            if (whole) {
#pragma unroll
                for (int q = 0; q < BATCH; ++q) cur[q] = col[q * C_PITCH];
            }
            for (int r = 0; r < whole; r += BATCH) {
                if (r + BATCH < whole) {
#pragma unroll
                    for (int q = 0; q < BATCH; ++q) nxt[q] = col[(r + BATCH + q) * C_PITCH];
                }
#pragma unroll
                for (int q = 0; q < BATCH; ++q) acc = __fadd_rn(acc, cur[q]);
#pragma unroll
                for (int q = 0; q < BATCH; ++q) cur[q] = nxt[q];
            }
            for (int r = whole; r < live; ++r) acc = __fadd_rn(acc, col[r * C_PITCH]);
            mbar_arrive(empty + (i & 1));
        }
        if (col0 + static_cast<int>(threadIdx.x) < n) dw[col0 + threadIdx.x] = Elem<WC>::narrow(acc);
    } else if (threadIdx.x < DX_T0) {  // B: loads, row sums, contributions
        const int t = threadIdx.x - B_T0;
        auto issue = [&](long long b) {
            unsigned char* tl = tile(b);
            constexpr int DYC_CH = DY_ROW / 16, ZC_CH = Z_ROW / 16, CH = DYC_CH > ZC_CH ? DYC_CH : ZC_CH;
            for (int e = t; e < ROWS * CH; e += B_THREADS) {
                const int r = e / CH, ch = e % CH;
                const long long row = b * ROWS + r;
                if (row >= rows) break;
                if (ch < DYC_CH)
                    copy_chunk(tl + r * DY_PITCH + ch * 16, dy + row * ds, col0 + ch * (16 / int(sizeof(dy_t))), n);
                if (ch < ZC_CH)
                    copy_chunk(tl + DY_TILE + r * Z_PITCH + ch * 16, z + row * zs,
                               col0 + ch * (16 / int(sizeof(n_t))), n);
                if (ch == 0) cp_async4(tl + DY_TILE + Z_TILE + r * 4, rstd + row);
            }
        };
        // this thread's slice of the row sums (B_THREADS is a multiple of SL): its columns' weights in registers
        const int slice = t % SL, c_lo = slice * SW;
        float wreg[SW];
#pragma unroll
        for (int j = 0; j < SW; ++j) wreg[j] = wf[c_lo + j];
        for (int d = 0; d < DEPTH; ++d) {
            if (d < blocks) issue(d);
            cp_async_commit();
        }
        for (long long i = 0; i < blocks; ++i) {
            cp_async_wait<DEPTH - 1>();  // this thread's copies of block i landed
            mbar_arrive(landed + i % TILES);  // for D
            named_barrier(1, B_THREADS);  // and every B thread's
            if (i >= 2) mbar_wait(empty + (i & 1), mbar_use_parity(i - 2, 2));  // the fold has added block i - 2
            const TileView tv = view(i);
            const int live = live_rows(i);
            float* part = partials + (i % TILES) * ROWS * GROUPS;
            float* cb = contrib + (i & 1) * ROWS * C_PITCH;
            for (int pair = t; pair < ROWS * SL; pair += B_THREADS) {  // whole warps: the shuffles below
                const int r = pair / SL;
                float vd[SW], vz[SW];
                load_widened<dy_t, DYC, SW>(vd, reinterpret_cast<const dy_t*>(tv.dy + r * DY_PITCH) + c_lo);
                load_widened<n_t, NC, SW>(vz, reinterpret_cast<const n_t*>(tv.z + r * Z_PITCH) + c_lo);
                const float rs = tv.rstd[r];
                float p[SW];
#pragma unroll
                for (int j = 0; j < SW; ++j) {
                    const float v = __fmul_rn(__fmul_rn(vz[j], rs), gscale<HAS_W>(vd[j], wreg[j]));
                    p[j] = col0 + c_lo + j < n ? v : 0.0f;  // padded lanes: +0.0, as canon_sum pads
                    vd[j] = __fmul_rn(vd[j], normalized_as_used<MODE, NC>(vz[j], rs));  // the dW contribution
                }
                const float s = warp_pair_tree<SW, SL>(p);
                if (r < live) {
                    if (slice == 0) part[r * GROUPS + grp] = s;
                    float* dst = cb + r * C_PITCH + c_lo;
#pragma unroll
                    for (int j = 0; j < SW; j += 4)
                        *reinterpret_cast<float4*>(dst + j) = make_float4(vd[j], vd[j + 1], vd[j + 2], vd[j + 3]);
                }
            }
            mbar_arrive(full + (i & 1));
            named_barrier(1, B_THREADS);  // every B thread's partials written
            if (t == 0) add_release(arrive1 + i, 1);
            const long long next = i + DEPTH;  // into the slot of block next - TILES, once D has read it
            if (next < blocks) {
                if (next >= TILES) mbar_wait(freed + next % TILES, mbar_use_parity(next - TILES, TILES));
                issue(next);
            }
            cp_async_commit();
        }
    } else {  // D: dx, this group's turns
        const int group = (threadIdx.x - DX_T0) / DX_GROUP, t = (threadIdx.x - DX_T0) % DX_GROUP;
        float* cs = cs_all + group * ROWS;
        for (long long j = group; j < blocks; j += DX_GROUPS) {
            if (t == 0) poll_all(arrive2 + j);
            mbar_wait(landed + j % TILES, mbar_use_parity(j, TILES));
            named_barrier(2 + group, DX_GROUP);
            const TileView tv = view(j);
            const int live = live_rows(j);
            const float* cv = cvals + (j % TILES) * ROWS;
            for (int r = t; r < live; r += DX_GROUP) cs[r] = __ldcg(cv + r);  // one L2 trip, not one a column
            named_barrier(2 + group, DX_GROUP);
            constexpr int CHUNKS = W_COLS / DX_VEC;
            for (int e = t; e < live * CHUNKS; e += DX_GROUP) {
                const int r = e / CHUNKS, c0 = (e % CHUNKS) * DX_VEC;
                const float rs = tv.rstd[r], c = cs[r];
                float vd[DX_VEC], vz[DX_VEC];
                load_widened<dy_t, DYC, DX_VEC>(vd, reinterpret_cast<const dy_t*>(tv.dy + r * DY_PITCH) + c0);
                load_widened<n_t, NC, DX_VEC>(vz, reinterpret_cast<const n_t*>(tv.z + r * Z_PITCH) + c0);
                __align__(16) n_t out[DX_VEC];
#pragma unroll
                for (int q = 0; q < DX_VEC; ++q) {
                    const float xh = __fmul_rn(vz[q], rs);
                    const float g = gscale<HAS_W>(vd[q], wf[c0 + q]);
                    out[q] = Elem<NC>::narrow(__fmul_rn(__fsub_rn(g, __fmul_rn(xh, c)), rs));
                }
                n_t* dst = dx + (j * ROWS + r) * xs + col0 + c0;
                if (col0 + c0 + DX_VEC <= n) {
#pragma unroll
                    for (int q = 0; q < DX_VEC * int(sizeof(n_t)) / 16; ++q)
                        reinterpret_cast<uint4*>(dst)[q] = reinterpret_cast<const uint4*>(out)[q];
                } else {
                    for (int q = 0; q < DX_VEC && col0 + c0 + q < n; ++q) dst[q] = out[q];
                }
            }
            // this thread is done with block j's tile; cs is rewritten for the next block only after every
            // thread's reads (behind the next block's first barrier)
            mbar_arrive(freed + j % TILES);
        }
    }
}
