"""Backend `cuda`: CUDA C++ compiled at run time with NVRTC: RMSNorm forward and backward (with the
fused residual add and per-head weights, kernels/rms_norm.cu) and the strict left fold (kernels/fold.cu).

The fold serves reduce_rows_left_fold and the strict dW of every RMSNorm backward on NVIDIA
GPUs (the Triton backend calls it when this backend is available).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...contract import NormSpec
from ...reference import next_pow2
from ..base import DTYPE_CODES, MODE_CODES, no_join, on_tensor_device
from ..layout import (
    BackwardPlan,
    ForwardPlan,
    RowLayout,
    backward_views,
    forward_outputs,
    forward_views,
    remember,
    row_layout,
    signature,
)
from ..tuning import Bounded, drop_shadowed, for_rows, load_tuning_file
from .nvrtc import current_stream

_SOURCE = "fold.cu"
_THREADS = 256
_SMEM_LIMIT = 48 * 1024  # stay within the default dynamic shared memory limit
_STAGED_SMEM_MAX = 160 * 1024  # a STAGED backward block's stages: within what sm_80 (164 KB) and sm_90 (227 KB) allow
_MIN_ARCH = (8, 0)  # cp.async
_MAX_GRID_X = 2**31 - 1  # the kernels stride over rows, so a capped grid is still complete
_CHAIN_COLS = 8  # fold_chain's columns an item, unless a FoldTuning says otherwise
# The strict dW fold runs after the dx pass by default. Beside it (a side stream, CudaBackend.fold_beside_dx) was
# measured faster (kernel-only, bench/results/2026-11-30-h200-run8) only while the host's launch gap kept the two
# apart; with the host ahead of the GPU, as in a busy training step (Timer.queued_us), both start together and the
# fold beside is slower: H200, bench/results/2026-12-01-h200-run19, call e (us; one after the other -> beside ->
# beside with the SMs shared out): 32768 x 4096 510 -> 616 -> 1027, 8192 x 4096 136 -> 160 -> 261, 8192 x 8192
# 207 -> 306 -> 313, 2048 x 4096 45 -> 50 -> 70.
# An out-of-place strict backward whose ring fold runs beside its dx pass shares the SMs out per padded length P:
# the fold's grid sized for this many SMs, the dx pass's persistent grid for the rest (CudaBackend.fold_sms). At
# P = 4096 the ring sized for every SM takes 512 stripes of 8 columns; sized for 32 SMs, 128 of 32, beside a dx pass
# of 100 SMs' blocks: H200, bench/results/2026-12-01-h200-run18, call a (bench/strict_parts.py, bitwise): 32768 x
# 4096 519.5 -> 410.3 us (16 SMs 494.7, 24 518.9, 48 430.5). Where the ring's stripes stay the same (8192 and 18432
# columns, a chain at 128) the dx pass only loses SMs: 8192 x 8192 197.9 -> 213.1, 2048 x 18432 136.4 -> 148.9.
_SHARED_FOLD_SMS = {4096: 32}


@dataclass(frozen=True)
class FoldLaunch:
    kernel: str
    defines: dict[str, int]
    grid_x: int
    block: int
    shmem: int
    state_ints: int = 0  # fold_chain: the zeroed int32 state it needs (item counter, hand-over words)


@dataclass(frozen=True)
class FoldTuning:
    """Shape knobs of fold.cu's ring (any values give the same bits: the order is the rows' order).
    cols: columns per CTA (0: automatic); rows_per_stage (0: automatic); full_stage: the consumer's loop
    over a whole stage fully unrolled (FULL_STAGE: its shared-memory loads then run ahead of the adds)."""

    cols: int = 0
    rows_per_stage: int = 0
    full_stage: bool = True
    # the ring's shared memory: up to 48 KB needs no opt-in; more (Hopper: up to 227 KB) is opted into at
    # load time and lets the dW fold convert stages of 256 rows (its contribution buffers need 4+ stages)
    smem_bytes: int = _SMEM_LIMIT
    # the dW fold's contributions stored column-major (COLUMN_MAJOR): the consumer loads four rows at once
    column_major: bool = False
    # > 0: fold_chain instead of the ring (one group of rows, i.e. no per-head weights): items of this many
    # rows x cols columns spread over every SM, the running sums handed from item to item
    chain_rows: int = 0
    # fold_stream instead of the ring: converter warps load rows straight into registers and hand fp32 addends to
    # the consumer warps through shared-memory buffers (cols 8, 16, 32, 64 or 128; rows_per_stage with whole warps
    # of 16-byte row segments; smem_bytes, full_stage and column_major do not apply). convert_warps: 0 for 8;
    # buffers: the addend buffers, a multiple of convert_warps (0: twice as many)
    stream: bool = False
    convert_warps: int = 0
    buffers: int = 0
    # fold_stream's addend buffers padded by 8 floats after each group of 8 columns (GROUP_PAD): the converters'
    # stores free of bank conflicts (H200, session 22: level with unpadded at 4096 columns; opt-in)
    pad_groups: bool = False
    # fold_stream's consumer warps alone on their SM sub-partitions (ISOLATE; up to 64 columns): the converters
    # on the others, the warps between idle (the default at 8 columns: see default_stream)
    isolate: bool = False
    # fold_stream's converters issue their next whole stage's loads before converting and storing the current one
    # (PREFETCH: two stages' raw rows in registers; opt-in: within 2% of the defaults on an H200, run 24)
    prefetch: bool = False


def _stream_threads(cols: int, warps: int, isolate: bool) -> int:
    """fold_stream's block: its consumer warps, then the converters (with isolate, only on the sub-partitions
    w % 4 >= consumers: fold.cu's S_LAST_WARP, whose static_assert checks THREADS against it)."""
    consumers = max(1, cols // 32)
    if not isolate:
        return (consumers + warps) * 32
    free = 4 - consumers
    return (4 * ((warps - 1) // free) + consumers + (warps - 1) % free + 1) * 32


def _chain_shmem(cols: int, chain_rows: int) -> int:
    """fold_chain's shared memory: an item's fp32 contributions, each column's rows padded by 4 (CHAIN_STRIDE),
    and the item slot."""
    return cols * (chain_rows + 4) * 4 + 16


def _chain_launch(n: int, rows: int, num_sms: int, tuning: FoldTuning, defines: dict[str, int]) -> FoldLaunch:
    cols, chain = tuning.cols or _CHAIN_COLS, tuning.chain_rows
    if chain % 4 or not 1 <= cols <= 32:
        raise ValueError(f"fold_chain takes items of a multiple of 4 rows and 1 to 32 columns, got {chain} x {cols}")
    shmem = _chain_shmem(cols, chain)
    if shmem > tuning.smem_bytes:
        raise ValueError(f"fold_chain items of {chain} rows x {cols} columns need {shmem} bytes of shared memory, "
                         f"more than smem_bytes = {tuning.smem_bytes}")
    items = -(-rows // chain) * -(-n // cols)
    per_sm = max(1, min(2, (200 * 1024) // shmem))  # CTAs an SM holds (Hopper: 227 KB of shared memory)
    return FoldLaunch("fold_chain", dict(defines, COLS=cols, CHAIN_ROWS=chain, THREADS=_THREADS),
                      max(1, min(items, num_sms * per_sm)), _THREADS, shmem, 2 + items * cols * 2)


_SM_SHARED = 228 * 1024  # an SM's shared memory (Hopper; a CTA reserves 1 KB of it)


def _stream_cols(n: int, groups: int, num_sms: int) -> int:
    """fold_stream's columns a CTA: the widest (whole DRAM bursts of every row) that still gives most SMs a CTA."""
    for cols in (64, 32, 16):
        if -(-n // cols) * groups >= 0.9 * num_sms:
            return cols
    return 8


def _stream_launch(n: int, num_sms: int, groups: int, smem_optin: int, tuning: FoldTuning,
                   defines: dict[str, int]) -> FoldLaunch:
    cols = tuning.cols or _stream_cols(n, groups, num_sms)
    rows = tuning.rows_per_stage or min(64, 2048 // cols)  # up to 8 row segments a converter lane
    segments = rows * cols // 8
    if cols not in (8, 16, 32, 64, 128) or rows % 4 or segments % 32:
        raise ValueError(f"fold_stream takes 8, 16, 32, 64 or 128 columns and rows a stage in multiples of 4 with "
                         f"whole warps of 8-column segments, got {cols} x {rows}")
    warps = tuning.convert_warps or 8
    buffers = tuning.buffers or 2 * warps
    if tuning.isolate and cols >= 128:
        raise ValueError(f"fold_stream's isolate takes at most 64 columns (a sub-partition left), got {cols}")
    threads = _stream_threads(cols, warps, tuning.isolate)
    if threads > 1024 or buffers % warps:
        raise ValueError(f"fold_stream: {threads} threads a CTA (at most 1024) and {buffers} buffers (a multiple of "
                         f"{warps} converting warps)")
    per_sm = min(4, -(-(-(-n // cols) * groups) // num_sms))
    budget = min(smem_optin or _SMEM_LIMIT, _SM_SHARED // per_sm - 1024)  # the CTA's share of an SM
    pad = 8 if tuning.pad_groups else 0
    per_buffer = (cols * (rows + 4) + cols // 8 * pad) * 4 + 16
    if not tuning.buffers and buffers * per_buffer > budget:  # fewer where the CTAs an SM holds would not fit
        buffers = max(warps, budget // per_buffer // warps * warps)
    shmem = buffers * per_buffer
    if shmem > (smem_optin or _SMEM_LIMIT):
        raise ValueError(f"fold_stream of {cols} columns x {rows} rows a stage: {buffers} buffers need {shmem} bytes "
                         f"of shared memory, more than {smem_optin or _SMEM_LIMIT}")
    if pad:
        defines = dict(defines, GROUP_PAD=pad)
    if tuning.isolate:
        defines = dict(defines, ISOLATE=1)
    if tuning.prefetch:
        defines = dict(defines, PREFETCH=1)
    return FoldLaunch("fold_stream", dict(defines, COLS=cols, STREAM_ROWS=rows, CSTAGES=buffers,
                                          CONVERT_WARPS=warps, THREADS=threads), -(-n // cols), threads, shmem)


# fold_chain by default where the ring leaves most SMs idle and the chain of adds is long: few columns (the
# ring gives each group of 8-16 columns one SM: 8-16 of 132 busy at 128 columns) and many rows. H200 sweeps
# of 2026-11-30 (bench/results/2026-11-30-h200-run7, calls d, e, g; every configuration bitwise): the dW fold
# (contributions converted by a whole CTA, where the ring's single consumer warp also converts) wins from
# 8192 rows up to 1024 columns (8192 x 128: 46.5 -> 29.7 us; 16384 x 512: 90.8 -> 63.2; 32768 x 1024: 179.6
# -> 130.3 with 2048-row items; 262144 x 128: 1418.7 -> 642.8), the plain fold only from 32768 rows up to 512
# columns (262144 x 128: 825.5 -> 634.8; the ring wins at 16384 x 512 and 32768 x 1024). Items shrink to fit
# the device's shared memory (4096 rows x 8 columns need 131 KB).
# Since session 22 the dW fold too only from 32768 rows (fold_stream's below: see default_stream). The plain fold at
# 16384 x 128 in fold_chain: 45.6 us against the ring's 54.9 in run 21 call a, 54.1 against 54.7 in call c: level.
# Since run 23 the dW fold only from 65536 rows and up to 256 columns: at 32768 rows fold_stream's isolated 8-column
# CTAs (with the seamless consumer) won at 256-1024 columns (call e, bitwise: 32768 x 256 100.0 -> 89.9 us, x 512
# 102.4 -> 90.2, x 1024 128.1 -> 96.3; 65536 x 512 184.3 -> 176.3), fold_chain at 131072 x 128 (331.5 against 347.7)
# and 262144 x 128 (call d: 641-649 against 679).


def default_chain(n: int, rows: int, groups: int, smem_optin: int, what: int = 1) -> FoldTuning | None:
    """The fold_chain tuning the fold uses without a FoldTuning (what: 0 plain fold, else the dW fold), or
    None for the ring."""
    if groups != 1 or rows < (65536 if what else 32768) or n > (256 if what else 512):
        return None
    for chain_rows in (2048, 1024) if n > 512 else (4096, 2048, 1024):
        if _chain_shmem(_CHAIN_COLS, chain_rows) <= smem_optin:
            return FoldTuning(cols=_CHAIN_COLS, chain_rows=chain_rows, smem_bytes=smem_optin)
    return None


# fold_stream by default for the dW fold from 4096 columns (H200, run 20 call d, every configuration bitwise; the
# strict dW alone, kernel-only: 32768 x 4096 303.6 -> 192.7 us, 2048 x 4096 27.0 -> 20.8, 8192 x 8192 101.4 -> 95.8
# with 32 columns and 4 converting warps, 2048 x 18432 66.4 -> 62.5 with 16 and 4; the whole strict backward queued:
# 32768 x 4096 513.2 -> 403.1, 2048 x 4096 45.3 -> 38.9). 8 converting warps where the CTAs are one an SM, else 4.
# The plain fold from 4096 columns keeps the ring (4096 x 4096 fp32: 25.5 us against 27.8).
# Below 4096 columns the dW fold too, where fold_chain does not take it (fewer than 65536 rows since run 23, more than
# 256 columns, or per-head groups):
# 8 columns a CTA in stages of 256 rows, 4 converting warps, the consumer warp alone on its SM sub-partition (H200,
# run 21 calls a and c, every configuration bitwise, against the earlier defaults: 4096 x 128 21.0 -> 14.5 us, 16384 x
# 128 58.2 -> 47.3, 8192 x 1024 46.2 -> 30.4; isolated against not: 15.8, 50.9, 31.2; at 65536 x 128 level with
# fold_chain, 177.1 against 175.9, and behind it at 262144 x 128, 697.2 against 643.3). The plain fold kept the ring
# and fold_chain then: fold_stream lost to them at every plain shape of those sweeps (4096 x 128 15.9 at best against
# the ring's 14.9, 262144 x 128 713 against fold_chain's 634, 4096 x 4096 26.7 against 25.2), until its consumer
# became seamless:
# The plain fold since run 23 too, with one group of 4096 to 32767 rows of up to 512 columns (fold_chain's from 32768):
# 8 columns a CTA, 4 converting warps, the consumer isolated and seamless, stages of 128 rows below 16384 rows and of
# 512 from there (calls a, d, e, every configuration bitwise, against the ring: 4096 x 128 14.8 -> 14.4-14.5 us,
# 4096 x 256 14.8 -> 14.5, 8192 x 128 27.2 -> 26.3, 8192 x 512 27.2 -> 26.6, 16384 x 128 51.7 -> 49.3-49.4, 16384 x 256
# 51.7 -> 49.7, 16384 x 512 51.7 -> 50.3, 24576 x 128 76.4 -> 72.0; level at 4096 x 1024, 15.1).
_STREAM_NARROW = (256, 4)  # rows a stage and converting warps where a CTA takes 8 columns (isolated)
_STREAM_PLAIN_ROWS = (4096, 16384, 32768)  # the plain fold's fold_stream: from, 512-row stages from, up to


def default_stream(n: int, groups: int, num_sms: int, what: int, rows: int) -> FoldTuning | None:
    """The fold_stream tuning the fold uses without a FoldTuning where default_chain does not apply (what: 0 plain
    fold, else the dW fold), or None for the ring."""
    if what == 0:
        first, long_stages, last = _STREAM_PLAIN_ROWS
        if groups != 1 or n > 512 or not first <= rows < last:
            return None
        return FoldTuning(stream=True, cols=8, rows_per_stage=512 if rows >= long_stages else 128,
                          convert_warps=_STREAM_NARROW[1], isolate=True)
    wide = _dw_stream_past_the_sms(n, rows, num_sms) if groups == 1 else None
    if wide is not None:
        return wide
    cols = (32 if n <= 8192 else 16) if n >= 4096 else _stream_cols(n, groups, num_sms)
    if cols == 8:
        return FoldTuning(stream=True, cols=8, rows_per_stage=_STREAM_NARROW[0], convert_warps=_STREAM_NARROW[1],
                          isolate=True)
    return FoldTuning(stream=True, cols=cols, convert_warps=8 if -(-n // cols) * groups <= num_sms else 4)


# The plain fold's ring where its CTAs are at most one an SM: more shared memory (96 KB, opted into) for more rows in
# flight (H200, run 22 calls a-c, every configuration bitwise; the 48 KB ring of 16 columns x 256 rows before):
# - 32 columns x 128 rows a stage where 32-column CTAs fill at least 90% of the SMs (4096 columns: 128 CTAs on
#   132 SMs, where the narrow ring's 256 CTAs are two an SM): 1024 x 4096 8.4 -> 7.4 us, 4096 x 4096 25.3 -> 22.2
#   (22.3 in call a); at 16384 x 4096 behind (79.7 against 76.8), so below 16384 rows only;
# - 16 columns x 512 rows a stage from 4096 rows where 16-column CTAs are at most one an SM: 4096 x 2048 18.3 ->
#   16.2, 16384 x 128 54.8 -> 51.7, 4096 x 128 15.0 -> 14.8; at 1024 rows behind (1024 x 128 5.6 against 5.1), and
#   at 16384 x 4096 (two CTAs an SM) 83.3 against 76.8.
# A consumer loop in blocks of 32 rows, each block's loads issued before the previous block's adds, gained nothing
# consistent there (16384 x 128 with 16 x 512: 50.8 against 51.7, 16384 x 4096 with 32 x 256 x 200 KB: 72.8 against
# 77.5; 8 x 512 x 200 KB: 59.1 against 50.1; run 22 calls b-c, commit a9fb652), so it was removed.
_RING_ROOMY = 96 * 1024


def default_ring(n: int, rows: int, groups: int, num_sms: int, smem_optin: int, what: int) -> FoldTuning | None:
    """The ring tuning of the plain fold (what == 0) without a FoldTuning, where default_chain does not apply, or
    None for _ring_shape's defaults (the dW fold's ring, per-head groups, devices of less opt-in shared memory)."""
    if what or groups != 1 or smem_optin < _RING_ROOMY:
        return None
    wide_ctas = -(-n // 32)
    if wide_ctas < num_sms and 10 * wide_ctas >= 9 * num_sms and rows < 16384:
        return FoldTuning(cols=32, rows_per_stage=128, smem_bytes=_RING_ROOMY)
    if -(-n // 16) <= num_sms and rows >= 4096:
        return FoldTuning(cols=16, rows_per_stage=512, smem_bytes=_RING_ROOMY)
    return None


def _ring_shape(n: int, a_size: int, b_size: int, what: int, num_sms: int, tuning: FoldTuning | None = None
                ) -> tuple[int, int, int, bool, int]:
    """(COLS, ROWS_PER_STAGE, STAGES, CONVERT, shared bytes). Few columns per CTA when columns are few
    (the chain of adds is the floor: spread columns over many SMs); a warp-wide 32 when there are
    enough CTAs anyway. CONVERT (producers compute the dW contributions) where at least 4 stages fit.
    Defaults from bench/sweep_fold.py on an H200 (bench/results/2026-11-29-h200-run4/a-sweep-fold.json):
    plain folds 16 columns x 256 rows a stage (1.6x the chain floor at 128 columns, 2.5x before), the
    dW folds 8 x 128."""
    tuning = tuning or FoldTuning()
    limit = tuning.smem_bytes
    narrow = 16 if what == 0 else 8
    cols = tuning.cols or (32 if -(-n // 32) >= num_sms else narrow)
    rows_per_stage = tuning.rows_per_stage or (64 if cols == 32 else (256 if what == 0 else 128))
    stage_bytes = rows_per_stage * cols * (a_size + (b_size if what else 0)) + (rows_per_stage * 4 if what else 0)
    contrib_bytes = 2 * (rows_per_stage + (4 if tuning.column_major else 0)) * cols * 4
    convert = bool(what) and cols % 8 == 0 and (limit - contrib_bytes) // stage_bytes >= 4  # CONVERT_VEC columns
    budget = limit - (contrib_bytes if convert else 0)
    stages = min(12, budget // stage_bytes)
    if stages < 2:
        raise ValueError(f"fold ring of {cols} columns x {rows_per_stage} rows a stage: two stages need "
                         f"{2 * stage_bytes} bytes of shared memory, more than {limit}")
    return cols, rows_per_stage, stages, convert, stages * stage_bytes + (contrib_bytes if convert else 0)


# The dW fold of 4096 to 8192 columns (one group) in the ring of 32-column CTAs, its stages converted by the
# producers, where its CTAs outnumber the SMs (128 rows a stage in 96 KB: two CTAs an SM) or its rows are fewer than
# 8192 (256 rows a stage in 200 KB: four stages, up to 1024 rows in flight a CTA). H200, run 27 calls b and f, every
# configuration bitwise against the default; the strict dW alone, kernel-only, against fold_stream before:
# 1024 x 4096 11.9 -> 10.1 us, 2048 x 4096 20.1 -> 16.5, 4096 x 4096 33.5 -> 29.1, 2048 x 5120 29.2 -> 25.4,
# 2048 x 8192 32.2 -> 28.8, 8192 x 8192 97.0 -> 93.8, level at 8192 x 5120 (88.6 against 89.2). fold_stream kept
# where the CTAs are one an SM and the rows many: 8192 x 4096 55.1 (the ring 54.0), 32768 x 4096 190.5 (206.5).
# Since run 30 (call a, every configuration bitwise against the default) the ring's many-CTA case gives way to
# fold_stream from 2048 rows: 16 columns x 64 rows a stage with 4 converting warps where those CTAs are at most three
# an SM (2048 x 5120 25.5 -> 23.2 us, 8192 x 5120 88.6 -> 69.2, 2048 x 6144 26.2 -> 25.2, 32768 x 6144 345.1 -> 272.8;
# run 29, call e: 4096-16384 x 6144 14-22%), else from 4096 rows 64 x 32 with 8 converters and padded buffers
# (4096 x 7168 50.3 -> 48.8, 16384 x 7168 177.3 -> 164.3, 8192 x 8192 94.6 -> 88.8; run 29: 16384 and 32768 x 8192
# 6-7%). 16 x 64 lost at 7168 and 8192 columns (4096 x 7168 62.4, 8192 x 8192 128.9), 64 x 32 at 5120 and 6144, and
# both to the ring at 2048 x 8192 (28.5 against 39.4 and 30.0).
_DW_RING_COLS = (4096, 8192)  # the columns it applies to
_DW_RING_FEW_ROWS = 8192  # fewer rows than this: the 200 KB ring
_DW_RING_FEW, _DW_RING_MANY_CTAS = (256, 200 * 1024), (128, _RING_ROOMY)  # (rows a stage, shared bytes)
_DW_STREAM_NARROW = FoldTuning(stream=True, cols=16, rows_per_stage=64, convert_warps=4)  # from 2048 rows
_DW_STREAM_WIDE = FoldTuning(stream=True, cols=64, rows_per_stage=32, convert_warps=8, pad_groups=True)  # from 4096


def _dw_stream_past_the_sms(n: int, rows: int, num_sms: int) -> FoldTuning | None:
    """fold_stream's tuning for the dW fold of 4096 to 8192 columns whose 32-column CTAs outnumber the SMs, where it
    beat the ring, else None."""
    if not _DW_RING_COLS[0] <= n <= _DW_RING_COLS[1] or -(-n // 32) <= num_sms:
        return None
    if -(-n // 16) <= 3 * num_sms:
        return _DW_STREAM_NARROW if rows >= 2048 else None
    return _DW_STREAM_WIDE if rows >= 4096 else None


def default_dw_ring(n: int, rows: int, groups: int, num_sms: int, smem_optin: int) -> FoldTuning | None:
    """The dW fold's ring tuning without a FoldTuning where default_chain does not apply, or None (fold_stream)."""
    if groups != 1 or not _DW_RING_COLS[0] <= n <= _DW_RING_COLS[1]:
        return None
    if -(-n // 32) > num_sms:
        if _dw_stream_past_the_sms(n, rows, num_sms):
            return None
        stage, smem = _DW_RING_MANY_CTAS
    elif rows < _DW_RING_FEW_ROWS:
        stage, smem = _DW_RING_FEW
    else:
        return None
    return FoldTuning(cols=32, rows_per_stage=stage, smem_bytes=smem) if smem <= smem_optin else None


def fold_launch(n: int, a_dtype: torch.dtype, b_dtype: torch.dtype, what: int, simple_rows: bool,
                ring: bool, num_sms: int, tuning: FoldTuning | None = None,
                out_dtype: torch.dtype = torch.float32, rows: int = 0, groups: int = 1, smem_optin: int = 0
                ) -> FoldLaunch:
    """The kernel and macros for one fold. ring=False gives the one-thread-per-column kernel (any layout);
    else the ring, fold_chain where the tuning asks for it and there is one group of `rows` rows, or fold_stream
    where it asks for that (without a tuning: default_chain, given the device's opt-in shared memory per block, else
    for the dW fold default_dw_ring, else default_stream where its buffers fit that memory, else the ring, shaped by
    default_ring where it applies).
    out_dtype: the result's (the fp32 sums rounded once at the store, as .to() would round them)."""
    defines = {"A_CODE": DTYPE_CODES[a_dtype], "B_CODE": DTYPE_CODES[b_dtype], "WHAT": what,
               "SIMPLE_ROWS": int(simple_rows)}
    if out_dtype != torch.float32:
        defines["OUT_CODE"] = DTYPE_CODES[out_dtype]
    if not ring:
        return FoldLaunch("fold_simple", defines, -(-n // 128), 128, 0)
    if tuning is None:
        tuning = default_chain(n, rows, groups, smem_optin, what)
        if tuning is None and what:
            tuning = default_dw_ring(n, rows, groups, num_sms, smem_optin)
        stream = default_stream(n, groups, num_sms, what, rows) if tuning is None else None
        if stream is not None:
            try:
                return _stream_launch(n, num_sms, groups, smem_optin, stream, defines)
            except ValueError:  # its buffers do not fit this device's shared memory (or none is known): the ring
                pass
        if tuning is None:
            tuning = default_ring(n, rows, groups, num_sms, smem_optin, what)
    if tuning is not None and tuning.chain_rows and groups == 1:
        return _chain_launch(n, rows, num_sms, tuning, defines)
    if tuning is not None and tuning.stream:
        return _stream_launch(n, num_sms, groups, smem_optin, tuning, defines)
    cols, rps, stages, convert, shmem = _ring_shape(n, a_dtype.itemsize, b_dtype.itemsize, what, num_sms, tuning)
    defines.update(COLS=cols, ROWS_PER_STAGE=rps, STAGES=stages, THREADS=_THREADS, CONVERT=int(convert))
    tuning = tuning or FoldTuning()
    if tuning.full_stage:
        defines["FULL_STAGE"] = 1
    if convert and tuning.column_major:
        defines["COLUMN_MAJOR"] = 1
    return FoldLaunch("fold_ring", defines, -(-n // cols), _THREADS, shmem)


_SUM_COLS, _SUM_THREADS = 16, 256  # partial_sum.cu's block: 16 columns, 256 threads


@dataclass(frozen=True)
class PartialSumShape:
    """partial_sum.cu's shape for (rows, n) partial rows: 16-byte loads (vec 4) where N % 4 == 0, column blocks of
    _SUM_COLS, and the rows cut into `segments` of seg_rows (the last one shorter) where the column blocks alone
    leave SMs idle; every thread adds at least 16 rows a segment: a second launch costs ~1 us, and fewer rows a
    thread gain less than that (H200, run 26 calls a-b, bench/partial_probe.py: 528 x 128 partial rows in one
    launch 2.8-3.0 us against 3.7 in two segments; Triton's fast backward at 262144 x 128 (528 partial rows)
    55.9 -> 54.4, at 65536 x 128 (1056) 19.4 in four segments and 18.5 in two against 18.1-18.3 in one)."""

    vec: int
    col_blocks: int
    segments: int
    seg_rows: int


def partial_sum_shape(rows: int, n: int, num_sms: int) -> PartialSumShape:
    vec = 4 if n % 4 == 0 else 1
    col_blocks = -(-n // _SUM_COLS)
    groups = _SUM_THREADS // (_SUM_COLS // vec)
    segments = max(1, min(-(-num_sms // col_blocks), rows // (16 * groups)))
    seg_rows = -(-rows // segments)
    return PartialSumShape(vec, col_blocks, -(-rows // seg_rows), seg_rows)


@dataclass(frozen=True)
class NormLaunch:
    defines: dict[str, int]
    rows_per_block: int
    threads: int
    partial_blocks_per_sm: int = 0
    persistent: bool = True


@dataclass(frozen=True)
class NormTuning:
    """Block shape knobs of rms_norm.cu. Any values give the same bits (the tree is fixed by N);
    only the speed changes. values: fp32 lanes a thread holds per row; min_threads: the block size
    to reach with several rows per block."""

    values: int = 16
    min_threads: int = 128
    partial_blocks_per_sm: int = 2  # backward with fast dW: fewer blocks, fewer fp32 partial rows
    hold_max_p: int = 8192  # longer (padded) rows are read twice instead of held in registers
    stream_threads: int = 256  # threads per row for those
    hold_weight: bool = True  # held rows: the weight's lanes stay in registers across rows (else reloaded)
    # held rows without hold_weight: the weight's lanes loaded with each row's, before its sum, and held to the
    # output (rms_norm.cu's W_WITH_ROW; same bits), instead of piece by piece after the sum, where ptxas issues
    # each load just ahead of its use (an L2 round trip each: 4 in a row at 8192 x 4096, read in the sm_90 SASS)
    weight_with_row: bool = False
    dw_smem: bool = False  # held rows, fast dW: the fp32 partials in shared memory instead of registers
    # fast dW with several rows a block: the slots' partial rows added in shared memory (slot order) and one row
    # written a block (rms_norm.cu's DW_COMBINE), not one a slot; where RPB * N fp32 fit in _SMEM_LIMIT, not staged
    dw_combine: bool = True
    # a grid of at most the resident blocks, striding over rows; False: one block per row group (not for the
    # fast dW, whose partial rows are one per block)
    persistent: bool = True
    # pieces wholly in the padding (k >= KR for every thread) neither loaded nor held: fewer registers and
    # instructions for N well below its power of two (N = 18432: 5 of 8 pieces a thread at P = 32768). On by
    # default since the H200 sweep of 2026-11-30 (bench/results/2026-11-30-h200-run6): the table's shapes at
    # N = 18432 forward 57.0 -> 45.4 us, backward 166.9 -> 110.7 us; N = 5120 29.7 -> 26.3, 69.2 -> 62.3 us;
    # the same code where N is a power of two
    trim: bool = True
    # where every row segment is 16-byte aligned and N a multiple of a 16-byte piece: only the 16-byte paths
    # compiled (rms_norm.cu's EVEN; the same arithmetic, so the same bits). Per table entry, as measured on an H200
    # (bench/results/2026-11-30-h200-run10 and -run11, b-sweep-variants): the backward 235 -> 221 us at
    # 32768 x 4096, 136 -> 131 at 8192 x 8192, 110 -> 101 at 2048 x 18432 (predicated loads); the forward
    # 12.0 -> 10.2 at 2048 x 4096, level elsewhere (unpredicated loads)
    even: bool = True
    # with EVEN, its loads without predicates (rms_norm.cu's UNPREDICATED; same bits): in run 11 the forward
    # gained at 8192 x 8192 (75 -> 67 us) and 262144 x 128, the backward lost at 2048 x 18432 (101 -> 119) and
    # 1024 x 65536 (263 -> 327) against run 10's predicated loads
    unpredicated: bool = True
    # backward with held rows and EVEN (not dw_smem): the next row's z and dy copied into shared memory (cp.async)
    # while a row is computed (rms_norm.cu's STAGED; same arithmetic, same bits)
    staged: bool = False
    # backward with held rows: the slot's next row's z, dy and rstd loaded into registers while a row is computed
    # (rms_norm.cu's PREFETCH; same loads, same bits; takes the place of `staged`). Measured slower at the tables'
    # grids before run 10; with fewer blocks an SM it won in the Triton and cute backwards (runs 14, 16) and here
    # (run 17, call a: the P = 4096 entries)
    prefetch: bool = False
    # backward with held rows: each lane's xh and g kept in fp32 between the passes, the dW contributions added in
    # the first (rms_norm.cu's HOLD_F32; same arithmetic, same bits): fewer instructions, more registers. On an
    # H200 slower where rows are long (8192 x 8192 130 -> 168 us), level or 2% faster elsewhere (run 12, call i):
    # in no table
    hold_f32: bool = False
    # N a power of two: the row's mean (the forward's mean square, the backward's c) as the sum times the exact 2^-k
    # (rms_norm.cu's MEAN_SHIFT; the same bits as the IEEE division, reference.exact_mean_scale), as the Triton
    # kernels take it since run 33. On by default since run 47 (H200, bench/results/2026-12-05-h200-run47, A/B of 2
    # rounds, fwd / fast bwd us, division -> scale): 262144 x 128 33.76 -> 33.58 / 56.32 -> 56.06, 65536 x 128 10.10
    # -> 10.03 / 18.89 -> 18.83, 4096 x 128 2.32 -> 2.30 / 4.96 -> 4.78, 32768 x 4096 132.34 -> 131.60 / 202.35 ->
    # 202.93, 128 x 4096 2.64 -> 2.50 / 6.06 -> 6.43 (that backward's rounds 6.24, 5.89 against 6.46, 6.40), so
    # BWD_TABLE's entries from P = 4096 on keep the division
    mean_scale: bool = True
    # the blocks an SM the kernel is compiled for (rms_norm.cu's MIN_BLOCKS, __launch_bounds__'s second argument:
    # ptxas keeps a thread's registers within 65536 / (threads x min_blocks)); dropped for a kernel it would make spill
    # (nvrtc.compile_for_load: an entry serves every dtype and mode, whose register needs differ); 0: the block size
    # alone bounds them
    min_blocks: int = 0


# Block shapes per padded row length P = next_pow2(N), from bench/sweep_cuda.py on an H200 (first
# bench/results/2026-11-29-h200-run4/b-tuning.json, last run11 below; every configuration bitwise); a P between entries
# takes the nearest one (log scale). Unbounded entries are the sweep's choice at its largest row count;
# bounded ones come from its smaller row counts (the launch shape may follow the row count because no
# shape changes a bit). A JSON file named by STRICTNORM_CUDA_TUNING replaces entries: {"fwd": {"4096":
# [[128, {"values": 8, ...}], [null, {...}]], ...}, "bwd": {...}} ([max rows or null, knobs] pairs; a
# bare knobs object is one unbounded entry), as bench/sweep_cuda.py writes it.
Tuning = Bounded[NormTuning]  # (max rows, tuning) entries, the last one unbounded
_H = 65536  # hold_max_p: rows held in registers


def _fwd(values: int, min_threads: int = 128, persistent: bool = False, weight_with_row: bool = False,
         unpredicated: bool = True, min_blocks: int = 0) -> NormTuning:
    """The forward's entries: rows held, the weight reloaded per row (registers go to the row), EVEN."""
    return NormTuning(values=values, min_threads=min_threads, hold_weight=False, hold_max_p=_H, partial_blocks_per_sm=0,
                      persistent=persistent, weight_with_row=weight_with_row, unpredicated=unpredicated,
                      min_blocks=min_blocks)


# Last revised from the sweeps of bench/results/2026-11-30-h200-run11 (b-: each entry with EVEN off and on, the
# forward's block sizes; e-: the backward's at 128 to 8192 rows of 4096 columns) and, for the backward, run12 (d-:
# each entry with EVEN off / predicated / unpredicated, each staged or not; the block shapes staged or not at 2048
# and 8192 rows of 4096): staged 2048 x 4096 31.5 -> 30.0 us, 2048 x 18432 100.9 -> 98.9, 32768 x 4096 221.5 ->
# 219.9, 8192 x 8192 130.5 -> 129.5 (a percent or two: what a row's loads in flight during the last one's
# arithmetic buy here).
# The weight loaded with the row, before its sum (run 28, call a: the tables' entries with and without it, EVEN off /
# predicated / unpredicated): 128 x 4096 3.1 -> 2.9 us; 2048 x 18432 44.6 -> 42.5 with predicated loads. Elsewhere
# within 1% either way, or slower (1024 x 65536 82.8 -> 120.4).
# QK-norm's decode shapes (run 36, call c: 64 to 512 threads a block, the weight with the row or not, every
# configuration bitwise): 16 threads a row, 8 lanes each, the weight loaded with the row, 4096 x 128 2.88 -> 2.40 us.
# (The sweep's 16 lanes a thread at 16384 and 65536 rows, 4.26 -> 3.74 and 11.20 -> 10.72, were level in the bench:
# call f, two rounds each, 4.03-4.10 -> 4.03-4.06 and 11.14-11.17 -> 10.91-11.07; not taken.)
# Past 4096 rows of P = 128 the training forward (4 threads a row, 32 lanes each) loads the weight with the row too:
# without it ptxas issued the weight's four loads after the row sum's shuffles, one before each piece of y
# (bench/compile_probe.py --cuda-forward; with it 46 -> 56 registers, 21 -> 18 blocks of 64 an SM). On an H200
# (bench/results/2026-12-06-h200-run49, calls b and e, the bench's backward: the training step less the inference
# forward, us) 16384 x 128 8.32 -> 8.00 and 8.40 -> 8.11; 65536 x 128 and 262144 x 128 level (18.48 -> 18.51,
# 56.08 -> 56.11 in call e's 4 rounds).
FWD_TABLE: dict[int, Tuning] = {
    128: ((4096, _fwd(8, weight_with_row=True)), (None, _fwd(32, min_threads=64, weight_with_row=True))),
    4096: ((128, _fwd(8, min_threads=64, weight_with_row=True)), (2048, _fwd(64)), (None, _fwd(32))),
    8192: ((None, _fwd(32)),),
    32768: ((None, _fwd(64, persistent=True, weight_with_row=True, unpredicated=False)),),
    65536: ((None, _fwd(32, persistent=True)),),
}
# An inference call's forward (need_rstd False: no rstd stored) where its best shape differs from the training
# forward's; other lengths take FWD_TABLE. P = 128 past 4096 rows: 16 lanes a thread, 128 threads a block, the weight
# with the row (run 42, call d, through the public call, every configuration bitwise): 16384 x 128 4.19 -> 3.62 us,
# 65536 x 128 11.17 -> 10.08, 262144 x 128 34.72 -> 33.41; the training kernel, which stores rstd, did not gain
# there (262144 x 128 35.74 -> 36.13), so FWD_TABLE keeps its entry.
FWD_INFERENCE_TABLE: dict[int, Tuning] = {
    128: (FWD_TABLE[128][0], (None, _fwd(16, weight_with_row=True))),
}
BWD_TABLE: dict[int, Tuning] = {
    # From P = 4096 on the backward keeps the IEEE division for the row's c (mean_scale=False): with the 2^-k scale
    # 128 x 4096 took 6.06 -> 6.43 us and 32768 x 4096 202.35 -> 202.93 (bench/results/2026-12-05-h200-run47, A/B),
    # and run 34's version of it lost at 2048 x 4096 (ptxas gave that tile 4 more registers); at P = 128 it gained
    # (4096 x 128 4.96 -> 4.78, 262144 x 128 56.32 -> 56.06)
    # xh and g held in fp32 between the passes: 262144 x 128 60.2 -> 58.7 us (run 13, call c; run 12, i: 62.7 -> 61.7)
    # 16 threads a row up to 16384 rows (run 36, call c): 4096 x 128 7.33 -> 7.11 us, 16384 x 128 11.10 -> 10.08;
    # the bench (call f, two rounds each) 7.17-7.26 -> 6.69-6.75 and 10.69-10.72 -> 9.92-9.98
    128: ((16384, NormTuning(values=8, hold_weight=False, hold_max_p=_H, partial_blocks_per_sm=8, hold_f32=True)),
          (None, NormTuning(hold_weight=False, hold_max_p=_H, partial_blocks_per_sm=8, hold_f32=True))),
    # up to 128 rows one row of 512 threads a block (run 40, call a, every configuration bitwise): 128 x 4096 7.2 ->
    # 6.1 us; the former 4-row blocks' partials (64 KB) did not fit in shared memory, so the strict fold served it
    4096: ((128, NormTuning(values=8, hold_weight=False, hold_max_p=_H, partial_blocks_per_sm=4, mean_scale=False)),
           # the next row prefetched into registers (run 17, call a; unpredicated): 2048 x 4096 24.6 -> 21.0 us with
           # 2 blocks an SM, 8192 x 4096 61.4 -> 59.3, 32768 x 4096 210.2 -> 202.2 with 4
           (2048, NormTuning(values=8, hold_weight=False, hold_max_p=_H, partial_blocks_per_sm=2, prefetch=True,
                             mean_scale=False)),
           (8192, NormTuning(values=32, hold_weight=False, hold_max_p=_H, partial_blocks_per_sm=8, prefetch=True,
                             mean_scale=False)),
           (None, NormTuning(values=32, hold_max_p=_H, partial_blocks_per_sm=4, prefetch=True, mean_scale=False))),
    8192: ((None, NormTuning(values=32, hold_max_p=_H, partial_blocks_per_sm=4, unpredicated=False, staged=True,
                             mean_scale=False)),),
    # EVEN's predicated loads here: run 10's sweep measured them (2048 x 18432 110.0 -> 101.4 us, 1024 x 65536
    # 270.5 -> 263.0), where the unpredicated ones lost (run 11: 118.9, 326.8; run 12: 119.4, 323.8)
    32768: ((None, NormTuning(values=64, hold_weight=False, hold_max_p=_H, partial_blocks_per_sm=4,
                              unpredicated=False, staged=True, mean_scale=False)),),
    # rows read twice: held, the backward spills at this length (392-byte stack with 1024 threads)
    65536: ((None, NormTuning(hold_max_p=0, stream_threads=512, partial_blocks_per_sm=8, unpredicated=False,
                              mean_scale=False)),),
}


def _load_tuning_file() -> None:
    """STRICTNORM_CUDA_TUNING's entries ("fwd"; "fwd_nr": the inference forward's; "bwd"). A file's "fwd" entry for P
    serves the inference forward too unless the file has a "fwd_nr" entry for P."""
    forward, inference = dict(FWD_TABLE), dict(FWD_INFERENCE_TABLE)
    load_tuning_file("STRICTNORM_CUDA_TUNING", {"fwd": FWD_TABLE, "fwd_nr": FWD_INFERENCE_TABLE, "bwd": BWD_TABLE},
                     NormTuning)
    drop_shadowed(forward, FWD_TABLE, inference, FWD_INFERENCE_TABLE)


_load_tuning_file()


def entries_for(table: dict[int, Tuning], n: int) -> Tuning:
    """The row-bounded entries for N's padded length (or the nearest one on a log scale)."""
    p = next_pow2(n)
    return table[min(table, key=lambda q: (abs(q.bit_length() - p.bit_length()), q))]


def tuning_for(table: dict[int, Tuning], n: int, rows: int | None = None) -> NormTuning:
    """The entry for N's padded length (or the nearest one on a log scale) and the row count (the
    unbounded entry when rows is not given)."""
    return for_rows(entries_for(table, n), rows)


def forward_tuning(n: int, rows: int | None = None, need_rstd: bool = True) -> NormTuning:
    """The forward's entry for N and the row count: an inference call's (need_rstd False) from FWD_INFERENCE_TABLE
    where it has N's padded length, else FWD_TABLE's."""
    inference = not need_rstd and next_pow2(n) in FWD_INFERENCE_TABLE
    return tuning_for(FWD_INFERENCE_TABLE if inference else FWD_TABLE, n, rows)


@functools.lru_cache(maxsize=4096)
def norm_launch(n: int, x_dtype: torch.dtype, res_dtype: torch.dtype | None, w_dtype: torch.dtype | None,
                y_dtype: torch.dtype, mode: str, per_head: bool, tuning: NormTuning | None = None,
                aligned: bool = False, store_rstd: bool = True) -> NormLaunch:
    """Macros and block shape of rms_norm.cu for one call: pieces of PIECE lanes (16 bytes of the
    narrowest streamed dtype), TPR threads per row holding K pieces each, RPB rows per block; rows
    held in registers (HOLD) up to tuning.hold_max_p padded lanes, read twice beyond. aligned: every row
    segment of the call starts 16-byte aligned (EVEN where N is also a multiple of PIECE). store_rstd False: the
    forward stores no rstd (NO_RSTD; the same cubin as before where it is True)."""
    tuning = tuning or tuning_for(FWD_TABLE, n)
    p = next_pow2(n)
    norm_dtype = res_dtype or x_dtype
    narrowest = min(t.itemsize for t in (x_dtype, norm_dtype, y_dtype))
    piece = min(p, 16 // narrowest)
    hold = p <= tuning.hold_max_p
    values = max(piece, tuning.values) if hold else max(piece, p // tuning.stream_threads)
    tpr = max(1, min(1024, p // values))
    k = p // (piece * tpr)
    rpb = max(1, tuning.min_threads // tpr)
    defines = {"XC": DTYPE_CODES[x_dtype], "RC": DTYPE_CODES[norm_dtype], "NC": DTYPE_CODES[norm_dtype],
               "WC": DTYPE_CODES[w_dtype or x_dtype], "YC": DTYPE_CODES[y_dtype], "MODE": MODE_CODES[mode],
               "HAS_W": int(w_dtype is not None), "PER_HEAD": int(per_head), "HAS_RES": int(res_dtype is not None),
               "PIECE": piece, "TPR": tpr, "K": k, "RPB": rpb, "HOLD": int(hold),
               "HOLD_W": int(hold and tuning.hold_weight)}
    if not store_rstd:
        defines["NO_RSTD"] = 1
    if tuning.mean_scale and n == p:
        defines["MEAN_SHIFT"] = p.bit_length() - 1
    if hold and not tuning.hold_weight and tuning.weight_with_row:
        defines["W_WITH_ROW"] = 1
    if tuning.min_blocks:
        defines["MIN_BLOCKS"] = tuning.min_blocks
    sizes = (x_dtype.itemsize, norm_dtype.itemsize, y_dtype.itemsize, (w_dtype or x_dtype).itemsize)
    if tuning.even and aligned and n % piece == 0 and all(piece * size % 16 == 0 for size in sizes):
        defines["EVEN"] = 1
        if tuning.unpredicated:
            defines["UNPREDICATED"] = 1
    pieces_with_data = max(1, -(-n // (piece * tpr)))
    if tuning.trim and pieces_with_data < k:  # else KR = K: the untrimmed kernel (same cubin, same cache key)
        defines["KR"] = pieces_with_data
    elif pieces_with_data < k and "UNPREDICATED" in defines:  # its loads must check every piece for padding
        defines["UNTRIMMED"] = 1
    return NormLaunch(defines, rpb, tpr * rpb, tuning.partial_blocks_per_sm, tuning.persistent)


@functools.lru_cache(maxsize=4096)
def norm_bwd_launch(n: int, z_dtype: torch.dtype, dy_dtype: torch.dtype, w_dtype: torch.dtype | None, mode: str,
                    per_head: bool, has_dres: bool, dw_partials: bool, tuning: NormTuning | None = None,
                    aligned: bool = False) -> NormLaunch:
    """rms_norm.cu's backward kernel for one call: the forward's block shape rules, BACKWARD set."""
    narrowest = dy_dtype if dy_dtype.itemsize < z_dtype.itemsize else z_dtype
    tuning = tuning or tuning_for(BWD_TABLE, n)
    fl = norm_launch(n, z_dtype, None, w_dtype, narrowest, mode, per_head, tuning, aligned)
    dw_smem = dw_partials and fl.defines["HOLD"] and tuning.dw_smem
    defines = dict(fl.defines, YC=DTYPE_CODES[z_dtype], BACKWARD=1, DYC=DTYPE_CODES[dy_dtype], HAS_DRES=int(has_dres),
                   DW_PARTIALS=int(dw_partials), DW_SMEM=int(dw_smem), PADDED=int(n < next_pow2(n)))
    if tuning.hold_f32 and fl.defines["HOLD"]:
        defines["HOLD_F32"] = 1
    if tuning.prefetch and fl.defines["HOLD"]:
        defines["PREFETCH"] = 1
    elif tuning.staged and fl.defines["HOLD"] and fl.defines.get("EVEN") and not dw_smem:
        defines["STAGED"] = 1
        if staged_smem(defines, z_dtype, dy_dtype) > _STAGED_SMEM_MAX:
            del defines["STAGED"]
    if (dw_partials and tuning.dw_combine and fl.rows_per_block > 1 and not defines.get("STAGED")
            and fl.rows_per_block * n * 4 <= _SMEM_LIMIT):
        defines["DW_COMBINE"] = 1
    return NormLaunch(defines, fl.rows_per_block, fl.threads, fl.partial_blocks_per_sm, fl.persistent)


def dw_partial_rows(defines: dict[str, int], grid: int) -> int:
    """The fast dW's partial rows a backward launch of `grid` blocks writes: one a block with DW_COMBINE, else one
    a row slot."""
    return grid if defines.get("DW_COMBINE") else grid * defines["RPB"]


def staged_smem(defines: dict[str, int], z_dtype: torch.dtype, dy_dtype: torch.dtype) -> int:
    """Dynamic shared memory of a STAGED backward: two stages of every thread's pieces of z and dy."""
    if not defines.get("STAGED"):
        return 0
    threads = defines["TPR"] * defines["RPB"]
    return 2 * threads * defines.get("KR", defines["K"]) * defines["PIECE"] * (z_dtype.itemsize + dy_dtype.itemsize)


@dataclass(frozen=True)
class OnepassTuning:
    """Knobs of onepass.cu's strict backward (any values give the same bits). w_cols: columns a CTA (0: the
    narrowest power of two >= 32 that needs no more CTAs than SMs); rows: rows a block; depth: blocks loaded
    ahead; tiles: the ring's slots (more than depth: the rest hold blocks waiting for their dx; a multiple of
    dx_groups); b_warps: warps loading blocks and computing their row sums and dW contributions; dx_warps:
    warps computing dx, in dx_groups groups taking blocks in turn; c_warps: combine warps taking blocks in turn
    (beside them, w_cols / 32 fold warps)."""

    w_cols: int = 0
    rows: int = 128
    depth: int = 2
    tiles: int = 4
    b_warps: int = 4
    dx_warps: int = 4
    dx_groups: int = 2
    c_warps: int = 2


@dataclass(frozen=True)
class OnepassLaunch:
    defines: dict[str, int]
    grid: int
    threads: int
    shmem: int


def _onepass_slices(w_cols: int, rows: int, threads: int, min_cols: int) -> int | None:
    """SL, the slices a row is cut into for the row sums: about one (row, slice) pair a thread, slices of at
    most 32 and at least min_cols columns (whole 16-byte loads), whole warps of pairs; None if none fits."""
    lo, hi = max(1, w_cols // 32), w_cols // min_cols
    sl = lo
    while sl * 2 <= hi and rows * sl * 2 <= threads:
        sl *= 2
    while sl <= hi and (rows * sl) % 32:
        sl *= 2
    return sl if sl <= hi and 32 % sl == 0 else None


def onepass_launch(n: int, dy_dtype: torch.dtype, z_dtype: torch.dtype, w_dtype: torch.dtype | None, mode: str,
                   num_sms: int, smem_optin: int, tuning: OnepassTuning | None = None) -> OnepassLaunch | None:
    """onepass.cu's launch for rows of N columns, or None where it does not apply (N < 32; more than 256
    columns a CTA needed to stay within the SMs). Blocks of rows shrink (halving, down to 4 rows) until the
    ring of tiles and the contributions' buffers fit the device's opt-in shared memory."""
    tuning = tuning or OnepassTuning()
    p = next_pow2(n)
    w_cols = tuning.w_cols or 32
    while not tuning.w_cols and -(-n // w_cols) > num_sms:
        w_cols *= 2
    if (w_cols > p or w_cols > 256 or w_cols % 32
            or min(tuning.b_warps, tuning.dx_warps, tuning.depth, tuning.dx_groups, tuning.c_warps) < 1
            or tuning.tiles <= tuning.depth or tuning.dx_warps % tuning.dx_groups or tuning.tiles % tuning.dx_groups
            or tuning.dx_groups > 14):
        return None
    threads = 32 * (w_cols // 32 + tuning.b_warps + tuning.dx_warps + tuning.c_warps)
    if threads > 1024:
        return None
    min_cols = 16 // min(dy_dtype.itemsize, z_dtype.itemsize)

    def shmem_of(rows: int) -> int:  # onepass.cu's ONEPASS_SMEM
        tile = rows * (w_cols * dy_dtype.itemsize + 16 + w_cols * z_dtype.itemsize + 16) + rows * 4
        return (tuning.tiles * tile + 2 * rows * (w_cols + 4) * 4 + 4 * (w_cols + tuning.dx_groups * rows)
                + 8 * (2 * tuning.tiles + 4))

    rows = tuning.rows
    while shmem_of(rows) > smem_optin and rows // 2 >= 4 and (rows // 2) % 4 == 0:
        rows //= 2
    sl = _onepass_slices(w_cols, rows, 32 * tuning.b_warps, min_cols)
    if shmem_of(rows) > smem_optin or rows % 4 or sl is None:
        return None
    defines = {"DYC": DTYPE_CODES[dy_dtype], "NC": DTYPE_CODES[z_dtype], "WC": DTYPE_CODES[w_dtype or z_dtype],
               "MODE": MODE_CODES[mode], "HAS_W": int(w_dtype is not None), "W_COLS": w_cols, "GROUPS": p // w_cols,
               "G_DATA": -(-n // w_cols), "ROWS": rows, "SL": sl, "DEPTH": tuning.depth, "TILES": tuning.tiles,
               "B_WARPS": tuning.b_warps, "DX_WARPS": tuning.dx_warps, "DX_GROUPS": tuning.dx_groups,
               "C_WARPS": tuning.c_warps, "THREADS": threads}
    return OnepassLaunch(defines, defines["G_DATA"], threads, shmem_of(rows))


def _aligned16(*tensors_and_layouts) -> bool:
    """Every row segment starts 16-byte aligned: pointers and row strides (in bytes) divisible by 16."""
    for t, strides in tensors_and_layouts:
        if t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s in strides):
            return False
    return True


def _ring_ok(t: torch.Tensor, lay: RowLayout) -> bool:
    """16-byte cp.async needs every row segment of whole chunks to start 16-byte aligned."""
    per = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % per == 0 for s in lay.args())


def _device_index(t: Tensor) -> int:
    index = t.get_device()
    return index if index >= 0 else torch.cuda.current_device()


def _simple_rows(lay: RowLayout) -> bool:
    return lay.g == 1 and lay.r1 == 1


@dataclass(frozen=True)
class _FoldPlan:
    """One fold launch with everything but the addresses fixed (fold.cu's argument order)."""

    kernel: object | None  # LoadedKernel; None when a group has no rows (the result is zeros)
    grid: tuple[int, int, int]
    block: int
    shmem: int
    a_strides: tuple[int, int, int]
    b_strides: tuple[int, int, int]
    r1: int
    g: int
    rows_per_group: int
    n: np.int32
    groups: int
    out_shape: tuple[int, int]
    out_dtype: torch.dtype
    state_ints: int = 0  # fold_chain's zeroed state, allocated per call
    kernel_name: str = ""  # fold.cu's kernel: fold_simple, fold_ring, fold_chain or fold_stream


@dataclass(frozen=True)
class _SumPlan:
    """One partial_sum.cu launch: grid (column blocks, segments), one output row a segment."""

    kernel: object
    grid: tuple[int, int, int]
    seg_rows: int
    out_dtype: torch.dtype
    dependent: bool  # launched as a dependent of the kernel before it (programmatic stream serialization)


@dataclass(frozen=True)
class _FwdPlan:
    """An rms_norm forward for one input signature (layout.signature): the views' decisions, the output
    dtype and the launch."""

    views: ForwardPlan
    y_dtype: torch.dtype
    kernel: object | None  # None for zero rows
    grid: int
    threads: int
    wsg: int
    tail: tuple  # rows, n, r1, g, eps, offset, aligned


@dataclass(frozen=True)
class _BwdPlan:
    """An rms_norm backward for one input signature: the views' decisions, the strict dW fold (before the
    dx kernel, which may overwrite dy), the dx kernel and the fast dW's partial rows and their sum."""

    views: BackwardPlan
    rows: int
    strict: _FoldPlan | None
    kernel: object | None
    grid: int
    threads: int
    shmem: int
    wsg: int
    tail: tuple  # rows, n, r1, g, offset, aligned (the one-pass plan: without aligned)
    partial_rows: int  # fp32 partial rows the kernel writes (0: no fast-dW partials)
    partial_sum: tuple[_SumPlan, ...]  # the launches summing the partial rows in a fixed order
    onepass: _OnepassPlan | None = None  # the whole strict backward in onepass.cu instead (opt-in)


@dataclass(frozen=True)
class _OnepassPlan:
    kernel: object
    launch: OnepassLaunch
    blocks: int  # blocks of rows: one arrival counter each (two kinds)
    slot_rows: int  # rows of the global exchange buffers: TILES blocks in flight


class CudaBackend:
    name = "cuda"
    ops = frozenset({"rms_norm", "left_fold"})

    def __init__(self) -> None:
        self._cache = None
        self._resident: dict[tuple, tuple[int, int]] = {}
        self._fwd_plans: dict[tuple, _FwdPlan] = {}
        self._bwd_plans: dict[tuple, _BwdPlan] = {}
        self._fold_plans: dict[tuple, _FoldPlan] = {}
        # fixed block shapes for rms_norm.cu instead of the tables, and fold.cu ring knobs (sweeps and
        # tests; same bits)
        self.fwd_tuning: NormTuning | None = None
        self.bwd_tuning: NormTuning | None = None
        self.fold_tuning: FoldTuning | None = None
        # the strict dW fold on a side stream beside the dx pass (see launch_fold and fold_beside): opt-in, slower
        # with the host ahead of the GPU (see above); same bits either way
        self.fold_beside_dx = False
        # > 0: an out-of-place strict backward whose fold runs beside its dx pass shares the SMs out: the fold's grid
        # sized for this many SMs (fold_chain's; the ring's column stripes: see _ring_shape) and the dx pass's
        # persistent grid for the rest, so that the two run at once (bench/strict_parts.py; same bits); 0 never;
        # None as _SHARED_FOLD_SMS says for the default fold (without a fold_tuning)
        self.fold_sms: int | None = None
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        # the strict backward in one pass (kernels/onepass.cu) where it applies; opt-in while the two passes are
        # faster (bench/results/2026-11-30-h200-run9)
        self.onepass_strict = False
        self.onepass_tuning: OnepassTuning | None = None
        # the fast dW's partial sum launched as a dependent of the backward (sm_90 and newer): scheduled while the
        # backward's last blocks run, it waits for them on the GPU (common.cuh); same bits either way
        self.dependent_sum = True

    def _norm_kernel(self, dev: int, name: str, fl: NormLaunch):
        return self._kernels().get(dev, "rms_norm.cu", name, fl.defines)

    def _grid(self, dev: int, kernel, threads: int, groups: int, per_sm_cap: int = 0, shmem: int = 0,
              persistent: bool = True, sms_left: int = 0) -> int:
        """Blocks for a grid-stride kernel: every row group, at most what the GPU holds at once
        (and at most per_sm_cap blocks per SM when that is set; on all SMs but sms_left); one per row group when
        not persistent."""
        if not persistent:
            return min(groups, _MAX_GRID_X)
        key = (dev, id(kernel), threads, shmem)
        per_sm, sms = self._resident.get(key, (0, 0))
        if not per_sm:
            per_sm = max(1, kernel.kernel.occupancy.max_active_blocks_per_multiprocessor(threads, shmem))
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            self._resident[key] = (per_sm, sms)
        if per_sm_cap:
            per_sm = min(per_sm, per_sm_cap)
        return max(1, min(groups, per_sm * max(1, sms - sms_left)))

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"CUDA kernels run on NVIDIA GPUs; tensors are on {device.type}"
        if torch.version.hip is not None:
            return "this PyTorch is built for ROCm; the CUDA backend needs an NVIDIA GPU (use triton)"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        if torch.cuda.get_device_capability(device) < _MIN_ARCH:
            return f"needs compute capability >= {_MIN_ARCH[0]}.{_MIN_ARCH[1]}"
        try:
            from cuda.core import Device  # noqa: F401

            from .nvrtc import nvrtc_version

            nvrtc_version()
        except Exception as e:  # missing package or NVRTC library
            return f"cuda-core/NVRTC not usable ({e}); pip install 'strictnorm[cuda]'"
        return None

    def _kernels(self):
        if self._cache is None:
            from .nvrtc import KernelCache

            self._cache = KernelCache()
        return self._cache

    # ---- the strict left fold ----------------------------------------------------------------------
    def _fold_plan(self, dev: int, alay: RowLayout, a_dtype: torch.dtype, blay: RowLayout, b_dtype: torch.dtype,
                   what: int, groups: int, ring: bool, simple: bool, out_dtype: torch.dtype, sms: int = 0) -> _FoldPlan:
        """sms: the SMs the fold's grid is sized for (0: all)."""
        n = alay.n
        rows_per_group = alay.rows // groups
        props = torch.cuda.get_device_properties(dev)
        num_sms = min(sms, props.multi_processor_count) if sms else props.multi_processor_count
        fl = fold_launch(n, a_dtype, b_dtype, what, simple, ring, num_sms, self.fold_tuning,
                         out_dtype, rows_per_group, groups, props.shared_memory_per_block_optin)
        kernel = self._kernels().get(dev, _SOURCE, fl.kernel, fl.defines) if rows_per_group else None
        if kernel is not None and fl.shmem > _SMEM_LIMIT:
            kernel.allow_dynamic_shared(fl.shmem)
        return _FoldPlan(kernel, (fl.grid_x, groups, 1), fl.block, fl.shmem, alay.args(), blay.args(), alay.r1,
                         alay.g, rows_per_group, np.int32(n), groups, (groups, n), out_dtype, fl.state_ints,
                         fl.kernel)

    def _side_stream(self, dev: int) -> torch.cuda.Stream:
        side = self._side_streams.get(dev)
        if side is None:
            side = self._side_streams.setdefault(dev, torch.cuda.Stream(device=dev))
        return side

    def _run_fold(self, plan: _FoldPlan, a: Tensor, b: Tensor, rstd: Tensor) -> Tensor:
        return self._launch_fold(plan, a, b, rstd, beside=False)[0]

    def _launch_fold(self, plan: _FoldPlan, a: Tensor, b: Tensor, rstd: Tensor, beside: bool
                     ) -> tuple[Tensor, Callable[[], None]]:
        """(the fold's output, join). beside=False: launched on the current stream, join does nothing.
        beside=True: launched on a side stream once the current stream's work so far is done, concurrent
        with what the caller enqueues next; join() makes the current stream wait for the fold. Outputs and
        state are allocated on the current stream before the fork and kept alive until the join."""
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=a.device)
        if plan.kernel is None:
            return out.zero_(), no_join
        args = (a.data_ptr(), *plan.a_strides, b.data_ptr(), *plan.b_strides, plan.r1, plan.g, rstd.data_ptr(),
                out.data_ptr(), plan.rows_per_group, plan.n, plan.groups)
        state = None
        if plan.state_ints:  # fold_chain: its item counter and hand-over words, zeroed; rows aligned
            state = torch.zeros(plan.state_ints, dtype=torch.int32, device=a.device)
            args = (*args, state.data_ptr(), np.int32(1))
        dev = _device_index(a)
        if not beside:
            plan.kernel.launch(current_stream(dev), plan.grid, plan.block, plan.shmem, *args)
            return out, no_join
        here, side = torch.cuda.current_stream(dev), self._side_stream(dev)
        side.wait_stream(here)
        plan.kernel.launch(side.cuda_stream, plan.grid, plan.block, plan.shmem, *args)

        def join(keep: tuple = (out, state, a, b, rstd)) -> None:
            here.wait_stream(side)

        return out, join

    def fold(self, a: torch.Tensor, alay: RowLayout, b: torch.Tensor, blay: RowLayout, rstd: torch.Tensor,
             what: int, groups: int, ring: bool = True, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(groups, N) in out_dtype: group h folds logical rows t * groups + h in fp32 (see fold.cu)."""
        return self.launch_fold(a, alay, b, blay, rstd, what, groups, ring, out_dtype)[0]

    @on_tensor_device
    def launch_fold(self, a: torch.Tensor, alay: RowLayout, b: torch.Tensor, blay: RowLayout, rstd: torch.Tensor,
                    what: int, groups: int, ring: bool = True, out_dtype: torch.dtype = torch.float32,
                    beside: bool = False, sms: int = 0) -> tuple[Tensor, Callable[[], None]]:
        """fold's result and a join (see _launch_fold): with beside=True the fold runs on a side stream, beside
        the kernels the caller enqueues before calling join() (which must not write a, b or rstd). sms: the SMs
        its grid is sized for (0: all; see shared_fold_sms)."""
        dev = _device_index(a)
        key = (dev, alay, a.dtype, a.data_ptr() % 16 == 0, blay, b.dtype, b.data_ptr() % 16 == 0, what, groups,
               ring, self.fold_tuning, out_dtype, sms)
        plan = self._fold_plans.get(key)
        if plan is None:
            ring = ring and _ring_ok(a, alay) and (what == 0 or _ring_ok(b, blay))
            simple = _simple_rows(alay) and (what == 0 or _simple_rows(blay))
            plan = remember(self._fold_plans, key,
                            self._fold_plan(dev, alay, a.dtype, blay, b.dtype, what, groups, ring, simple, out_dtype,
                                            sms))
        return self._launch_fold(plan, a, b, rstd, beside)

    def shared_fold_sms(self, n: int, out_of_place: bool) -> int:
        """The SMs a strict dW fold of n columns is sized for beside a dx pass whose persistent grid takes the
        rest (0: no share): only out of place (a dx_out of the same signature may or may not overlap dy from call
        to call) where the fold runs beside; fold_sms where it is set, else _SHARED_FOLD_SMS for the default fold."""
        if not out_of_place or not self.fold_beside(None):
            return 0
        if self.fold_sms is not None:
            return self.fold_sms
        return 0 if self.fold_tuning else _SHARED_FOLD_SMS.get(next_pow2(n), 0)

    def fold_beside(self, dx: Tensor | None, *reads: Tensor) -> bool:
        """Whether a strict dW fold reading `reads` runs beside a dx pass writing dx (None: a buffer of the pass's
        own): never where dx shares storage with them (an in-place backward, dx over dy, folds first), else as
        fold_beside_dx says (off by default)."""
        if dx is not None:
            out = dx.untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() == out for t in reads):
                return False
        return self.fold_beside_dx

    # ---- rms_norm forward ----------------------------------------------------------------------------
    @on_tensor_device
    def rms_norm_fwd(self, x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec,
                     need_rstd: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(y, rstd, residual_out), as the Backend protocol says; see kernels/rms_norm.cu. The launch is
        planned once per input signature; a call allocates the outputs and launches. need_rstd False: rstd is
        neither allocated nor stored (None; a kernel compiled without the store)."""
        key = (x.get_device(), signature(x, weight, residual), spec, self.fwd_tuning, need_rstd)
        plan = self._fwd_plans.get(key)
        if plan is None:
            plan = remember(self._fwd_plans, key, self._plan_fwd(x, weight, residual, spec, need_rstd))
        y, rstd, z = forward_outputs(x, residual, plan.y_dtype, need_rstd)
        if plan.kernel is None:
            return y, rstd, z
        xk, weight, rk = plan.views.inputs(x, weight, residual)
        plan.kernel.launch(current_stream(_device_index(x)), (plan.grid, 1, 1), plan.threads, 0,
                           xk.data_ptr(), *plan.views.lay.args(), rk.data_ptr(), *plan.views.rlay.args(),
                           (z if z is not None else y).data_ptr(), (weight if weight is not None else xk).data_ptr(),
                           plan.wsg, y.data_ptr(), rstd.data_ptr() if rstd is not None else 0, *plan.tail)
        return y, rstd, z

    def _plan_fwd(self, x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec,
                  need_rstd: bool = True) -> _FwdPlan:
        v = forward_views(x, weight, residual, spec.out_dtype)
        views = ForwardPlan.of(v, x, weight, residual)
        if views.lay.rows == 0:
            return _FwdPlan(views, spec.out_dtype, None, 0, 0, 0, ())
        n = v.lay.n
        wsg = v.weight.stride(0) if v.per_head else 0
        aligned = _aligned16((v.x, v.lay.args()), (v.res, v.rlay.args()), (v.y, (n,)),
                             *(((v.z, (n,)),) if v.z is not None else ()),
                             *(((v.weight, (wsg,)),) if v.weight is not None else ()))
        fl = norm_launch(n, x.dtype, residual.dtype if residual is not None else None,
                         v.weight.dtype if v.weight is not None else None, spec.out_dtype, spec.mode, v.per_head,
                         self.fwd_tuning or forward_tuning(n, v.lay.rows, need_rstd), aligned, need_rstd)
        dev = _device_index(x)
        kernel = self._norm_kernel(dev, "rms_fwd", fl)
        groups = -(-v.lay.rows // fl.rows_per_block)
        grid = self._grid(dev, kernel, fl.threads, groups, persistent=fl.persistent)
        tail = (v.lay.rows, np.int32(n), v.lay.r1, v.lay.g, np.float32(spec.eps), np.float32(spec.offset),
                np.int32(aligned))
        return _FwdPlan(views, spec.out_dtype, kernel, grid, fl.threads, wsg, tail)

    # ---- rms_norm backward ---------------------------------------------------------------------------
    @on_tensor_device
    def rms_norm_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, rstd: Tensor, dres: Tensor | None,
                     spec: NormSpec, dw_mode: str, need_dw: bool, dx_out: Tensor | None
                     ) -> tuple[Tensor, Tensor | None]:
        """(dz, dw), as the Backend protocol says; see kernels/rms_norm.cu (BACKWARD). Planned once per
        input signature, like the forward."""
        # fold_beside_dx: whether the plan shares the SMs out (shared_fold_sms)
        key = (z.get_device(), signature(dy, z, weight, rstd, dres, dx_out), spec.mode, spec.offset, dw_mode, need_dw,
               self.bwd_tuning, self.fold_tuning, self.fold_sms, self.fold_beside_dx, self.onepass_strict,
               self.onepass_tuning, self.dependent_sum)
        plan = self._bwd_plans.get(key)
        if plan is None:
            plan = remember(self._bwd_plans, key,
                            self._plan_bwd(dy, z, weight, rstd, dres, spec, dw_mode, need_dw, dx_out))
        dx = dx_out if dx_out is not None else torch.empty_like(z, memory_format=torch.contiguous_format)
        if plan.rows == 0:
            return dx, (torch.zeros(weight.shape, dtype=weight.dtype, device=z.device) if need_dw else None)
        dyk, zk, w, rstd, dresk, dxk = plan.views.inputs(dy, z, weight, rstd, dres, dx)
        lays = plan.views
        if plan.onepass is not None:
            dw = self._run_onepass(plan, dyk, zk, w, rstd, dxk, weight)
            if dxk is not dx:
                dx.copy_(dxk)
            return dx, dw
        dw, join = None, no_join
        if plan.strict is not None:  # strict (or per-head): beside the dx pass, or first where dx overwrites dy
            dw, join = self._launch_fold(plan.strict, dyk, zk, rstd, self.fold_beside(dx, dy, z, rstd))
            dw = dw.reshape(weight.shape)
        # the partial rows (an unused pointer without them)
        part = (torch.empty((plan.partial_rows, zk.shape[-1]), dtype=torch.float32, device=z.device)
                if plan.partial_rows else rstd)
        plan.kernel.launch(current_stream(_device_index(z)), (plan.grid, 1, 1), plan.threads, plan.shmem,
                           dyk.data_ptr(), *lays.dlay.args(), zk.data_ptr(), *lays.lay.args(),
                           (w if w is not None else zk).data_ptr(), plan.wsg, rstd.data_ptr(), dresk.data_ptr(),
                           *lays.elay.args(), dxk.data_ptr(), *lays.xlay.args(), part.data_ptr(), *plan.tail)
        join()
        if plan.partial_rows:  # right after the backward: launched as its dependent (dependent_sum)
            dw = self._sum_partials(plan.partial_sum, part)
        if dxk is not dx:
            dx.copy_(dxk)
        return dx, dw

    def _plan_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, rstd: Tensor, dres: Tensor | None,
                  spec: NormSpec, dw_mode: str, need_dw: bool, dx_out: Tensor | None) -> _BwdPlan:
        v = backward_views(dy, z, weight, rstd, dres, dx_out)
        views = BackwardPlan.of(v, dy, z, weight, rstd, dres)
        n, rows = v.lay.n, v.lay.rows
        w_dtype = v.weight.dtype if v.weight is not None else None
        partials = need_dw and dw_mode == "fast" and not v.per_head
        tuning = self.bwd_tuning or tuning_for(BWD_TABLE, n, rows)
        wsg = v.weight.stride(0) if v.per_head else 0
        aligned = _aligned16((v.z, v.lay.args()), (v.dy, v.dlay.args()), (v.dres, v.elay.args()),
                             (v.dx_kernel, v.xlay.args()), *(((v.weight, (wsg,)),) if v.weight is not None else ()))
        fl = norm_bwd_launch(n, z.dtype, dy.dtype, w_dtype, spec.mode, v.per_head, dres is not None, partials, tuning,
                             aligned)
        # fp32 partials in shared memory (rows not held, or the tuning says so); where they do not fit,
        # the strict fold (deterministic too) serves dw="fast"
        in_smem = partials and (not fl.defines["HOLD"] or fl.defines["DW_SMEM"] or fl.defines.get("DW_COMBINE"))
        shmem = fl.rows_per_block * n * 4 if in_smem else 0
        if shmem > _SMEM_LIMIT:
            partials, shmem = False, 0
            fl = norm_bwd_launch(n, z.dtype, dy.dtype, w_dtype, spec.mode, v.per_head, dres is not None, False, tuning,
                                 aligned)
        shmem += staged_smem(fl.defines, z.dtype, dy.dtype)
        if rows == 0:
            return _BwdPlan(views, 0, None, None, 0, 0, 0, 0, (), 0, ())
        dev = _device_index(z)
        tail = (rows, np.int32(n), v.lay.r1, v.lay.g, np.float32(spec.offset))
        onepass = self._onepass_plan(dev, v, spec, dw_mode, need_dw, dres is not None)
        if onepass is not None:  # the whole backward in one kernel: no fold or dx kernel to plan
            return _BwdPlan(views, rows, None, None, 0, 0, 0, 0, tail, 0, (), onepass)
        strict, shared_sms = None, 0
        if need_dw and not partials:
            groups = weight.shape[0] if weight.dim() == 2 else 1
            ring = _ring_ok(v.dy, v.dlay) and _ring_ok(v.z, v.lay)
            shared_sms = self.shared_fold_sms(n, dx_out is None)
            strict = self._fold_plan(dev, v.dlay, v.dy.dtype, v.lay, v.z.dtype, MODE_CODES[spec.mode] + 1, groups, ring,
                                     _simple_rows(v.dlay) and _simple_rows(v.lay), weight.dtype, shared_sms)
        kernel = self._norm_kernel(dev, "rms_bwd", fl)
        if shmem:  # opted in whatever the size: 48 KB of dynamic shared memory plus the static scratch exceed 48 KB
            kernel.allow_dynamic_shared(shmem)
        groups = -(-rows // fl.rows_per_block)
        grid = self._grid(dev, kernel, fl.threads, groups, fl.partial_blocks_per_sm if partials else 0, shmem,
                          persistent=fl.persistent or partials, sms_left=shared_sms)  # one partial row per block
        part_rows = dw_partial_rows(fl.defines, grid) if partials else 0
        return _BwdPlan(views, rows, strict, kernel, grid, fl.threads, shmem, wsg, (*tail, np.int32(aligned)),
                        part_rows, self._partial_sum_plan(dev, part_rows, n, weight.dtype) if partials else ())

    def _onepass_plan(self, dev: int, v, spec: NormSpec, dw_mode: str, need_dw: bool, has_dres: bool
                      ) -> _OnepassPlan | None:
        """onepass.cu for this backward where it applies: opted in, dw="strict" needed, a shared weight, no
        residual gradient, rows at one stride and 16-byte aligned, and the grid co-resident."""
        if not (self.onepass_strict and need_dw and dw_mode == "strict" and not v.per_head and not has_dres):
            return None
        if not all(_simple_rows(lay) for lay in (v.dlay, v.lay, v.xlay)):
            return None
        if not _aligned16((v.dy, (v.dlay.s0,)), (v.z, (v.lay.s0,)), (v.dx_kernel, (v.xlay.s0,))):
            return None
        props = torch.cuda.get_device_properties(dev)
        fl = onepass_launch(v.lay.n, v.dy.dtype, v.z.dtype, v.weight.dtype if v.weight is not None else None,
                            spec.mode, props.multi_processor_count, props.shared_memory_per_block_optin,
                            self.onepass_tuning)
        if fl is None:
            return None
        kernel = self._kernels().get(dev, "onepass.cu", "strict_bwd_onepass", fl.defines)
        kernel.allow_dynamic_shared(fl.shmem)
        resident = kernel.kernel.occupancy.max_active_blocks_per_multiprocessor(fl.threads, fl.shmem)
        if resident * props.multi_processor_count < fl.grid:
            return None
        return _OnepassPlan(kernel, fl, -(-v.lay.rows // fl.defines["ROWS"]), fl.defines["TILES"] * fl.defines["ROWS"])

    def _run_onepass(self, plan: _BwdPlan, dy: Tensor, z: Tensor, w: Tensor | None, rstd: Tensor, dx: Tensor,
                     weight: Tensor) -> Tensor:
        op = plan.onepass
        fl = op.launch
        dev = z.device
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev)
        partials = torch.empty(op.slot_rows * fl.defines["GROUPS"], dtype=torch.float32, device=dev)
        cvals = torch.empty(op.slot_rows, dtype=torch.float32, device=dev)
        arrivals = torch.zeros(2 * op.blocks, dtype=torch.int32, device=dev)  # arrive1, then arrive2
        rows, n, offset = plan.tail[0], plan.tail[1], plan.tail[4]
        lays = plan.views
        op.kernel.launch(current_stream(_device_index(z)), (fl.grid, 1, 1), fl.threads, fl.shmem,
                         dy.data_ptr(), lays.dlay.s0, z.data_ptr(), lays.lay.s0, (w if w is not None else z).data_ptr(),
                         rstd.data_ptr(), dx.data_ptr(), lays.xlay.s0, dw.data_ptr(), partials.data_ptr(),
                         cvals.data_ptr(), arrivals.data_ptr(), arrivals.data_ptr() + 4 * op.blocks, rows, n, offset,
                         cooperative=True)
        return dw

    def strict_dw(self, dy: Tensor, dlay: RowLayout, z: Tensor, zlay: RowLayout, rstd: Tensor, mode: str,
                  weight: Tensor, beside: bool = False, sms: int = 0) -> tuple[Tensor, Callable[[], None]]:
        """(dW, join): dW in weight's dtype and shape as the ascending left fold of the rows' contributions
        (per head for (H, N) weights), recomputed from dy, z and rstd by the fold kernel; zeros for no rows.
        beside: on a side stream until join() (see launch_fold); sms: the SMs its grid is sized for (0: all)."""
        groups = weight.shape[0] if weight.dim() == 2 else 1
        dw, join = self.launch_fold(dy, dlay, z, zlay, rstd, MODE_CODES[mode] + 1, groups, out_dtype=weight.dtype,
                                    beside=beside, sms=sms)
        return dw.reshape(weight.shape), join

    # ---- fixed-order sums of fp32 partial rows -------------------------------------------------------
    def _partial_sum_plan(self, dev: int, rows: int, n: int, out_dtype: torch.dtype) -> tuple[_SumPlan, ...]:
        """partial_sum.cu's launches summing a dense (rows, n) fp32 buffer (16-byte aligned) into out_dtype: the
        rows in `segments` (partial_sum_shape), then, with more than one, the segment sums."""
        shape = partial_sum_shape(rows, n, torch.cuda.get_device_properties(dev).multi_processor_count)
        f32 = torch.float32
        plans = (self._sum_plan(dev, shape, shape.segments, shape.seg_rows, f32 if shape.segments > 1 else out_dtype),)
        if shape.segments > 1:
            plans += (self._sum_plan(dev, shape, 1, shape.segments, out_dtype),)
        return plans

    def _sum_plan(self, dev: int, shape: PartialSumShape, segments: int, seg_rows: int, out_dtype: torch.dtype
                  ) -> _SumPlan:
        defines = {"SUM_COLS": _SUM_COLS, "SUM_THREADS": _SUM_THREADS, "VEC": shape.vec}
        if out_dtype != torch.float32:
            defines["OUT_CODE"] = DTYPE_CODES[out_dtype]
        kernel = self._kernels().get(dev, "partial_sum.cu", "partial_sum", defines)
        dependent = self.dependent_sum and torch.cuda.get_device_properties(dev).major >= 9
        return _SumPlan(kernel, (shape.col_blocks, segments, 1), seg_rows, out_dtype, dependent)

    def _sum_partials(self, plans: tuple[_SumPlan, ...], part: Tensor) -> Tensor:
        n = part.shape[-1]
        stream = current_stream(_device_index(part))
        for plan in plans:
            out = torch.empty((plan.grid[1], n), dtype=plan.out_dtype, device=part.device)
            plan.kernel.launch(stream, plan.grid, _SUM_THREADS, 0, part.data_ptr(), part.shape[0], np.int32(n),
                               plan.seg_rows, out.data_ptr(), dependent=plan.dependent)
            part = out
        return part.reshape(n)

    @on_tensor_device
    def sum_rows(self, part: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
        """Sum over the rows of (R, N) fp32 in the fixed order of partial_sum.cu (the fast dW's partial rows),
        rounded once to out_dtype; a copy first where the rows are not dense and 16-byte aligned."""
        rows, n = part.shape
        if rows == 0:
            return torch.zeros(n, dtype=out_dtype, device=part.device)
        if not part.is_contiguous() or part.data_ptr() % 16:
            part = part.clone(memory_format=torch.contiguous_format)
        dev = _device_index(part)
        key = ("partial_sum", dev, rows, n, out_dtype, self.dependent_sum)
        plans = self._fold_plans.get(key)
        if plans is None:
            plans = remember(self._fold_plans, key, self._partial_sum_plan(dev, rows, n, out_dtype))
        return self._sum_partials(plans, part)

    @on_tensor_device
    def left_fold(self, rows: torch.Tensor, ring: bool = True) -> torch.Tensor:
        if rows.numel() == 0:
            return torch.zeros(rows.shape[1:], dtype=torch.float32, device=rows.device)
        flat = rows.reshape(rows.shape[0], -1)
        ak, lay = row_layout(flat)
        return self.fold(ak, lay, ak, lay, ak, 0, 1, ring).reshape(rows.shape[1:])
