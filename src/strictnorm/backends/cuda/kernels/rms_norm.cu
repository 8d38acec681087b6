// strictnorm: RMSNorm forward (with the fused residual add) and backward with the contract's exact bits.
//
// Mapping of a row onto threads. The row is padded with +0.0 to P = PIECE * TPR * K lanes and cut into
// pieces of PIECE contiguous lanes (one or two 16-byte vectors). TPR threads serve a row; thread t owns
// the pieces k * TPR + t for k < K, so that every load instruction of a warp reads one contiguous span.
// canon_sum is then, exactly:
//   1. an in-thread pairwise tree over each piece (a subtree of PIECE lanes),
//   2. xor-shuffles with offsets 1, 2, 4, ... below min(TPR, 32): for each k, the pieces of 32
//      (or TPR) adjacent threads, i.e. adjacent subtrees, combine pairwise,
//   3. the remaining subtrees, indexed k * WARPS + warp, combine pairwise: in-thread when a row fits
//      in a warp, else through shared memory (each warp of the row reduces them all, lanes first
//      in-thread over aligned runs, then xor-shuffles).
// Every operation is a single rounded IEEE op (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn) and the
// loader disables contraction and flush-to-zero, so any (PIECE, TPR, K, RPB) gives the same bits.
//
// Blocks stride over groups of RPB rows (row slot = threadIdx.x / TPR). With HOLD, a thread keeps its
// lanes of the row in registers between the reduction and the output pass, as raw 16- or 32-bit patterns
// packed in 32-bit words (widened again where used: half the registers of fp32 copies for 16-bit
// types, hence more resident rows per SM — the number of bytes in flight is what bounds these kernels);
// HOLD_W keeps the weight's lanes there too, across rows. Without HOLD, the output pass reads the lanes
// again (L1/L2 hits). (A register prefetch of the slot's next row was measured slower on an H200 at every
// shape: register pressure costs more resident blocks than it gains.)
//
// Pieces k >= KR (KR = ceil(N / (PIECE * TPR)) <= K) lie wholly in the padding for every thread: they are
// neither loaded nor held, and enter the tree as the exact +0.0 subtrees the contract's padding makes.
//
// EVEN (host-checked: every row segment 16-byte aligned, N a multiple of PIECE, PIECE lanes of the narrowest
// streamed dtype 16 bytes) compiles only the 16-byte paths: every piece is then whole or wholly padding, and the
// per-lane fallbacks (half the code) are gone; with UNPREDICATED its loads also drop their predicates (load_even).
// (Cache hints on the streamed loads and the row stores -- L1 no-allocate, L2 256-byte prefetch, evict-first
// stores -- were measured slower or equal on an H200 at every shape of the tables:
// bench/results/2026-11-30-h200-run10.)
//
// Macros: XC, RC, NC, WC, YC (dtype codes of x, residual, the norm input z, weight, y), MODE (0 llama,
// 1 gemma, 2 none), HAS_W, PER_HEAD, HAS_RES, PIECE, TPR, K, KR (default K), RPB, HOLD, HOLD_W, W_WITH_ROW, EVEN,
// UNTRIMMED, UNPREDICATED, STAGED, HOLD_F32, NO_RSTD (the forward stores no rstd: a caller that does not use it
// passes no buffer); BACKWARD selects the backward kernel (below) instead of the forward.
#include "common.cuh"
#include "async.cuh"

typedef Elem<XC>::T x_t;
typedef Elem<RC>::T r_t;
typedef Elem<NC>::T n_t;
typedef Elem<WC>::T w_t;
typedef Elem<YC>::T y_t;
#ifndef HOLD_W
#define HOLD_W 1
#endif
#ifndef W_WITH_ROW  // host-set with HOLD and HOLD_W 0: the weight's lanes loaded with each row's, before its sum
#define W_WITH_ROW 0
#endif
#ifndef DW_SMEM
#define DW_SMEM 0
#endif
#ifndef PADDED
#define PADDED 1
#endif
#ifndef NO_RSTD
#define NO_RSTD 0
#endif
#ifndef KR
#define KR K
#endif
#ifndef EVEN
#define EVEN 0
#endif
#ifndef UNTRIMMED  // host-set with UNPREDICATED where KR = K although pieces before the last lie in the padding
#define UNTRIMMED 0
#endif
#ifndef UNPREDICATED  // host-set with EVEN: its loads without predicates (load_even), else those of load_raw
#define UNPREDICATED 0
#endif
#ifndef STAGED  // host-set in the backward with HOLD and EVEN (not DW_SMEM): the next row copied ahead (stage_row)
#define STAGED 0
#endif
#ifndef HOLD_F32  // host-set in the backward with HOLD: a row's xh and g kept as fp32 between the passes
#define HOLD_F32 0
#endif
#ifndef PREFETCH  // host-set in the backward with HOLD (not STAGED): the slot's next row loaded into registers ahead
#define PREFETCH 0
#endif
#ifndef DW_COMBINE  // host-set in the backward with DW_PARTIALS and RPB > 1: one partial row a block (rms_bwd)
#define DW_COMBINE 0
#endif
constexpr bool EVEN_UNPREDICATED = EVEN && UNPREDICATED;
static_assert(KR >= 1 && KR <= K, "pieces with data");
// The weight's lanes held in registers: across rows (HOLD_W), or loaded with each row before its sum (per-head
// weights, W_WITH_ROW: then in flight across the row sum's barriers; reloaded piece by piece after the sum,
// ptxas issued each load only just ahead of its use, one L2 round trip after another: sm_90 SASS, NVRTC 13.0).
constexpr bool HOLD_WEIGHT = HOLD && (HOLD_W || W_WITH_ROW) && HAS_W;
constexpr bool WEIGHT_EACH_ROW = PER_HEAD || W_WITH_ROW;  // the held weight loaded with each row
constexpr int THREADS = TPR * RPB;
constexpr int WARP_SIZE = 32;
constexpr int ROW_WARPS = TPR > WARP_SIZE ? TPR / WARP_SIZE : 1;
constexpr int SUBTREES = K * ROW_WARPS;  // partial sums per row after step 2
static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "block shape");

// The block's dynamic shared memory as floats (on the CPU, the emulation's buffer: bench/emulate/shim.h).
__device__ __forceinline__ float* dynamic_floats() {
#ifdef STRICTNORM_EMULATED
    return reinterpret_cast<float*>(g_dynamic_smem);
#else
    extern __shared__ float dynamic_f32[];
    return dynamic_f32;
#endif
}

__device__ __forceinline__ int piece_col(int k, int t) { return (k * TPR + t) * PIECE; }
// Lanes of the row from piece k's first lane on, unclamped: <= 0 none of the piece, >= PIECE all of it. Kept
// unclamped on purpose: ptxas (NVRTC 13.0, sm_90) compiled `aligned && max(0, min(PIECE, left)) == PIECE` for the
// held weight into VIMNMX.RELU with a predicate output, and on an H200 the branch on that predicate took the
// 16-byte load for left == 0: a read past the weight's end, garbage in padded lanes (compute-sanitizer memcheck,
// bench/NOTES.md). Plain compares of `left` compile to ISETP.
__device__ __forceinline__ int piece_left(int k, int t, int n) { return n - piece_col(k, t); }

// One piece as raw bit patterns packed in 32-bit words (two 16-bit values per word): rows held in
// registers take half the registers of their fp32 widening, so more rows are in flight per SM.
template <int CODE>
struct Raw {
    typedef typename Elem<CODE>::T T;
    static constexpr int SIZE = sizeof(T);
    static constexpr int WORDS = (PIECE * SIZE + 3) / 4;
    static __device__ __forceinline__ float value(const unsigned int* w, int i) {  // i: a constant after unrolling
        if constexpr (SIZE == 4) return Elem<CODE>::from_bits(w[i]);
        else return Elem<CODE>::from_bits(i % 2 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu);
    }
};

// One whole piece's bits through 16-byte loads.
template <int CODE>
__device__ __forceinline__ void load_whole(unsigned int* w, const typename Elem<CODE>::T* p) {
    typedef Raw<CODE> R;
    static_assert(R::WORDS % 4 == 0, "whole 16-byte chunks");
#pragma unroll
    for (int q = 0; q < R::WORDS / 4; ++q) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[q];
        w[4 * q] = u.x, w[4 * q + 1] = u.y, w[4 * q + 2] = u.z, w[4 * q + 3] = u.w;
    }
}

// Loads one piece's bits; lanes at or past `left` (piece_left) get +0.0's bits (zero). 16-byte vector loads
// when the piece is whole and `aligned` (pointers and row strides checked by the host).
template <int CODE>
__device__ __forceinline__ void load_raw(unsigned int* w, const typename Elem<CODE>::T* p, int left, bool aligned) {
    typedef Raw<CODE> R;
    static_assert(!EVEN || R::WORDS % 4 == 0, "EVEN: whole 16-byte pieces");
    if constexpr (R::WORDS % 4 == 0) {
        if ((EVEN || aligned) && left >= PIECE) {
            load_whole<CODE>(w, p);
            return;
        }
    }
#pragma unroll
    for (int j = 0; j < R::WORDS; ++j) w[j] = 0u;
    if constexpr (!EVEN) {  // with EVEN, a piece that is not whole is wholly padding
#pragma unroll
        for (int i = 0; i < PIECE; ++i)
            if (i < left) w[i * R::SIZE / 4] |= Elem<CODE>::bits(p[i]) << (i * R::SIZE % 4 * 8);
    }
}

template <int CODE>
__device__ __forceinline__ void unpack(float* out, const unsigned int* w) {
#pragma unroll
    for (int i = 0; i < PIECE; ++i) out[i] = Raw<CODE>::value(w, i);
}

// Loads one piece widened to fp32 (lanes at or past `left` read as +0.0).
template <int CODE>
__device__ __forceinline__ void load_piece(float* out, const typename Elem<CODE>::T* p, int left, bool aligned) {
    unsigned int w[Raw<CODE>::WORDS];
    load_raw<CODE>(w, p, left, aligned);
    unpack<CODE>(out, w);
}

template <int CODE>
__device__ __forceinline__ void store_piece(typename Elem<CODE>::T* p, const float* v, int left, bool aligned) {
    typedef typename Elem<CODE>::T t;
    constexpr int PER = 16 / sizeof(t);
    static_assert(!EVEN || PIECE % PER == 0, "EVEN: whole 16-byte pieces");
    if constexpr (PIECE % PER == 0) {
        if ((EVEN || aligned) && left >= PIECE) {
#pragma unroll
            for (int q = 0; q < PIECE / PER; ++q) {
                uint4 u;
                t* e = reinterpret_cast<t*>(&u);
#pragma unroll
                for (int j = 0; j < PER; ++j) e[j] = Elem<CODE>::narrow(v[q * PER + j]);
                reinterpret_cast<uint4*>(p)[q] = u;
            }
            return;
        }
    }
    if constexpr (!EVEN) {
#pragma unroll
        for (int i = 0; i < PIECE; ++i)
            if (i < left) p[i] = Elem<CODE>::narrow(v[i]);
    }
}

// A row's lanes held by one thread (HOLD), as raw bits: piece k is lanes [(k * TPR + t) * PIECE, ... + PIECE).
template <int CODE>
struct Held {
    unsigned int w[KR][Raw<CODE>::WORDS];
};

// EVEN with UNPREDICATED: piece k of a row (`row` its first lane; `left` as piece_left gives it, or 0) through an
// unpredicated 16-byte load. Predicated, ptxas -- NVRTC 13.0, sm_90 -- issued a held row's last load after pass 1's
// arithmetic on the others (two memory round trips a row; bench/NOTES.md, run 10) and each of pass 2's weight loads
// just before its use; unpredicated, the forward gained on an H200 (8192 x 8192 75 -> 67 us, 262144 x 128 38 -> 36)
// but some backward entries lost (2048 x 18432 101 -> 119; bench/results/2026-11-30-h200-run11), hence a knob per
// table entry. Every piece before the last one with data is whole (known at compile time unless UNTRIMMED: then
// pieces k < KR - 1 may lie in the padding too, and each is checked); a padding piece reads the row's first piece
// and is zeroed. A row past the end is read as row 0 (the callers point it there; nothing of it is stored or
// summed into dW).
template <int CODE>
__device__ __forceinline__ void load_even(unsigned int* w, const typename Elem<CODE>::T* row, int k, int t, int left) {
    const bool whole = (!UNTRIMMED && k + 1 < KR) || left >= PIECE;
    load_whole<CODE>(w, row + (whole ? piece_col(k, t) : 0));
#pragma unroll
    for (int j = 0; j < Raw<CODE>::WORDS; ++j) w[j] = whole ? w[j] : 0u;
}

// A row's lanes into registers.
template <int CODE>
__device__ __forceinline__ void load_held(Held<CODE>& h, const typename Elem<CODE>::T* row, int t, int n, bool live,
                                          bool aligned) {
#pragma unroll
    for (int k = 0; k < KR; ++k) {
        if constexpr (EVEN_UNPREDICATED) load_even<CODE>(h.w[k], row, k, t, piece_left(k, t, n));
        else load_raw<CODE>(h.w[k], row + piece_col(k, t), live ? piece_left(k, t, n) : 0, aligned);
    }
}

// Hides the held words' values from the optimizer at this point: without it, the compiler keeps the fp32
// widening of pass 1 (or of the loop-invariant weight) alive for pass 2 instead of the packed words.
template <int CODE>
__device__ __forceinline__ void launder(Held<CODE>& h) {
#pragma unroll
    for (int k = 0; k < KR; ++k)
#pragma unroll
        for (int j = 0; j < Raw<CODE>::WORDS; ++j) asm volatile("" : "+r"(h.w[k][j]));
}

// fp32 accumulators, one per lane a thread serves (the backward's dW partials with HOLD).
struct Lanes {
    float v[KR][PIECE];
};

// A row's mean, total / n. With MEAN_SHIFT (host-set where n = 2^MEAN_SHIFT) one multiply by the exact 2^-MEAN_SHIFT:
// the same rounding of the same exact quotient as __fdiv_rn, subnormal results, infinities and NaN included
// (reference.exact_mean_scale), without the IEEE division's instructions on every row's critical path.
__device__ __forceinline__ float row_mean(float total, int n) {
#ifdef MEAN_SHIFT
    static_assert(MEAN_SHIFT >= 0 && MEAN_SHIFT < 31, "n = 2^MEAN_SHIFT");
    (void)n;
    return __fmul_rn(total, 1.0f / static_cast<float>(1u << MEAN_SHIFT));
#else
    return __fdiv_rn(total, static_cast<float>(n));
#endif
}

// canon_sum of a row from this thread's piece sums part[k] (steps 2 and 3 above; part is overwritten);
// every thread of the row gets the total. All threads of the block must call it together; `scratch`
// holds SUBTREES floats per row slot and alternates between two halves (`parity`), so one barrier per
// call suffices.
__device__ __forceinline__ float row_sum(float (&part)[K], float (*scratch)[RPB][SUBTREES], int parity) {
    constexpr int IN_WARP = TPR < WARP_SIZE ? TPR : WARP_SIZE;
#pragma unroll
    for (int off = 1; off < IN_WARP; off <<= 1)
#pragma unroll
        for (int k = 0; k < KR; ++k)  // part[k >= KR] is +0.0 and stays so
            part[k] = __fadd_rn(part[k], __shfl_xor_sync(0xffffffffu, part[k], off));
#if TPR <= 32
    (void)scratch;
    (void)parity;
    return pair_tree<K>(part);  // subtree k of the row is part[k]
#else
    const int slot = threadIdx.x / TPR, warp = (threadIdx.x % TPR) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    float* s = scratch[parity][slot];
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < K; ++k) s[k * ROW_WARPS + warp] = part[k];
    }
    __syncthreads();
    float u;
#if K * TPR >= 1024  // SUBTREES = K * TPR / 32 >= 32: lane l reduces the aligned run [l * RUN, (l + 1) * RUN)
    constexpr int RUN = SUBTREES / WARP_SIZE;
    float r[RUN];
#pragma unroll
    for (int j = 0; j < RUN; ++j) r[j] = s[lane * RUN + j];
    u = pair_tree<RUN>(r);
#pragma unroll
    for (int off = 1; off < WARP_SIZE; off <<= 1) u = __fadd_rn(u, __shfl_xor_sync(0xffffffffu, u, off));
#else  // lanes [0, SUBTREES) hold one subtree each; xor offsets below SUBTREES never reach the rest
    u = lane < SUBTREES ? s[lane] : 0.0f;
#pragma unroll
    for (int off = 1; off < SUBTREES; off <<= 1) u = __fadd_rn(u, __shfl_xor_sync(0xffffffffu, u, off));
#endif
    return __shfl_sync(0xffffffffu, u, 0);
#endif
}

// The normalized value as y's scaling step uses it (contract, forward step 3).
__device__ __forceinline__ float normalized(float x, float rstd) { return normalized_as_used<MODE, NC>(x, rstd); }

// wf = f32(w) + offset (in fp32), rounded to z's dtype in mode none, in place over a widened piece.
__device__ __forceinline__ void effective_weight(float* wp, float offset) {
#pragma unroll
    for (int i = 0; i < PIECE; ++i) wp[i] = effective_weight_of<MODE, NC>(wp[i], offset);
}

// Piece k of a row: unpacked from the lanes this thread holds (HELD), or loaded from the row (`row` its first lane;
// lanes at or past `left` read as +0.0).
template <int CODE, bool HELD = HOLD>
__device__ __forceinline__ void fetch_piece(float* a, const Held<CODE>& held, int k, const typename Elem<CODE>::T* row,
                                            int left, bool aligned) {
    if constexpr (HELD) {
        (void)row, (void)left, (void)aligned;
        unpack<CODE>(a, held.w[k]);
    } else if constexpr (EVEN_UNPREDICATED) {
        (void)aligned;
        unsigned int w[Raw<CODE>::WORDS];
        load_even<CODE>(w, row, k, threadIdx.x % TPR, left);
        unpack<CODE>(a, w);
    } else {
        load_piece<CODE>(a, row + piece_col(k, threadIdx.x % TPR), left, aligned);
    }
}

// Piece k of the effective weight: from the held weight (HOLD_WEIGHT) or the weight row. (Measured slower on an H200
// in every table entry, both directions, bench/results/2026-11-30-h200-run13: the effective fp32 weight in shared
// memory, computed once a block (the forward 35 -> 44 us at 8192 x 4096, the backward 71 -> 79), and held in
// registers as fp32 instead of raw bits (the forward 10.1 -> 11.9 us at 2048 x 4096, the backward 117 -> 167 at
// 8192 x 8192).)
__device__ __forceinline__ void fetch_weight(float* wp, const Held<WC>& held, int k, const w_t* row, int left,
                                             bool aligned, float offset) {
    fetch_piece<WC, HOLD_WEIGHT>(wp, held, k, row, left, aligned);
    effective_weight(wp, offset);
}

// Rows of the grid-stride loop: blocks take groups of RPB rows, blockIdx.x + j * gridDim.x. The loop runs while the
// block's group is a real one: the same test for every thread of a block (row_sum synchronizes the block), and no
// trip count to divide out before the first load (a one-group block's prologue lost its division by gridDim.x).
// A thread's row < rows implies its group is real, so loads ahead (STAGED, PREFETCH) test the row alone.
struct RowWalk {
    long long row, stride, group, groups;
    __device__ __forceinline__ RowWalk(long long rows) {
        groups = (rows + RPB - 1) / RPB;
        stride = static_cast<long long>(gridDim.x) * RPB;
        group = blockIdx.x;
        row = group * RPB + threadIdx.x / TPR;
    }
    __device__ __forceinline__ bool more() const { return group < groups; }
    __device__ __forceinline__ void next() { group += gridDim.x, row += stride; }
};

// Weight row (head) of logical row r for per-head weights.
__device__ __forceinline__ long long head_of(long long r, long long g) {
    return r <= 0x7fffffffLL ? static_cast<long long>(static_cast<unsigned int>(r) % static_cast<unsigned int>(g))
                             : r % g;
}

__device__ __forceinline__ long long offset_of(long long r, long long s0, long long s1, long long sg, long long r1,
                                               long long g) {
    if (g == 1 && r1 == 1) return r * s0;  // the common case: no divisions
    return row_offset(r, Layout{s0, s1, sg, r1, g});
}

// MIN_BLOCKS: the blocks an SM the kernel is compiled for (ptxas then keeps a thread's registers within
// 65536 / (THREADS * MIN_BLOCKS)); unset, the block size alone bounds them.
#ifdef MIN_BLOCKS
#define KERNEL_BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else
#define KERNEL_BOUNDS __launch_bounds__(THREADS)
#endif

#ifndef BACKWARD
extern "C" __global__ void KERNEL_BOUNDS rms_fwd(
    const x_t* __restrict__ x, long long xs0, long long xs1, long long xsg,
    const r_t* __restrict__ res, long long rs0, long long rs1, long long rsg, n_t* z,
    const w_t* __restrict__ w, long long wsg, y_t* __restrict__ y, float* __restrict__ rstd_out,
    long long rows, int n, long long r1, long long g, float eps, float offset, int aligned) {
    __shared__ float scratch[2][RPB][SUBTREES];
    const int t = threadIdx.x % TPR;
    RowWalk walk(rows);
    Held<WC> wh;  // HOLD_WEIGHT: the weight's lanes, loaded once (with each row: WEIGHT_EACH_ROW)
    if constexpr (HOLD_WEIGHT && !WEIGHT_EACH_ROW) load_held<WC>(wh, w, t, n, true, aligned);
    for (long long it = 0; walk.more(); ++it, walk.next()) {
        const bool live = walk.row < rows;
        const long long r = live ? walk.row : 0;
        const x_t* xrow = x + offset_of(r, xs0, xs1, xsg, r1, g);
        const r_t* rrow = res + (HAS_RES ? offset_of(r, rs0, rs1, rsg, r1, g) : 0);
        const w_t* wrow = w + (PER_HEAD ? head_of(r, g) * wsg : 0);
        (void)rrow, (void)wrow;
        Held<XC> xh;  // HOLD: this thread's lanes of x and the residual
        Held<RC> rh;
#if HOLD
        load_held<XC>(xh, xrow, t, n, live, aligned);
#if HAS_RES
        load_held<RC>(rh, rrow, t, n, live, aligned);
#endif
#endif
        if constexpr (HOLD_WEIGHT && WEIGHT_EACH_ROW) load_held<WC>(wh, wrow, t, n, true, aligned);
        // piece k of the norm's input: x, or z = rd(x + residual) (recomputed from the held lanes in pass 2
        // with HOLD, read back from z, which pass 1 wrote, otherwise)
        auto input = [&](int k, float* a, int left, bool second_pass) {
#if HAS_RES
            if (!HOLD && second_pass) {
                load_piece<NC>(a, z + r * n + piece_col(k, t), left, aligned);
                return;
            }
            float b[PIECE];
            fetch_piece<XC>(a, xh, k, xrow, left, aligned);
            fetch_piece<RC>(b, rh, k, rrow, left, aligned);
#pragma unroll
            for (int i = 0; i < PIECE; ++i) a[i] = round_f32<NC>(__fadd_rn(a[i], b[i]));
#else
            (void)second_pass;
            fetch_piece<XC>(a, xh, k, xrow, left, aligned);
#endif
        };
        // pass 1: z (stored as residual_out with the fused add), its squares, the piece sums
        float part[K] = {};  // pieces k >= KR: +0.0 subtrees
#pragma unroll
        for (int k = 0; k < KR; ++k) {
            const int left = live ? piece_left(k, t, n) : 0;
            float a[PIECE];
            input(k, a, left, false);
#if HAS_RES
            store_piece<NC>(z + r * n + piece_col(k, t), a, left, aligned);
#endif
#pragma unroll
            for (int i = 0; i < PIECE; ++i) a[i] = __fmul_rn(a[i], a[i]);
            part[k] = pair_tree<PIECE>(a);
        }
        const float ss = row_sum(part, scratch, it & 1);
        const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(row_mean(ss, n), eps)));
        if (!NO_RSTD && live && t == 0) rstd_out[r] = rstd;
#if HOLD
        launder(xh);
        if constexpr (HAS_RES) launder(rh);
        if constexpr (HOLD_WEIGHT) launder(wh);
#endif
        // pass 2: y. Without HOLD, the input is read again (this thread's own lanes: from L1/L2) and so is w.
#pragma unroll
        for (int k = 0; k < KR; ++k) {
            const int c0 = piece_col(k, t), left = live ? piece_left(k, t, n) : 0;
            float a[PIECE];
            input(k, a, left, true);
#if HAS_W
            float wp[PIECE];
            // `live ? piece_left(...)` rather than `left` (same value): NVRTC 13.0 compiled the latter to
            // 25% more sm_90 code for the stream-mode forward
            fetch_weight(wp, wh, k, wrow, live ? piece_left(k, t, n) : 0, aligned, offset);
#endif
#pragma unroll
            for (int i = 0; i < PIECE; ++i) {
                float o = normalized(a[i], rstd);
#if HAS_W
                o = __fmul_rn(o, wp[i]);
#if MODE == 2
                o = round_f32<NC>(o);
#endif
#endif
                a[i] = o;
            }
            store_piece<YC>(y + r * n + c0, a, left, aligned);
        }
    }
}
#endif  // !BACKWARD

#ifdef BACKWARD
// STAGED: while a thread computes one row, cp.async copies its pieces of the slot's next row (z and dy) into
// shared memory, two stages: the loads of the next row are in flight during this row's reduction and output
// pass without holding registers (a register prefetch cost resident blocks; see the top). Each thread copies
// and later reads only its own 16-byte chunks, so its own cp.async waits order them: no barrier. A stage holds
// STAGE_CHUNKS chunks a thread, chunk c of thread i at c * THREADS + i (consecutive threads, consecutive
// chunks). With EVEN a piece is whole or wholly padding: padding pieces and rows past the end are zero-filled
// copies of nothing.
template <int CODE>
constexpr int CHUNKS = Raw<CODE>::WORDS / 4;  // 16-byte chunks a piece

template <int CODE>
__device__ __forceinline__ void stage_row(uint4* slot, const typename Elem<CODE>::T* row, int t, int n, bool live) {
#pragma unroll
    for (int k = 0; k < KR; ++k) {
        const bool whole = live && piece_left(k, t, n) >= PIECE;
        const uint4* src = reinterpret_cast<const uint4*>(row + (whole ? piece_col(k, t) : 0));
#pragma unroll
        for (int q = 0; q < CHUNKS<CODE>; ++q)
            cp_async16(slot + (k * CHUNKS<CODE> + q) * THREADS, src + q, whole ? 16 : 0);
    }
}

template <int CODE>
__device__ __forceinline__ void unstage_row(Held<CODE>& h, const uint4* slot) {
#pragma unroll
    for (int k = 0; k < KR; ++k)
#pragma unroll
        for (int q = 0; q < CHUNKS<CODE>; ++q) {
            const uint4 u = slot[(k * CHUNKS<CODE> + q) * THREADS];
            h.w[k][4 * q] = u.x, h.w[k][4 * q + 1] = u.y, h.w[k][4 * q + 2] = u.z, h.w[k][4 * q + 3] = u.w;
        }
}

// Backward: dx = rd((g - xh * c) * rstd [+ f32(dres)], NC) per row with g = f32(dy) * wf,
// xh = z * rstd, c = canon_sum(xh * g) / N (contract, backward). With DW_PARTIALS each row slot of a
// block also sums its rows' dW contributions (in row order) into dw_part[block * RPB + slot], reduced
// afterwards in a fixed order ("fast" dW): in registers with HOLD (unless DW_SMEM), else in dynamic shared
// memory (RPB * n floats). DW_COMBINE: the block's RPB slot rows are added in slot order (from +0.0) in that
// shared memory first, and the block writes one row, dw_part[block]: RPB times fewer partial rows to write and
// sum (at 128 columns RPB is 8-16: 4096 x 128 wrote 4096 partial rows, as many as dy has). dx may alias dy
// (in place): a row's lanes are read and written by the same thread, reads first.
// HOLD_F32: pass 1 keeps each lane's xh and g in fp32 registers and adds the row's dW contributions (rstd is an
// input: they need not wait for the row's sum), so pass 2 only computes dx from them: about half the instructions
// an element of widening z, dy and the weight twice, for twice the registers of the packed rows.
// PREFETCH: the slot's next row's z and dy (packed, as held) and rstd loaded into registers before this row's sums, so
// their loads are in flight while this row computes and stores; the same loads, earlier. (Measured slower at the
// tables' grids before run 10; the Triton and cute backwards won with it at 2 blocks or programs an SM, fewer and
// fuller: bench/NOTES.md, runs 14 and 16.)
// Extra macros: DYC (dy's dtype code), HAS_DRES, DW_PARTIALS, DW_SMEM, DW_COMBINE, PADDED (N below P: padded lanes
// exist), STAGED, HOLD_F32, PREFETCH.
typedef Elem<DYC>::T dy_t;
static_assert(!STAGED || (HOLD && EVEN && !DW_SMEM), "STAGED: held rows of whole pieces, shared memory for them");
static_assert(!PREFETCH || (HOLD && !STAGED), "PREFETCH: held rows, not staged");
static_assert(!HOLD_F32 || HOLD, "HOLD_F32: held rows");
static_assert(!DW_COMBINE || (DW_PARTIALS && RPB > 1 && !STAGED), "DW_COMBINE: partial rows of several slots");
constexpr int STAGE_CHUNKS = KR * (CHUNKS<NC> + CHUNKS<DYC>);  // a thread's chunks in one stage (z, then dy)

extern "C" __global__ void KERNEL_BOUNDS rms_bwd(
    const dy_t* dy, long long ds0, long long ds1, long long dsg,
    const n_t* __restrict__ zin, long long zs0, long long zs1, long long zsg,
    const w_t* __restrict__ w, long long wsg, const float* __restrict__ rstd_in,
    const n_t* __restrict__ dres, long long es0, long long es1, long long esg,
    n_t* dx, long long xs0, long long xs1, long long xsg, float* __restrict__ dw_part,
    long long rows, int n, long long r1, long long g, float offset, int aligned) {
    __shared__ float scratch[2][RPB][SUBTREES];
#if DW_PARTIALS
    launch_dependents();  // the partial sum may be scheduled now; it waits for this grid's end (common.cuh)
#endif
    const int t = threadIdx.x % TPR;
    RowWalk walk(rows);
#if DW_PARTIALS && HOLD && !DW_SMEM
    Lanes dw_acc;
#pragma unroll
    for (int k = 0; k < KR; ++k)
#pragma unroll
        for (int i = 0; i < PIECE; ++i) dw_acc.v[k][i] = 0.0f;
#elif DW_PARTIALS
    float* dw_row = dynamic_floats() + (threadIdx.x / TPR) * n;  // RPB rows of n: this thread's lanes of its slot's row
#pragma unroll
    for (int k = 0; k < KR; ++k)
#pragma unroll
        for (int i = 0; i < PIECE; ++i)
            if (i < piece_left(k, t, n)) dw_row[piece_col(k, t) + i] = 0.0f;
#endif
    Held<WC> wh;  // HOLD_WEIGHT: the weight's lanes, loaded once (with each row: WEIGHT_EACH_ROW)
    if constexpr (HOLD_WEIGHT && !WEIGHT_EACH_ROW) load_held<WC>(wh, w, t, n, true, aligned);
#if STAGED
#ifdef STRICTNORM_EMULATED
    uint4* const mine = reinterpret_cast<uint4*>(g_dynamic_smem) + threadIdx.x;
#else
    extern __shared__ uint4 stage_smem[];  // 2 stages of STAGE_CHUNKS * THREADS chunks
    uint4* const mine = stage_smem + threadIdx.x;
#endif
    auto stage = [&](int s, long long row, bool lv) {  // one commit group per call, empty ones included
        const long long rs = lv ? row : 0;
        uint4* slot = mine + s * STAGE_CHUNKS * THREADS;
        stage_row<NC>(slot, zin + offset_of(rs, zs0, zs1, zsg, r1, g), t, n, lv);
        stage_row<DYC>(slot + KR * CHUNKS<NC> * THREADS, dy + offset_of(rs, ds0, ds1, dsg, r1, g), t, n, lv);
        cp_async_commit();
    };
    stage(0, walk.row, walk.row < rows);
#endif
#if PREFETCH
    Held<NC> next_z;  // the slot's next row, as held, and its rstd
    Held<DYC> next_d;
    float next_rstd;
    auto prefetch = [&](long long row, bool lv) {  // a row past the end reads row 0 (nothing of it is used)
        const long long rs = lv ? row : 0;
        load_held<NC>(next_z, zin + offset_of(rs, zs0, zs1, zsg, r1, g), t, n, lv, aligned);
        load_held<DYC>(next_d, dy + offset_of(rs, ds0, ds1, dsg, r1, g), t, n, lv, aligned);
        next_rstd = lv ? rstd_in[rs] : 0.0f;
    };
    prefetch(walk.row, walk.row < rows);
#endif
    for (long long it = 0; walk.more(); ++it, walk.next()) {
        const bool live = walk.row < rows;
        const long long r = live ? walk.row : 0;
        const n_t* zrow = zin + offset_of(r, zs0, zs1, zsg, r1, g);
        const dy_t* drow = dy + offset_of(r, ds0, ds1, dsg, r1, g);
        const w_t* wrow = w + (PER_HEAD ? head_of(r, g) * wsg : 0);
        (void)wrow;
        Held<NC> zh;  // HOLD: this thread's lanes of z and dy
        Held<DYC> dh;
#if STAGED
        {
            const long long next = walk.row + walk.stride;
            asm volatile("" ::: "memory");  // the previous row's reads of the stage refilled here come first
            stage(static_cast<int>((it + 1) & 1), next, next < rows);
            cp_async_wait<1>();  // this thread's copies of this row landed (the next row's may be in flight)
            asm volatile("" ::: "memory");  // and the compiler reads them after the wait
            const uint4* slot = mine + static_cast<int>(it & 1) * STAGE_CHUNKS * THREADS;
            unstage_row<NC>(zh, slot);
            unstage_row<DYC>(dh, slot + KR * CHUNKS<NC> * THREADS);
        }
#elif PREFETCH
        zh = next_z, dh = next_d;
        const float rstd = next_rstd;
        {
            const long long next = walk.row + walk.stride;
            prefetch(next, next < rows);
        }
#elif HOLD
        load_held<NC>(zh, zrow, t, n, live, aligned);
        load_held<DYC>(dh, drow, t, n, live, aligned);
#endif
        if constexpr (HOLD_WEIGHT && WEIGHT_EACH_ROW) load_held<WC>(wh, wrow, t, n, true, aligned);
#if !PREFETCH
        const float rstd = live ? rstd_in[r] : 0.0f;
#endif
        // this thread's pieces of z, dy and the effective weight (1.0 without one)
        auto get = [&](int k, float* zp, float* dp, float* wp) {
            const int left = live ? piece_left(k, t, n) : 0;
            fetch_piece<NC>(zp, zh, k, zrow, left, aligned);
            fetch_piece<DYC>(dp, dh, k, drow, left, aligned);
#if HAS_W
            fetch_weight(wp, wh, k, wrow, left, aligned, offset);
#else
#pragma unroll
            for (int i = 0; i < PIECE; ++i) wp[i] = 1.0f;
#endif
        };
        // the row's dW contributions of piece k (its first column c0, `left` as piece_left gives it for live rows),
        // summed into this thread's partials (in row order)
        auto add_dw = [&](int k, int c0, int left, const float* zp, const float* dp) {
#if DW_PARTIALS
            if (live) {
#pragma unroll
                for (int i = 0; i < PIECE; ++i) {
                    const float contrib = __fmul_rn(dp[i], normalized(zp[i], rstd));
#if HOLD && !DW_SMEM
                    dw_acc.v[k][i] = __fadd_rn(dw_acc.v[k][i], contrib);
                    (void)c0, (void)left;
#else
                    if (i < left) dw_row[c0 + i] = __fadd_rn(dw_row[c0 + i], contrib);
#endif
                }
            }
#else
            (void)k, (void)c0, (void)left, (void)zp, (void)dp;
#endif
        };
#if HOLD_F32
        Lanes xhl, gl;  // xh and g of this thread's lanes
#endif
        float part[K] = {};  // pieces k >= KR: +0.0 subtrees
#pragma unroll
        for (int k = 0; k < KR; ++k) {
            float zp[PIECE], dp[PIECE], wp[PIECE], prod[PIECE];
            get(k, zp, dp, wp);
#pragma unroll
            for (int i = 0; i < PIECE; ++i) {
                const float xh = __fmul_rn(zp[i], rstd), gv = gscale<HAS_W>(dp[i], wp[i]);
                prod[i] = __fmul_rn(xh, gv);
#if HOLD_F32
                xhl.v[k][i] = xh, gl.v[k][i] = gv;
#endif
            }
#if HOLD_F32
            add_dw(k, piece_col(k, t), live ? piece_left(k, t, n) : 0, zp, dp);
#endif
#if PADDED
            // padded lanes add +0.0, as canon_sum pads: computed from the zero-filled lanes they would be
            // 0 * (0 * (0 + offset)), -0.0 for a negative offset
            const int left = live ? piece_left(k, t, n) : 0;
#pragma unroll
            for (int i = 0; i < PIECE; ++i) prod[i] = i < left ? prod[i] : 0.0f;
#endif
            part[k] = pair_tree<PIECE>(prod);
        }
        const float c = row_mean(row_sum(part, scratch, it & 1), n);
#if HOLD && !HOLD_F32
        launder(zh), launder(dh);
#endif
#if HOLD
        if constexpr (HOLD_WEIGHT) launder(wh);
#endif
        n_t* xrow = dx + offset_of(r, xs0, xs1, xsg, r1, g);
#pragma unroll
        for (int k = 0; k < KR; ++k) {
            const int c0 = piece_col(k, t), left = live ? piece_left(k, t, n) : 0;
            float out[PIECE];
#if !HOLD_F32
            float zp[PIECE], dp[PIECE], wp[PIECE];
            get(k, zp, dp, wp);
#endif
#if HAS_DRES
            load_piece<NC>(out, dres + offset_of(r, es0, es1, esg, r1, g) + c0, left, aligned);
#endif
#pragma unroll
            for (int i = 0; i < PIECE; ++i) {
#if HOLD_F32
                const float xh = xhl.v[k][i], gv = gl.v[k][i];
#else
                const float xh = __fmul_rn(zp[i], rstd), gv = gscale<HAS_W>(dp[i], wp[i]);
#endif
                const float o = __fmul_rn(__fsub_rn(gv, __fmul_rn(xh, c)), rstd);
#if HAS_DRES
                out[i] = __fadd_rn(o, out[i]);
#else
                out[i] = o;
#endif
            }
            store_piece<NC>(xrow + c0, out, left, aligned);
#if !HOLD_F32
            add_dw(k, c0, left, zp, dp);
#endif
        }
    }
#if STAGED
    cp_async_wait<0>();  // the last (empty) stage: no copy outlives the kernel
#endif
#if DW_COMBINE
#if HOLD && !DW_SMEM
    float* dw_row = dynamic_floats() + (threadIdx.x / TPR) * n;
#pragma unroll
    for (int k = 0; k < KR; ++k)
#pragma unroll
        for (int i = 0; i < PIECE; ++i)
            if (i < piece_left(k, t, n)) dw_row[piece_col(k, t) + i] = dw_acc.v[k][i];
#endif
    __syncthreads();  // every slot's row in shared memory
    const float* slots = dynamic_floats();
    float* out = dw_part + static_cast<long long>(blockIdx.x) * n;
    for (int c = threadIdx.x; c < n; c += THREADS) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < RPB; ++j) s = __fadd_rn(s, slots[j * n + c]);
        out[c] = s;
    }
#elif DW_PARTIALS
    const long long part_row = static_cast<long long>(blockIdx.x) * RPB + threadIdx.x / TPR;
#pragma unroll
    for (int k = 0; k < KR; ++k) {
        const int c0 = piece_col(k, t), cols = piece_left(k, t, n);
        float* out = dw_part + part_row * n + c0;
#if HOLD && !DW_SMEM
        const float* acc = dw_acc.v[k];
#else
        const float* acc = dw_row + c0;
#endif
        // 16-byte stores where pieces are whole or wholly padding (n % 4 == 0: rows 16-byte aligned). Per lane, a warp's
        // stores touched 32-byte sectors 8 times each (ncu: 29% excess sectors); vectorized, the backward went 30.0 ->
        // 25.3 us at 2048 x 4096 and 71.0 -> 62.4 at 8192 x 4096 on an H200 (bench/results/2026-11-30-h200-run13).
        if constexpr (EVEN && PIECE % 4 == 0) {
            if (cols >= PIECE) {
#pragma unroll
                for (int q = 0; q < PIECE / 4; ++q)
                    reinterpret_cast<float4*>(out)[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2],
                                                                    acc[4 * q + 3]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < PIECE; ++i)
                if (i < cols) out[i] = acc[i];
        }
    }
#endif
}
#endif  // BACKWARD
