"""Backend `triton`: the portable GPU path (NVIDIA and ROCm); also runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ...contract import NormSpec
from ...reference import exact_mean_scale, next_pow2
from ..base import DTYPE_CODES, MODE_CODES, no_join, on_tensor_device
from ..cuda.nvrtc import current_stream
from ..layout import (
    BackwardPlan,
    ForwardPlan,
    RowLayout,
    backward_views,
    forward_outputs,
    forward_views,
    remember,
    row_layout,
    rstd_sink,
    signature,
)
from ..registry import get_backend, status
from ..tuning import Bounded, drop_shadowed, for_rows, load_tuning_file

# Elements one program keeps in flight; more rows per program when rows are short.
_TILE_ELEMS = 4096
# Longest padded row whose fast dW uses in-kernel partials (see rms_norm_bwd).
_PARTIALS_MAX_P = 8192
# The fast dW at few rows: up to this many rows (and P <= _PARTIALS_MAX_P, a shared weight of a dtype the kernels
# store, dx not in place) the backward's last programs sum the rows' dW contributions by columns in the same launch
# (kernels.py, _dw_columns) instead of writing fp32 partial rows for a second kernel to sum: one launch instead of
# two where each costs more than its bytes. A dW program takes _DW_ELEMS_A_THREAD elements of dy and of z a thread
# (the dx tile's warps). On an H100 (run 54) the fast backward took 0.9-2.2 us less at 1-256 rows of
# 128-8192 columns (128 x 4096: 5.50 -> 3.15 us).
_DW_COLUMNS_ROWS = 256
_DW_ELEMS_A_THREAD = 16
# Columns per program and unrolled rows per step of the Triton strict fold (the ROCm fold path).
_FOLD_BN = 64
_FOLD_UNROLL = 8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():
    from . import kernels

    return kernels


def _store_view(t: torch.Tensor) -> torch.Tensor:
    """bf16 outputs are written as int16 bit patterns (see kernels.py)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@dataclass(frozen=True)
class TileChoice:
    """How a row kernel tiles rows of one padded length P (any choice gives the same bits; the tree is fixed by N).
    rows: rows a program (None: _TILE_ELEMS // P, at least one); num_warps (None: one warp per 512 lanes, 1 to
    32); split: rows of N <= 3/4 P in two column tiles (kernels.py, tiled_canon_sum), the same bits with fewer
    lanes; w_first, chunk: see below."""

    rows: int | None = None
    num_warps: int | None = None
    split: bool = False
    w_first: bool = False  # forward: the weight loaded with the rows, before their sum (kernels.py, W_FIRST)
    # forward: a shared weight loaded as (rows, lanes) in the rows' own layout, not as one row that Triton converts
    # through shared memory where its layout differs from the rows' (kernels.py, W_ROWS; _fwd_weight)
    w_rows: bool = False
    # forward, rows held whole: an inference call (no rstd asked for) compiles without rstd's store (kernels.py,
    # STORE_RSTD), which Triton converts through shared memory at 8 rows of 128 lanes in 2 warps (the kernel's last
    # barrier there). Not everywhere: without the store ptxas serialized the loads of 2-row tiles at 4096 columns (run
    # 27: 22% slower), so elsewhere an inference call stores rstd into a sink (layout.rstd_sink)
    drop_rstd: bool = False
    # rows of P > chunk lanes in one tile: summed and scaled in column chunks of `chunk` lanes, read twice
    # (kernels.py, CHUNK; fewer registers a row, so more rows in flight; in the backward, the fast dW's partials in
    # a row of global memory per program instead of registers); 0: held whole
    chunk: int = 0
    # programs striding over the row blocks (persistent grid) per SM; the next block's rows loaded into registers
    # before this block's sums (kernels.py, PREFETCH); the loop's loads pipelined through shared memory in `stages`
    # stages (STAGES; 1: not pipelined; rows in column chunks: the chunk loops'). The forward's grid is persistent
    # where its rows are held whole and prefetched or pipelined (a shared weight then loaded once a program); the
    # backward's also where its fast dW adds partials in the kernel
    programs_per_sm: int = 4
    prefetch: bool = False
    stages: int = 1
    # forward: the row (each chunk; each column tile) in warp blocks, each warp's block summed in the warp and the
    # blocks' sums combined at once (kernels.py, WB_NW; taken only where _warp_block_piece allows)
    warp_blocks: bool = False
    # registers a thread, bounded for ptxas (Triton's maxnreg) where the kernel compiled without the bound takes more
    # (_Launcher; 0: no bound): 16 warps of at most 64 fit twice in an SM's 65536, where 70 leave room for one
    # program only. Register use decides how many programs an SM runs, never a bit
    max_registers: int = 0
    # forward, rows held whole: bf16 rows without a residual held across the sum as loaded and widened again for y
    # (kernels.py, REWIDEN): half the registers for the rows, so more programs an SM (the same bits)
    rewiden: bool = False
    # forward, rows held whole in one tile: where a call's rows fill the tiles, N is a power of two and the row tensors'
    # rows are contiguous (dense_rows), compiled without masks, with 32-bit offsets and N as a constant (kernels.py,
    # DENSE: Inductor's addressing at a static shape); other calls take the masked kernel
    dense: bool = False
    # forward: rstd's reciprocal by rcp.rn.f32 on NVIDIA GPUs (kernels.py, RCP_RN: the same bits as div_rn(1, s));
    # div_rn elsewhere (ROCm, the interpreter)
    rcp_rn: bool = False


# Choices per direction and padded length P: a TileChoice, or ((max rows, TileChoice), ..., (None, TileChoice)) where
# the row count decides (the first bound at or above it; any choice gives the same bits). A P not listed takes
# TileChoice(split=DEFAULT_SPLIT[direction]). Split by default in the backward only: on an H200
# (bench/results/2026-11-30-h200-run7, call i; 2048 x 18432) the backward went 282 -> 177 us, the forward 80 -> 84 us.
# A JSON file named by STRICTNORM_TRITON_TUNING replaces entries: {"fwd": {"4096": {"rows": 1, "num_warps": 16,
# "split": false}, "128": [[128, {...}], [null, {...}]], ...}, "bwd": {...}}, as bench/sweep_triton.py writes it.
DEFAULT_SPLIT = {"fwd": False, "bwd": True}
# From bench/sweep_triton.py on an H200 (bench/results/2026-11-30-h200-run12, call a; every configuration
# bitwise; the least mean slowdown over the shapes of each P, kernel-only us against the formula's choice):
# forward 32768 x 4096 135.7 -> 129.1, 8192 x 8192 75.7 -> 67.8, 262144 x 128 34.8 -> 34.0, 2048 x 18432
# 78.9 -> 74.9; backward 2048 x 18432 172.4 -> 156.2, 262144 x 128 63.0 -> 59.9. The forward at <= 128 rows of
# P = 4096: the weight loaded first, one row of 8 warps a program (run 13, call a: 128 x 4096 2.98 -> 2.56 us; slower
# from 2048 rows on: 11.1 -> 12.2 at 2048, 130 -> 146 at 32768). The forward at P = 32768 in column chunks of 4096 lanes
# (run 13, call c: 2048 x 18432 75.3 -> 56.7 us; chunks of 1024-4096 with 2-16 warps 57-62), and at P = 65536 in
# chunks of 2048 (call h: 1024 x 65536 130.1 -> 108.8 us); at P = 8192 chunks lost (call g: 8192 x 8192 67 -> 83+).
# The backward's persistent grid at 2 programs an SM, the next row prefetched into registers at P = 4096 and the
# loop's loads in 3 (P = 8192) or 2 (P = 32768) shared-memory stages (bench/results/2026-11-30-h200-run14, call a,
# SWEEP_PIPELINES; kernel-only us, every configuration bitwise): 2048 x 4096 24.2 -> 18.8, 8192 x 4096 72.2 -> 55.8,
# 32768 x 4096 250.4 -> 198.2, 8192 x 8192 162.3 -> 108.5, 2048 x 18432 156.5 -> 152.5; at P = 128 none won (59.3 ->
# 58.9). At P = 32768 both directions in column chunks of 4096 lanes with the chunk loops' loads in 3 shared-memory
# stages, the backward two rows a program and one program an SM (its fast dW's partial rows in global memory;
# bench/results/2026-11-30-h200-run15, call b, SWEEP_CHUNKS / SWEEP_STAGES, every configuration bitwise; call c's
# anchored bench: 2048 x 18432 backward 150.6 -> 130.4 us, forward 56.7 -> 52.3). The backward at P = 65536 in chunks
# of 2048 (call d: 1024 x 65536 639.2 -> 246.2 us; rows held whole took the strict fold for the fast dW). The forward's
# persistent grid (bench/results/2026-11-30-h200-run16, call a, SWEEP_PIPELINES, every configuration bitwise) won at
# 2048 x 4096 only (prefetched and in 2 stages, 2 programs an SM: 11.0 -> 10.6 us) and lost from 8192 rows of 4096
# (34.9 -> 36.4+, 130.2 -> 138.8+), at 8192 x 8192 (67.6 -> 70.3+) and 262144 x 128 (34.4 -> 45.1+), as in run 14.
# A weight loaded first (w_first) and pinned ahead of the rows' sum (the rows made to depend on it through a select on
# N < 0, so ptxas issues its loads with theirs rather than after the sum's first shuffles) lost on an H100
# (bench/results/2026-12-05-h100-run48, call c): 128 x 4096 2.35 -> 2.42 us; it was removed.
TileEntry = TileChoice | Bounded[TileChoice]
TILE_TABLE: dict[str, dict[int, TileEntry]] = {
    # P = 128 to 16384 rows: 16 rows of 8 warps a program (bench/results/2026-12-03-h200-run33, call c, and run34,
    # call d; every configuration bitwise: 16384 x 128 3.80 -> 3.55 us and 3.84 -> 3.58, 4096 x 128 2.34 -> 2.21);
    # past them 8 rows of 2 warps (at 65536 rows 16 x 8 took 11.0 us against 10.5; at 262144 and more no one tile
    # was ahead in both runs), the weight loaded in the rows' layout and an inference call's rstd not stored (w_rows,
    # drop_rstd: compiled for sm_90 by Triton 3.6, 3 -> 1 -> 0 barriers a program, 40 -> 40 -> 38 registers, no load
    # reusing an earlier one's register; on an H200 level, bench/results/2026-12-04-h200-run42, call d: 262144 x 128
    # 33.65 -> 33.58 us, 65536 x 128 10.54 -> 10.53); past 16384 rows the weight loaded first (w_first): without it
    # Triton emits the weight's loads where y needs them, and ptxas issues them after the row sum and rstd, a memory
    # round trip on every program's critical path (compiled for sm_90 by Triton 3.6: LDG 3 and 4 of 4 after the
    # shuffles; with it all four ahead of them, 38 -> 52 registers). On an H100 (bench/results/2026-12-05-h100-run48,
    # call g, inference forward us, 2 rounds): 65536 x 128 13.34 -> 13.04, 262144 x 128 46.66 -> 45.84, the training
    # step level (122.4 -> 122.3); at 16 rows of 8 warps it lost at 16384 rows (3.84 -> 4.46) and gained at 4096 (2.22
    # -> 2.16), so the 16 x 8 tile takes the weight first up to 4096 rows only (on an H200,
    # bench/results/2026-12-06-h200-run49, call b, 2 rounds: 4096 x 128 2.22 -> 2.13 us, the backward level; 34 -> 29
    # registers without it, both loads ahead of the sum with it)
    "fwd": {128: ((4096, TileChoice(rows=16, num_warps=8, w_first=True)),
                  (16384, TileChoice(rows=16, num_warps=8)),
                  (None, TileChoice(rows=8, num_warps=2, w_rows=True, drop_rstd=True, w_first=True))),
            4096: ((128, TileChoice(rows=1, num_warps=8, w_first=True, warp_blocks=True)),
                   (2048, TileChoice(rows=2, num_warps=8, programs_per_sm=2, prefetch=True, stages=2)),
                   (None, TileChoice(rows=2, num_warps=8, warp_blocks=True))),
            8192: TileChoice(rows=1, num_warps=8, warp_blocks=True),
            32768: TileChoice(rows=1, num_warps=4, chunk=4096, stages=3),
            65536: TileChoice(rows=1, num_warps=4, chunk=2048)},
    # warp blocks (kernels.py) where the same tile in order was slower in run 29, call a (each pair bitwise):
    # 32768 x 4096 130.2 -> 128.8 us, 8192 x 4096 34.9 -> 34.8, 8192 x 8192 67.6 -> 67.2; call b: 128 x 4096 2.56 -> 2.4
    # P = 128: the loop pipelined through 3 stages (run 17, call a: 262144 x 128 60.4 -> 57.1 us at 4 warps), at
    # 2 warps (bench/results/2026-12-01-h200-run18, call a: 57.2 -> 55.5; rows 8 or 32, 8 programs an SM: slower)
    # P = 4096 (bench/results/2026-12-03-h200-run31, call a, every configuration bitwise; against the prefetched
    # tile in order): to 8192 rows prefetched in warp blocks (2048 x 4096 19.2 -> 18.5 us, 8192 x 4096 56.4 -> 56.0),
    # past them in order through 3 stages (32768 x 4096 203.3 -> 197.1; in warp blocks 200.0, prefetched 198.3)
    "bwd": {128: TileChoice(rows=16, num_warps=2, stages=3),
            4096: ((8192, TileChoice(rows=1, num_warps=8, programs_per_sm=2, prefetch=True, warp_blocks=True)),
                   (None, TileChoice(rows=1, num_warps=8, programs_per_sm=2, stages=3))),
            8192: TileChoice(rows=1, num_warps=8, programs_per_sm=2, stages=3),
            # P = 32768: rows held whole in warp blocks through 3 stages (as many as shared memory holds:
            # stages_that_fit), so the fast dW takes the strict fold beside the dx pass, as dw="strict" does: the
            # chunks' in-kernel partials were slower (bench/results/2026-12-03-h200-run33, calls e and f, 2048 x
            # 18432: fast 131.5 / 132.0 us, strict 118.1 / 118.9). The dx pass alone, against the same tile in order
            # through 2 stages (run 31, call a, every configuration bitwise): 2048 x 18432 88.2 -> 61.4 us, 2048 x
            # 20480 95.2 -> 72.1, 2048 x 24576 133.0 -> 107.8; 32 warps slower, 74.4-113.1
            32768: TileChoice(rows=1, num_warps=16, split=True, programs_per_sm=2, stages=3, warp_blocks=True),
            65536: TileChoice(rows=2, num_warps=8, chunk=2048, programs_per_sm=2, stages=3)},
    # the forward where the entry's tile takes warp blocks (and, where it asks for two column tiles, N splits in two),
    # else the "fwd" entry (in order its tile would be slower). P = 32768: the row in a tile of 16384 lanes and one
    # of 2048 or less, both in warp blocks, 16 warps (run 30, call a, every configuration bitwise: 2048 x 18432 52.3
    # -> 42.6 us; the same tile in order 79.6, held whole in warp blocks 65.9); 64 registers a thread where ptxas
    # takes more (a second tile of 4096 lanes or more: 70 and 81 registers at 20480 and 24576 columns; run 31, calls a
    # and b, every configuration bitwise: 2048 x 20480 62.3 -> 46.4 us, 8192 x 20480 233.2 -> 168.7, 2048 x 22528
    # 70.2 -> 63.8, 2048 x 24576 71.9 -> 66.9)
    "fwd_wb": {32768: TileChoice(rows=1, num_warps=16, split=True, warp_blocks=True, max_registers=64)},
    # the backward where the kernel adds no dW partials (dw="strict", per-head weights, no weight gradient), where it
    # lists the padded length; a P not listed takes the "bwd" entry (none listed: the one tile at P = 32768 serves
    # both since run 33)
    "bwd_dx": {},
}


def _load_tuning_file() -> None:
    """STRICTNORM_TRITON_TUNING's entries; a file's "fwd" entry for P replaces P's "fwd_wb" too unless the file
    lists that (a built-in warp-block entry would otherwise shadow the tuned one)."""
    forward, blocked = dict(TILE_TABLE["fwd"]), dict(TILE_TABLE.get("fwd_wb", {}))
    load_tuning_file("STRICTNORM_TRITON_TUNING", TILE_TABLE, TileChoice)
    drop_shadowed(forward, TILE_TABLE["fwd"], blocked, TILE_TABLE.get("fwd_wb", {}))


_load_tuning_file()


@dataclass(frozen=True)
class RowTile:
    """A row kernel's tile: ROWS rows of one column tile of PA lanes, or of two (PA = P / 2 and T lanes,
    T > 0); num_warps. A function of N and, where TILE_TABLE bounds rows, of the row count's range: one compiled
    kernel serves every row count of a range."""

    rows: int
    pa: int
    t: int
    num_warps: int
    w_first: bool = False
    chunk: int = 0  # column chunks (0: rows held whole)
    programs_per_sm: int = 4  # the persistent grid, prefetch and pipeline stages (TileChoice)
    prefetch: bool = False
    stages: int = 1
    warp_blocks: bool = False
    max_registers: int = 0
    w_rows: bool = False
    drop_rstd: bool = False
    rewiden: bool = False
    dense: bool = False
    rcp_rn: bool = False

    def constexprs(self) -> dict:
        return dict(ROWS=self.rows, PA=self.pa, LOG2PA=self.pa.bit_length() - 1, T=self.t,
                    LOG2T=max(0, self.t.bit_length() - 1))

    def meta(self) -> dict:
        """The constexprs and the launch options."""
        return {**self.constexprs(), **_launch_opts(self.num_warps, self.max_registers)}

    def backward_constexprs(self, piece: int = 0) -> dict:
        """The backward's prefetch, pipeline-stage and warp-block constexprs (warp blocks as the forward's, for rows
        held whole only)."""
        return dict(PREFETCH=self.prefetch, STAGES=self.stages,
                    **self.warp_block_constexprs(0 if self.chunk else piece))

    def warp_block_constexprs(self, piece: int) -> dict:
        """WB_NW, WB_S, WB_ST: warp blocks of `piece`-element pieces where the tile asks for them and piece > 0 (see
        _warp_block_piece), the row (or each chunk) at least one piece a thread. Two column tiles take warp blocks
        where the second's are of whole pieces, or of T / threads elements a thread in a one-row tile (the
        compiler's layout there, compiled for sm_90 by Triton 3.6 and 3.9; with more rows it spread the warps over
        the rows); else neither does."""
        threads = 32 * self.num_warps
        blocks = self.warp_blocks and piece > 0 and (self.chunk or self.pa) >= threads * piece
        tail_piece = 0
        if blocks and self.t >= threads * piece:
            tail_piece = piece
        elif blocks and self.rows == 1 and self.t >= threads:
            tail_piece = self.t // threads
        blocks = blocks and (self.t == 0 or tail_piece > 0)
        return dict(WB_NW=self.num_warps if blocks else 0, WB_S=piece if blocks else 8, WB_ST=tail_piece)

    @property
    def forward_persistent(self) -> bool:
        """Whether the forward's programs stride over the blocks (rows held whole, prefetched or pipelined)."""
        return not self.chunk and (self.prefetch or self.stages > 1)

    def forward_constexprs(self, piece: int = 0, dense_ok: bool = False) -> dict:
        """The forward's weight-first, weight-layout, chunk, persistent-grid, stage and warp-block constexprs (the
        chunk loops' stages, or the persistent grid's; warp_block_constexprs); DENSE where the tile asks for it and
        the call's rows allow it (dense_ok: dense_rows' answer); RCP_RN where the tile asks for it and the kernel
        compiles for NVIDIA."""
        persistent = self.forward_persistent
        return dict(W_FIRST=self.w_first, W_ROWS=self.w_rows, REWIDEN=self.rewiden, DENSE=self.dense and dense_ok,
                    RCP_RN=self.rcp_rn and torch.version.hip is None and not _interpreting(),
                    STAGES=self.stages if self.chunk or persistent else 1,
                    PERSISTENT=persistent, PREFETCH=self.prefetch and persistent,
                    **self.warp_block_constexprs(piece), **self.chunk_constexprs())

    def chunk_constexprs(self) -> dict:
        """The column-chunk constexprs (CHUNK = 0: none)."""
        chunks = self.pa // self.chunk if self.chunk else 1
        return dict(CHUNK=self.chunk, LOG2CHUNK=max(0, self.chunk.bit_length() - 1), NCH=chunks,
                    LOG2NCH=chunks.bit_length() - 1)


def dense_rows(tile: RowTile, layouts: tuple[RowLayout, ...]) -> bool:
    """Whether a forward call's rows can take its tile's DENSE kernel (TileChoice.dense): rows held whole in one
    column tile of N = P lanes, not persistent, the rows filling the tiles, each row tensor's rows N elements apart
    (one leading dim, R1 = G = 1) and every element offset under 2^31."""
    lay = layouts[0]
    return (not tile.chunk and tile.t == 0 and not tile.forward_persistent and lay.n == tile.pa
            and lay.rows % tile.rows == 0 and lay.rows * lay.n < 2**31
            and all((r.r1, r.g, r.s0) == (1, 1, lay.n) for r in layouts))


def column_tiles(n: int, split: bool) -> tuple[int, int]:
    """(PA, T): one tile of P = next_pow2(N) lanes (T = 0), or with split and N <= 3/4 P, PA = P / 2 and
    T = next_pow2(N - PA)."""
    p = next_pow2(n)
    tail = next_pow2(n - p // 2) if split and n > p // 2 else 0
    return (p // 2, tail) if 0 < tail < p // 2 else (p, 0)


def row_tile(n: int, direction: str, rows: int | None = None) -> RowTile:
    """The tile for `rows` rows of N columns (None: the entry for any row count) in direction "fwd", "bwd" or "bwd_dx"
    (TILE_TABLE; "bwd_dx" falls back to "bwd")."""
    p = next_pow2(n)
    if direction == "bwd_dx" and p not in TILE_TABLE.get("bwd_dx", {}):
        direction = "bwd"
    return _tile_of(n, _for_rows(TILE_TABLE[direction].get(p) or TileChoice(split=DEFAULT_SPLIT[direction]), rows))


def forward_tile(n: int, rows: int | None, piece: int) -> RowTile:
    """The forward's tile: TILE_TABLE["fwd_wb"]'s where it lists N's padded length and that tile takes warp blocks
    of `piece`-element pieces (_warp_block_piece) in the column tiles its choice asks for (two where it splits),
    else row_tile's "fwd"."""
    entry = TILE_TABLE.get("fwd_wb", {}).get(next_pow2(n))
    if entry is not None:
        choice = _for_rows(entry, rows)
        tile = _tile_of(n, choice)
        if tile.warp_block_constexprs(piece)["WB_NW"] and (tile.t or not choice.split):
            return tile
    return row_tile(n, "fwd", rows)


def _for_rows(entry: TileEntry, rows: int | None) -> TileChoice:
    """A TILE_TABLE entry's choice for `rows` rows (None: its unbounded one)."""
    return entry if isinstance(entry, TileChoice) else for_rows(entry, rows)


def _tile_of(n: int, choice: TileChoice) -> RowTile:
    """The tile a choice gives rows of N columns."""
    p = next_pow2(n)
    pa, t = column_tiles(n, choice.split)
    tile_rows = choice.rows or max(1, _TILE_ELEMS // p)
    lanes = tile_rows * (pa + t)
    num_warps = choice.num_warps or 1 << max(0, min(5, (lanes // 512).bit_length() - 1))  # a power of two, 1 to 32
    chunk = choice.chunk if t == 0 and 0 < choice.chunk < pa else 0
    return RowTile(tile_rows, pa, t, num_warps, choice.w_first, chunk, choice.programs_per_sm, choice.prefetch,
                   choice.stages, choice.warp_blocks, choice.max_registers, choice.w_rows, choice.drop_rstd,
                   choice.rewiden, choice.dense, choice.rcp_rn)


class _Launcher:
    """One plan's kernel: the first call goes through Triton's JIT (which compiles it, or finds it compiled); later
    calls launch the compiled kernel directly. The JIT binds and specializes every argument on every call, most of
    this backend's host time; a plan's arguments specialize the same way on every call (its key holds the shapes,
    strides, dtypes and 16-byte alignment of each tensor, and every other tensor is allocated by torch), so the
    kernel the JIT chose for the first call is the one it would choose for the rest. Under the interpreter every call
    goes through the JIT."""

    __slots__ = ("fn", "meta", "kernel", "constexprs", "runtime")

    def __init__(self, fn, meta: dict) -> None:
        self.fn, self.meta = fn, meta
        self.kernel = None
        self.constexprs: tuple = ()
        self.runtime = None  # triton's runtime knobs (the launch hooks, read at each launch as the JIT does)

    def __call__(self, grid: tuple[int, ...], device_index: int, *args) -> None:
        kernel = self.kernel
        if kernel is None:
            if _interpreting():
                self.fn[grid](*args, **self.meta)
                return
            if "maxnreg" in self.meta:
                self.meta = self._register_bound_where_exceeded(grid, args)
            kernel = self.fn[grid](*args, **self.meta)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel  # an asynchronous compile's future
            from triton import knobs

            self.constexprs = constexpr_tail(self.fn, len(args), self.meta)
            self.runtime = knobs.runtime
            self.kernel = kernel
            return
        stream = current_stream(device_index)
        hooks = self.runtime
        enter = hooks.launch_enter_hook
        # launch_metadata is None without an enter hook (Triton 3.6 and 3.9 return that first): not called then
        # (0.7 us of host time a launch on an H200 machine, bench/results/2026-12-03-h200-run35, call d)
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, kernel.function, kernel.packed_metadata,
                   None if enter is None else kernel.launch_metadata(grid, stream, *args, *self.constexprs), enter,
                   hooks.launch_exit_hook, *args, *self.constexprs)

    def _register_bound_where_exceeded(self, grid: tuple[int, ...], args: tuple) -> dict:
        """The launch options with their register bound (TileChoice.max_registers) only where the kernel compiled
        without it takes more registers a thread: where ptxas fits in the bound on its own, its own code is kept (with
        the bound it schedules differently even then: 2048 x 18432, 16 warps, 64 registers either way, 8 bytes
        spilled with the bound, 42.8 -> 43.5 us; bench/results/2026-12-03-h200-run31, call b)."""
        free = {k: v for k, v in self.meta.items() if k != "maxnreg"}
        compiled = self.fn.warmup(*args, grid=grid, **free)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        compiled._init_handles()  # loads the binary: ptxas's register count
        return self.meta if compiled.n_regs > self.meta["maxnreg"] else free


def constexpr_tail(fn, runtime_args: int, meta: dict) -> tuple:
    """The values of a kernel's parameters after its first runtime_args ones, which must all be constexprs: meta's,
    else their defaults. The JIT passes every parameter to a compiled kernel's launcher, constexprs included, in the
    kernel's order."""
    tail = list(inspect.signature(fn.fn).parameters.values())[runtime_args:]
    runtime = [p.name for p in tail if not _is_constexpr(p)]
    if runtime:
        raise TypeError(f"{fn.fn.__name__}: parameters {runtime} follow the launch's arguments but are not constexprs")
    return tuple(meta.get(p.name, p.default) for p in tail)


def _is_constexpr(param: inspect.Parameter) -> bool:
    """Annotated tl.constexpr (as Triton tells, by the annotation's text; kernels.py's are strings)."""
    return "constexpr" in str(param.annotation)


@dataclass(frozen=True)
class _Plan:
    """A row kernel's launch for one input signature: the views' decisions, the grid (empty for zero rows),
    the per-head weight stride, the scalar arguments, the constexprs with launch options, and the launcher."""

    views: ForwardPlan | BackwardPlan
    grid: tuple[int, ...]
    wsg: int
    scalars: tuple
    meta: dict
    launch: _Launcher | None = field(default=None, compare=False)
    fold_sms: int = 0  # the backward's strict fold sized for this many SMs, the dx pass's grid for the rest (0: all)


def _launch_opts(num_warps: int, max_registers: int = 0) -> dict:
    """The JIT's options: no FMA contraction (the contract's products and sums rounded apart), the warps, and where
    given the bound on registers a thread (TileChoice.max_registers)."""
    cap = {"maxnreg": max_registers} if max_registers else {}
    return {"num_warps": num_warps, "enable_fp_fusion": False, **cap}


class TritonBackend:
    name = "triton"
    ops = frozenset({"rms_norm", "left_fold"})

    def __init__(self) -> None:
        # The strict fold runs on the CUDA backend's kernel where that backend is available (same
        # bits, much faster); the Triton fold below serves ROCm and machines without NVRTC.
        self.use_cuda_fold = True
        # Where the CUDA fold runs beside this dx pass (CudaBackend.fold_beside_dx, opt-in), the SMs shared out as the
        # CUDA backend's are (CudaBackend.shared_fold_sms: at 4096 columns the fold sized for 32 SMs, this dx pass's
        # persistent grid for the rest; same bits). Opt-in: with the host ahead of the GPU it was slower, 32768 x
        # 4096 604 -> 1008 us (bench/results/2026-12-01-h200-run19, call e)
        self.share_sms_with_fold = False
        self._fwd_plans: dict[tuple, _Plan] = {}
        self._bwd_plans: dict[tuple, _Plan] = {}

    def unavailable_reason(self, device: torch.device) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"triton is not installed ({e}); pip install 'strictnorm[triton]'"
        if _interpreting():
            return None if device.type == "cpu" else "TRITON_INTERPRET=1 runs kernels on CPU tensors only"
        if device.type != "cuda":
            return f"Triton kernels run on GPUs (CUDA or ROCm); tensors are on {device.type}"
        return None

    # ---- forward -------------------------------------------------------------------------------
    @on_tensor_device
    def rms_norm_fwd(self, x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec,
                     need_rstd: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Planned once per input signature (layout.signature), like the CUDA backend's launches. need_rstd False:
        no rstd tensor is allocated (None is returned for it); the kernel stores rstd into layout.rstd_sink all the
        same (compiled without that store, the forward ran 22% slower on an H200 at 32768 x 4096: ptxas then issued a
        block's last row load after the first's use; bench/NOTES.md, run 27), except where its tile drops the store
        (TileChoice.drop_rstd)."""
        device = x.get_device()
        key = (device, signature(x, weight, residual), spec, need_rstd)
        plan = self._fwd_plans.get(key)
        if plan is None:
            plan = remember(self._fwd_plans, key, self._plan_fwd(x, weight, residual, spec, need_rstd))
        y, rstd, z = forward_outputs(x, residual, spec.out_dtype, need_rstd)
        if not plan.grid:
            return y, rstd, z
        xk, w, rk = plan.views.inputs(x, weight, residual)
        plan.launch(
            plan.grid, device, xk, *plan.views.lay.args(), rk, *plan.views.rlay.args(),
            _store_view(z) if z is not None else y, w if w is not None else xk, plan.wsg, _store_view(y),
            rstd if rstd is not None else rstd_sink(x.device, plan.scalars[0]), *plan.scalars)
        return y, rstd, z

    @staticmethod
    def _plan_fwd(x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec,
                  need_rstd: bool = True) -> _Plan:
        v = forward_views(x, weight, residual, spec.out_dtype)
        views, lay, w = ForwardPlan.of(v, x, weight, residual), v.lay, v.weight
        if lay.rows == 0:
            return _Plan(views, (), 0, (), {})
        wsg = w.stride(0) if views.per_head else 0
        layouts = (lay,) if residual is None else (lay, views.rlay)
        piece = _warp_block_piece([t for t in (x, residual, w) if t is not None], layouts, wsg, spec.out_dtype)
        tile = stages_that_fit(forward_tile(lay.n, lay.rows, piece),
                               x.element_size() + (residual.element_size() if residual is not None else 0),
                               _smem_optin(x.device))
        norm_dtype = residual.dtype if residual is not None else x.dtype
        meta = dict(MODE=MODE_CODES[spec.mode], XDT=DTYPE_CODES[norm_dtype], YDT=DTYPE_CODES[spec.out_dtype],
                    HAS_W=w is not None, PER_HEAD=views.per_head, HAS_RES=residual is not None,
                    MEAN_SCALE=exact_mean_scale(lay.n), **tile.forward_constexprs(piece, dense_rows(tile, layouts)),
                    **tile.meta(),
                    STORE_RSTD=need_rstd or not tile.drop_rstd or bool(tile.chunk))
        nprog = _programs(_cdiv(lay.rows, tile.rows), tile, x.device, tile.forward_persistent)
        return _Plan(views, (nprog,), wsg,
                     (lay.rows, lay.n, lay.r1, lay.g, spec.eps, spec.offset), meta,
                     _Launcher(_kernels().rms_fwd_kernel, meta))

    # ---- backward ------------------------------------------------------------------------------
    @on_tensor_device
    def rms_norm_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, rstd: Tensor, dres: Tensor | None,
                     spec: NormSpec, dw_mode: str, need_dw: bool, dx_out: Tensor | None
                     ) -> tuple[Tensor, Tensor | None]:
        key = (z.get_device(), signature(dy, z, weight, rstd, dres, dx_out), spec.mode, spec.offset, dw_mode, need_dw,
               self.share_sms_with_fold)
        plan = self._bwd_plans.get(key)
        if plan is None:
            plan = remember(self._bwd_plans, key,
                            self._plan_bwd(dy, z, weight, rstd, dres, dx_out, spec, dw_mode, need_dw))
        dx = dx_out if dx_out is not None else torch.empty_like(z, memory_format=torch.contiguous_format)
        if not plan.grid:
            return dx, (torch.zeros(weight.shape, dtype=weight.dtype, device=z.device) if need_dw else None)
        lays = plan.views
        dyk, zk, w, rstd, dresk, dxk = lays.inputs(dy, z, weight, rstd, dres, dx)
        partials = plan.meta["DW_PARTIALS"]
        dw, join = None, no_join
        if plan.meta.get("DW_BN"):  # the fast dW by columns, stored by the dx pass's launch in its partials' place
            dw = torch.empty(weight.shape, dtype=weight.dtype, device=z.device)
            part = _store_view(dw)
        else:
            if need_dw and not partials:  # beside the dx pass (CUDA fold), or before it: in place, dx overwrites dy
                dw, join = self._launch_fold(dyk, lays.dlay, zk, lays.lay, rstd, MODE_CODES[spec.mode] + 1,
                                             DTYPE_CODES[z.dtype], weight.shape[0] if lays.per_head else 1,
                                             weight.dtype, dx=dx, reads=(dy, z, rstd), sms=plan.fold_sms)
                dw = dw.reshape(weight.shape)
            part = torch.empty((plan.grid[0], lays.lay.n), dtype=torch.float32, device=z.device) if partials else rstd
        plan.launch(
            plan.grid, z.get_device(), dyk, *lays.dlay.args(), zk, *lays.lay.args(), w if w is not None else zk,
            plan.wsg, rstd, dresk, *lays.elay.args(), _store_view(dxk), *lays.xlay.args(), part, *plan.scalars)
        join()
        if partials:  # right after the backward: the CUDA partial sum is launched as its dependent (GDC)
            dw = self._sum_rows(part, weight.dtype)
        if dxk is not dx:
            dx.copy_(dxk)
        return dx, dw

    def _plan_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, rstd: Tensor, dres: Tensor | None,
                  dx_out: Tensor | None, spec: NormSpec, dw_mode: str, need_dw: bool) -> _Plan:
        v = backward_views(dy, z, weight, rstd, dres, dx_out)
        views, lay, w = BackwardPlan.of(v, dy, z, weight, rstd, dres), v.lay, v.weight
        if lay.rows == 0:
            return _Plan(views, (), 0, (), {})
        n, rows = lay.n, lay.rows
        # fast dW: per-program fp32 partials in the dx pass (shared weight). Per-head weights take the
        # strict fold for both modes (it satisfies "fast" too: deterministic, fixed order).
        # Past P = 8192 the per-program partials held in registers across rows cost more than the strict fold
        # (701 vs 291 us at 2048 x 18432 on an H200, bench/results/2026-11-29-h200-run2): rows in column chunks
        # keep them in global memory instead (kernels.py, _bwd_chunked); rows held whole take the fold, which is
        # deterministic too, for dw="fast".
        wants_partials = need_dw and dw_mode == "fast" and not views.per_head
        tile = stages_that_fit(row_tile(n, "bwd" if wants_partials else "bwd_dx", rows),
                               z.element_size() + dy.element_size(), _smem_optin(z.device))
        partials = wants_partials and (next_pow2(n) <= _PARTIALS_MAX_P or tile.chunk > 0)
        dw_columns = (partials and rows <= _DW_COLUMNS_ROWS and dx_out is None and tile.chunk == 0
                      and weight is not None and weight.dtype in DTYPE_CODES)
        if dw_columns:  # dx alone in the row programs: the dx pass's own tile
            partials = False
            tile = stages_that_fit(row_tile(n, "bwd_dx", rows), z.element_size() + dy.element_size(),
                                   _smem_optin(z.device))
        fold_sms = 0
        if need_dw and not partials and self.share_sms_with_fold and self._cuda_available(z):
            fold_sms = get_backend("cuda").shared_fold_sms(n, dx_out is None)
        nprog = _programs(_cdiv(rows, tile.rows), tile, z.device, partials or tile.prefetch or tile.stages > 1,
                          sms_left=fold_sms)
        wsg = w.stride(0) if views.per_head else 0
        layouts = (lay, views.dlay, views.xlay) + ((views.elay,) if dres is not None else ())
        piece = _warp_block_piece([t for t in (z, dy, w, dres, dx_out) if t is not None], layouts, wsg, z.dtype)
        meta = dict(MODE=MODE_CODES[spec.mode], XDT=DTYPE_CODES[z.dtype], HAS_W=w is not None, PER_HEAD=views.per_head,
                    HAS_DRES=dres is not None, DW_PARTIALS=partials, MEAN_SCALE=exact_mean_scale(n),
                    GDC=partials and self._dependent_sum(z),
                    **tile.backward_constexprs(piece), **tile.chunk_constexprs(), **tile.meta())
        if dw_columns:  # the grid's last programs: dW by columns (kernels.py, _dw_columns)
            dw_rows = next_pow2(rows)
            bn = min(next_pow2(n), max(1, _DW_ELEMS_A_THREAD * 32 * tile.num_warps // dw_rows))
            meta.update(DW_MB=dw_rows, DW_BN=bn, WDT=DTYPE_CODES[weight.dtype])
            nprog += _cdiv(n, bn)
        return _Plan(views, (nprog,), wsg, (rows, n, lay.r1, lay.g, spec.offset),
                     meta, _Launcher(_kernels().rms_bwd_kernel, meta), fold_sms)

    # ---- strict fold ---------------------------------------------------------------------------
    def _cuda_available(self, t: Tensor) -> bool:
        return self.use_cuda_fold and t.device.type == "cuda" and status("cuda", t.device).available

    def _dependent_sum(self, t: Tensor) -> bool:
        """Whether the backward lets the CUDA partial sum after it start early (kernels.py's GDC): on sm_90 and
        newer with the CUDA sum (launched as a dependent grid where CudaBackend.dependent_sum says so; without
        that the signal does nothing) and a Triton that has the instruction."""
        import triton.language.extra.cuda as tl_cuda

        return (self._cuda_available(t) and not _interpreting() and torch.cuda.get_device_capability(t.device)[0] >= 9
                and hasattr(tl_cuda, "gdc_launch_dependents"))

    def _sum_rows(self, part: Tensor, dtype: torch.dtype) -> Tensor:
        """The fast dW's partial rows summed in a fixed order: the CUDA backend's fold where it is available
        (as the strict fold), else torch's sum over rows (deterministic on a given device)."""
        if self._cuda_available(part):
            return get_backend("cuda").sum_rows(part, dtype)
        return part.sum(0).to(dtype)

    def _fold(self, a: Tensor, alay: RowLayout, b: Tensor, blay: RowLayout, rstd: Tensor, what: int, xdt: int,
              groups: int, out_dtype: torch.dtype = torch.float32) -> Tensor:
        """(groups, N) in out_dtype: the strict left fold (see fold_kernel)."""
        return self._launch_fold(a, alay, b, blay, rstd, what, xdt, groups, out_dtype)[0]

    def _launch_fold(self, a: Tensor, alay: RowLayout, b: Tensor, blay: RowLayout, rstd: Tensor, what: int,
                     xdt: int, groups: int, out_dtype: torch.dtype = torch.float32, dx: Tensor | None = None,
                     reads: tuple[Tensor, ...] = (), sms: int = 0) -> tuple[Tensor, Callable[[], None]]:
        """_fold's result and a join: with the CUDA fold and a dx pass writing dx next (that does not
        overwrite `reads`), the fold runs beside it until join() (the CUDA backend's launch_fold, its grid sized
        for `sms` SMs: 0 all)."""
        if self._cuda_available(a):
            cb = get_backend("cuda")
            beside = dx is not None and cb.fold_beside(dx, *reads)
            return cb.launch_fold(a, alay, b, blay, rstd, what, groups, out_dtype=out_dtype, beside=beside, sms=sms)
        out = torch.empty((groups, alay.n), dtype=torch.float32, device=a.device)  # fp32, then rounded once
        grid = (_cdiv(alay.n, _FOLD_BN), groups)
        _kernels().fold_kernel[grid](
            a, *alay.args(), b, *blay.args(), rstd, out, alay.rows // groups, alay.n, alay.r1, alay.g,
            groups, BN=_FOLD_BN, UNROLL=_FOLD_UNROLL, WHAT=what, XDT=xdt,
            **_launch_opts(2))
        return out.to(out_dtype), no_join

    @on_tensor_device
    def left_fold(self, rows: Tensor) -> Tensor:
        if rows.numel() == 0:
            return torch.zeros(rows.shape[1:], dtype=torch.float32, device=rows.device)
        flat = rows.reshape(rows.shape[0], -1)
        ak, lay = row_layout(flat)
        return self._fold(ak, lay, ak, lay, ak, 0, 0, 1).reshape(rows.shape[1:])


# Triton releases whose lowering of the warp blocks' closing tl.sum was checked to be the contract's butterfly (every
# allowed configuration compiled for sm_90 and read; 3.6 also run on an H200): other releases take the columns in
# order, since the order rests on how the compiler lays out and reduces the row, which Triton does not promise.
WARP_BLOCK_TRITON_RELEASES = ("3.6", "3.9")


def _triton_release() -> str:
    import triton

    return ".".join(triton.__version__.split(".")[:2])


def _warp_block_piece(tensors: list[Tensor], layouts: tuple[RowLayout, ...], wsg: int, out_dtype: torch.dtype) -> int:
    """Elements of the 16-byte pieces the compiler loads a row kernel's rows in, where warp blocks may rely on that
    layout (kernels.py's notes), else 0. On a Triton release of WARP_BLOCK_TRITON_RELEASES, where the rows are
    16-byte aligned as the JIT specializes them (N and every row stride of `layouts` divisible by 16, the tensors'
    starts 16-byte aligned) and every row-long tensor (`tensors`: the forward's x, residual and weight, the
    backward's z, dy, weight, residual gradient and given dx; the output of out_dtype) has one element size, Triton
    lays the rows out as warp blocks assume (compiled for sm_90: mixing a 32-bit weight or y with 16-bit rows changed
    the layout for some tiles, so such calls take the columns in order); 32-lane warps only (not ROCm's 64)."""
    if _triton_release() not in WARP_BLOCK_TRITON_RELEASES:
        return 0
    size = tensors[0].element_size()
    if torch.version.hip or any(t.element_size() != size for t in tensors) or out_dtype.itemsize != size:
        return 0
    if layouts[0].n % 16 or wsg % 16 or any(v % 16 for layout in layouts for v in layout.args()) or any(
            t.data_ptr() % 16 for t in tensors):
        return 0
    return 16 // size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _programs(blocks: int, tile: RowTile, device: torch.device, persistent: bool, sms_left: int = 0) -> int:
    """A row kernel's grid: a program a block, or persistent: at most tile.programs_per_sm an SM (on all SMs but
    sms_left, one at least), striding."""
    sms = max(1, _num_sms(device) - sms_left)
    return min(blocks, sms * tile.programs_per_sm) if persistent else blocks


def stages_that_fit(tile: RowTile, bytes_per_lane: int, limit: int) -> RowTile:
    """tile with no more pipeline stages than `limit` bytes of shared memory a block hold, for rows held whole:
    Triton keeps stages - 1 blocks of the loop's loads (rows x lanes x bytes_per_lane: z and dy, or x and the
    residual) in shared memory (compiled for sm_90 with triton 3.6: the backward at 18432 columns in 3 stages 148 KB,
    at 30000 columns 263 KB, past the H200's 227 KB a block, while 2 stages take 131 KB)."""
    if tile.chunk or tile.stages <= 1 or limit <= 0:
        return tile
    per_stage = tile.rows * (tile.pa + tile.t) * bytes_per_lane
    return replace(tile, stages=max(1, min(tile.stages, 1 + (limit - 1024) // per_stage)))


def _smem_optin(device: torch.device) -> int:
    """The opt-in shared memory a block may use on a CUDA device (0 elsewhere: no bound known)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
