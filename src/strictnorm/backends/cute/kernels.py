"""CuTe DSL RMSNorm forward and backward with the contract's exact bits (first versions, compile-tested).

Same mapping as ../cuda/kernels/rms_norm.cu: the padded row (P lanes) is cut into pieces of PIECE
lanes; TPR threads serve a row and thread t owns pieces k * TPR + t; canon_sum is the in-thread
pairwise tree over each piece, butterfly shuffles with offsets 1, 2, 4, ... across adjacent threads,
then the remaining subtrees (k * warps + warp) pairwise, in-thread or through shared memory.

Exactness: every fp32 operation is an explicitly rounded intrinsic (add/mul/div/sqrt with
RoundingMode.NEAREST_EVEN, which lower to add.rn.f32 & co.): plain `a * b + c` in the DSL becomes an
fma, and plain `add.f32` may be contracted by ptxas. The Gemma offset is a runtime fp32 added to the
widened weight inside the kernel, never to the weight in its own dtype.

Status: compiles for sm_90a without a GPU (CUTE_DSL_ARCH; tests/test_cute.py, in CI); bitwise equal to
the reference on an H200 (bf16 rows, every mode, fused add with an fp32 residual stream; see
bench/results/); offered as backend `cute` (backend.py). Rows whose pieces are whole and 16-byte aligned
use 16-byte vector loads and stores; others load element by element. Kernels launch on torch's current
stream. Block shapes follow the CUDA backend's tables (tuned_shape); a thread keeps its lanes of the row in
registers between the two passes (HOLD; at most _HOLD_MAX_VALUES of them) instead of reading them again.

Calls: through TVM FFI where apache-tvm-ffi is importable (the default then): the kernels are compiled for
it (`--enable-tvm-ffi`), take torch tensors as they are and find torch's current stream themselves; else
through DLPack (cute.runtime.from_dlpack per tensor per call, and an explicit stream argument).
STRICTNORM_CUTE_CALLS=dlpack or tvm-ffi picks one. The same kernels either way (CI compares the PTX); on an
H200 (bench/results/2026-11-30-h200-run7) both pass the GPU tests and an eager cute forward cost 70 us of
host time through TVM FFI against 208-359 us through DLPack in run 6.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cache, lru_cache

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.math import RoundingMode
from cutlass.cutlass_dsl import T

from ...reference import exact_mean_scale, next_pow2
from ..base import MODE_CODES
from ..tuning import for_rows

_RN = RoundingMode.NEAREST_EVEN
_WARP = 32


def _add(a, b):
    return cute.math.add(a, b, rounding=_RN)


def _mul(a, b):
    return cute.math.mul(a, b, rounding=_RN)


def _div(a, b):
    return cute.math.div(a, b, rounding=_RN)


def _round_to(v, dtype):
    """rd(v, dtype) widened back to fp32 (round to nearest even)."""
    if const_expr(dtype == Float32):
        return v
    return v.to(dtype).to(Float32)


@cute.jit
def _launder(raw: cute.Tensor) -> None:
    """Hides a held piece's 32-bit words from the optimizer at this point (rms_norm.cu's launder): without it the
    compiler keeps pass 1's fp32 widening alive for pass 2 instead of the words as loaded. An empty asm: no
    instruction, the same values."""
    words = cute.recast_tensor(raw, Int32)
    for j in cutlass.range_constexpr(cute.size(words)):
        words[j] = Int32(llvm.inline_asm(T.i32(), [words[j].ir_value()], "", "=r,0", has_side_effects=True,
                                         is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _pair_tree(values: list):
    """Adjacent-first pairwise tree over a power-of-two list (trace time: fully unrolled)."""
    while len(values) > 1:
        values = [_add(values[2 * j], values[2 * j + 1]) for j in range(len(values) // 2)]
    return values[0]


@dataclass(frozen=True)
class ForwardShape:
    """Compile-time block shape; any choice gives the same bits (the tree is fixed by N). hold: pass 1's
    lanes stay in registers for pass 2 (else pass 2 reads them again); persistent: a grid of at most the
    resident blocks striding over the row groups (else one block per group)."""

    piece: int
    tpr: int
    k: int
    rpb: int
    hold: bool = False
    persistent: bool = True
    # with hold, the weight's lanes loaded in pass 1 and held for pass 2 (else read in pass 2): in the forward its loads
    # then go out with the row's, before the row sum (Triton's w_first); in the backward they are held beside z and dy
    hold_weight: bool = False
    # the backward: the next row's z, dy and rstd loaded into registers (as loaded) before this row's sums, so their
    # loads are in flight while it computes and stores
    prefetch: bool = False
    # pieces a thread may have inside N (0: all k): pieces kr..k-1 lie wholly in every thread's padding (kk * TPR *
    # PIECE >= N), so their piece sums are the +0.0 canon_sum pads with and they are neither loaded, held nor
    # stored (the CUDA backend's trim). A kernel with kr < k is for its N's pieces only (its compile key holds N)
    kr: int = 0
    # the forward with hold: its lanes held as loaded (x's dtype; with the fused add z rounded to D; with hold_weight
    # the weight's too) and widened to fp32 again in pass 2, as the CUDA forward holds them: half the registers for
    # bf16/fp16 rows (the widening is exact, so the bits are the same)
    hold_raw: bool = False
    # the forward of 16-byte rows (vector) without a residual: x's pieces copied into shared memory by cp.async (a
    # thread's pieces all issued, the weight's too where it comes first, then one wait) and both passes reading them
    # there, so the loads in flight hold no registers (Quack's forward); on a grid that is not persistent only
    staged: bool = False

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb

    @property
    def live(self) -> int:
        """The pieces a thread computes (kr, or k without a trim)."""
        return self.kr or self.k

    @property
    def subtrees(self) -> int:
        return self.k * max(1, self.tpr // _WARP)


# lanes a thread holds across the passes, as fp32 registers: the forward holds one tensor's, the backward two or
# three (z, dy, maybe w) beside its fp32 dW partials
_HOLD_MAX_VALUES = {False: 32, True: 16}
# what the tables' shapes hold between the passes (bench/sweep_cute.py times the alternatives on a GPU; any
# choice gives the same bits)
# The backward's prefetch applies where its rows are held (on an H200, bench/results/2026-11-30-h200-run16, call d,
# sweep_cute, every configuration bitwise: with 2 blocks an SM, 2048 x 4096 26.8 -> 19.9 us, 8192 x 4096 73.0 -> 58.6,
# 32768 x 4096 246.6 -> 207.7; with 4 at 262144 x 128, 70.2 -> 58.1; rows read twice lost: 8192 x 8192 141.7 -> 159.1,
# 2048 x 18432 173.1 -> 207.3)
# "threads": the most threads a row may take to hold its lanes (longer rows are read twice); "prefetch_threads" the
# same for the backward that prefetches (run 17, call b: rows of P = 8192 held by 512 threads and prefetched, 1 block
# an SM, 8192 x 8192 141.3 -> 113.2 us; Quack 129.1).
# "forward_trimmed": where the rule above reads a forward's rows twice, hold them anyway at the table entry's threads
# a row when a thread's lanes inside N (ForwardShape.live pieces) are at most that many (0: never): N = 16384 held by
# 512 threads, 32 lanes each, N = 18432 by 512, 40 live lanes each, as the CUDA forward (bench/results/
# 2026-12-01-h200-run18, call b, sweep_cute "forward held trimmed", bitwise: 4096 x 16384 76.6 -> 71.9 us, 2048 x
# 18432 51.2 -> 42.2; Quack 45.9).
# "forward_raw": the longest padded rows whose held forward keeps its lanes as loaded (ForwardShape.hold_raw; 0:
# none, sweep_cute's "forward held in fp32", the rule before it). Offline, sm_90a cubins of bf16 rows, registers a
# thread: P = 4096 with 32 lanes a thread 48 -> 32, with 64 lanes (FORWARD_VALUES) 80 -> 48 (the CUDA forward's: 61);
# P = 128, 32 lanes 56 -> 40. On an H200 (bench/results/2026-12-04-h200-run42, call c, sweep_cute, bitwise, us, held
# in fp32 -> as loaded): 2048 x 4096 11.7 -> 10.1, 16384 x 128 4.4 -> 4.1, level at 32768 x 4096 and 262144 x 128,
# but 8192 x 8192 66.8 -> 70.1 (the A/B, call d: 66.75 -> 70.14), so P = 8192 and past keep fp32.
# "forward_staged": per padded length (at most _STAGED_MAX_P) the fewest rows whose held forward, on a grid that is not
# persistent, stages x in shared memory (ForwardShape.staged), and the weight beside it (forward_args: the weight
# first at every row count); fewer rows, and lengths not named, take the register path (forward_stages). On an H200
# (run42, call c, bitwise, us) x staged with the weight after the sum was slower or level everywhere; with the weight
# staged too it won at 8192 x 8192 (66.8 -> 66.1) and collapsed at P = 128 (262144 x 128 34.4 -> 355.4: the weight
# copied with .cg, from L2 by every row slot). With the weight copied through L1 (.ca, _stage_piece;
# bench/results/2026-12-05-h200-run44, call c, sweep_cute "forward staged + weight first"): 8192 x 4096 35.7 -> 34.2
# (Quack 34.4 in call b), 512 x 4096 3.8 -> 3.9, 65536 x 128 10.9 -> 10.8, 262144 x 128 34.7 -> 35.0. The row bounds:
# where few rows are in flight a block's one wait for all its copies puts their whole latency ahead of its sums
# (bench/results/2026-12-05-run45, A/B of P = 4096 and 8192 staged against main, us; H200 with staging at every row
# count: 128 x 4096 2.53 -> 2.62, 512 x 4096 3.78 -> 3.84, 2048 x 4096 9.86 -> 9.81, 8192 x 4096 35.89 -> 34.24
# (Quack 34.51), 32768 x 4096 130.67 -> 131.06 (Quack 130.05-130.67), 8192 x 8192 66.86 -> 66.67; H100 from 2048
# rows: 2048 x 4096 12.10 -> 12.54, 4096 x 4096 24.23 -> 23.87, 8192 x 4096 46.82 -> 46.43, 32768 x 4096 180.58 ->
# 179.62, 2048 x 8192 24.42 -> 23.65, 8192 x 8192 90.72 -> 90.34).
HOLD = {"forward": True, "backward": True, "backward_weight": False, "backward_prefetch": True, "threads": 256,
        "prefetch_threads": 512, "forward_trimmed": 40, "forward_raw": 4096,
        "forward_staged": {4096: 4096, 8192: 2048}, "mean_scale": False}
# HOLD["mean_scale"]: for N a power of two, both kernels take a row's mean as the sum times the exact 2^-k
# (reference.exact_mean_scale: the same bits as the IEEE division by N), as the Triton kernels do since run 33 and
# the CUDA ones with NormTuning.mean_scale. Off: on an H200 (bench/results/2026-12-05-h200-run47, call c, A/B of 2
# rounds, fwd / bwd us) it lost 262144 x 128 34.69 -> 36.93 / 55.36 -> 59.02, 65536 x 128 bwd 17.31 -> 18.53, 32768 x
# 4096 bwd 207.97 -> 219.22. Offline (sm_90a cubins) the division's slow path gone, ptxas schedules otherwise: the
# P = 128 forward takes 32 registers instead of 40 and issues its fourth x load after the first three pieces'
# squares, the backward its next row's loads after this row's dx (ptxas places a load by its first use).
# Pinning the held forward's loads ahead of the row sum (its first word made to depend, through selects on n < -j,
# on every other piece of x and the weight loaded first) lost on an H100 (bench/results/2026-12-05-h100-run48, call
# c, fwd us): 128 x 4096 2.43 -> 2.50, 512 x 4096 4.29 -> 4.54, 262144 x 128 47.86 -> 50.91; it was removed.
# the forward's weight loaded with the row, before the row sum (ForwardShape.hold_weight), per padded length P up to
# this many rows (a latency saving where few rows are in flight; a P not listed: never), as Triton's w_first. On an
# H200 (bench/results/2026-12-01-h200-run18, sweep_cute "weight first" against "weight after the sum", bitwise, us):
# 128 x 4096 3.7 -> 2.7, 512 x 4096 4.6 -> 4.2, 128 x 8192 4.2 -> 3.2; slower from 1024 rows of 4096 (6.2 -> 7.6;
# more registers, fewer rows in flight) and at 2048 x 18432 (42.9 -> 60.3). At P = 128 up to 4096 rows as the CUDA
# table's entry there (FORWARD_ROW_BOUNDS: bench/results/2026-12-04-h200-run41, 4096 x 128 2.91 -> 2.10 us), and on
# to 16384 rows with FORWARD_FEW_ROWS. A staged forward (HOLD["forward_staged"]) takes the weight first always.
# Past those bounds at P = 128 the weight is read in the second pass, each piece's load just before its y (sm_90a
# SASS); the weight first there (48 registers against 40, its loads among the sum's shuffles) was level on an H200
# (bench/results/2026-12-06-h200-run49, calls b and e: 65536 x 128 and 262144 x 128 within the rounds' spread).
FORWARD_WEIGHT_FIRST_ROWS: dict[int, int] = {128: 16384, 4096: 512, 8192: 128}
# the lanes a thread of the held forward takes per padded length, past the table's entry and _HOLD_MAX_VALUES (fewer
# threads a row, more rows a block): Quack's forward takes 64 threads a row at 4096 columns (64 lanes each), as the
# CUDA table's entry for 129-2048 rows does. Empty until measured (sweep_cute's "forward 64 a thread").
FORWARD_VALUES: dict[int, int] = {}


# whether shapes trim the pieces wholly past N (ForwardShape.kr; the same bits either way)
TRIM = True
# the longest padded rows a staged forward takes (a block's rows in shared memory: 16 KB a row of bf16 at P = 8192)
_STAGED_MAX_P = 8192


def forward_shape(n: int, threads_min: int = 128, values: int = 16) -> ForwardShape:
    """PIECE = 8 lanes; TPR = P / values threads per row (1 to 1024), RPB rows per block up to threads_min; with
    TRIM, the pieces wholly past N trimmed."""
    p = next_pow2(n)
    piece = min(p, 8)
    tpr = max(1, min(1024, p // max(piece, values)))
    k = p // (piece * tpr)
    kr = min(k, -(-n // (piece * tpr))) if TRIM else 0
    return ForwardShape(piece, tpr, k, max(1, threads_min // tpr), kr=kr if kr < k else 0)


# The padded lengths whose forward takes the CUDA forward table's entry for its row count (FWD_TABLE's row bounds: at
# P = 128 up to 4096 rows 16 threads a row of 8 lanes, the CUDA forward's 4096 x 128 2.88 -> 2.40 us in run 36; at
# P = 4096 up to 128 rows one row of 512 threads); any other P takes the unbounded entry at every row count. On an
# H200 (bench/results/2026-12-04-h200-run41, A/B against the unbounded entry): 4096 x 128 2.91 -> 2.10 us (Quack 2.0),
# 128 x 4096 2.85 -> 2.46.
# The backward keeps the unbounded entry (its table's smaller row counts are not measured for the cute kernel).
FORWARD_ROW_BOUNDS: frozenset[int] = frozenset({128, 4096})
# Per padded length, the row count up to which the forward keeps the table's first (few-rows) entry past that entry's
# own bound: Quack's forward shape at P = 128 (16 threads a row, 8 rows a block of 128 threads) with the weight first
# (FORWARD_WEIGHT_FIRST_ROWS). On an H200 (bench/results/2026-12-04-h200-run42, call e, sweep_cute "forward few-rows
# shape at 128", bitwise, us): 16384 x 128 4.1 -> 3.3 (Quack 3.4); at 262144 x 128 it lost (34.4 -> 36.5). Up to
# 65536 rows (run 44, call c, "forward few rows to 65536 at 128"): 65536 x 128 10.9 -> 10.4 (Quack 9.6 and Liger 9.5
# in call b); in run 45's A/B (bench/results/2026-12-05-run45, us, forward / backward as the bench takes them, the
# backward = forward with grad + backward less the forward without) the forward won on both cards (H200 11.01 ->
# 10.74, H100 14.03 -> 13.38) but the backward lost as much or more on both (H200 17.14 -> 17.94, H100 21.87 ->
# 23.04; its kernel unchanged, so the training step's forward), so 16384 stays.
FORWARD_FEW_ROWS: dict[int, int] = {128: 16384}
# Per padded length, the row count up to which an inference call's forward (need_rstd False: no backward follows)
# keeps that few-rows entry, with the weight first, past FORWARD_FEW_ROWS and FORWARD_WEIGHT_FIRST_ROWS. Run 45's
# backward loss at 65536 x 128 is the training step's: on an H100 (bench/results/2026-12-05-run46, call b,
# bench/kernel_split.py, each kernel of forward with grad + backward, two rounds, us) the forward 14.08 / 14.19 ->
# 13.57 / 13.63 and the backward kernel after it 19.26 / 19.20 -> 20.26 / 20.26 (the same kernel, after a forward of
# the other shape), a step 0.5 us slower; a forward with no backward after it keeps the gain.
FORWARD_INFERENCE_FEW_ROWS: dict[int, int] = {128: 65536}


def _inference_few_rows(n: int, rows: int, need_rstd: bool) -> bool:
    """Whether an inference forward of `rows` rows of N keeps the few-rows entry (FORWARD_INFERENCE_FEW_ROWS)."""
    return not need_rstd and rows <= FORWARD_INFERENCE_FEW_ROWS.get(next_pow2(n), 0)


def forward_row_bound(n: int, rows: int, need_rstd: bool = True) -> int | None:
    """The row bound of the CUDA forward table's entry that the forward of `rows` rows of N takes (None: the unbounded
    entry, or an entry giving its shape); need_rstd False for an inference call's. tuned_shape and compile_forward
    take it, so a kernel is compiled per distinct shape, not per row count."""
    from ..cuda.backend import FWD_TABLE, entries_for

    p = next_pow2(n)
    if p not in FORWARD_ROW_BOUNDS:
        return None
    bounds = [(bound, bound) for bound, _ in entries_for(FWD_TABLE, n)]  # each entry's own bound
    # the first entry, stretched
    few = bounds[0][0] is not None and (rows <= FORWARD_FEW_ROWS.get(p, 0) or _inference_few_rows(n, rows, need_rstd))
    bound = bounds[0][0] if few else for_rows(bounds, rows)
    return bound if tuned_shape(n, False, True, bound) != tuned_shape(n, False, True, None) else None


def forward_stages(n: int, rows: int) -> bool:
    """compile_forward's `stage` for the forward of `rows` rows of N: False for fewer rows of a staged length than
    HOLD["forward_staged"] names, True elsewhere (where the shape does not stage, True too: one kernel for every row
    count)."""
    return rows >= HOLD["forward_staged"].get(next_pow2(n), 0)


@cache
def tuned_shape(n: int, backward: bool, partials: bool = True, row_bound: int | None = None) -> ForwardShape:
    """The block shape of the CUDA backend's table entry for N's padded length at its largest row counts, or for the
    forward the entry of row bound `row_bound` (forward_row_bound; ../cuda/backend.py: the same mapping of a row onto
    threads, swept on an H200), holding at most
    _HOLD_MAX_VALUES lanes a thread; rows past the entry's hold_max_p, or longer than HOLD["threads"] threads holding
    that many (HOLD["prefetch_threads"] for the backward that prefetches), are read twice. The backward prefetches
    only with the fast dW's partials: without them (the strict backward beside the CUDA fold) it keeps the shape
    measured up to run 15."""
    from ..cuda.backend import BWD_TABLE, FWD_TABLE, entries_for

    t = for_rows(entries_for(BWD_TABLE if backward else FWD_TABLE, n), None if backward else row_bound)
    p = next_pow2(n)
    # held only where 256 threads a row can hold it: on an H200 rows held by 512 or 1024 threads lost to rows read
    # twice by 256 (bench/results/2026-11-30-h200-run11, d-sweep-cute: 2048 x 18432 forward 56.5 -> 72.3 us,
    # 8192 x 8192 backward 156.6 -> 162.2), where at 4096 columns holding won (32768 rows forward 152.4 -> 132.4);
    # with the backward's prefetch, which needs held rows, 512 threads a row won (HOLD's comment)
    prefetch = backward and partials and HOLD["backward_prefetch"]
    threads = HOLD["prefetch_threads" if prefetch else "threads"]
    hold = (HOLD["backward" if backward else "forward"] and p <= t.hold_max_p
            and p // threads <= _HOLD_MAX_VALUES[backward])
    if not (hold or backward) and HOLD["forward"] and HOLD["forward_trimmed"] and p <= t.hold_max_p:
        s = forward_shape(n, t.min_threads, t.values)
        if s.live * s.piece <= HOLD["forward_trimmed"]:
            return replace(s, hold=True, persistent=t.persistent, hold_raw=p <= HOLD["forward_raw"])
    values = min(t.values, _HOLD_MAX_VALUES[backward]) if hold else max(8, p // t.stream_threads)
    if hold and not backward:
        values = FORWARD_VALUES.get(p, values)
    # the backward's fp32 dW partials are one row per block slot: its grid stays persistent
    staged = hold and not (backward or t.persistent) and p in HOLD["forward_staged"] and p <= _STAGED_MAX_P
    return replace(forward_shape(n, t.min_threads, values), hold=hold, persistent=t.persistent or backward,
                   hold_weight=hold and backward and HOLD["backward_weight"], prefetch=hold and prefetch,
                   hold_raw=hold and not backward and p <= HOLD["forward_raw"], staged=staged)


@dataclass
class _Thread:
    """A thread's place in a row kernel (trace-time values, made at the top of the kernel)."""

    t: object  # lane of the row: pieces k * TPR + t
    slot: object  # the block's row slot
    lane: object  # lane of the warp
    warp_in_row: object
    scratch: cute.Tensor  # (2, RPB, SUBTREES) fp32 for the row reduction
    block: object
    blocks: object
    iters: object  # grid-stride iterations over groups of RPB rows (the same for the whole block)
    stages: list | None = None  # a staged forward's rows in shared memory (thread_place)

    def row(self, s: ForwardShape, it):
        return (self.block + it * self.blocks) * s.rpb + self.slot


def thread_place(s: ForwardShape, rows, stage_dtypes: tuple = ()) -> _Thread:
    """The thread's place; for each of stage_dtypes, a block's staging rows in shared memory too (a staged forward:
    (RPB, the live pieces' lanes) of x's dtype, and of the weight's where it comes first; from the same allocator as
    the reduction's scratch)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    smem = cutlass.memory.SmemAllocator()
    scratch = smem.allocate_tensor(Float32, cute.make_layout((2, s.rpb, s.subtrees)), 16)
    lanes = s.live * s.tpr * s.piece
    stages = [smem.allocate_tensor(dtype, cute.make_layout((s.rpb, lanes), stride=(lanes, 1)), 16)
              for dtype in stage_dtypes]
    # a grid that is not persistent has a block for each row group (_grid): one iteration, no trip count to divide
    # out before the first load
    iters = 1
    if const_expr(s.persistent):
        iters = ((rows + s.rpb - 1) // s.rpb - bidx + gdim - 1) // gdim
    return _Thread(t=tidx % s.tpr, slot=tidx // s.tpr, lane=tidx % _WARP, warp_in_row=(tidx % s.tpr) // _WARP,
                   scratch=scratch, block=bidx, blocks=gdim, iters=iters, stages=stages)


def row_sum(s: ForwardShape, part: list, th: _Thread, parity):
    """canon_sum of a row from this thread's piece sums part[k] (steps 2 and 3 of the module
    docstring); every thread of the row gets the total. All threads of the block call it together.
    Trace-time helper: no data-dependent branches (every lane of a warp holds the same totals after
    the butterfly, so all of them may write them). A trimmed piece's part is None: +0.0 in every thread, so its
    butterfly sums are +0.0 and need no shuffles."""
    off = 1
    while off < min(s.tpr, _WARP):  # adjacent pieces first
        part = [p_ if p_ is None else _add(p_, cute.arch.shuffle_sync_bfly(p_, offset=off)) for p_ in part]
        off *= 2
    part = [Float32(0.0) if p_ is None else p_ for p_ in part]
    if s.tpr <= _WARP:
        return _pair_tree(part)
    scratch, slot, lane = th.scratch, th.slot, th.lane
    for kk in range(s.k):
        scratch[parity, slot, kk * (s.tpr // _WARP) + th.warp_in_row] = part[kk]
    cute.arch.sync_threads()
    if s.subtrees >= _WARP:  # lane l reduces the aligned run [l * run, (l + 1) * run), then butterfly
        run = s.subtrees // _WARP
        u = _pair_tree([scratch[parity, slot, lane * run + j] for j in range(run)])
        for sh in (1, 2, 4, 8, 16):
            u = _add(u, cute.arch.shuffle_sync_bfly(u, offset=sh))
    else:  # lanes [0, subtrees) hold one subtree each; xor offsets below subtrees never reach the rest
        u = cutlass.select_(lane < s.subtrees, scratch[parity, slot, cutlass.min(lane, s.subtrees - 1)], Float32(0.0))
        sh = 1
        while sh < s.subtrees:
            u = _add(u, cute.arch.shuffle_sync_bfly(u, offset=sh))
            sh *= 2
    return cute.arch.shuffle_sync(u, 0)


class _RowKernel:
    """What the forward and backward share: block shape, casting mode, weight, vector access."""

    def __init__(self, shape: ForwardShape, mode: str, has_weight: bool, norm_dtype, vector: bool = False,
                 mean_scale: float = 0.0) -> None:
        self.s = shape
        self.mode = MODE_CODES[mode]
        self.has_weight = has_weight
        self.norm_dtype = norm_dtype  # D of the contract: the norm input's dtype
        # whole pieces of 16-byte-aligned rows (N % PIECE == 0): 16-byte vector loads and stores
        self.vector = vector
        # 1 / N for a kernel compiled for one N = 2^k (HOLD["mean_scale"]), else 0.0: the mean divided by n
        self.mean_scale = mean_scale

    def _mean(self, total, n):
        """total / N: times the exact mean scale where the kernel has one (the same bits), else the IEEE division."""
        if const_expr(self.mean_scale != 0.0):
            return _mul(total, Float32(self.mean_scale))
        return _div(total, n.to(Float32))

    def _normalized(self, xf, rstd):
        """The normalized value as y's scaling step uses it (contract, forward step 3)."""
        if const_expr(self.mode == 1):
            return _mul(xf, rstd)
        if const_expr(self.mode == 0):
            return _round_to(_mul(xf, rstd), self.norm_dtype)
        return _round_to(_mul(xf, _round_to(rstd, self.norm_dtype)), self.norm_dtype)

    def _weight(self, wraw, offset):
        """wf = f32(w) + offset in fp32 (rounded to D in mode none)."""
        wf = _add(wraw, offset)
        return _round_to(wf, self.norm_dtype) if const_expr(self.mode == 2) else wf

    @cute.jit
    def _piece(self, line: cute.Tensor, kk: cutlass.Constexpr[int], t: Int32, n: Int32, ok: cutlass.Boolean
               ) -> cute.Tensor:
        """Piece kk of thread t of a row (a 1D tensor), widened to fp32; +0.0 past N or when not ok.
        Every address read is inside the row."""
        raw = cute.make_rmem_tensor((self.s.piece,), line.element_type)
        self._load_piece(line, kk, t, n, ok, raw)
        return self._widen_piece(raw.load(), kk, t, n, ok)

    @cute.jit
    def _load_piece(self, line: cute.Tensor, kk: cutlass.Constexpr[int], t: Int32, n: Int32, ok: cutlass.Boolean,
                    raw: cute.Tensor) -> None:
        """Piece kk of thread t of a row as loaded, into raw (the row's dtype): with vector access zeros past N or
        when not ok; else every lane from a column inside the row (_widen_piece zeroes the lanes past N)."""
        s = self.s
        if const_expr(self.vector):
            idx = kk * s.tpr + t
            if ok & (idx * s.piece < n):
                atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), line.element_type, num_bits_per_copy=128)
                cute.copy(atom, cute.zipped_divide(line, (s.piece,))[None, idx], raw)
            else:
                raw.fill(0)
        else:
            for i in cutlass.range_constexpr(s.piece):
                raw[i] = line[cutlass.min((kk * s.tpr + t) * s.piece + i, n - 1)]

    @cute.jit
    def _widen_piece(self, raw, kk: cutlass.Constexpr[int], t: Int32, n: Int32, ok: cutlass.Boolean) -> cute.Tensor:
        """A loaded piece (_load_piece's values) widened to fp32, +0.0 past N or when not ok."""
        s = self.s
        out = cute.make_rmem_tensor((s.piece,), Float32)
        out.store(raw.to(Float32))
        if const_expr(not self.vector):
            for i in cutlass.range_constexpr(s.piece):
                out[i] = cutlass.select_(ok & ((kk * s.tpr + t) * s.piece + i < n), out[i], Float32(0.0))
        return out

    @cute.jit
    def _store(self, line: cute.Tensor, kk: cutlass.Constexpr[int], t: Int32, n: Int32, ok: cutlass.Boolean,
               values: cute.Tensor) -> None:
        """Stores piece kk of thread t of a row, rounded to the row's dtype, where ok and inside N."""
        s = self.s
        raw = cute.make_rmem_tensor((s.piece,), line.element_type)
        raw.store(values.load().to(line.element_type))
        if const_expr(self.vector):
            idx = kk * s.tpr + t
            if ok & (idx * s.piece < n):
                atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), line.element_type, num_bits_per_copy=128)
                cute.copy(atom, raw, cute.zipped_divide(line, (s.piece,))[None, idx])
        else:
            for i in cutlass.range_constexpr(s.piece):
                col = (kk * s.tpr + t) * s.piece + i
                if ok & (col < n):
                    line[col] = raw[i]

    @cute.jit
    def _stage_piece(self, line: cute.Tensor, stage_row: cute.Tensor, kk: cutlass.Constexpr[int], t: Int32, n: Int32,
                     ok: cutlass.Boolean, shared_line: cutlass.Constexpr[bool] = False) -> None:
        """Piece kk of thread t of a 16-byte row copied into its place in stage_row (shared memory) by cp.async;
        zeros there past N or when not ok (16-byte rows only: vector). shared_line: a line every row slot copies
        (the weight), through L1 (cp.async.ca); a row's own lanes bypass it (.cg). Every slot of every block copying
        the weight from L2 sends those requests to the few L2 lines that hold it (256 bytes at N = 128): the staged
        forward's 10x collapse at P = 128 with the weight copied by .cg (run 42: 262144 x 128 355 us), gone with .ca
        (run 44: 35.0 us)."""
        s = self.s
        idx = kk * s.tpr + t
        dst = cute.zipped_divide(stage_row, (s.piece,))[None, idx]
        if ok & (idx * s.piece < n):
            mode = cute.nvgpu.cpasync.LoadCacheMode.ALWAYS if const_expr(shared_line) else \
                cute.nvgpu.cpasync.LoadCacheMode.GLOBAL
            atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(mode), line.element_type, num_bits_per_copy=128)
            cute.copy(atom, cute.zipped_divide(line, (s.piece,))[None, idx], dst)
        else:
            zeros = cute.make_rmem_tensor((s.piece,), line.element_type)
            zeros.fill(0)
            cute.autovec_copy(zeros, dst)

    @cute.jit
    def _staged_piece(self, stage_row: cute.Tensor, kk: cutlass.Constexpr[int], t: Int32, n: Int32,
                      ok: cutlass.Boolean) -> cute.Tensor:
        """Piece kk of thread t from stage_row (_stage_piece's copy, landed), widened to fp32."""
        s = self.s
        raw = cute.make_rmem_tensor((s.piece,), stage_row.element_type)
        cute.autovec_copy(cute.zipped_divide(stage_row, (s.piece,))[None, kk * s.tpr + t], raw)
        return self._widen_piece(raw.load(), kk, t, n, ok)


class RMSNormForward(_RowKernel):
    """y, rstd of x (M, N) with a row stride; weight (N,) or none; casting mode and fp32 offset. With
    has_res, the fused add: z = rd(f32(x) + f32(residual), D) is stored to mZ (residual_out) and
    normalized (D = the residual's dtype)."""

    def __init__(self, shape: ForwardShape, mode: str, has_weight: bool, norm_dtype, vector: bool = False,
                 has_res: bool = False, mean_scale: float = 0.0) -> None:
        super().__init__(shape, mode, has_weight, norm_dtype, vector, mean_scale)
        self.has_res = has_res

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRes: cute.Tensor, mZ: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor,
                 mRstd: cute.Tensor, rows: Int32, n: Int32, eps: Float32, offset: Float32, grid: Int32,
                 stream: cuda_driver.CUstream):
        self.kernel(mX, mRes, mZ, mW, mY, mRstd, rows, n, eps, offset).launch(
            grid=(grid, 1, 1), block=(self.s.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRes: cute.Tensor, mZ: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor,
               mRstd: cute.Tensor, rows: Int32, n: Int32, eps: Float32, offset: Float32):
        s = self.s
        # trace-time: the staged path (stages_rows); the weight staged too where its pieces are 16 bytes as well
        staged = stages_rows(s, self.vector, self.has_res, mX.element_type.width)
        stage_w = staged and self.has_weight and s.hold_weight and mW.element_type.width * s.piece == 128
        th = thread_place(s, rows, ((mX.element_type,) + ((mW.element_type,) if const_expr(stage_w) else ()))
                          if const_expr(staged) else ())
        t = th.t
        for it in cutlass.range(th.iters):
            row = th.row(s, it)
            live = row < rows
            r = cutlass.min(row, rows - 1)  # loads stay in bounds; dead rows read row rows - 1, then zero
            # pass 1: z (x, or rd(x + residual) stored as residual_out), its squares, the piece trees
            xrow = mX[r, None]
            part, held, wheld = [None] * s.k, [], []  # trimmed pieces: None parts (row_sum)
            if const_expr(staged):
                # every piece's copy issued (the weight's too where it comes first), then one wait; the weight loaded
                # into registers here instead would sink past the row sum (ptxas places the loads by their use)
                stage_row = th.stages[0][th.slot, None]
                for kk in cutlass.range_constexpr(s.live):
                    self._stage_piece(xrow, stage_row, kk, t, n, live)
                if const_expr(stage_w):
                    wstage_row = th.stages[1][th.slot, None]
                    for kk in cutlass.range_constexpr(s.live):
                        self._stage_piece(mW, wstage_row, kk, t, n, live, shared_line=True)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
            # the weight's pieces loaded with the row's, into registers (stage_w: staged beside x, above)
            w_first = self.has_weight and s.hold_weight and not stage_w
            for kk in cutlass.range_constexpr(s.live):
                if const_expr(staged):
                    v = self._staged_piece(stage_row, kk, t, n, live)
                else:
                    raw = cute.make_rmem_tensor((s.piece,), xrow.element_type)
                    self._load_piece(xrow, kk, t, n, live, raw)
                    v = self._widen_piece(raw.load(), kk, t, n, live)
                if const_expr(w_first):
                    wheld.append(self._held_weight_piece(mW, kk, t, n, live))
                if const_expr(self.has_res):
                    res = self._piece(mRes[r, None], kk, t, n, live)
                    for i in cutlass.range_constexpr(s.piece):
                        v[i] = _round_to(_add(v[i], res[i]), self.norm_dtype)
                    self._store(mZ[r, None], kk, t, n, live, v)
                    raw = cute.make_rmem_tensor((s.piece,), self.norm_dtype)  # z's values are D's: exact
                    raw.store(v.load().to(self.norm_dtype))
                part[kk] = _pair_tree([_mul(v[i], v[i]) for i in range(s.piece)])
                if const_expr(not staged):
                    held.append(raw if const_expr(s.hold_raw) else v)
            if const_expr(self.has_res):
                xrow = mZ[r, None]  # without hold, pass 2 reads z back: this thread's own lanes
            ss = row_sum(s, part, th, it % 2)
            rstd = _div(Float32(1.0), cute.math.sqrt(_add(self._mean(ss, n), eps), rounding=_RN))
            if live & (t == 0):
                mRstd[r] = rstd
            if const_expr(s.hold and s.hold_raw):
                for raw in held + wheld:
                    if const_expr(raw.element_type.width < 32):
                        _launder(raw)
            # pass 2: y (the held or staged lanes, or x read again: this thread's own lanes, from L1/L2; w read again)
            for kk in cutlass.range_constexpr(s.live):
                if const_expr(staged):
                    xs = self._staged_piece(stage_row, kk, t, n, live)
                elif const_expr(s.hold and s.hold_raw):
                    xs = self._widen_piece(held[kk].load(), kk, t, n, live)
                else:
                    xs = held[kk] if const_expr(s.hold) else self._piece(xrow, kk, t, n, live)
                if const_expr(stage_w):
                    ws = self._staged_piece(wstage_row, kk, t, n, live)
                elif const_expr(self.has_weight and s.hold_weight and s.hold_raw):
                    ws = self._widen_piece(wheld[kk].load(), kk, t, n, live)
                elif const_expr(self.has_weight):
                    ws = wheld[kk] if const_expr(s.hold_weight) else self._piece(mW, kk, t, n, live)
                out = cute.make_rmem_tensor((s.piece,), Float32)
                for i in cutlass.range_constexpr(s.piece):
                    o = self._normalized(xs[i], rstd)
                    if const_expr(self.has_weight):
                        o = _mul(o, self._weight(ws[i], offset))  # the offset is added in fp32
                        if const_expr(self.mode == 2):
                            o = _round_to(o, self.norm_dtype)
                    out[i] = o
                self._store(mY[r, None], kk, t, n, live, out)

    @cute.jit
    def _held_weight_piece(self, mW: cute.Tensor, kk: cutlass.Constexpr[int], t: Int32, n: Int32,
                           ok: cutlass.Boolean) -> cute.Tensor:
        """Piece kk of the weight held for pass 2: as loaded (hold_raw) or widened."""
        if const_expr(self.s.hold_raw):
            wraw = cute.make_rmem_tensor((self.s.piece,), mW.element_type)
            self._load_piece(mW, kk, t, n, ok, wraw)
            return wraw
        return self._piece(mW, kk, t, n, ok)


class RMSNormBackward(_RowKernel):
    """dx (and optionally fp32 dW partials) of rows z (M, N) given dy, rstd, the weight and an optional
    gradient through residual_out: dx = rd((g - xh * c) * rstd [+ f32(dres)], D) with g = f32(dy) * wf,
    xh = z * rstd, c = canon_sum(xh * g) / N (contract, backward). With partials, row slot j of block b
    sums its rows' dW contributions, in row order, into mPart[b * RPB + j] (the "fast" dW, reduced over
    that buffer in a fixed order afterwards); where combines_slots, the block's slots' sums are added in slot
    order into mPart[b] instead. dx may alias dy: a thread reads its lanes of dy before it writes them."""

    def __init__(self, shape: ForwardShape, mode: str, has_weight: bool, norm_dtype, vector: bool = False,
                 has_dres: bool = False, partials: bool = False, mean_scale: float = 0.0) -> None:
        super().__init__(shape, mode, has_weight, norm_dtype, vector, mean_scale)
        self.has_dres = has_dres
        self.partials = partials

    @cute.jit
    def _fetch(self, mZ: cute.Tensor, mDY: cute.Tensor, mRstd: cute.Tensor, row: Int32, rows: Int32, t: Int32, n: Int32,
               next_z: list, next_d: list, next_rstd: cute.Tensor) -> None:
        """Loads a row's pieces of z and dy (as loaded) and its rstd into the prefetch registers; a row past the end
        reads row rows - 1's rstd and no piece."""
        live = row < rows
        r = cutlass.min(row, rows - 1)
        for kk in cutlass.range_constexpr(self.s.live):
            self._load_piece(mZ[r, None], kk, t, n, live, next_z[kk])
            self._load_piece(mDY[r, None], kk, t, n, live, next_d[kk])
        next_rstd[0] = mRstd[r]

    @cute.jit
    def __call__(self, mDY: cute.Tensor, mZ: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor, mDres: cute.Tensor,
                 mDX: cute.Tensor, mPart: cute.Tensor, rows: Int32, n: Int32, offset: Float32, grid: Int32,
                 stream: cuda_driver.CUstream):
        self.kernel(mDY, mZ, mW, mRstd, mDres, mDX, mPart, rows, n, offset).launch(
            grid=(grid, 1, 1), block=(self.s.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mDY: cute.Tensor, mZ: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor, mDres: cute.Tensor,
               mDX: cute.Tensor, mPart: cute.Tensor, rows: Int32, n: Int32, offset: Float32):
        s = self.s
        if const_expr(self.partials):
            # the partial rows' sum is launched after this grid as its dependent (CudaBackend.sum_rows on sm_90+):
            # let it be scheduled now; it waits on the GPU for this grid's end before it reads a partial
            cute.arch.griddepcontrol_launch_dependents()
        th = thread_place(s, rows)
        t = th.t
        dw_acc = cute.make_rmem_tensor((s.live, s.piece), Float32)
        dw_acc.fill(0.0)
        # with prefetch: the next row's pieces of z and dy, as loaded, and its rstd
        next_z = [cute.make_rmem_tensor((s.piece,), mZ.element_type) for _ in range(s.live)]
        next_d = [cute.make_rmem_tensor((s.piece,), mDY.element_type) for _ in range(s.live)]
        next_rstd = cute.make_rmem_tensor((1,), Float32)
        if const_expr(s.prefetch):
            self._fetch(mZ, mDY, mRstd, th.row(s, 0), rows, t, n, next_z, next_d, next_rstd)
        for it in cutlass.range(th.iters):
            row = th.row(s, it)
            live = row < rows
            r = cutlass.min(row, rows - 1)
            zrow = mZ[r, None]
            drow = mDY[r, None]
            if const_expr(s.prefetch):
                raw_z = [v.load() for v in next_z]
                raw_d = [v.load() for v in next_d]
                rstd = next_rstd[0]
                self._fetch(mZ, mDY, mRstd, th.row(s, it + 1), rows, t, n, next_z, next_d, next_rstd)
            else:
                rstd = mRstd[r]  # a dead row (r clamped) reads a real rstd; its pieces are zero and nothing is stored
            # pass 1: the piece trees of xh * g (trimmed pieces: None parts, row_sum)
            part, held = [None] * s.k, []
            for kk in cutlass.range_constexpr(s.live):
                if const_expr(s.prefetch):
                    zs = self._widen_piece(raw_z[kk], kk, t, n, live)
                    ds = self._widen_piece(raw_d[kk], kk, t, n, live)
                else:
                    zs = self._piece(zrow, kk, t, n, live)
                    ds = self._piece(drow, kk, t, n, live)
                if const_expr(self.has_weight):
                    ws = self._piece(mW, kk, t, n, live)
                held.append((zs, ds, ws if const_expr(self.has_weight and s.hold_weight) else None))
                prods = []
                for i in cutlass.range_constexpr(s.piece):
                    g = _mul(ds[i], self._weight(ws[i], offset)) if const_expr(self.has_weight) else ds[i]
                    # padded lanes add +0.0, as canon_sum pads: computed from the zero-filled lanes they
                    # would be 0 * (0 + offset), -0.0 for a negative offset
                    inside = live & ((kk * s.tpr + t) * s.piece + i < n)
                    prods.append(cutlass.select_(inside, _mul(_mul(zs[i], rstd), g), Float32(0.0)))
                part[kk] = _pair_tree(prods)
            c = self._mean(row_sum(s, part, th, it % 2), n)
            # pass 2: dx (z, dy and maybe w held, or read again: this thread's own lanes), and the dW contributions
            for kk in cutlass.range_constexpr(s.live):
                if const_expr(s.hold):
                    zs, ds, ws = held[kk]
                else:
                    zs = self._piece(zrow, kk, t, n, live)
                    ds = self._piece(drow, kk, t, n, live)
                if const_expr(self.has_weight and not s.hold_weight):
                    ws = self._piece(mW, kk, t, n, live)
                if const_expr(self.has_dres):
                    es = self._piece(mDres[r, None], kk, t, n, live)
                out = cute.make_rmem_tensor((s.piece,), Float32)
                for i in cutlass.range_constexpr(s.piece):
                    g = _mul(ds[i], self._weight(ws[i], offset)) if const_expr(self.has_weight) else ds[i]
                    xh = _mul(zs[i], rstd)
                    o = _mul(_add(g, -_mul(xh, c)), rstd)  # g - xh * c: negation is exact
                    if const_expr(self.has_dres):
                        o = _add(o, es[i])
                    out[i] = o
                    if const_expr(self.partials):
                        contrib = _mul(ds[i], self._normalized(zs[i], rstd))
                        dw_acc[kk, i] = cutlass.select_(live, _add(dw_acc[kk, i], contrib), dw_acc[kk, i])
                self._store(mDX[r, None], kk, t, n, live, out)
        if const_expr(self.partials and combines_slots(s)):
            # the slots' rows added in slot order (from +0.0) in shared memory, one row a block (as rms_norm.cu's
            # DW_COMBINE): rpb times fewer partial rows to write and sum
            width = s.k * s.tpr * s.piece
            slots = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout((s.rpb, width)), 16)
            for kk in cutlass.range_constexpr(s.live):
                for i in cutlass.range_constexpr(s.piece):
                    slots[th.slot, (kk * s.tpr + t) * s.piece + i] = dw_acc[kk, i]
            cute.arch.sync_threads()
            tidx, _, _ = cute.arch.thread_idx()
            prow = mPart[th.block, None]
            for q in cutlass.range_constexpr(-(-width // s.threads)):
                col = q * s.threads + tidx
                if col < n:
                    acc = Float32(0.0)
                    for j in cutlass.range_constexpr(s.rpb):
                        acc = _add(acc, slots[j, col])
                    prow[col] = acc
        elif const_expr(self.partials):
            prow = mPart[th.block * s.rpb + th.slot, None]
            for kk in cutlass.range_constexpr(s.live):
                vals = cute.make_rmem_tensor((s.piece,), Float32)
                for i in cutlass.range_constexpr(s.piece):
                    vals[i] = dw_acc[kk, i]
                self._store(prow, kk, t, n, True, vals)


class _Fakes:
    """Fake tensors cute.compile specializes on, for rows of N lanes: with `vector`, every row (and the
    weight) 16-byte aligned and N % PIECE == 0. Row strides are 64-bit: offsets past 2^31 elements."""

    def __init__(self, n: int, vector: bool, backward: bool, partials: bool = True, row_bound: int | None = None
                 ) -> None:
        self.shape = tuned_shape(n, backward, partials, row_bound)
        self.div = self.shape.piece if vector else 1
        self.align = 16 if vector else None
        self.m, self.n = cute.sym_int(), cute.sym_int(divisibility=self.div)

    def rows(self, dtype, own_count: bool = False):
        from cutlass.cute.runtime import make_fake_tensor

        m = cute.sym_int() if own_count else self.m
        stride = (cute.sym_int64(divisibility=self.div), 1)
        return make_fake_tensor(dtype, (m, self.n), stride, assumed_align=self.align)

    def weight(self, dtype):
        from cutlass.cute.runtime import make_fake_tensor

        return make_fake_tensor(dtype, (self.n,), (1,), assumed_align=self.align)

    def per_row(self, own_count: bool = False):
        """One fp32 per row; own_count: of any length (the forward's rstd may be a longer sink, layout.rstd_sink:
        TVM FFI calls check a shared count)."""
        from cutlass.cute.runtime import make_fake_tensor

        return make_fake_tensor(Float32, (cute.sym_int() if own_count else self.m,), (1,))


def stages_rows(s: ForwardShape, vector: bool, has_res: bool, x_width: int) -> bool:
    """Whether the forward of shape s copies x into shared memory (ForwardShape.staged): aligned rows of 16-byte
    pieces without a residual, one cp.async a piece (a piece of 8 fp32 lanes took one 16-byte copy, half the piece,
    in the DSL 4.8.1: such rows and weights are not staged)."""
    return s.staged and vector and not has_res and x_width * s.piece == 128


def _mean_scale(n: int) -> float:
    """The mean scale a kernel compiled for rows of N bakes in: 1 / N for N = 2^k with HOLD["mean_scale"], else 0.0
    (divided by its n argument). The compile caches key on N, so a kernel with a scale runs for that N only."""
    return exact_mean_scale(n) if HOLD["mean_scale"] else 0.0


def forward_args(n: int, x_dtype, w_dtype, y_dtype, mode: str, vector: bool, res_dtype=None,
                 tvm_ffi: bool = False, weight_first: bool = False, row_bound: int | None = None,
                 stage: bool = True) -> tuple:
    """The forward operator and the fake arguments cute.compile specializes on: dtypes, mode, block
    shape, and for `vector` the 16-byte alignment of every row and of the weight (PIECE = 8, N % 8 == 0).
    tvm_ffi: the stream comes from TVM FFI's environment (torch's current stream) at each call. weight_first: the
    weight loaded with held rows (ForwardShape.hold_weight; always where x is staged: the weight is staged beside
    it). row_bound: the table entry's (forward_row_bound). stage: x staged where the shape stages it (False: the
    register path; plan_forward: fewer rows than HOLD["forward_staged"] names)."""
    f = _Fakes(n, vector, backward=False, row_bound=row_bound)
    norm_dtype = res_dtype or x_dtype
    shape = replace(f.shape, staged=f.shape.staged and stage)
    staged = stages_rows(shape, vector, res_dtype is not None, x_dtype.width)
    shape = replace(shape, hold_weight=shape.hold and (weight_first or staged))
    op = RMSNormForward(shape, mode, w_dtype is not None, norm_dtype, vector, res_dtype is not None, _mean_scale(n))
    return op, (f.rows(x_dtype), f.rows(norm_dtype), f.rows(norm_dtype), f.weight(w_dtype or x_dtype),
                f.rows(y_dtype), f.per_row(own_count=True), Int32(1), Int32(n), Float32(1e-6), Float32(0.0), Int32(1),
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def backward_args(n: int, z_dtype, dy_dtype, w_dtype, mode: str, vector: bool, has_dres: bool, partials: bool,
                  tvm_ffi: bool = False) -> tuple:
    """The backward operator and its fake arguments (see forward_args); the partials have their own
    row count."""
    f = _Fakes(n, vector, backward=True, partials=partials)
    op = RMSNormBackward(f.shape, mode, w_dtype is not None, z_dtype, vector, has_dres, partials, _mean_scale(n))
    return op, (f.rows(dy_dtype), f.rows(z_dtype), f.weight(w_dtype or z_dtype), f.per_row(), f.rows(z_dtype),
                f.rows(z_dtype), f.rows(Float32, own_count=True), Int32(1), Int32(n), Float32(0.0), Int32(1),
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def _compile(op, args: tuple, tvm_ffi: bool):
    return cute.compile(op, *args, options="--enable-tvm-ffi") if tvm_ffi else cute.compile(op, *args)


@lru_cache(maxsize=256)
def compile_backward(n: int, z_dtype, dy_dtype, w_dtype, mode: str, vector: bool, has_dres: bool, partials: bool,
                     tvm_ffi: bool = False):
    op, args = backward_args(n, z_dtype, dy_dtype, w_dtype, mode, vector, has_dres, partials, tvm_ffi)
    return _compile(op, args, tvm_ffi), op.s


@lru_cache(maxsize=256)
def compile_forward(n: int, x_dtype, w_dtype, y_dtype, mode: str, vector: bool, res_dtype=None,
                    tvm_ffi: bool = False, weight_first: bool = False, row_bound: int | None = None,
                    stage: bool = True):
    """The compiled forward for one (N, dtypes, mode, vector, residual, calling convention, weight first, table
    entry, staging): the cache key holds everything baked into the kernel. The offset and eps are runtime fp32
    arguments."""
    op, args = forward_args(n, x_dtype, w_dtype, y_dtype, mode, vector, res_dtype, tvm_ffi, weight_first, row_bound,
                            stage)
    return _compile(op, args, tvm_ffi), op.s


CALLS = ("dlpack", "tvm-ffi")


def calls() -> str:
    """The calling convention in use: STRICTNORM_CUTE_CALLS, else "tvm-ffi" where apache-tvm-ffi is
    importable and "dlpack" where not (see the module's docstring)."""
    how = os.environ.get("STRICTNORM_CUTE_CALLS") or ("tvm-ffi" if _tvm_ffi_importable() else "dlpack")
    if how not in CALLS:
        raise ValueError(f"STRICTNORM_CUTE_CALLS must be one of {CALLS}, got {how!r}")
    if how == "tvm-ffi" and not _tvm_ffi_importable():
        raise RuntimeError("STRICTNORM_CUTE_CALLS=tvm-ffi needs apache-tvm-ffi: pip install apache-tvm-ffi")
    return how


@cache
def _tvm_ffi_importable() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def _launch(compiled, tvm_ffi: bool, tensors: tuple, scalars: tuple, device) -> None:
    """One kernel call: tensors then the int and float scalars, in the compiled signature's order. Tensors that
    require grad are detached (eager autograd calls reach the backend; none of them is exported). `device` is a CUDA
    tensor's, so it has an index."""
    tensors = tuple(t.detach() if t.requires_grad else t for t in tensors)
    if tvm_ffi:
        compiled(*tensors, *scalars)
        return
    typed = (Int32(v) if isinstance(v, int) else Float32(v) for v in scalars)
    compiled(*_dlpack(*tensors), *typed, _stream(device))


_TORCH_TO_CUTE = {"torch.float32": Float32, "torch.bfloat16": cutlass.BFloat16, "torch.float16": cutlass.Float16}


@dataclass(frozen=True)
class ForwardLaunch:
    """A forward planned for one row count, N, dtypes, mode, residual and vector access (all a kernel and its grid
    depend on), and the calling convention in use when it was planned (calls()); called with 2D (rows, N) tensors,
    it launches. The weight slot takes `placeholder` when there is no weight (never read)."""

    compiled: object
    tvm_ffi: bool
    rows: int
    n: int
    grid: int
    placeholder: object

    def __call__(self, x, weight, residual, y, rstd, z, eps: float, offset: float) -> None:
        res, zt = (residual, z) if residual is not None else (x, x)
        w = weight if weight is not None else self.placeholder
        _launch(self.compiled, self.tvm_ffi, (x, res, zt, w, y, rstd), (self.rows, self.n, eps, offset, self.grid),
                x.device)


def plan_forward(x, weight, residual, mode: str, out_dtype, need_rstd: bool = True) -> ForwardLaunch:
    """The forward launch for 2D rows like x (unit stride along N), the weight (N,) or None and the residual's rows
    or None, into fresh dense outputs of out_dtype; need_rstd False plans an inference call's (its rstd still
    written, into whatever buffer the call passes)."""
    import torch

    rows, n = x.shape
    if rows == 0:  # nothing to launch: nothing compiled
        return ForwardLaunch(None, False, 0, n, 0, None)
    w_dtype = _TORCH_TO_CUTE[str(weight.dtype)] if weight is not None else None
    y = torch.empty((1, n), dtype=out_dtype, device=x.device)  # stands for the fresh outputs: 16-byte aligned rows
    vector = _vector_ok(n, x, y, *(t for t in (weight, residual) if t is not None))
    weight_first = weight is not None and (rows <= FORWARD_WEIGHT_FIRST_ROWS.get(next_pow2(n), 0)
                                           or _inference_few_rows(n, rows, need_rstd))
    tvm_ffi = calls() == "tvm-ffi"
    compiled, shape = compile_forward(n, _TORCH_TO_CUTE[str(x.dtype)], w_dtype, _TORCH_TO_CUTE[str(out_dtype)], mode,
                                      vector, _TORCH_TO_CUTE[str(residual.dtype)] if residual is not None else None,
                                      tvm_ffi, weight_first, forward_row_bound(n, rows, need_rstd),
                                      forward_stages(n, rows))
    return ForwardLaunch(compiled, tvm_ffi, rows, n, _grid(shape, rows, x.device),
                         torch.empty(n, dtype=x.dtype, device=x.device))


def forward(x, weight, eps: float, offset: float, mode: str, out_dtype, residual=None, need_rstd: bool = True):
    """(y, rstd, residual_out or None) of a 2D torch tensor x (rows with a row stride, unit stride along
    N) on the GPU, planned for this call (the backend keeps its plans); need_rstd False takes an inference call's
    plan, rstd returned all the same."""
    import torch

    rows, n = x.shape
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    z = torch.empty((rows, n), dtype=residual.dtype, device=x.device) if residual is not None else None
    if rows:
        plan_forward(x, weight, residual, mode, out_dtype, need_rstd)(x, weight, residual, y, rstd, z, eps, offset)
    return y, rstd, z


# The persistent backward's blocks an SM (each writes one fp32 dW partial row a row slot) per padded length; 0 or
# absent for as many as 2048 threads an SM allow (whether or not its registers let that many run at once).
# bench/sweep_cute.py SWEEP_BLOCKS on an H200 (bench/results/2026-11-30-h200-run15, call c; every configuration
# bitwise): at P = 8192, 2 blocks an SM, 8192 x 8192 156.7 -> 142.4 us; at P = 4096 fewer blocks won at 2048 rows
# (27.0 -> 24.7) and lost from 8192 (72.7 -> 75.2, 32768 rows 246.7 -> 269.7). With the next row prefetched (run 16,
# call d): at P = 4096 2 blocks an SM at every row count (2048 x 4096 30.0 -> 19.9 us, 32768 x 4096 217.3 -> 207.7),
# at P = 128 4 (262144 x 128 70.2 -> 58.1). Rows of P = 8192 held by 512 threads and prefetched (run 17, call b):
# 1 block an SM (8192 x 8192: 4 blocks 122.5 us, 2 117.3, 1 113.2). Rows of P = 16384 and 32768 keep their partials
# (PARTIALS_MAX_VALUES) in registers enough for one block of 256 threads an SM: 1 (2048 x 18432 in run 17, call d:
# 151.3 us with 8 blocks an SM asked, 108.1 with 1; P = 16384 not measured).
# Those choices were measured with the fast dW's partials; the backward without them (strict or per-head dW, no weight
# gradient) keeps run 15's (with the CUDA fold beside it, 2 blocks an SM made the strict backward at 32768 x 4096
# 492.3 -> 569.3 us in run 16, call e).
BACKWARD_BLOCKS_PER_SM: dict[int, int] = {128: 4, 4096: 2, 8192: 1, 16384: 1, 32768: 1}
DX_BLOCKS_PER_SM: dict[int, int] = {8192: 2}


# The most fp32 dW partials a thread of the backward keeps (ForwardShape.live pieces); rows with more go to the strict
# fold, deterministic too, for dw="fast". N = 18432 with its trimmed 9 pieces of 8: 255 registers and no stack at sm_90a
# (all 16 pieces spilled: a 2 KB stack and 1.6 ms on an H200 before the trim); on an H200 (run 17, call d, bitwise) its
# backward 143.3 us with the fold beside the dx pass -> 108.1 with the partials at 1 block an SM (Quack 153.2).
PARTIALS_MAX_VALUES = 72


# The most shared memory the backward's slot rows may take where they are combined (combines_slots)
_COMBINE_SMEM_MAX = 32 * 1024


def combines_slots(s: ForwardShape) -> bool:
    """Whether the backward with partials adds its row slots' partial rows in shared memory and writes one row a
    block (several slots whose padded rows fit in _COMBINE_SMEM_MAX)."""
    return s.rpb > 1 and s.rpb * s.k * s.tpr * s.piece * 4 <= _COMBINE_SMEM_MAX


def keeps_partials(n: int) -> bool:
    """Whether the backward with the fast dW keeps its fp32 partials in the kernel for rows of N."""
    s = tuned_shape(n, True)
    return s.live * s.piece <= PARTIALS_MAX_VALUES


def backward_blocks_per_sm(n: int, partials: bool = True) -> int:
    return (BACKWARD_BLOCKS_PER_SM if partials else DX_BLOCKS_PER_SM).get(next_pow2(n), 0)


def _grid(shape: ForwardShape, rows: int, device, blocks_per_sm: int = 0, sms_left: int = 0) -> int:
    """Blocks of the grid-stride kernels: every row group, persistent ones at most blocks_per_sm an SM (0: about
    what 2048 threads an SM allow) on all SMs but sms_left (one at least)."""
    groups = -(-rows // shape.rpb)
    per_sm = blocks_per_sm or max(1, 2048 // shape.threads)
    return min(groups, max(1, _sm_count(device.index) - sms_left) * per_sm) if shape.persistent else groups


@cache
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def _stream(device):
    """torch's current stream on device: kernels are ordered with torch's work and captured in graphs."""
    from ..cuda.nvrtc import current_stream

    return cuda_driver.CUstream(current_stream(device.index))


def _dlpack(*tensors) -> list:
    from cutlass.cute.runtime import from_dlpack

    return [from_dlpack(t).mark_layout_dynamic(leading_dim=t.dim() - 1) for t in tensors]


def _vector_ok(n: int, *tensors) -> bool:
    return forward_shape(n).piece == 8 and n % 8 == 0 and all(
        t.data_ptr() % 16 == 0 and (t.dim() == 1 or t.stride(0) % 8 == 0) for t in tensors)


@dataclass(frozen=True)
class BackwardLaunch:
    """A backward planned for one row count, N, dtypes, mode, residual gradient, vector access, partials and SMs left
    to a kernel beside it, and the calling convention in use when it was planned; called with 2D (rows, N) tensors,
    it launches and returns the fast dW's fp32 partial rows (None without partials). The weight slot takes
    `placeholder` when there is no weight, and the partials' slot a one-row `placeholder_rows` without partials
    (never read or written)."""

    compiled: object
    tvm_ffi: bool
    rows: int
    n: int
    grid: int
    partial_rows: int  # 0: no partials
    placeholder: object
    placeholder_rows: object

    def __call__(self, dy, z, weight, rstd, dres, dx, offset: float):
        import torch

        part = (torch.empty((self.partial_rows, self.n), dtype=torch.float32, device=z.device) if self.partial_rows
                else self.placeholder_rows)
        _launch(self.compiled, self.tvm_ffi,
                (dy, z, weight if weight is not None else self.placeholder, rstd, dres if dres is not None else dy, dx,
                 part), (self.rows, self.n, offset, self.grid), z.device)
        return part if self.partial_rows else None


def plan_backward(dy, z, weight, dres, dx, mode: str, partials: bool, sms_left: int = 0) -> BackwardLaunch:
    """The backward launch for 2D rows like dy, z, dres (or None) and dx (unit stride along N), the weight (N,) or
    None. sms_left: SMs the persistent grid leaves to a kernel beside it (the strict fold)."""
    import torch

    rows, n = z.shape
    if rows == 0:  # nothing to launch: nothing compiled
        return BackwardLaunch(None, False, 0, n, 0, 0, None, None)
    tvm_ffi = calls() == "tvm-ffi"
    compiled, shape = compile_backward(
        n, _TORCH_TO_CUTE[str(z.dtype)], _TORCH_TO_CUTE[str(dy.dtype)],
        _TORCH_TO_CUTE[str(weight.dtype)] if weight is not None else None, mode,
        _vector_ok(n, dy, z, dx, *(t for t in (weight, dres) if t is not None)), dres is not None, partials, tvm_ffi)
    grid = _grid(shape, rows, z.device, backward_blocks_per_sm(n, partials), sms_left)
    part_rows = (grid if combines_slots(shape) else grid * shape.rpb) if partials else 0
    return BackwardLaunch(compiled, tvm_ffi, rows, n, grid, part_rows,
                          torch.empty(n, dtype=z.dtype, device=z.device),
                          torch.empty((1, n), dtype=torch.float32, device=z.device))


def backward(dy, z, weight, rstd, dres, offset: float, mode: str, partials: bool, sms_left: int = 0):
    """(dx, fp32 dW partials or None) for 2D torch tensors on the GPU; dW = partials.sum(0) in "fast"
    mode. sms_left: SMs the persistent grid leaves to a kernel beside it (the strict fold). Planned for this call
    (the backend keeps its plans)."""
    import torch

    dx = torch.empty_like(z)
    launch = plan_backward(dy, z, weight, dres, dx, mode, partials, sms_left)
    return dx, (launch(dy, z, weight, rstd, dres, dx, offset) if launch.rows else None)
