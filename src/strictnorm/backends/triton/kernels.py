"""Triton kernels for the contract (docs/contract.md). Launch with enable_fp_fusion=False.

Exactness notes, each found the hard way (../docs/contract.md, "Implementing a backend"):
- fp32 division and square root are `tl.div_rn` / `tl.sqrt_rn`; Triton's `/` is not IEEE on GPUs.
- fp32 -> bf16 rounding: on a GPU the hardware conversion (round to nearest even, cvt.rn.bf16.f32 on
  NVIDIA); under the Triton interpreter (CI), which truncates and flushes subnormals on that path,
  integer operations on the bit pattern give the same round to nearest even. bf16 results are stored
  as int16 bits either way. The interpreter's bf16 -> fp32 cast flushes subnormals too: loads widen
  bf16 through the bits there (`widen`).
- canon_sum is the contract's adjacent-first pairwise tree, one level at a time over pairs (2j, 2j+1),
  which fixes the order independently of the compiler's layouts and of the launch shape. Signed zeros
  count: (-0) + (-0) is -0. A compiled tl.sum over a pair is that one add; the interpreter's tl.sum is
  numpy's, which starts from +0.0, so under the interpreter the pair is split and added instead.
- Padded lanes (columns N..P-1) enter canon_sum as +0.0, as the contract pads: their effective weight is
  +0.0, not 0 + offset (whose product with a zero-filled dy is -0.0 for a negative offset).
- Rows split in two column tiles (T > 0): lanes [0, PA) with PA = P / 2, and [PA, PA + T) with
  T = next_pow2(N - PA) < PA. canon_sum over P is then tree(tile 1) + (tree(tile 2) + 0.0): every subtree
  of [PA + T, P) is padding and sums to +0.0, and adding +0.0 (once or more) only turns -0.0 into +0.0.
  N = 18432 then takes 18432 lanes instead of 32768 (5120 instead of 8192), the same bits.
- Rows in column chunks (CHUNK > 0): the aligned chunks of CHUNK lanes are subtrees of the tree over P,
  so canon_sum over P is canon_sum over the NCH = P / CHUNK chunk sums, chunks past N (all padding) +0.0.
- Warp blocks (WB_NW > 0; the forward's table tiles of 4096, 8192 and split 32768 columns; the backward's rows held
  whole, opt-in): canon_sum's levels whose pairs
  span warps each cost a shared-memory round trip (triton 3.6, 4096 lanes, 8 warps: 10 barriers against tl.sum's 4).
  The row's columns are loaded permuted (row_columns) so that each warp holds one aligned block of the row, a subtree
  of the tree: its sum stays in the warp's registers and shuffles, and the blocks' sums meet once, in one tl.sum,
  which Triton lowers (3.6, 3.9) to a shared-memory exchange and a butterfly over the warps (xor NW/2 first): with
  warp w holding block bitrev(w) that pairs adjacent blocks first, the contract's order. That holds only where the
  compiler lays the rows out as assumed (16-byte pieces of S elements, 32 lanes, the warps, then repeats): the
  backend takes warp blocks only for 16-byte-aligned rows whose row-long tensors share one element size (a 32-bit
  weight or y beside 16-bit rows changed the layout), on the Triton releases whose lowering was read
  (backend.WARP_BLOCK_TRITON_RELEASES), and a CI test checks the compiled butterfly. Under the interpreter the blocks'
  sums are un-permuted and summed by canon_sum (the decomposition is checked there). In two column tiles (T > 0)
  each tile's block sums are taken so, and the two sets meet in one reduction of their join: met apart, the sum had
  two layouts and Triton 3.6 moved the whole first tile through shared memory into the second for y (37 barriers
  against 2 at 18432 columns, 8 warps).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

# dtype codes shared with the host side
F32: tl.constexpr = tl.constexpr(0)
BF16: tl.constexpr = tl.constexpr(1)
F16: tl.constexpr = tl.constexpr(2)
# casting modes
LLAMA: tl.constexpr = tl.constexpr(0)
GEMMA: tl.constexpr = tl.constexpr(1)
NONE: tl.constexpr = tl.constexpr(2)
# compiled for a GPU, or run by the Triton interpreter (decided, as Triton decides whether to interpret, when
# this module is imported): bf16 rounding and canon_sum's pair adds take interpreter-safe forms there
COMPILED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
# what the fold kernel folds: raw rows, or a casting mode's dW contribution (LLAMA/GEMMA/NONE + 1)
RAW_ROWS: tl.constexpr = tl.constexpr(0)


@triton.jit
def _bf16_bits(v):
    """fp32 -> the bf16 bit pattern (uint32 holding 16 bits), round to nearest even, NaN kept NaN."""
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)


@triton.jit
def widen_bits(v):
    """bf16 widened to fp32 through its bit pattern (exact): the interpreter's path (widen), and a second widening of
    loaded rows that the compiler does not merge with a first one by widen (_fwd_rows, REWIDEN)."""
    return ((v.to(tl.int16, bitcast=True).to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def widen(v):
    """A loaded value widened to fp32, exactly. The interpreter's bf16 -> fp32 cast flushes subnormals to
    zero: there bf16 goes through its bit pattern."""
    if not COMPILED and v.dtype == tl.bfloat16:
        return widen_bits(v)
    else:
        return v.to(tl.float32)


@triton.jit
def round_f32(v, DT: tl.constexpr):
    """rd(v, DT) widened back to fp32 (exact)."""
    if DT == BF16:
        if COMPILED:
            return v.to(tl.bfloat16).to(tl.float32)
        else:
            return (_bf16_bits(v) << 16).to(tl.float32, bitcast=True)
    elif DT == F16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def store_rounded(ptr, v, mask, DT: tl.constexpr):
    """Store rd(v, DT); bf16 outputs are passed to kernels as int16 views."""
    if DT == BF16:
        if COMPILED:
            tl.store(ptr, v.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(ptr, _bf16_bits(v).to(tl.int16), mask=mask)
    elif DT == F16:
        tl.store(ptr, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def canon_sum(v, ROWS: tl.constexpr, P: tl.constexpr, LOG2P: tl.constexpr):
    """Sum over axis 1 of (ROWS, P) as the balanced adjacent-first pairwise tree. P = 2**LOG2P."""
    # Each level sums pairs (2j, 2j+1): a reduction over an axis of size 2 is one exact add. A tl.split
    # form of the same tree gives the same bits, but Triton 3.6 compiled it to 25x more PTX (48,598 lines
    # against 1,909 at P = 4096) and it ran at ~0.2% of the copy bandwidth on an H200.
    for lvl in tl.static_range(LOG2P):
        pairs = tl.reshape(v, (ROWS, P >> (lvl + 1), 2))
        if COMPILED:
            v = tl.sum(pairs, axis=2)
        else:
            a, b = tl.split(pairs)
            v = a + b
    return tl.reshape(v, (ROWS,))


@triton.jit
def tiled_canon_sum(va, vb, ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr, T: tl.constexpr,
                    LOG2T: tl.constexpr):
    """canon_sum over the padded row P = 2 * PA of its two column tiles (T > 0; see the module's notes),
    or over the one tile va of PA = P lanes (T == 0: vb is not used)."""
    s = canon_sum(va, ROWS, PA, LOG2PA)
    if T > 0:
        s = s + (canon_sum(vb, ROWS, T, LOG2T) + 0.0)
    return s


@triton.constexpr_function
def _log2(v):
    return int(v).bit_length() - 1


@triton.constexpr_function
def _binary_shape(rows, log2n):
    """(rows, 2, ..., 2): n = 2**log2n elements as one axis a bit, the most significant first."""
    return [int(rows)] + [2] * int(log2n)


@triton.constexpr_function
def _bits_reversed(log2n):
    """The permutation of _binary_shape's axes that reverses the bits of the element index."""
    return [0] + list(range(int(log2n), 0, -1))


@triton.jit
def _bit_reversed(v, LOG2N: tl.constexpr):
    """Each element of v (integers below 2**LOG2N) with its LOG2N bits reversed."""
    r = v * 0
    for i in tl.static_range(LOG2N):
        r += ((v >> i) & 1) << (LOG2N - 1 - i)
    return r


@triton.jit
def row_columns(PA: tl.constexpr, WB_NW: tl.constexpr, WB_S: tl.constexpr):
    """The column each lane of a row tile loads: in order, or with warp blocks (WB_NW > 0; the module's notes) so that
    warp w holds the row's block bitrev(w) of PA / WB_NW columns, and lane l's piece of repeat r lies at
    ((block * R + r) * 32 + l) * WB_S (R = PA / (32 * WB_S * WB_NW) repeats)."""
    j = tl.arange(0, PA)
    if WB_NW > 0:
        inner: tl.constexpr = 32 * WB_S
        reps: tl.constexpr = PA // (inner * WB_NW)
        block = _bit_reversed((j // inner) % WB_NW, _log2(WB_NW))
        j = block * (reps * inner) + (j // (WB_NW * inner)) * inner + j % inner
    return j


@triton.jit
def warp_block_sums(v, ROWS: tl.constexpr, PA: tl.constexpr, WB_NW: tl.constexpr, WB_S: tl.constexpr):
    """The block sums (ROWS, WB_NW) of rows (ROWS, PA) loaded at row_columns(PA, WB_NW, WB_S) with WB_NW > 0, each by
    canon_sum within its warp (its pieces, then its repeats): warp w's is block bitrev(w)'s."""
    inner: tl.constexpr = 32 * WB_S
    reps: tl.constexpr = PA // (inner * WB_NW)
    s = canon_sum(tl.reshape(v, (ROWS * reps * WB_NW, inner)), ROWS * reps * WB_NW, inner, _log2(inner))
    s = tl.reshape(tl.permute(tl.reshape(s, (ROWS, reps, WB_NW)), (0, 2, 1)), (ROWS * WB_NW, reps))
    return tl.reshape(canon_sum(s, ROWS * WB_NW, reps, _log2(reps)), (ROWS, WB_NW))


@triton.jit
def blocks_meet(s, ROWS: tl.constexpr, WB_NW: tl.constexpr):
    """The sum of warp_block_sums' (ROWS, WB_NW) in the tree's order: compiled, one tl.sum over the warps (the
    butterfly, xor WB_NW / 2 first, that the bit-reversed placement needs); interpreted, un-permuted and canon_sum."""
    if COMPILED:  # a constexpr branch: only the one taken is compiled
        total = tl.sum(s, axis=1)
    else:
        blocks = tl.permute(tl.reshape(s, _binary_shape(ROWS, _log2(WB_NW))), _bits_reversed(_log2(WB_NW)))
        total = canon_sum(tl.reshape(blocks, (ROWS, WB_NW)), ROWS, WB_NW, _log2(WB_NW))
    return total


@triton.jit
def canon_sum_warp_blocks(v, ROWS: tl.constexpr, PA: tl.constexpr, WB_NW: tl.constexpr, WB_S: tl.constexpr):
    """canon_sum of rows (ROWS, PA) loaded at row_columns(PA, WB_NW, WB_S) with WB_NW > 0: each warp's block summed
    within the warp, the blocks' sums last."""
    return blocks_meet(warp_block_sums(v, ROWS, PA, WB_NW, WB_S), ROWS, WB_NW)


@triton.jit
def row_sum(va, vb, ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr, T: tl.constexpr,
            LOG2T: tl.constexpr, WB_NW: tl.constexpr, WB_S: tl.constexpr, WB_ST: tl.constexpr = 0):
    """canon_sum over a row's column tiles (tiled_canon_sum), or in warp blocks where WB_NW > 0: one tile, or two
    (T > 0) with the second's pieces WB_ST elements."""
    if WB_NW > 0 and T > 0:
        # both tiles' block sums meet in one reduction (two meetings would give the sum two layouts, and Triton 3.6
        # then moved the whole row into the second one for y); as tiled_canon_sum: the second half's tree is tile
        # b's, then adds of +0.0 (its padding)
        ba, bb = warp_block_sums(va, ROWS, PA, WB_NW, WB_S), warp_block_sums(vb, ROWS, T, WB_NW, WB_ST)
        if COMPILED:
            sa, sb = tl.split(tl.sum(tl.join(ba, bb), axis=1))
        else:
            sa, sb = blocks_meet(ba, ROWS, WB_NW), blocks_meet(bb, ROWS, WB_NW)
        s = sa + (sb + 0.0)
    elif WB_NW > 0:
        s = canon_sum_warp_blocks(va, ROWS, PA, WB_NW, WB_S)
    else:
        s = tiled_canon_sum(va, vb, ROWS, PA, LOG2PA, T, LOG2T)
    return s


@triton.jit
def in_bounds(idx, bound, DENSE: tl.constexpr = False):
    """idx < bound (rows < M, columns < N); a constant true where DENSE (the rows fill the tiles and are N = P lanes
    long: Triton folds such masks away)."""
    if DENSE:
        return tl.full(idx.shape, True, tl.int1)
    else:
        return idx < bound


@triton.jit
def tile_in(rows, M, N, cols, DENSE: tl.constexpr = False):
    """The (rows, cols) lanes inside the (M, N) rows; a constant true where DENSE."""
    return in_bounds(rows, M, DENSE)[:, None] & in_bounds(cols, N, DENSE)[None, :]


@triton.jit
def row_offsets(rows, R1, G, s0, s1, sg):
    """Element offsets of logical rows in a RowLayout view, and each row's group (head) index."""
    rows = rows.to(tl.int64)
    g = rows % G
    t = rows // G
    return (t // R1) * s0 + (t % R1) * s1 + g * sg, g


@triton.jit
def effective_weight(W, w_offs, mask, offset, MODE: tl.constexpr, XDT: tl.constexpr, HAS_W: tl.constexpr):
    """wf = f32(w) + f32(offset); in casting mode none, rounded to x's dtype. 1.0 without a weight; +0.0
    in padded lanes (so that their products with zero-filled rows are +0.0, as canon_sum pads)."""
    if HAS_W:
        wf = widen(tl.load(W + w_offs, mask=mask, other=0.0)) + offset
        if MODE == NONE:
            wf = round_f32(wf, XDT)
        wf = tl.where(mask, wf, 0.0)
    else:
        wf = tl.full(w_offs.shape, 1.0, tl.float32)
    return wf


@triton.jit
def normalized_as_used(xf, rstd, MODE: tl.constexpr, XDT: tl.constexpr):
    """The normalized row as y's scaling step sees it (rstd broadcast over the row)."""
    if MODE == GEMMA:
        return xf * rstd[:, None]
    elif MODE == LLAMA:
        return round_f32(xf * rstd[:, None], XDT)
    else:
        return round_f32(xf * round_f32(rstd, XDT)[:, None], XDT)


@triton.jit
def _fwd_load(X, x_offs, RES, r_offs, rows, M, N, cols, HAS_RES: tl.constexpr, DENSE: tl.constexpr = False):
    """One column tile of the forward's input rows as loaded: x, and the residual (x again without one)."""
    mask = tile_in(rows, M, N, cols, DENSE)
    x = tl.load(X + x_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    r = x
    if HAS_RES:
        r = tl.load(RES + r_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    return x, r


@triton.jit
def _fwd_widen(x, r, Z, rows, M, N, cols, XDT: tl.constexpr, HAS_RES: tl.constexpr, STORE_Z: tl.constexpr = True,
               DENSE: tl.constexpr = False):
    """The norm's input of one loaded column tile, widened: x, or z = rd(f32(x) + f32(residual), residual dtype)
    (stored to Z unless STORE_Z is False)."""
    xf = widen(x)
    if HAS_RES:
        xf = round_f32(xf + widen(r), XDT)
        if STORE_Z:
            store_rounded(Z + rows[:, None] * N + cols[None, :], xf, tile_in(rows, M, N, cols, DENSE), XDT)
    return xf


@triton.jit
def _fwd_input(X, x_offs, RES, r_offs, Z, rows, M, N, cols, XDT: tl.constexpr, HAS_RES: tl.constexpr,
               STORE_Z: tl.constexpr = True):
    """_fwd_widen of one column tile, loaded here."""
    x, r = _fwd_load(X, x_offs, RES, r_offs, rows, M, N, cols, HAS_RES)
    return _fwd_widen(x, r, Z, rows, M, N, cols, XDT, HAS_RES, STORE_Z)


@triton.jit
def row_mean(s, N, ROWS: tl.constexpr, MEAN_SCALE: tl.constexpr):
    """s / N, IEEE-rounded. MEAN_SCALE: 1 / N where N is a power of two, else 0 (reference.exact_mean_scale):
    s * 2^-k is the same rounding of the same exact quotient as div_rn(s, N), one multiply where the division takes
    about ten instructions a row."""
    return s * MEAN_SCALE if MEAN_SCALE != 0.0 else tl.div_rn(s, tl.full((ROWS,), N, tl.float32))


@triton.jit
def _rstd(ss, N, eps, ROWS: tl.constexpr, MEAN_SCALE: tl.constexpr = 0.0, RCP_RN: tl.constexpr = False):
    """rstd = 1 / sqrt(ss / N + eps), each step IEEE-rounded. RCP_RN (compiled for NVIDIA only): the reciprocal as
    rcp.rn.f32, the same correctly rounded 1 / s as div_rn(1, s) in fewer instructions (Triton links libdevice with
    flush-to-zero, so it is rcp.rn.ftz.f32: s = sqrt_rn(.) is never subnormal and 1 / s never is)."""
    root = tl.sqrt_rn(row_mean(ss, N, ROWS, MEAN_SCALE) + eps)
    if RCP_RN:
        return libdevice.rcp_rn(root)
    else:
        return tl.div_rn(tl.full((ROWS,), 1.0, tl.float32), root)


@triton.jit
def _fwd_chunked(X, x_offs, RES, r_offs, Z, W, wsg, g, Y, RSTD, rows, M, N, eps, offset, ROWS: tl.constexpr,
                 CHUNK: tl.constexpr, LOG2CHUNK: tl.constexpr, NCH: tl.constexpr, LOG2NCH: tl.constexpr,
                 MODE: tl.constexpr, XDT: tl.constexpr, YDT: tl.constexpr, HAS_W: tl.constexpr, PER_HEAD: tl.constexpr,
                 HAS_RES: tl.constexpr, STAGES: tl.constexpr, MEAN_SCALE: tl.constexpr, WB_NW: tl.constexpr = 0,
                 WB_S: tl.constexpr = 8, RCP_RN: tl.constexpr = False):
    """y and rstd of rows in column chunks of CHUNK lanes (the module's notes): each chunk's squares summed by
    canon_sum (a chunk in warp blocks where WB_NW > 0), then the NCH chunk sums; y chunk by chunk, the rows read
    again (this program's own lanes, from L2; with a residual, z recomputed rather than read back). STAGES > 1: the
    chunk loops' loads pipelined by Triton through shared memory."""
    chunk_ids = tl.arange(0, NCH)
    parts = tl.zeros((ROWS, NCH), tl.float32)
    chunks = tl.cdiv(N, CHUNK)
    for c in tl.range(0, chunks, num_stages=STAGES):
        cols = c * CHUNK + row_columns(CHUNK, WB_NW, WB_S)
        xf = _fwd_input(X, x_offs, RES, r_offs, Z, rows, M, N, cols, XDT, HAS_RES)
        s = row_sum(xf * xf, xf, ROWS, CHUNK, LOG2CHUNK, 0, 0, WB_NW, WB_S)
        parts = tl.where(chunk_ids[None, :] == c, s[:, None], parts)
    rstd = _rstd(canon_sum(parts, ROWS, NCH, LOG2NCH), N, eps, ROWS, MEAN_SCALE, RCP_RN)
    tl.store(RSTD + rows, rstd, mask=rows < M)
    for c in tl.range(0, chunks, num_stages=STAGES):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        xf = _fwd_input(X, x_offs, RES, r_offs, Z, rows, M, N, cols, XDT, HAS_RES, False)
        wf = _fwd_weight(W, wsg, g, rows, M, N, cols, offset, MODE, XDT, HAS_W, PER_HEAD)
        _fwd_output(xf, rstd, wf, Y, rows, M, N, cols, MODE, XDT, YDT)


@triton.jit
def _fwd_weight(W, wsg, g, rows, M, N, cols, offset, MODE: tl.constexpr, XDT: tl.constexpr, HAS_W: tl.constexpr,
                PER_HEAD: tl.constexpr, W_ROWS: tl.constexpr = False, DENSE: tl.constexpr = False):
    """The effective weight of one column tile: (ROWS, lanes) per head, else (1, lanes); W_ROWS: (ROWS, lanes), each
    row's copy loaded in the rows' own layout (where the (1, lanes) load's layout differs from the rows', Triton
    converts it through shared memory: at 8 rows of 128 lanes in 2 warps, 4 of the kernel's 5 barriers)."""
    if PER_HEAD:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        wf = effective_weight(W, g[:, None] * wsg + cols[None, :], mask, offset, MODE, XDT, HAS_W)
    elif W_ROWS:
        offs = cols[None, :] + tl.zeros_like(rows)[:, None].to(cols.dtype)
        wf = effective_weight(W, offs, in_bounds(offs, N, DENSE), offset, MODE, XDT, HAS_W)
    else:
        wf = effective_weight(W, cols, in_bounds(cols, N, DENSE), offset, MODE, XDT, HAS_W)[None, :]
    return wf


@triton.jit
def _fwd_output(xf, rstd, wf, Y, rows, M, N, cols, MODE: tl.constexpr, XDT: tl.constexpr, YDT: tl.constexpr,
                DENSE: tl.constexpr = False):
    """y of one column tile."""
    mask = tile_in(rows, M, N, cols, DENSE)
    y = normalized_as_used(xf, rstd, MODE, XDT) * wf
    if MODE == NONE:
        y = round_f32(y, XDT)
    store_rounded(Y + rows[:, None] * N + cols[None, :], y, mask, YDT)


# Row counts are not specialized on: one compiled kernel serves every batch. R1 and G are: the common
# R1 = G = 1 (one leading dim) then compiles to offset = row * s0, without 64-bit divisions.
@triton.jit(do_not_specialize=["M"])
def rms_fwd_kernel(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, Z, W, wsg, Y, RSTD,
                   M, N, R1, G, eps, offset,
                   ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr, T: tl.constexpr,
                   LOG2T: tl.constexpr, MODE: tl.constexpr, XDT: tl.constexpr, YDT: tl.constexpr,
                   HAS_W: tl.constexpr, PER_HEAD: tl.constexpr, HAS_RES: tl.constexpr, W_FIRST: tl.constexpr,
                   CHUNK: tl.constexpr = 0, LOG2CHUNK: tl.constexpr = 0, NCH: tl.constexpr = 1,
                   LOG2NCH: tl.constexpr = 0, STAGES: tl.constexpr = 1, PERSISTENT: tl.constexpr = False,
                   PREFETCH: tl.constexpr = False, WB_NW: tl.constexpr = 0, WB_S: tl.constexpr = 8,
                   WB_ST: tl.constexpr = 0, MEAN_SCALE: tl.constexpr = 0.0, W_ROWS: tl.constexpr = False,
                   STORE_RSTD: tl.constexpr = True, REWIDEN: tl.constexpr = False, DENSE: tl.constexpr = False,
                   RCP_RN: tl.constexpr = False):
    """y and rstd for blocks of ROWS rows, in one or two column tiles (T), or in column chunks of CHUNK lanes (CHUNK
    > 0, T = 0: _fwd_chunked). W_FIRST: the weight is loaded with the rows, before their sum (else after it, where
    y needs it). PERSISTENT (rows held whole): programs stride over the blocks (_fwd_persistent). WB_NW > 0
    (num_warps = WB_NW): the row (each chunk; the first column tile) in warp blocks of WB_S-element pieces (the
    module's notes), the second column tile (T > 0) in pieces of WB_ST. MEAN_SCALE: 1 / N where N is a power of two,
    else 0 (_rstd). W_ROWS: a shared weight loaded as (ROWS, lanes) in the rows' layout (_fwd_weight). STORE_RSTD
    False (rows held whole): no rstd stored, for an inference call that asks for none. REWIDEN (rows held whole): bf16
    rows held as loaded across the sum (_fwd_rows). DENSE (rows held whole in one column tile, not persistent): the
    rows fill the tiles (M % ROWS == 0), N == PA, every row tensor's rows contiguous (R1 = G = 1, row stride N) and M *
    N < 2^31: Inductor's addressing at a static shape, no masks and 32-bit offsets with N compiled in. RCP_RN (NVIDIA
    only): rstd's reciprocal by rcp_rn (_rstd). The same bits every way."""
    tl.static_assert(not DENSE or (CHUNK == 0 and T == 0 and not PERSISTENT), "DENSE: rows held whole, one tile")
    if DENSE:  # the row length compiled in: rows addressed by immediates
        N = PA
    pid = tl.program_id(0)
    cols_a = row_columns(PA, 0 if CHUNK > 0 else WB_NW, WB_S)
    cols_b = PA + row_columns(T if T > 0 else 1, WB_NW if T > 0 else 0, WB_ST)
    if CHUNK > 0:
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        x_offs, g = row_offsets(rows, R1, G, xs0, xs1, xsg)
        r_offs = x_offs
        if HAS_RES:
            r_offs, _ = row_offsets(rows, R1, G, rs0, rs1, rsg)
        _fwd_chunked(X, x_offs, RES, r_offs, Z, W, wsg, g, Y, RSTD, rows, M, N, eps, offset, ROWS, CHUNK, LOG2CHUNK,
                     NCH, LOG2NCH, MODE, XDT, YDT, HAS_W, PER_HEAD, HAS_RES, STAGES, MEAN_SCALE, WB_NW, WB_S, RCP_RN)
    elif PERSISTENT:
        _fwd_persistent(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, Z, W, wsg, Y, RSTD, pid, M, N, R1, G, eps, offset,
                        cols_a, cols_b, ROWS, PA, LOG2PA, T, LOG2T, MODE, XDT, YDT, HAS_W, PER_HEAD, HAS_RES, STAGES,
                        PREFETCH, WB_NW, WB_S, WB_ST, MEAN_SCALE, W_ROWS, STORE_RSTD, REWIDEN, RCP_RN)
    else:
        xa, ra, xb, rb = _fwd_fetch(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, pid, M, N, R1, G, cols_a, cols_b, ROWS, T,
                                    HAS_RES, DENSE)
        wf_a, wf_b = tl.zeros((1, PA), tl.float32), tl.zeros((1, T if T > 0 else 1), tl.float32)
        if W_FIRST:
            wf_a, wf_b = _fwd_weights(W, wsg, pid, M, N, G, cols_a, cols_b, offset, ROWS, T, MODE, XDT, HAS_W,
                                      PER_HEAD, W_ROWS, DENSE)
        _fwd_rows(xa, ra, xb, rb, wf_a, wf_b, Z, W, wsg, Y, RSTD, pid, M, N, G, eps, offset, cols_a, cols_b, ROWS,
                  PA, LOG2PA, T, LOG2T, MODE, XDT, YDT, HAS_W, PER_HEAD, HAS_RES, W_FIRST, WB_NW, WB_S, WB_ST,
                  MEAN_SCALE, W_ROWS, STORE_RSTD, REWIDEN, DENSE, RCP_RN)


@triton.jit
def _fwd_persistent(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, Z, W, wsg, Y, RSTD, pid, M, N, R1, G, eps, offset, cols_a,
                    cols_b, ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr, T: tl.constexpr,
                    LOG2T: tl.constexpr, MODE: tl.constexpr, XDT: tl.constexpr, YDT: tl.constexpr,
                    HAS_W: tl.constexpr, PER_HEAD: tl.constexpr, HAS_RES: tl.constexpr, STAGES: tl.constexpr,
                    PREFETCH: tl.constexpr, WB_NW: tl.constexpr, WB_S: tl.constexpr, WB_ST: tl.constexpr,
                    MEAN_SCALE: tl.constexpr, W_ROWS: tl.constexpr = False, STORE_RSTD: tl.constexpr = True,
                    REWIDEN: tl.constexpr = False, RCP_RN: tl.constexpr = False):
    """Rows held whole, programs striding over the blocks: a shared weight loaded once a program; PREFETCH: the next
    block's rows loaded into registers before this block's sum (their loads in flight while it computes and
    stores); STAGES > 1: the loop's loads pipelined by Triton through shared memory."""
    nprog = tl.num_programs(0)
    wf_a, wf_b = tl.zeros((1, PA), tl.float32), tl.zeros((1, T if T > 0 else 1), tl.float32)
    if not PER_HEAD:
        wf_a, wf_b = _fwd_weights(W, wsg, pid, M, N, G, cols_a, cols_b, offset, ROWS, T, MODE, XDT, HAS_W, PER_HEAD,
                                  W_ROWS)
    if PREFETCH:
        n_xa, n_ra, n_xb, n_rb = _fwd_fetch(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, pid, M, N, R1, G, cols_a, cols_b,
                                            ROWS, T, HAS_RES)
    for blk in tl.range(pid, tl.cdiv(M, ROWS), nprog, num_stages=STAGES):
        if PREFETCH:
            xa, ra, xb, rb = n_xa, n_ra, n_xb, n_rb
            n_xa, n_ra, n_xb, n_rb = _fwd_fetch(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, blk + nprog, M, N, R1, G,
                                                cols_a, cols_b, ROWS, T, HAS_RES)
        else:
            xa, ra, xb, rb = _fwd_fetch(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, blk, M, N, R1, G, cols_a, cols_b, ROWS,
                                        T, HAS_RES)
        # per-head weights: loaded for each block, after its sum
        _fwd_rows(xa, ra, xb, rb, wf_a, wf_b, Z, W, wsg, Y, RSTD, blk, M, N, G, eps, offset, cols_a, cols_b, ROWS,
                  PA, LOG2PA, T, LOG2T, MODE, XDT, YDT, HAS_W, PER_HEAD, HAS_RES, not PER_HEAD, WB_NW, WB_S, WB_ST,
                  MEAN_SCALE, W_ROWS, STORE_RSTD, REWIDEN, False, RCP_RN)


@triton.jit
def _block_rows(blk, ROWS: tl.constexpr, I32: tl.constexpr = False):
    """The logical rows of block blk (64-bit; I32: 32-bit, where every offset fits)."""
    return (blk if I32 else tl.cast(blk, tl.int64)) * ROWS + tl.arange(0, ROWS)


@triton.jit
def _fwd_fetch(X, xs0, xs1, xsg, RES, rs0, rs1, rsg, blk, M, N, R1, G, cols_a, cols_b, ROWS: tl.constexpr,
               T: tl.constexpr, HAS_RES: tl.constexpr, DENSE: tl.constexpr = False):
    """The forward's loads of one block of rows, as loaded (x and the residual of each column tile; tile b is tile a
    when T == 0). A block past the end loads nothing (every lane masked). DENSE: rows N apart (rms_fwd_kernel)."""
    rows = _block_rows(blk, ROWS, DENSE)
    if DENSE:
        x_offs = rows * N
        r_offs = x_offs
    else:
        x_offs, _ = row_offsets(rows, R1, G, xs0, xs1, xsg)
        r_offs = x_offs
        if HAS_RES:
            r_offs, _ = row_offsets(rows, R1, G, rs0, rs1, rsg)
    xa, ra = _fwd_load(X, x_offs, RES, r_offs, rows, M, N, cols_a, HAS_RES, DENSE)
    xb, rb = xa, ra
    if T > 0:
        xb, rb = _fwd_load(X, x_offs, RES, r_offs, rows, M, N, cols_b, HAS_RES, DENSE)
    return xa, ra, xb, rb


@triton.jit
def _fwd_weights(W, wsg, blk, M, N, G, cols_a, cols_b, offset, ROWS: tl.constexpr, T: tl.constexpr,
                 MODE: tl.constexpr, XDT: tl.constexpr, HAS_W: tl.constexpr, PER_HEAD: tl.constexpr,
                 W_ROWS: tl.constexpr = False, DENSE: tl.constexpr = False):
    """The effective weight of block blk's column tiles (tile b is tile a when T == 0)."""
    rows = _block_rows(blk, ROWS, DENSE)
    g = rows % G
    wf_a = _fwd_weight(W, wsg, g, rows, M, N, cols_a, offset, MODE, XDT, HAS_W, PER_HEAD, W_ROWS, DENSE)
    wf_b = wf_a
    if T > 0:
        wf_b = _fwd_weight(W, wsg, g, rows, M, N, cols_b, offset, MODE, XDT, HAS_W, PER_HEAD, W_ROWS, DENSE)
    return wf_a, wf_b


@triton.jit
def _fwd_rows(xa, ra, xb, rb, wf_a, wf_b, Z, W, wsg, Y, RSTD, blk, M, N, G, eps, offset, cols_a, cols_b,
              ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr, T: tl.constexpr, LOG2T: tl.constexpr,
              MODE: tl.constexpr, XDT: tl.constexpr, YDT: tl.constexpr, HAS_W: tl.constexpr, PER_HEAD: tl.constexpr,
              HAS_RES: tl.constexpr, W_GIVEN: tl.constexpr, WB_NW: tl.constexpr = 0, WB_S: tl.constexpr = 8,
              WB_ST: tl.constexpr = 0, MEAN_SCALE: tl.constexpr = 0.0, W_ROWS: tl.constexpr = False,
              STORE_RSTD: tl.constexpr = True, REWIDEN: tl.constexpr = False, DENSE: tl.constexpr = False,
              RCP_RN: tl.constexpr = False):
    """y and rstd of block blk's rows held whole, from their loaded column tiles. W_GIVEN: wf_a and wf_b are the
    effective weight; else it is loaded after the rows' sum. REWIDEN (bf16 rows without a residual): the rows held
    across the sum as loaded, 16 bits a value, and widened again for y (widen_bits), not held widened: half the
    registers for the rows (sm_90, Triton 3.6, 32 rows of 128 at 2 warps: 122 -> 95 a thread in
    bench/exactness_probe.py's tile)."""
    rows = _block_rows(blk, ROWS, DENSE)
    xfa = _fwd_widen(xa, ra, Z, rows, M, N, cols_a, XDT, HAS_RES, True, DENSE)
    xfb = xfa
    if T > 0:
        xfb = _fwd_widen(xb, rb, Z, rows, M, N, cols_b, XDT, HAS_RES, True, DENSE)
    rstd = _rstd(row_sum(xfa * xfa, xfb * xfb, ROWS, PA, LOG2PA, T, LOG2T, WB_NW, WB_S, WB_ST), N, eps, ROWS,
                 MEAN_SCALE, RCP_RN)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=in_bounds(rows, M, DENSE))
    if not W_GIVEN:
        wf_a, wf_b = _fwd_weights(W, wsg, blk, M, N, G, cols_a, cols_b, offset, ROWS, T, MODE, XDT, HAS_W, PER_HEAD,
                                  W_ROWS, DENSE)
    if REWIDEN and not HAS_RES and xa.dtype == tl.bfloat16:
        xfa = widen_bits(xa)
        if T > 0:
            xfb = widen_bits(xb)
    _fwd_output(xfa, rstd, wf_a, Y, rows, M, N, cols_a, MODE, XDT, YDT, DENSE)
    if T > 0:
        _fwd_output(xfb, rstd, wf_b, Y, rows, M, N, cols_b, MODE, XDT, YDT, DENSE)


@triton.jit
def _bwd_fetch(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, RSTD, blk, M, N, R1, G, cols_a, cols_b, ROWS: tl.constexpr,
               T: tl.constexpr):
    """The backward's loads of one block of rows, as loaded (rstd, then z and dy of each column tile; tile b is tile
    a when T == 0). A block past the end loads nothing (every lane masked)."""
    rows = _block_rows(blk, ROWS)
    z_offs, _ = row_offsets(rows, R1, G, zs0, zs1, zsg)
    d_offs, _ = row_offsets(rows, R1, G, ds0, ds1, dsg)
    rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
    za, da = _bwd_load(Z, z_offs, DY, d_offs, rows, M, N, cols_a)
    zb, db = za, da
    if T > 0:
        zb, db = _bwd_load(Z, z_offs, DY, d_offs, rows, M, N, cols_b)
    return rstd, za, da, zb, db


@triton.jit
def _bwd_load(Z, z_offs, DY, d_offs, rows, M, N, cols):
    """z and dy of rows' columns `cols`, as loaded (0 past the end)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    z = tl.load(Z + z_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + d_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    return z, dy


@triton.jit
def _bwd_input(z, dy, W, wsg, wf_shared, g, rows, rstd, M, N, cols, offset, MODE: tl.constexpr,
               XDT: tl.constexpr, HAS_W: tl.constexpr, PER_HEAD: tl.constexpr):
    """One column tile of the backward's rows from its loaded z and dy: (xf, dyf, xh, gr) with xh = xf * rstd,
    gr = dyf * wf."""
    xf = widen(z)
    dyf = widen(dy)
    if PER_HEAD:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        wf = effective_weight(W, g[:, None] * wsg + cols[None, :], mask, offset, MODE, XDT, HAS_W)
    else:
        wf = wf_shared
    return xf, dyf, xf * rstd[:, None], dyf * wf


@triton.jit
def _bwd_output(xh, gr, c, rstd, DRES, e_offs, DX, x_offs, rows, M, N, cols, XDT: tl.constexpr,
                HAS_DRES: tl.constexpr):
    """dx of one column tile: (gr - xh * c) * rstd, plus the residual's gradient."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dx = (gr - xh * c[:, None]) * rstd[:, None]
    if HAS_DRES:
        dx = dx + widen(tl.load(DRES + e_offs[:, None] + cols[None, :], mask=mask, other=0.0))
    store_rounded(DX + x_offs[:, None] + cols[None, :], dx, mask, XDT)


@triton.jit
def _bwd_chunk(DY, d_offs, Z, z_offs, W, wsg, g, rows, rstd, M, N, cols, offset, MODE: tl.constexpr,
               XDT: tl.constexpr, HAS_W: tl.constexpr, PER_HEAD: tl.constexpr):
    """_bwd_input of one column chunk, loaded here (z, dy and the shared weight's chunk)."""
    z, dy = _bwd_load(Z, z_offs, DY, d_offs, rows, M, N, cols)
    wf = tl.zeros((1, cols.shape[0]), tl.float32)
    if not PER_HEAD:
        wf = effective_weight(W, cols, cols < N, offset, MODE, XDT, HAS_W)[None, :]
    return _bwd_input(z, dy, W, wsg, wf, g, rows, rstd, M, N, cols, offset, MODE, XDT, HAS_W, PER_HEAD)


@triton.jit
def _bwd_chunked(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg, DX, xs0, xs1, xsg, DW_PART,
                 pid, nprog, M, N, R1, G, offset, ROWS: tl.constexpr, CHUNK: tl.constexpr, LOG2CHUNK: tl.constexpr,
                 NCH: tl.constexpr, LOG2NCH: tl.constexpr, MODE: tl.constexpr, XDT: tl.constexpr,
                 HAS_W: tl.constexpr, PER_HEAD: tl.constexpr, HAS_DRES: tl.constexpr, DW_PARTIALS: tl.constexpr,
                 STAGES: tl.constexpr, MEAN_SCALE: tl.constexpr):
    """The backward of rows in column chunks of CHUNK lanes (the module's notes): each chunk's products summed by
    canon_sum, then the NCH chunk sums; dx chunk by chunk, the rows read again (this program's own lanes, from L2).
    Only a chunk is live at a time, so the dW partials cannot stay in registers across rows: each program adds its
    rows' contributions into its fp32 row DW_PART[pid] (stored by its first block, read back and added to by the
    later ones; the row stays in L2). STAGES > 1: the chunk loops' loads pipelined through shared memory."""
    chunk_ids = tl.arange(0, NCH)
    chunks = tl.cdiv(N, CHUNK)
    part_row = DW_PART + pid.to(tl.int64) * N
    for blk in range(pid, tl.cdiv(M, ROWS), nprog):
        rows = _block_rows(blk, ROWS)
        z_offs, g = row_offsets(rows, R1, G, zs0, zs1, zsg)
        d_offs, _ = row_offsets(rows, R1, G, ds0, ds1, dsg)
        rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
        parts = tl.zeros((ROWS, NCH), tl.float32)
        for c in tl.range(0, chunks, num_stages=STAGES):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            xs = _bwd_chunk(DY, d_offs, Z, z_offs, W, wsg, g, rows, rstd, M, N, cols, offset, MODE, XDT, HAS_W,
                            PER_HEAD)
            s = canon_sum(xs[2] * xs[3], ROWS, CHUNK, LOG2CHUNK)
            parts = tl.where(chunk_ids[None, :] == c, s[:, None], parts)
        cv = row_mean(canon_sum(parts, ROWS, NCH, LOG2NCH), N, ROWS, MEAN_SCALE)
        x_offs, _ = row_offsets(rows, R1, G, xs0, xs1, xsg)
        e_offs = x_offs
        if HAS_DRES:
            e_offs, _ = row_offsets(rows, R1, G, es0, es1, esg)
        if DW_PARTIALS:
            tl.debug_barrier()  # the previous block's partial-row stores, visible to every thread of the program
        for c in tl.range(0, chunks, num_stages=STAGES):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            xf, dyf, xh, gr = _bwd_chunk(DY, d_offs, Z, z_offs, W, wsg, g, rows, rstd, M, N, cols, offset, MODE,
                                         XDT, HAS_W, PER_HEAD)
            _bwd_output(xh, gr, cv, rstd, DRES, e_offs, DX, x_offs, rows, M, N, cols, XDT, HAS_DRES)
            if DW_PARTIALS:
                # +0.0 where this is the program's first block: the partials start from +0.0, as in registers
                acc = tl.load(part_row + cols, mask=cols < tl.where(blk != pid, N, 0), other=0.0)
                tl.store(part_row + cols, acc + tl.sum(dyf * normalized_as_used(xf, rstd, MODE, XDT), axis=0),
                         mask=cols < N)


@triton.jit
def _bwd_held(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg, DX, xs0, xs1, xsg, DW_PART,
              pid, nprog, M, N, R1, G, offset, ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr,
              T: tl.constexpr, LOG2T: tl.constexpr, MODE: tl.constexpr, XDT: tl.constexpr, HAS_W: tl.constexpr,
              PER_HEAD: tl.constexpr, HAS_DRES: tl.constexpr, DW_PARTIALS: tl.constexpr, PREFETCH: tl.constexpr,
              STAGES: tl.constexpr, WB_NW: tl.constexpr, WB_S: tl.constexpr, WB_ST: tl.constexpr,
              MEAN_SCALE: tl.constexpr):
    """The backward of rows held whole, in one or two column tiles (rms_bwd_kernel), in warp blocks where WB_NW > 0
    (as the forward's: row_columns, row_sum)."""
    cols_a = row_columns(PA, WB_NW, WB_S)
    cols_b = PA + row_columns(T if T > 0 else 1, WB_NW if T > 0 else 0, WB_ST)
    wf_a = tl.zeros((1, PA), tl.float32)
    wf_b = tl.zeros((1, T if T > 0 else 1), tl.float32)
    if not PER_HEAD:
        wf_a = effective_weight(W, cols_a, cols_a < N, offset, MODE, XDT, HAS_W)[None, :]
        if T > 0:
            wf_b = effective_weight(W, cols_b, cols_b < N, offset, MODE, XDT, HAS_W)[None, :]
    # the dW partials as a whole tile, summed over its rows once after the loop: a tl.sum over rows in every
    # block cost a cross-warp reduction per block (H200, run 8: 262144 x 128, the dx pass alone 52.9 us, with
    # the partials summed per block 109.6)
    dw_a = tl.zeros((ROWS, PA), tl.float32)
    dw_b = tl.zeros((ROWS, T if T > 0 else 1), tl.float32)
    if PREFETCH:
        n_rstd, n_za, n_da, n_zb, n_db = _bwd_fetch(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, RSTD, pid, M, N, R1, G,
                                                    cols_a, cols_b, ROWS, T)
    for blk in tl.range(pid, tl.cdiv(M, ROWS), nprog, num_stages=STAGES):
        if PREFETCH:
            rstd, za, da, zb, db = n_rstd, n_za, n_da, n_zb, n_db
            n_rstd, n_za, n_da, n_zb, n_db = _bwd_fetch(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, RSTD, blk + nprog, M, N,
                                                        R1, G, cols_a, cols_b, ROWS, T)
        else:
            rstd, za, da, zb, db = _bwd_fetch(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, RSTD, blk, M, N, R1, G, cols_a,
                                              cols_b, ROWS, T)
        rows = _block_rows(blk, ROWS)
        _, g = row_offsets(rows, R1, G, zs0, zs1, zsg)
        x_offs, _ = row_offsets(rows, R1, G, xs0, xs1, xsg)
        e_offs = x_offs
        if HAS_DRES:
            e_offs, _ = row_offsets(rows, R1, G, es0, es1, esg)
        xa, dya, xha, gra = _bwd_input(za, da, W, wsg, wf_a, g, rows, rstd, M, N, cols_a, offset, MODE, XDT, HAS_W,
                                       PER_HEAD)
        pb = xha * gra
        if T > 0:
            xb, dyb, xhb, grb = _bwd_input(zb, db, W, wsg, wf_b, g, rows, rstd, M, N, cols_b, offset, MODE, XDT,
                                           HAS_W, PER_HEAD)
            pb = xhb * grb
        c = row_mean(row_sum(xha * gra, pb, ROWS, PA, LOG2PA, T, LOG2T, WB_NW, WB_S, WB_ST), N, ROWS, MEAN_SCALE)
        _bwd_output(xha, gra, c, rstd, DRES, e_offs, DX, x_offs, rows, M, N, cols_a, XDT, HAS_DRES)
        if DW_PARTIALS:
            dw_a += dya * normalized_as_used(xa, rstd, MODE, XDT)
        if T > 0:
            _bwd_output(xhb, grb, c, rstd, DRES, e_offs, DX, x_offs, rows, M, N, cols_b, XDT, HAS_DRES)
            if DW_PARTIALS:
                dw_b += dyb * normalized_as_used(xb, rstd, MODE, XDT)
    if DW_PARTIALS:
        tl.store(DW_PART + pid.to(tl.int64) * N + cols_a, tl.sum(dw_a, axis=0), mask=cols_a < N)
        if T > 0:
            tl.store(DW_PART + pid.to(tl.int64) * N + cols_b, tl.sum(dw_b, axis=0), mask=cols_b < N)


@triton.jit
def _dw_columns(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, RSTD, DW, blk, M, N, R1, G, MB: tl.constexpr,
                BN: tl.constexpr, MODE: tl.constexpr, XDT: tl.constexpr, WDT: tl.constexpr):
    """The fast dW of columns [blk * BN, blk * BN + BN) over all M <= MB rows, from dy, z and rstd in one tile: the
    rows' contributions (as the partials' and the fold's) summed by one tl.sum over the rows, an order fixed by the
    compiled kernel, then rounded once to the weight's dtype WDT (bf16 stored through an int16 view). Rows past M
    add +0.0 (their z, dy and rstd load as 0)."""
    rows = tl.arange(0, MB)
    cols = blk * BN + tl.arange(0, BN)
    z_offs, _ = row_offsets(rows, R1, G, zs0, zs1, zsg)
    d_offs, _ = row_offsets(rows, R1, G, ds0, ds1, dsg)
    rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
    z, dy = _bwd_load(Z, z_offs, DY, d_offs, rows, M, N, cols)
    contributions = widen(dy) * normalized_as_used(widen(z), rstd, MODE, XDT)
    store_rounded(DW + cols, tl.sum(contributions, axis=0), cols < N, WDT)


@triton.jit
def _bwd_rows(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg, DX, xs0, xs1, xsg, DW_PART,
              pid, nprog, M, N, R1, G, offset, ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr,
              T: tl.constexpr, LOG2T: tl.constexpr, MODE: tl.constexpr, XDT: tl.constexpr, HAS_W: tl.constexpr,
              PER_HEAD: tl.constexpr, HAS_DRES: tl.constexpr, DW_PARTIALS: tl.constexpr, PREFETCH: tl.constexpr,
              STAGES: tl.constexpr, CHUNK: tl.constexpr, LOG2CHUNK: tl.constexpr, NCH: tl.constexpr,
              LOG2NCH: tl.constexpr, WB_NW: tl.constexpr, WB_S: tl.constexpr, WB_ST: tl.constexpr,
              MEAN_SCALE: tl.constexpr):
    """dx (and the partials) of the row blocks program pid of nprog takes: rows held whole or in column chunks."""
    if CHUNK > 0:
        _bwd_chunked(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg, DX, xs0, xs1, xsg,
                     DW_PART, pid, nprog, M, N, R1, G, offset, ROWS, CHUNK, LOG2CHUNK, NCH, LOG2NCH, MODE, XDT, HAS_W,
                     PER_HEAD, HAS_DRES, DW_PARTIALS, STAGES, MEAN_SCALE)
    else:
        _bwd_held(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg, DX, xs0, xs1, xsg, DW_PART,
                  pid, nprog, M, N, R1, G, offset, ROWS, PA, LOG2PA, T, LOG2T, MODE, XDT, HAS_W, PER_HEAD, HAS_DRES,
                  DW_PARTIALS, PREFETCH, STAGES, WB_NW, WB_S, WB_ST, MEAN_SCALE)


@triton.jit(do_not_specialize=["M"])
def rms_bwd_kernel(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg,
                   DX, xs0, xs1, xsg, DW_PART,
                   M, N, R1, G, offset,
                   ROWS: tl.constexpr, PA: tl.constexpr, LOG2PA: tl.constexpr, T: tl.constexpr,
                   LOG2T: tl.constexpr, MODE: tl.constexpr, XDT: tl.constexpr, HAS_W: tl.constexpr,
                   PER_HEAD: tl.constexpr, HAS_DRES: tl.constexpr, DW_PARTIALS: tl.constexpr,
                   PREFETCH: tl.constexpr = False, STAGES: tl.constexpr = 1, CHUNK: tl.constexpr = 0,
                   LOG2CHUNK: tl.constexpr = 0, NCH: tl.constexpr = 1, LOG2NCH: tl.constexpr = 0,
                   WB_NW: tl.constexpr = 0, WB_S: tl.constexpr = 8, WB_ST: tl.constexpr = 0,
                   MEAN_SCALE: tl.constexpr = 0.0, GDC: tl.constexpr = False, DW_MB: tl.constexpr = 0,
                   DW_BN: tl.constexpr = 0, WDT: tl.constexpr = 0):
    """dx for blocks of ROWS rows, programs striding over the blocks, in one or two column tiles (T), or in column
    chunks of CHUNK lanes (CHUNK > 0, T = 0: _bwd_chunked). With DW_PARTIALS, each program also sums its rows' dW
    contributions (shared weight only) into DW_PART[pid]. GDC (sm_90 and newer): each program first lets the
    partial rows' sum, launched after it as a dependent grid, be scheduled (it waits for this grid's end on the GPU:
    the CUDA backend's partial_sum.cu).
    DW_BN > 0 (few rows, M <= DW_MB; no partials): the grid's last cdiv(N, DW_BN) programs compute the fast dW
    itself, DW_BN columns each over every row (_dw_columns), into DW_PART (the weight's dtype WDT), while the others
    compute dx: dW and dx in one launch, no partial rows. dx must not overwrite dy or z (not in place).
    PREFETCH: the next block's rows loaded into registers before this block's sums (its loads in flight while this
    block computes and stores); STAGES > 1: the loop's loads pipelined by Triton through shared memory, that many
    stages. WB_NW > 0 (num_warps = WB_NW; rows held whole): the row in warp blocks, as in rms_fwd_kernel. MEAN_SCALE:
    as rms_fwd_kernel's. None changes a value."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if DW_BN > 0:
        n_dx = nprog - tl.cdiv(N, DW_BN)
        if pid >= n_dx:
            _dw_columns(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, RSTD, DW_PART, pid - n_dx, M, N, R1, G, DW_MB, DW_BN,
                        MODE, XDT, WDT)
        else:
            _bwd_rows(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg, DX, xs0, xs1, xsg,
                      DW_PART, pid, n_dx, M, N, R1, G, offset, ROWS, PA, LOG2PA, T, LOG2T, MODE, XDT, HAS_W,
                      PER_HEAD, HAS_DRES, DW_PARTIALS, PREFETCH, STAGES, CHUNK, LOG2CHUNK, NCH, LOG2NCH, WB_NW,
                      WB_S, WB_ST, MEAN_SCALE)
    else:
        _bwd_rows(DY, ds0, ds1, dsg, Z, zs0, zs1, zsg, W, wsg, RSTD, DRES, es0, es1, esg, DX, xs0, xs1, xsg,
                  DW_PART, pid, nprog, M, N, R1, G, offset, ROWS, PA, LOG2PA, T, LOG2T, MODE, XDT, HAS_W, PER_HEAD,
                  HAS_DRES, DW_PARTIALS, PREFETCH, STAGES, CHUNK, LOG2CHUNK, NCH, LOG2NCH, WB_NW, WB_S, WB_ST,
                  MEAN_SCALE)


@triton.jit(do_not_specialize=["ROWS_PER_GROUP", "GROUP_STEP"])
def fold_kernel(A, as0, as1, asg, B, bs0, bs1, bsg, RSTD, OUT,
                ROWS_PER_GROUP, N, R1, G, GROUP_STEP,
                BN: tl.constexpr, UNROLL: tl.constexpr, WHAT: tl.constexpr, XDT: tl.constexpr):
    """Strict ascending left fold over rows, acc = acc + v[row] from +0.0, for BN columns of one group.

    WHAT == RAW_ROWS: v = f32(A[row]). Otherwise v is the dW contribution of casting mode WHAT - 1,
    recomputed from dy (A), the norm's input (B) and rstd: no (rows, N) buffer. Group h = program_id(1)
    folds logical rows t * GROUP_STEP + h for t ascending (GROUP_STEP = H for per-head weights, else 1).
    """
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    h = tl.program_id(1)
    cmask = cols < N
    acc = tl.zeros((BN,), tl.float32)
    for t0 in range(0, ROWS_PER_GROUP, UNROLL):
        for u in tl.static_range(UNROLL):
            t = tl.full((1,), t0 + u, tl.int64)
            live = t < ROWS_PER_GROUP
            rows = t * GROUP_STEP + h
            mask = cmask[None, :] & live[:, None]
            a_offs, _ = row_offsets(rows, R1, G, as0, as1, asg)
            v = widen(tl.load(A + a_offs[:, None] + cols[None, :], mask=mask, other=0.0))
            if WHAT != RAW_ROWS:
                b_offs, _ = row_offsets(rows, R1, G, bs0, bs1, bsg)
                xf = widen(tl.load(B + b_offs[:, None] + cols[None, :], mask=mask, other=0.0))
                rstd = tl.load(RSTD + rows, mask=live, other=0.0)
                v = v * normalized_as_used(xf, rstd, WHAT - 1, XDT)
            # rows past the end add nothing: keep acc as is (adding +0.0 would turn -0.0 into +0.0)
            acc = tl.where(live, acc + tl.reshape(v, (BN,)), acc)
    tl.store(OUT + h.to(tl.int64) * N + cols, acc, mask=cmask)
