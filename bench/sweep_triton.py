"""Tuning sweep for the Triton row kernels: rows per program and warps, forward and backward apart.

Each configuration replaces the backend's tile choice (backend._row_tile: the column tiles stay as the backend
splits them; ROWS rows a program and num_warps change) and clears its cached plans. Every result is checked
against the torch reference's bits (y and rstd; dx, and the fast dW the same twice; sweep_cuda.measure), and
timed kernel-only as in strictnorm.bench. SWEEP_SHAPES=MxN,MxN limits the shapes (compiling is most of the
time: about 2 s per configuration and direction on an H200 machine). Run on the GPU machine:
    python3 bench/sweep_triton.py [out.json]
(On a machine without a GPU, under TRITON_INTERPRET=1, it runs on the CPU: a smoke test, not a measurement.)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from sweep_cuda import Case, measure

from strictnorm.backends.registry import get_backend
from strictnorm.backends.triton import backend as tb
from strictnorm.bench import NORM_SHAPES, Timer, copy_ceiling_gbps
from strictnorm.contract import make_spec
from strictnorm.reference import next_pow2

SHAPES = NORM_SHAPES
if os.environ.get("SWEEP_SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["SWEEP_SHAPES"].split(",")]
MAX_TILE = 16384  # lanes a program (rows x padded row) beyond one row
MAX_LANES_PER_THREAD = 64


def configs(n: int) -> list[tuple[int, int]]:
    """(rows a program, warps): up to MAX_TILE lanes a program (one row at least), every thread at least one
    lane and at most MAX_LANES_PER_THREAD."""
    p = next_pow2(n)
    out = []
    for rows in (1, 2, 4, 8, 16, 32):
        if rows > 1 and rows * p > MAX_TILE:
            break
        lanes = rows * p
        out += [(rows, w) for w in (1, 2, 4, 8, 16, 32) if 32 * w <= lanes and lanes <= 32 * w * MAX_LANES_PER_THREAD]
    return out


ORIGINAL_ROW_TILE = tb._row_tile


def use(rows: int | None, warps: int | None, backend) -> None:
    """The backend's tiles with `rows` rows a program and `warps` warps (None: the backend's own choice); its
    cached plans cleared (a plan keeps the tile it was made with)."""

    def row_tile(n: int, split: bool) -> tb.RowTile:
        t = ORIGINAL_ROW_TILE(n, split)
        return tb.RowTile(rows, t.pa, t.t, warps)

    tb._row_tile = ORIGINAL_ROW_TILE if warps is None else row_tile
    backend._fwd_plans.clear()
    backend._bwd_plans.clear()


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(dev, iters=int(os.environ.get("SWEEP_ITERS", "9")))
    ceiling = copy_ceiling_gbps(dev)
    triton, ref = get_backend("triton"), get_backend("torch")
    spec = make_spec(torch.bfloat16, 1e-6, 0.0, "llama", torch.bfloat16)
    results = []
    for m, n in SHAPES:
        case = Case.make(ref, dev, m, n, spec)
        for rows, warps in [(None, None)] + configs(n):
            use(rows, warps, triton)
            for direction in ("fwd", "bwd"):
                tile = tb._row_tile(n, tb.SPLIT_TILES[direction])
                row = dict(M=m, N=n, direction=direction, default=warps is None, rows=tile.rows,
                           num_warps=tile.num_warps)
                row.update(measure(timer, triton, case, direction, ceiling))
                results.append(row)
                print(json.dumps(row), flush=True)
        use(None, None, triton)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": ceiling, "rows": results}, f, indent=1)
    print(f"\nbest per shape (all rows bitwise: {all(r.get('bitwise') for r in results)}): us (rows, warps); "
          "the backend's own choice")
    for m, n in SHAPES:
        line = f"{m:>7d}x{n:<6d}"
        for direction in ("fwd", "bwd"):
            ok = [r for r in results if (r["M"], r["N"], r["direction"]) == (m, n, direction) and "us" in r]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                own = next((r for r in ok if r["default"]), None)
                line += (f"  {direction} {b['us']:7.1f} ({b['rows']}, {b['num_warps']})"
                         f" own {own['us'] if own else float('nan'):7.1f}")
        print(line)


if __name__ == "__main__":
    main()
