// strictnorm: the strict ascending left fold over rows, acc = acc + v[row] from +0.0, per column.
//
// v is either a row of A widened to fp32 (WHAT == 0), or the RMSNorm weight-gradient contribution
// of casting mode WHAT (1 llama, 2 gemma, 3 none) recomputed from dy (A), the norm's input (B) and
// rstd, so no (rows, N) fp32 buffer exists. Every add is __fadd_rn, every multiply __fmul_rn: no
// contraction, no reassociation, no atomics, and the order is the rows' logical order.
//
// Configuration macros (set by the loader): A_CODE, B_CODE (0 fp32, 1 bf16, 2 fp16), OUT_CODE (the
// result's dtype, default fp32: the fp32 sums rounded to nearest even once, at the store), WHAT,
// SIMPLE_ROWS (row r lives at r * s0), for fold_chain: CHAIN_ROWS, COLS, THREADS (below), and for
// fold_stream: COLS, STREAM_ROWS, CSTAGES, CONVERT_WARPS, THREADS, GROUP_PAD, ISOLATE, PREFETCH (below), and for
// fold_ring: COLS, ROWS_PER_STAGE, STAGES, THREADS,
// CONVERT (dW contributions computed by the producers; needs WHAT != 0 and STAGES >= 3), COLUMN_MAJOR
// (with CONVERT: the contributions stored a column's rows contiguous, so that a consumer lane loads four
// rows with one 16-byte load instead of one), FULL_STAGE
// (the consumer's loop over a whole stage fully unrolled, so that its shared-memory loads run ahead of
// the chain of adds; default 0: unrolled by 16, each block's first load latency exposed).
//
// Rows are addressed through the layout of ../layout.py: for logical row r,
//   g = r % G; t = r / G; offset = (t / R1) * s0 + (t % R1) * s1 + g * sg.
// Group h (program y) folds logical rows t * group_step + h, t = 0, 1, ... (per-head weights).

#include "common.cuh"
#include "async.cuh"

#ifndef OUT_CODE
#define OUT_CODE 0
#endif

typedef Elem<A_CODE>::T a_t;
typedef Elem<B_CODE>::T b_t;
typedef Elem<OUT_CODE>::T out_t;

// The dW contribution of one element: f32(dy) times the normalized value as y's scaling step used it.
__device__ __forceinline__ float contribution(float dy, float x, float rstd) {
#if WHAT != 0
    return __fmul_rn(dy, normalized_as_used<WHAT - 1, B_CODE>(x, rstd));
#else
    (void)x, (void)rstd;
    return dy;
#endif
}

__device__ __forceinline__ long long fold_row_offset(long long r, const Layout& l) {
#if SIMPLE_ROWS
    return r * l.s0;  // plain rows: no divisions on the producers' path
#else
    return row_offset(r, l);
#endif
}

// Folds `rows` consecutive fp32 values of one column (16-byte aligned) into acc, four rows per load; the
// adds stay one at a time, in row order. FULL > 0: a count of exactly FULL rows is unrolled completely.
// Else blocks of FOLD_BLOCK loads (4 * FOLD_BLOCK rows), each block's loads issued before the previous
// block's adds: the shared-memory latency hides behind the chain of adds instead of stalling it once a block
// (run 7: fold_chain's 4096-row items took ~3.5 ns a row with the loads at the top of each block of 16 rows,
// against the chain's 2.0).
__device__ __forceinline__ float add4(float acc, float4 v) {
    return __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(acc, v.x), v.y), v.z), v.w);
}
constexpr int FOLD_BLOCK = 8;

// Block blk of a column's rows: FOLD_BLOCK 16-byte loads (4 * FOLD_BLOCK rows).
__device__ __forceinline__ void load_block(float4 (&v)[FOLD_BLOCK], const float* col, int blk) {
    const float4* c4 = reinterpret_cast<const float4*>(col) + blk * FOLD_BLOCK;
#pragma unroll
    for (int j = 0; j < FOLD_BLOCK; ++j) v[j] = c4[j];
}

template <int FULL>
__device__ __forceinline__ float fold_column(float acc, int rows, const float* col) {
    const float4* c4 = reinterpret_cast<const float4*>(col);
    if (FULL > 0 && rows == FULL) {
#pragma unroll
        for (int j = 0; j < FULL / 4; ++j) acc = add4(acc, c4[j]);
        return acc;
    }
    const int blocks = rows / (4 * FOLD_BLOCK);
    if (blocks > 0) {
        float4 cur[FOLD_BLOCK];
        load_block(cur, col, 0);
        for (int blk = 1; blk < blocks; ++blk) {
            float4 next[FOLD_BLOCK];
            load_block(next, col, blk);
#pragma unroll
            for (int j = 0; j < FOLD_BLOCK; ++j) {
                acc = add4(acc, cur[j]);
                cur[j] = next[j];
            }
        }
#pragma unroll
        for (int j = 0; j < FOLD_BLOCK; ++j) acc = add4(acc, cur[j]);
    }
    int i = blocks * 4 * FOLD_BLOCK;
    for (; i + 4 <= rows; i += 4) acc = add4(acc, c4[i / 4]);
    for (; i < rows; ++i) acc = __fadd_rn(acc, col[i]);
    return acc;
}

// COUNT consecutive values of one row widened to fp32, those at or past `left` as +0.0: 16-byte loads where the
// row segment is aligned and whole, else one element at a time.
template <typename T, int CODE, int COUNT>
__device__ __forceinline__ void load_upto(float* v, const T* p, int left, bool aligned) {
    if constexpr ((COUNT * sizeof(T)) % 16 == 0) {
        if (aligned && left >= COUNT) {
            load_widened<T, CODE, COUNT>(v, p);
            return;
        }
    }
#pragma unroll
    for (int c = 0; c < COUNT; ++c) v[c] = c < left ? Elem<CODE>::widen(p[c]) : 0.0f;
}

#define FOLD_PARAMS                                                                               \
    const a_t* __restrict__ a, long long as0, long long as1, long long asg,                       \
    const b_t* __restrict__ b, long long bs0, long long bs1, long long bsg,                       \
    long long r1, long long g, const float* __restrict__ rstd, out_t* __restrict__ out,           \
    long long rows_per_group, int n, long long group_step

// One thread per column, plain loads: the simplest correct kernel. Any layout or alignment.
extern "C" __global__ void fold_simple(FOLD_PARAMS) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int h = blockIdx.y;
    if (col >= n) return;
    const Layout la{as0, as1, asg, r1, g};
    const Layout lb{bs0, bs1, bsg, r1, g};
    float acc = 0.0f;
    for (long long t = 0; t < rows_per_group; ++t) {
        const long long r = t * group_step + h;
        float v = Elem<A_CODE>::widen(a[fold_row_offset(r, la) + col]);
#if WHAT != 0
        v = contribution(v, Elem<B_CODE>::widen(b[fold_row_offset(r, lb) + col]), rstd[r]);
#endif
        acc = __fadd_rn(acc, v);
    }
    out[static_cast<long long>(h) * n + col] = Elem<OUT_CODE>::narrow(acc);
}

#if defined(COLS) && !defined(CHAIN_ROWS) && !defined(STREAM_ROWS)
// A shared-memory ring keeps (STAGES - 1) * ROWS_PER_STAGE rows in flight so that the dependent
// chain of adds, not memory latency, sets the pace. Warp 0 folds (one lane per column); the other
// warps are producers issuing 16-byte cp.async copies. Needs 16-byte aligned row segments: the
// loader checks pointers and strides and uses fold_simple otherwise (same bits).

#ifndef FULL_STAGE
#define FULL_STAGE 0
#endif

// Folds `rows` rows of a stage into acc: value(i) is row i's fp32 addend. Whole stages are unrolled
// completely with FULL_STAGE; the last, partial stage (and every stage without it) by 16.
template <typename Value>
__device__ __forceinline__ float fold_stage(float acc, int rows, Value value) {
    if (FULL_STAGE && rows == ROWS_PER_STAGE) {
#pragma unroll
        for (int i = 0; i < ROWS_PER_STAGE; ++i) acc = __fadd_rn(acc, value(i));
        return acc;
    }
#pragma unroll 16
    for (int i = 0; i < rows; ++i) acc = __fadd_rn(acc, value(i));
    return acc;
}

#ifndef COLUMN_MAJOR
#define COLUMN_MAJOR 0
#endif

constexpr int A_ROW_BYTES = COLS * sizeof(a_t);
constexpr int B_ROW_BYTES = (WHAT != 0) ? COLS * sizeof(b_t) : 0;
constexpr int A_TILE = ROWS_PER_STAGE * A_ROW_BYTES;
constexpr int B_TILE = ROWS_PER_STAGE * B_ROW_BYTES;
constexpr int R_TILE = (WHAT != 0) ? ROWS_PER_STAGE * 4 : 0;
constexpr int STAGE_BYTES = A_TILE + B_TILE + R_TILE;
constexpr int PRODUCERS = THREADS - 32;
// the contribution buffers (CONVERT): row-major, or a column's rows contiguous and padded by 4 floats, so
// that the producers' stores (consecutive columns of a row) fall in different banks
constexpr int COLUMN_STRIDE = ROWS_PER_STAGE + 4;
constexpr int CONTRIB_TILE = COLUMN_MAJOR ? COLS * COLUMN_STRIDE : ROWS_PER_STAGE * COLS;
static_assert(!COLUMN_MAJOR || (CONVERT && ROWS_PER_STAGE % 4 == 0), "COLUMN_MAJOR: converted stages of 4k rows");
static_assert(A_ROW_BYTES % 16 == 0 && B_ROW_BYTES % 16 == 0, "row segments must be whole 16-byte chunks");
static_assert(COLS <= 32, "one consumer lane per column");
static_assert(!CONVERT || (WHAT != 0 && STAGES >= 3), "CONVERT folds dW contributions through >= 3 stages");
// columns a producer converts at once: 16 bytes of a 16-bit dtype (whole chunks of fp32 too)
constexpr int CONVERT_VEC = 8;
static_assert(!CONVERT || COLS % CONVERT_VEC == 0, "CONVERT: whole groups of CONVERT_VEC columns");

constexpr int A_CHUNKS = A_ROW_BYTES / 16;
constexpr int B_CHUNKS = B_ROW_BYTES / 16;
constexpr int CHUNKS = A_CHUNKS > B_CHUNKS ? A_CHUNKS : B_CHUNKS;

// Copies rows [t0, t0 + ROWS_PER_STAGE) of group h into one ring slot: a's row segments, and b's and rstd
// for the dW fold. Producer p takes chunk ch of row `row` for i = row * CHUNKS + ch (consecutive producers,
// consecutive chunks of a row), a row's offsets computed once for all its copies (run 8, ncu: with a loop
// per tensor, address arithmetic was ~30% of the dW ring's instructions, and the ring is issue-bound).
__device__ __forceinline__ void issue_stage(unsigned char* slot, const a_t* a, const b_t* b, const float* rstd,
                                            const Layout& la, const Layout& lb, int p, long long t0,
                                            long long rows_per_group, long long group_step, int h, int col0,
                                            int n) {
    for (int i = p; i < ROWS_PER_STAGE * CHUNKS; i += PRODUCERS) {
        const int row = i / CHUNKS, ch = i % CHUNKS;
        const long long t = t0 + row;
        if (t >= rows_per_group) break;  // i grows with row: later i are past the end too
        const long long r = t * group_step + h;
        if (ch < A_CHUNKS)
            copy_chunk(slot + row * A_ROW_BYTES + ch * 16, a + fold_row_offset(r, la),
                       col0 + ch * (16 / static_cast<int>(sizeof(a_t))), n);
#if WHAT != 0
        if (ch < B_CHUNKS)
            copy_chunk(slot + A_TILE + row * B_ROW_BYTES + ch * 16, b + fold_row_offset(r, lb),
                       col0 + ch * (16 / static_cast<int>(sizeof(b_t))), n);
        if (ch == 0) cp_async4(slot + A_TILE + B_TILE + row * 4, rstd + r);
#else
        (void)b, (void)lb, (void)rstd;
#endif
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) fold_ring(FOLD_PARAMS) {
    extern __shared__ __align__(16) unsigned char ring[];
    const int h = blockIdx.y;
    const int col0 = blockIdx.x * COLS;
    const Layout la{as0, as1, asg, r1, g};
    const Layout lb{bs0, bs1, bsg, r1, g};
    const long long stages = (rows_per_group + ROWS_PER_STAGE - 1) / ROWS_PER_STAGE;
    const bool consumer = threadIdx.x < 32;
    const int p = threadIdx.x - 32;

    auto issue = [&](long long s) {
        issue_stage(ring + (s % STAGES) * STAGE_BYTES, a, b, rstd, la, lb, p, s * ROWS_PER_STAGE, rows_per_group,
                    group_step, h, col0, n);
    };

    for (int s = 0; s < STAGES - 1; ++s) {  // one commit group per stage, empty ones included
        if (!consumer && s < stages) issue(s);
        cp_async_commit();
    }

    float acc = 0.0f;
    const int lane = threadIdx.x;
#if CONVERT
    // The producers also turn each landed stage into fp32 contributions (two buffers after the ring),
    // one stage ahead of the consumer, whose lanes then only load and add: the chain of dependent adds
    // is all that is left on the consumer's path.
    float* contrib = reinterpret_cast<float*>(ring + STAGES * STAGE_BYTES);
    auto convert = [&](long long s) {
        const unsigned char* slot = ring + (s % STAGES) * STAGE_BYTES;
        const a_t* ta = reinterpret_cast<const a_t*>(slot);
        const b_t* tb = reinterpret_cast<const b_t*>(slot + A_TILE);
        const float* tr = reinterpret_cast<const float*>(slot + A_TILE + B_TILE);
        float* dst = contrib + (s % 2) * CONTRIB_TILE;
        // CONVERT_VEC columns of a row at a time: 16-byte loads of a, b and (row-major) the contributions
        for (int i = p; i < ROWS_PER_STAGE * (COLS / CONVERT_VEC); i += PRODUCERS) {
            const int row = i / (COLS / CONVERT_VEC), c0 = (i % (COLS / CONVERT_VEC)) * CONVERT_VEC;
            float v[CONVERT_VEC], vb[CONVERT_VEC];
            load_widened<a_t, A_CODE, CONVERT_VEC>(v, ta + row * COLS + c0);
            load_widened<b_t, B_CODE, CONVERT_VEC>(vb, tb + row * COLS + c0);
            const float rs = tr[row];
#pragma unroll
            for (int j = 0; j < CONVERT_VEC; ++j) v[j] = contribution(v[j], vb[j], rs);
#if COLUMN_MAJOR
#pragma unroll
            for (int j = 0; j < CONVERT_VEC; ++j) dst[(c0 + j) * COLUMN_STRIDE + row] = v[j];
#else
#pragma unroll
            for (int j = 0; j < CONVERT_VEC; j += 4)
                *reinterpret_cast<float4*>(dst + row * COLS + c0 + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
#endif
        }
    };
    cp_async_wait<STAGES - 2>();  // stage 0 landed
    __syncthreads();
    if (!consumer && stages > 0) convert(0);
    for (long long s = 0; s < stages; ++s) {
        cp_async_wait<STAGES - 3>();  // stage s + 1 landed (this thread's copies)
        // stage s + 1 is visible, stage s is converted, the consumer is done with the other buffer, and
        // the slot refilled below (stage s - 1) was converted an iteration ago
        __syncthreads();
        if (!consumer && s + STAGES - 1 < stages) issue(s + STAGES - 1);
        cp_async_commit();
        if (!consumer && s + 1 < stages) convert(s + 1);
        if (consumer && lane < COLS) {
            const float* tc = contrib + (s % 2) * CONTRIB_TILE;
            const long long left = rows_per_group - s * ROWS_PER_STAGE;
            const int rows = left < ROWS_PER_STAGE ? static_cast<int>(left) : ROWS_PER_STAGE;
#if COLUMN_MAJOR
            acc = fold_column<FULL_STAGE ? ROWS_PER_STAGE : 0>(acc, rows, tc + lane * COLUMN_STRIDE);
#else
            acc = fold_stage(acc, rows, [&](int i) { return tc[i * COLS + lane]; });
#endif
        }
    }
#else
    for (long long s = 0; s < stages; ++s) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage s is visible; everyone is done with the slot refilled below
        if (!consumer && s + STAGES - 1 < stages) issue(s + STAGES - 1);
        cp_async_commit();
        if (consumer && lane < COLS) {
            const unsigned char* slot = ring + (s % STAGES) * STAGE_BYTES;
            const a_t* ta = reinterpret_cast<const a_t*>(slot);
#if WHAT != 0
            const b_t* tb = reinterpret_cast<const b_t*>(slot + A_TILE);
            const float* tr = reinterpret_cast<const float*>(slot + A_TILE + B_TILE);
#endif
            // row i of the stage as this lane adds it
            auto value = [&](int i) {
                float v = Elem<A_CODE>::widen(ta[i * COLS + lane]);
#if WHAT != 0
                v = contribution(v, Elem<B_CODE>::widen(tb[i * COLS + lane]), tr[i]);
#endif
                return v;
            };
            const long long left = rows_per_group - s * ROWS_PER_STAGE;
            const int rows = left < ROWS_PER_STAGE ? static_cast<int>(left) : ROWS_PER_STAGE;
            acc = fold_stage(acc, rows, value);
        }
    }
#endif  // CONVERT
    if (consumer && lane < COLS && col0 + lane < n)
        out[static_cast<long long>(h) * n + col0 + lane] = Elem<OUT_CODE>::narrow(acc);
}
#endif  // COLS

#ifdef STREAM_ROWS
// fold_stream: the fold fed by converter warps that load rows straight into registers. Converter warp w takes
// stages w, w + CONVERT_WARPS, ... (STREAM_ROWS rows x COLS columns each): it issues all of a stage's 16-byte
// loads of dy, x and rstd at once, turns them into fp32 addends and stores those, a column's rows contiguous,
// in one of its own CSTAGES / CONVERT_WARPS buffers once the consumer is done with it (mbarrier cempty), then
// marks the buffer full (cfull). The consumer warps (one lane a column) take the buffers in stage order and
// fold their rows in order. Every converter warp has a stage's loads in flight while the consumer adds, and
// no data passes through shared memory twice: fold_ring copies tiles into shared memory (cp.async), converts
// them into a second buffer and syncs the block every stage (its time at 32768 x 4096: 305 us, ~4.6x the
// chain); run 20's first fold_stream, with cp.async tiles and copying warps, reached 242 us at best.
constexpr int S_CONSUMER_WARPS = COLS >= 32 ? COLS / 32 : 1;
constexpr int S_VEC = 8;  // columns a converter lane takes at once: 16 bytes of a 16-bit dtype
constexpr int S_GROUPS = COLS / S_VEC;
constexpr int S_ITEMS = STREAM_ROWS * S_GROUPS / 32;  // a converter lane's row segments a stage
// ISOLATE: the consumer warps alone on their SM sub-partitions (warp w issues from sub-partition w % 4), so that no
// converter takes the issue slot a dependent add is ready for; the warps between, on the consumers' sub-partitions,
// only take part in the block's first barrier.
#ifndef ISOLATE
#define ISOLATE 0
#endif
constexpr int S_FREE = S_CONSUMER_WARPS < 4 ? 4 - S_CONSUMER_WARPS : 1;  // the converters' sub-partitions (ISOLATE)
static_assert(!ISOLATE || S_CONSUMER_WARPS < 4, "ISOLATE leaves the converters a sub-partition at least");
// the last converter's warp: converter k is warp 4 (k / S_FREE) + S_CONSUMER_WARPS + k % S_FREE with ISOLATE
constexpr int S_LAST_WARP = ISOLATE ? 4 * ((CONVERT_WARPS - 1) / S_FREE) + S_CONSUMER_WARPS + (CONVERT_WARPS - 1) % S_FREE
                                    : S_CONSUMER_WARPS + CONVERT_WARPS - 1;
static_assert(THREADS == (S_LAST_WARP + 1) * 32, "THREADS: the consumer's and converters' warps");
static_assert(COLS % S_VEC == 0 && (COLS <= 32 || COLS % 32 == 0), "COLS: 8, 16, 32, 64 or 128");
static_assert(32 % S_GROUPS == 0 || S_GROUPS % 32 == 0, "a row's segments on consecutive lanes");
static_assert(STREAM_ROWS % 4 == 0 && (STREAM_ROWS * S_GROUPS) % 32 == 0, "whole warps of segments a stage");
static_assert(CSTAGES % CONVERT_WARPS == 0, "each converter warp owns CSTAGES / CONVERT_WARPS buffers");
// a column's rows contiguous, padded by 4 floats: the consumer's 16-byte loads (consecutive columns) fall in
// different banks. GROUP_PAD (floats, 0 or 8) more after each group of S_VEC columns: the converters' stores, whose
// lanes hold the same row of different groups, then fall in different banks too (without it those lanes meet in
// one bank: up to 4-way conflicts at 32 columns)
#ifndef GROUP_PAD
#define GROUP_PAD 0
#endif
constexpr int S_CSTRIDE = STREAM_ROWS + 4;
constexpr int S_CTILE = COLS * S_CSTRIDE + S_GROUPS * GROUP_PAD;
__device__ __forceinline__ int column_at(int c) { return c * S_CSTRIDE + (c / S_VEC) * GROUP_PAD; }
// shared memory: the addend buffers, then their barriers; the loader's shmem is S_BARRIERS_AT + CSTAGES * 16
constexpr int S_BARRIERS_AT = CSTAGES * S_CTILE * 4;

// Segment k of a converter lane's stage (its k-th 16-byte load): row (lane + 32 k) / S_GROUPS, columns
// S_VEC * ((lane + 32 k) % S_GROUPS) on, consecutive lanes the segments of a row.
__device__ __forceinline__ int segment_row(int lane, int k) { return (lane + 32 * k) / S_GROUPS; }
__device__ __forceinline__ int segment_col(int lane, int k) { return (lane + 32 * k) % S_GROUPS * S_VEC; }

// Segment k's addends v stored in its stage buffer dst, a column's rows contiguous.
__device__ __forceinline__ void store_segment(float* dst, const float* v, int lane, int k) {
    const int row = segment_row(lane, k), c = segment_col(lane, k);
#pragma unroll
    for (int j = 0; j < S_VEC; ++j) dst[column_at(c + j) + row] = v[j];
}

// A stage's addends, segment k of this lane in v[k]: WHOLE, every row and column of the stage exists (no checks); else
// rows at or past `rows` are skipped and columns at or past n read as +0.0. All loads are issued before any
// conversion.
template <bool WHOLE>
__device__ __forceinline__ void stage_addends(float (&v)[S_ITEMS][S_VEC], const a_t* a, const b_t* b,
                                              const float* rstd, const Layout& la, const Layout& lb, int lane,
                                              long long t0, int rows, long long group_step, int h, int col0, int n) {
#if WHAT != 0
    float vb[S_ITEMS][S_VEC];
    float rs[S_ITEMS];
#endif
#pragma unroll
    for (int k = 0; k < S_ITEMS; ++k) {
        const int row = segment_row(lane, k), c = col0 + segment_col(lane, k);
        if (!WHOLE && row >= rows) continue;
        const long long r = (t0 + row) * group_step + h;
        load_upto<a_t, A_CODE, S_VEC>(v[k], a + fold_row_offset(r, la) + c, WHOLE ? S_VEC : n - c, true);
#if WHAT != 0
        load_upto<b_t, B_CODE, S_VEC>(vb[k], b + fold_row_offset(r, lb) + c, WHOLE ? S_VEC : n - c, true);
        rs[k] = rstd[r];
#endif
    }
#if WHAT != 0
#pragma unroll
    for (int k = 0; k < S_ITEMS; ++k)
#pragma unroll
        for (int j = 0; j < S_VEC; ++j) v[k][j] = contribution(v[k][j], vb[k][j], rs[k]);
#else
    (void)b, (void)lb, (void)rstd;
#endif
}

// PREFETCH: a converter issues the 16-byte loads of its next whole stage (dy, x and rstd as raw chunks: StageLoads)
// before it converts and stores the current one, so a stage's loads stay in flight while the previous stage is
// converted, waits for its buffer and is stored (without it a converter's loads and its conversion alternate). It
// holds two stages' raw chunks in registers. Partial stages (the last one, a partial column group) load as before.
#ifndef PREFETCH
#define PREFETCH 0
#endif
#if PREFETCH
template <typename T> constexpr int S_CHUNKS = S_VEC * static_cast<int>(sizeof(T)) / 16;  // 16-byte loads a segment
struct StageLoads {
    uint4 a[S_ITEMS][S_CHUNKS<a_t>];
#if WHAT != 0
    uint4 b[S_ITEMS][S_CHUNKS<b_t>];
    float rs[S_ITEMS];
#endif
};

// A whole stage's loads (every row and column of it exists), issued and not waited for.
__device__ __forceinline__ void issue_stage_loads(StageLoads& ld, const a_t* a, const b_t* b, const float* rstd,
                                                  const Layout& la, const Layout& lb, int lane, long long t0,
                                                  long long group_step, int h, int col0) {
#pragma unroll
    for (int k = 0; k < S_ITEMS; ++k) {
        const int row = segment_row(lane, k), c = col0 + segment_col(lane, k);
        const long long r = (t0 + row) * group_step + h;
        const uint4* pa = reinterpret_cast<const uint4*>(a + fold_row_offset(r, la) + c);
#pragma unroll
        for (int q = 0; q < S_CHUNKS<a_t>; ++q) ld.a[k][q] = pa[q];
#if WHAT != 0
        const uint4* pb = reinterpret_cast<const uint4*>(b + fold_row_offset(r, lb) + c);
#pragma unroll
        for (int q = 0; q < S_CHUNKS<b_t>; ++q) ld.b[k][q] = pb[q];
        ld.rs[k] = rstd[r];
#else
        (void)b, (void)lb, (void)rstd;
#endif
    }
}

// The stage's addends from its loads, stored in its buffer dst (as the converter loop below stores them).
__device__ __forceinline__ void store_stage_loads(const StageLoads& ld, float* dst, int lane) {
    constexpr int PA = 16 / sizeof(a_t);
#pragma unroll
    for (int k = 0; k < S_ITEMS; ++k) {
        float v[S_VEC];
#pragma unroll
        for (int q = 0; q < S_CHUNKS<a_t>; ++q) widen_chunk<a_t, A_CODE>(v + q * PA, ld.a[k][q]);
#if WHAT != 0
        constexpr int PB = 16 / sizeof(b_t);
        float vb[S_VEC];
#pragma unroll
        for (int q = 0; q < S_CHUNKS<b_t>; ++q) widen_chunk<b_t, B_CODE>(vb + q * PB, ld.b[k][q]);
#pragma unroll
        for (int j = 0; j < S_VEC; ++j) v[j] = contribution(v[j], vb[j], ld.rs[k]);
#endif
        store_segment(dst, v, lane, k);
    }
}
#endif  // PREFETCH

// The consumer folds the whole stages (all but a partial last one) as one stream of blocks of FOLD_BLOCK 16-byte loads,
// each block's loads issued before the previous block's adds across stage boundaries too: the next stage's first
// block is loaded (once its buffer is marked full) before this stage's last block is added, so a stage boundary
// exposes neither the shared-memory latency nor the loop's restart on the chain of adds (H200, run 23 call a: level
// or faster than a fold_column call a stage at every shape swept, 16384 x 128 fp32 rows 89.0 -> 80.5 us with 32
// columns a CTA). It holds a stage's buffer while it waits for the next, so it needs two buffers at least, and stages
// of whole blocks; other shapes take fold_column a stage. Lanes past COLS (COLS < 32) load a column of their own
// (lane % COLS) and drop the sums: no branch around the loads.
// The blocks alternate between two register sets (no copies from one to the other: a copy waits for its load, and
// the warp issues in order, so the adds behind it wait too), and whether the next stage's buffer is full is tested
// (mbar_test) before it is needed, two blocks ahead in the source (ptxas 13.0 schedules the test later, near its use:
// bench/NOTES.md, run 25), and only a buffer not yet full is waited for (H200, run 25: the consumer's stalls at a
// stage boundary, per-instruction samples). Stages of at most 4 blocks, or of an odd count, are taken two a loop
// iteration: half the loop's branches.
constexpr bool S_SEAMLESS = STREAM_ROWS % (4 * FOLD_BLOCK) == 0 && CSTAGES >= 2;
constexpr int S_BLOCKS = STREAM_ROWS / (4 * FOLD_BLOCK);
constexpr int S_PAIRED = S_BLOCKS % 2 == 1 || S_BLOCKS <= 4;

// The fold from +0.0 of the first `whole` stages (each STREAM_ROWS rows) of this lane's column, `col` its place in
// buffer 0.
__device__ __forceinline__ float fold_whole_stages(long long whole, const float* col, unsigned long long* cfull,
                                                   unsigned long long* cempty) {
    float acc = 0.0f;
    if (whole == 0) return acc;
    float4 a[FOLD_BLOCK], b[FOLD_BLOCK];
    // stage s, its first block in x: the next stage's first block lands in y if S_BLOCKS is odd, else in x
    auto stage = [&](float4 (&x)[FOLD_BLOCK], float4 (&y)[FOLD_BLOCK], long long s) {
        const int cs = static_cast<int>(s % CSTAGES), ns = static_cast<int>((s + 1) % CSTAGES);
        const float* here = col + cs * S_CTILE;
        const bool more = s + 1 < whole;
        bool ready = true;
#pragma unroll
        for (int blk = 0; blk < S_BLOCKS; ++blk) {
            float4(&cur)[FOLD_BLOCK] = blk % 2 ? y : x;
            float4(&next)[FOLD_BLOCK] = blk % 2 ? x : y;
            if (blk == (S_BLOCKS >= 2 ? S_BLOCKS - 2 : 0) && more)
                ready = mbar_test(cfull + ns, mbar_use_parity(s + 1, CSTAGES));
            if (blk + 1 < S_BLOCKS) {
                load_block(next, here, blk + 1);
            } else if (more) {  // the next stage's first block, before this stage's last adds
                if (!ready) mbar_wait(cfull + ns, mbar_use_parity(s + 1, CSTAGES));
                load_block(next, col + ns * S_CTILE, 0);
            }
#pragma unroll
            for (int j = 0; j < FOLD_BLOCK; ++j) acc = add4(acc, cur[j]);
        }
        mbar_arrive(cempty + cs);  // its last block is added: the buffer is free
    };
    mbar_wait(cfull, 0);
    load_block(a, col, 0);
    for (long long s = 0; s < whole; s += 1 + S_PAIRED) {
        stage(a, b, s);
        if constexpr (S_PAIRED) {
            if (s + 1 == whole) break;
            if constexpr (S_BLOCKS % 2 == 1)
                stage(b, a, s + 1);
            else
                stage(a, b, s + 1);
        }
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(THREADS) fold_stream(FOLD_PARAMS) {
    extern __shared__ __align__(16) unsigned char stream_smem[];
    float* addends = reinterpret_cast<float*>(stream_smem);
    unsigned long long* cfull = reinterpret_cast<unsigned long long*>(stream_smem + S_BARRIERS_AT);
    unsigned long long* cempty = cfull + CSTAGES;
    const int h = blockIdx.y;
    const int col0 = blockIdx.x * COLS;
    const long long stages = (rows_per_group + STREAM_ROWS - 1) / STREAM_ROWS;
    auto stage_rows = [&](long long s) {
        const long long left = rows_per_group - s * STREAM_ROWS;
        return left < STREAM_ROWS ? static_cast<int>(left) : STREAM_ROWS;
    };
    if (threadIdx.x == 0)
        for (int i = 0; i < CSTAGES; ++i) mbar_init(cfull + i, 32), mbar_init(cempty + i, S_CONSUMER_WARPS * 32);
    __syncthreads();
    const int warp = threadIdx.x / 32;
    if (warp < S_CONSUMER_WARPS) {  // the fold: lane c of the consumer warps adds column col0 + c
        const int c = threadIdx.x;
        float acc = 0.0f;
        long long s = 0;
        if constexpr (S_SEAMLESS) {
            s = rows_per_group / STREAM_ROWS;
            const float folded = fold_whole_stages(s, addends + column_at(c < COLS ? c : c % COLS), cfull, cempty);
            if (c < COLS) acc = folded;  // lanes past COLS folded a column of their own
        }
        for (; s < stages; ++s) {  // every stage, or the partial last one after the seamless whole stages
            const int cs = static_cast<int>(s % CSTAGES);
            mbar_wait(cfull + cs, mbar_use_parity(s, CSTAGES));
            if (c < COLS) acc = fold_column<STREAM_ROWS>(acc, stage_rows(s), addends + cs * S_CTILE + column_at(c));
            mbar_arrive(cempty + cs);
        }
        if (c < COLS && col0 + c < n) out[static_cast<long long>(h) * n + col0 + c] = Elem<OUT_CODE>::narrow(acc);
        return;
    }
#if ISOLATE
    if (warp % 4 < S_CONSUMER_WARPS) return;  // on a consumer's sub-partition: no work
    const int converter = warp / 4 * S_FREE + warp % 4 - S_CONSUMER_WARPS;
#else
    const int converter = warp - S_CONSUMER_WARPS;
#endif
    const int lane = threadIdx.x % 32;
    const Layout la{as0, as1, asg, r1, g};
    const Layout lb{bs0, bs1, bsg, r1, g};
    long long s = converter;
#if PREFETCH
    if (col0 + COLS <= n && s < stages && stage_rows(s) == STREAM_ROWS) {
        // Stage s (its loads in `cur`) stored after stage s + CONVERT_WARPS's loads are issued into `next`; false
        // where no whole stage follows. Called with the two buffers in turn (no copy from one to the other, which
        // would wait for the loads just issued).
        auto step = [&](StageLoads& cur, StageLoads& next) {
            const long long s2 = s + CONVERT_WARPS;
            const bool more = s2 < stages && stage_rows(s2) == STREAM_ROWS;
            if (more) issue_stage_loads(next, a, b, rstd, la, lb, lane, s2 * STREAM_ROWS, group_step, h, col0);
            const int cs = static_cast<int>(s % CSTAGES);
            if (s >= CSTAGES) mbar_wait(cempty + cs, mbar_use_parity(s - CSTAGES, CSTAGES));
            store_stage_loads(cur, addends + cs * S_CTILE, lane);
            mbar_arrive(cfull + cs);
            return more;
        };
        StageLoads even, odd;
        issue_stage_loads(even, a, b, rstd, la, lb, lane, s * STREAM_ROWS, group_step, h, col0);
        for (;;) {
            if (!step(even, odd)) break;
            s += CONVERT_WARPS;
            if (!step(odd, even)) break;
            s += CONVERT_WARPS;
        }
        s += CONVERT_WARPS;  // a partial last stage, if any, below
    }
#endif
    for (; s < stages; s += CONVERT_WARPS) {
        const int cs = static_cast<int>(s % CSTAGES), rows = stage_rows(s);
        float v[S_ITEMS][S_VEC];
        if (rows == STREAM_ROWS && col0 + COLS <= n)
            stage_addends<true>(v, a, b, rstd, la, lb, lane, s * STREAM_ROWS, rows, group_step, h, col0, n);
        else
            stage_addends<false>(v, a, b, rstd, la, lb, lane, s * STREAM_ROWS, rows, group_step, h, col0, n);
        if (s >= CSTAGES) mbar_wait(cempty + cs, mbar_use_parity(s - CSTAGES, CSTAGES));  // the consumer's done
        float* dst = addends + cs * S_CTILE;
#pragma unroll
        for (int k = 0; k < S_ITEMS; ++k)
            if (segment_row(lane, k) < rows) store_segment(dst, v[k], lane, k);
        mbar_arrive(cfull + cs);
    }
}
#endif  // STREAM_ROWS


#ifdef CHAIN_ROWS
// The fold as a chain of work items spread over every SM: item (k, g) takes rows [k * CHAIN_ROWS, ...) of
// column group g (COLS columns). All of a CTA's threads load the item's rows and store their contributions
// in shared memory, a column's rows contiguous; then warp 0 waits for item (k - 1, g)'s running sums,
// continues the fold over its rows (one lane per column, four rows per 16-byte load, the adds one at a
// time in row order) and hands the sums on (the last item writes the result). Loading is spread over all
// CTAs and runs ahead of the chain; what remains on the chain is CHAIN_ROWS adds and one hand-over per
// item. CTAs take items in order from a counter, so an item's predecessor is always held by a CTA that is
// running: no co-residency is assumed. `state` (zeroed by the loader for each launch): [0] the counter,
// then from int 2 on, per item and column, one 64-bit hand-over word: the running sum's bits below a ready
// mark, stored with release and polled with acquire by the successor's lane, so one round trip through L2
// carries both. One group (no per-head weights).
constexpr unsigned long long HANDED = 1ull << 32;  // the ready mark above a hand-over word's sum

constexpr int CHAIN_STRIDE = CHAIN_ROWS + 4;  // padded: the producers' stores fall in different banks
static_assert(CHAIN_ROWS % 4 == 0 && COLS <= 32, "four rows a load; one consumer lane per column");

extern "C" __global__ void __launch_bounds__(THREADS) fold_chain(FOLD_PARAMS, int* __restrict__ state,
                                                                   int aligned) {
    extern __shared__ __align__(16) unsigned char chain_smem[];
    float* contrib = reinterpret_cast<float*>(chain_smem);              // [COLS][CHAIN_STRIDE]
    int* item_slot = reinterpret_cast<int*>(contrib + COLS * CHAIN_STRIDE);
    const Layout la{as0, as1, asg, r1, g};
    const Layout lb{bs0, bs1, bsg, r1, g};
    (void)group_step;
    const int groups_n = (n + COLS - 1) / COLS;
    const long long segments = (rows_per_group + CHAIN_ROWS - 1) / CHAIN_ROWS;
    const long long items = segments * groups_n;
    unsigned long long* handover = reinterpret_cast<unsigned long long*>(state + 2);  // [items][COLS]
    const int lane = threadIdx.x;
    for (;;) {
        if (threadIdx.x == 0) *item_slot = atomicAdd(state, 1);
        __syncthreads();
        const long long i = *item_slot;
        if (i >= items) break;
        const long long k = i / groups_n;
        const int col0 = static_cast<int>(i % groups_n) * COLS;
        const long long t0 = k * CHAIN_ROWS;
        const int rows = static_cast<int>(rows_per_group - t0 < CHAIN_ROWS ? rows_per_group - t0 : CHAIN_ROWS);
#pragma unroll 4  // several rows' loads in flight per thread
        for (int r = threadIdx.x; r < rows; r += THREADS) {  // this item's contributions, column-major
            const long long t = t0 + r;
            float va[COLS];
            load_upto<a_t, A_CODE, COLS>(va, a + fold_row_offset(t, la) + col0, n - col0, aligned);
#if WHAT != 0
            float vb[COLS];
            load_upto<b_t, B_CODE, COLS>(vb, b + fold_row_offset(t, lb) + col0, n - col0, aligned);
            const float rs = rstd[t];
#pragma unroll
            for (int c = 0; c < COLS; ++c) va[c] = contribution(va[c], vb[c], rs);
#endif
#pragma unroll
            for (int c = 0; c < COLS; ++c) contrib[c * CHAIN_STRIDE + r] = va[c];
        }
        __syncthreads();
        if (lane < COLS) {
            float acc = 0.0f;
            if (k > 0) {  // the running sum of this column's rows before this item's
                const unsigned long long* from = handover + (i - groups_n) * COLS + lane;
                unsigned long long word;
                do {
                    word = load_acquire64(from);
                } while (!(word & HANDED));
                acc = __uint_as_float(static_cast<unsigned int>(word));
            }
            acc = fold_column<0>(acc, rows, contrib + lane * CHAIN_STRIDE);
            if (k + 1 < segments)
                store_release64(handover + i * COLS + lane, HANDED | __float_as_uint(acc));
            else if (col0 + lane < n)
                out[col0 + lane] = Elem<OUT_CODE>::narrow(acc);
        }
        __syncthreads();  // the contributions' buffer and the item slot are reused
    }
}
#endif  // CHAIN_ROWS
