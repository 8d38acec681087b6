"""The cute backend's hold choices (backends/cute/kernels.py HOLD) timed at the PERF.md shapes.

Variants: rows read twice (no hold), rows held between the passes, and for the backward the weight held too or the
next row prefetched into registers (where rows are held), also with rows of up to 512 threads held; the defaults
(K.HOLD) without the trim of pieces wholly past N (K.TRIM), and with the fast dW's partials in the backward kernel only
up to 16 a thread (K.PARTIALS_MAX_VALUES; past it the strict fold serves dw="fast": rows of P <= 8192, the rule
before run 17); for the forward, rows past 256 threads' hold read twice (HOLD["forward_trimmed"] = 0, the rule before
run 18), the weight loaded with the row at every row count or at none (K.FORWARD_WEIGHT_FIRST_ROWS), and rows of
4096 held by 64 threads, 64 lanes each, with or without it, or by 256 threads, 16 lanes each (the Triton forward's
shape from 2048 rows), and rows of 128 held by 16 or 8 threads, 8 or 16 lanes each
(K.FORWARD_VALUES), the forward at the CUDA table's unbounded entry at every row count (K.FORWARD_ROW_BOUNDS empty,
the rule up to run 41), rows of 128 at the few-rows entry's shape at every row count (Quack's), and the held
forward's lanes kept in fp32 between the passes (HOLD["forward_raw"] off, the rule before it; with 64 lanes too),
and x staged in shared memory by cp.async with the weight beside it (HOLD["forward_staged"]: Quack's forward) at every
padded length up to 8192 and row count, or at none.
SWEEP_BLOCKS=2,4 adds the backward of each variant with its persistent grid at that many blocks an SM
(K.BACKWARD_BLOCKS_PER_SM; fewer blocks write fewer fp32 dW partial rows). SWEEP_VARIANTS="hold,read twice" limits
the variants.
Every result is checked bitwise against the torch backend (y and rstd; dx, and the fast dW against the same
variant's second call). Kernel-only time as in strictnorm.bench (L2 flushed, profiler); the fast dW includes
its partial-row sum. Run on the GPU machine (nvidia-cutlass-dsl installed):
    python3 bench/sweep_cute.py [out.json]
"""

from __future__ import annotations

import json
import os
import sys

import torch
from sweep_cuda import Case, Sweep, measure, shapes_from_env

from strictnorm.backends.cuda.backend import FWD_TABLE
from strictnorm.backends.cute import kernels as K
from strictnorm.bench import NORM_SHAPES, Timer
from strictnorm.reference import next_pow2

DEFAULT = dict(K.HOLD)
_HELD = {"forward": True, "backward": True, "backward_weight": False, "backward_prefetch": False, "threads": 256,
         "prefetch_threads": 256}
VARIANTS = {"read twice": {**_HELD, "forward": False, "backward": False},
            "hold": _HELD,
            "hold + weight": {**_HELD, "backward_weight": True},
            "hold + prefetch": {**_HELD, "backward_prefetch": True},
            "hold 512 + prefetch": {**_HELD, "backward_prefetch": True, "prefetch_threads": 512},
            "default": DEFAULT,
            "no trim": {**DEFAULT, "trim": False},
            "fold past 8192": {**DEFAULT, "partials_max_values": 16},
            "forward read twice": {**DEFAULT, "forward_trimmed": 0},
            "weight first": {**DEFAULT, "weight_first_rows": {1 << k: 1 << 40 for k in range(17)}},
            "weight after the sum": {**DEFAULT, "weight_first_rows": {}},
            "forward 64 a thread": {**DEFAULT, "forward_values": {4096: 64}},
            "forward 64 a thread + weight first": {**DEFAULT, "forward_values": {4096: 64},
                                                  "weight_first_rows": {1 << k: 1 << 40 for k in range(17)}},
            "forward held in fp32": {**DEFAULT, "forward_raw": 0},
            "forward 64 a thread held in fp32": {**DEFAULT, "forward_values": {4096: 64}, "forward_raw": 0},
            "forward 16 a thread at 4096": {**DEFAULT, "forward_values": {4096: 16}},
            # x staged in shared memory at every padded length up to K._STAGED_MAX_P and row count (the weight beside
            # it), or at none
            "forward staged": {**DEFAULT,
                               "forward_staged": {1 << k: 1 for k in range(K._STAGED_MAX_P.bit_length())}},
            "forward unstaged": {**DEFAULT, "forward_staged": {}},
            "forward 8 a thread at 128": {**DEFAULT, "forward_values": {128: 8}},
            "forward 16 a thread at 128": {**DEFAULT, "forward_values": {128: 16}},
            "forward unbounded": {**DEFAULT, "forward_row_bounds": frozenset(), "forward_few_rows": {},
                                  "weight_first_rows": {p: r for p, r in K.FORWARD_WEIGHT_FIRST_ROWS.items()
                                                        if p != 128}},
            # Quack's forward shape at N = 128 (16 threads a row, 8 rows a block) at every row count: the CUDA
            # table's entry for up to 4096 rows made its P = 128 entry for any row count, the weight with the row
            "forward few-rows shape at 128": {**DEFAULT, "fwd_table": {128: ((None, FWD_TABLE[128][0][1]),)},
                                              "weight_first_rows": {**K.FORWARD_WEIGHT_FIRST_ROWS, 128: 1 << 40}},
            # K.FORWARD_FEW_ROWS at P = 128: that shape (and the weight first) up to 4096 rows (the table entry's own
            # bound: the rule before), or up to 65536
            "forward few rows to 4096 at 128": {**DEFAULT, "forward_few_rows": {},
                                                "weight_first_rows": {**K.FORWARD_WEIGHT_FIRST_ROWS, 128: 4096}},
            "forward few rows to 16384 at 128": {**DEFAULT, "forward_few_rows": {128: 16384},
                                                 "weight_first_rows": {**K.FORWARD_WEIGHT_FIRST_ROWS, 128: 16384}},
            "forward few rows to 65536 at 128": {**DEFAULT, "forward_few_rows": {128: 65536},
                                                 "weight_first_rows": {**K.FORWARD_WEIGHT_FIRST_ROWS, 128: 65536}}}
FORWARD_ONLY = ("forward read twice", "weight first", "weight after the sum", "forward 64 a thread",
                "forward held in fp32", "forward 64 a thread held in fp32", "forward 16 a thread at 4096",
                "forward staged", "forward unstaged",
                "forward 64 a thread + weight first", "forward 8 a thread at 128", "forward 16 a thread at 128",
                "forward unbounded", "forward few-rows shape at 128", "forward few rows to 4096 at 128",
                "forward few rows to 16384 at 128", "forward few rows to 65536 at 128")
WEIGHT_FIRST_ROWS = K.FORWARD_WEIGHT_FIRST_ROWS
FORWARD_VALUES = K.FORWARD_VALUES
FORWARD_ROW_BOUNDS = K.FORWARD_ROW_BOUNDS
FORWARD_FEW_ROWS = K.FORWARD_FEW_ROWS
PARTIALS_MAX_VALUES = K.PARTIALS_MAX_VALUES
SHAPES = shapes_from_env(NORM_SHAPES)
BLOCKS = [0] + [int(v) for v in os.environ.get("SWEEP_BLOCKS", "").split(",") if v]
TABLE_FWD = dict(FWD_TABLE)
TABLE_BLOCKS = dict(K.BACKWARD_BLOCKS_PER_SM)  # 0 in a row's label: what 2048 threads an SM allow, not the table's


def use(variant: dict) -> None:
    variant = dict(variant)
    K.TRIM = variant.pop("trim", True)
    K.PARTIALS_MAX_VALUES = variant.pop("partials_max_values", PARTIALS_MAX_VALUES)
    K.FORWARD_WEIGHT_FIRST_ROWS = variant.pop("weight_first_rows", WEIGHT_FIRST_ROWS)
    K.FORWARD_VALUES = variant.pop("forward_values", FORWARD_VALUES)
    K.FORWARD_ROW_BOUNDS = variant.pop("forward_row_bounds", FORWARD_ROW_BOUNDS)
    K.FORWARD_FEW_ROWS = variant.pop("forward_few_rows", FORWARD_FEW_ROWS)
    FWD_TABLE.clear()  # the CUDA forward table the cute forward's shapes come from (only cute is timed here)
    FWD_TABLE.update({**TABLE_FWD, **variant.pop("fwd_table", {})})
    K.HOLD.update(variant)
    for cached in (K.tuned_shape, K.compile_forward, K.compile_backward):
        cached.cache_clear()


def _sweep_shape(timer: Timer, cute, ref, spec, m: int, n: int, ceiling: float) -> list[dict]:
    case = Case.make(ref, timer.device, m, n, spec)
    rows = []
    chosen = os.environ.get("SWEEP_VARIANTS")
    unknown = set(chosen.split(",")) - set(VARIANTS) if chosen else set()
    if unknown:  # a name with a comma in it, or a typo, would otherwise be skipped without a word
        raise SystemExit(f"SWEEP_VARIANTS: no variant named {sorted(unknown)}; the variants: {list(VARIANTS)}")
    for name, variant in VARIANTS.items():
        if chosen and name not in chosen.split(","):
            continue
        use(variant)
        cute._fwd_plans.clear()  # the backend's plans hold the kernels the last variant's choices compiled
        cute._bwd_plans.clear()
        for direction, blocks in [("fwd", 0)] + [("bwd", b) for b in BLOCKS]:
            if direction == "fwd" and name in ("hold + weight", "hold + prefetch", "fold past 8192"):
                continue  # the forward's kernel is the "hold" (or "default") one
            if direction == "bwd" and name in FORWARD_ONLY:
                continue
            K.BACKWARD_BLOCKS_PER_SM = {**TABLE_BLOCKS, next_pow2(n): blocks}
            label = f"{name}, {blocks} blocks an SM" if blocks else name
            row_bound = K.forward_row_bound(n, m) if direction == "fwd" else None
            row = {"M": m, "N": n, "direction": direction, "variant": label,
                   "shape": str(K.tuned_shape(n, direction == "bwd", row_bound=row_bound))}
            row.update(measure(timer, cute, case, direction, ceiling))
            rows.append(row)
            print(json.dumps(row), flush=True)
    K.BACKWARD_BLOCKS_PER_SM = TABLE_BLOCKS
    return rows


def main() -> None:
    sw = Sweep.make("cute", iters=10)
    ceiling = sw.ceiling
    rows = []
    for m, n in SHAPES:
        rows += _sweep_shape(sw.timer, sw.backend, sw.ref, sw.spec, m, n, ceiling)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": ceiling, "rows": rows}, f, indent=1)
    print(f"\ncopy ceiling {ceiling:.0f} GB/s; all rows bitwise: {all(r.get('bitwise') for r in rows)}")
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"{'shape':>14} {'dir':>4} " + " ".join(f"{v[:22]:>22}" for v in names))
    for m, n in SHAPES:
        for direction in ("fwd", "bwd"):
            cells = []
            for name in names:
                r = next((r for r in rows if (r["M"], r["N"], r["direction"], r["variant"]) == (m, n, direction, name)),
                         None)
                cells.append(f"{r['us']:22.1f}" if r and "us" in r else f"{'-':>22}")
            print(f"{m:>7d}x{n:<6d} {direction:>4} " + " ".join(cells))


if __name__ == "__main__":
    main()
