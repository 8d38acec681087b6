"""Tuning sweep for the Triton row kernels: rows per program and warps, forward and backward apart.

Each configuration replaces the backend's tile choice for the shape's padded length (backend.TILE_TABLE: rows a
program, warps, and whether rows well below their padded length take two column tiles) and clears its cached
plans. SWEEP_WFIRST=1 tries each configuration also with the forward's weight loaded before the row sum;
SWEEP_CHUNKS=1024,2048 adds rows in column chunks of those lanes (rows longer than a chunk; one or two rows a
program, SWEEP_PROGRAMS (2,4) programs an SM in the backward, SWEEP_WARPS (1,2,4,8,16) warps, the chunk loops' loads
in SWEEP_STAGES (1) shared-memory stages); SWEEP_DIRECTIONS=fwd (or bwd, or bwd_dx: dx alone, its "bwd_dx" entry)
measures one direction; fwd_nr is the forward as an inference call asks for it (need_rstd=False), timed and
checked beside the others but not tuned apart (it takes the forward's table). SWEEP_WARP_BLOCKS=1 tries each
configuration (held whole, in chunks or in two column tiles) also with the row in warp blocks
(TileChoice.warp_blocks; kernels.py's notes; the backward's only where its rows are held whole);
SWEEP_MAX_REGISTERS=64,... also with ptxas's registers a thread bounded (TileChoice.max_registers); SWEEP_W_ROWS=1
also with the forward's shared weight loaded the other way (TileChoice.w_rows: as one row, or in the rows' layout);
SWEEP_DROP_RSTD=1 also with an inference call's rstd store the other way (TileChoice.drop_rstd; timed by fwd_nr);
SWEEP_REWIDEN=1 also with bf16 rows held as loaded across the forward's sum (TileChoice.rewiden); SWEEP_DENSE=1 also
with the forward's tiles without masks where the shape's rows allow (TileChoice.dense); SWEEP_BASE='{"rcp_rn": true}'
takes rstd's reciprocal by rcp_rn (TileChoice.rcp_rn) in every configuration.
SWEEP_BASE='{"w_first": true, ...}' sets those TileChoice fields in every configuration before the variants toggle
them.
SWEEP_PIPELINES=1 sweeps instead, around the backward's own choice for each shape (the forward's with
SWEEP_DIRECTIONS=fwd), its warps times SWEEP_WARP_FACTORS (1,2) with its pipelining: the next block prefetched into
registers, the loop's loads in 2 or 3 shared-memory stages, SWEEP_PROGRAMS (2,4) programs an SM, its rows a program
times SWEEP_ROW_FACTORS (1). Every result is
checked against the torch reference's bits (y and rstd; dx, and the fast dW the same twice; sweep_cuda.measure), and
timed kernel-only as in strictnorm.bench.
SWEEP_MAX_TILE (16384) bounds the lanes of a program of several rows; SWEEP_TILE_ROWS (1,2,4,8,16,32) and
SWEEP_TILE_WARPS (1,2,4,8,16,32) list the rows a program and warps of the tiles held whole.
SWEEP_SHAPES=MxN,MxN limits the shapes (compiling is most of the time: about 2 s per configuration and direction on
an H200 machine). Run on the GPU machine:
    python3 bench/sweep_triton.py [out.json [tuning.json]]
(On a machine without a GPU, under TRITON_INTERPRET=1, it runs on the CPU: a smoke test, not a measurement.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
from sweep_cuda import Case, Sweep, measure, shapes_from_env

from strictnorm.backends.layout import row_layout
from strictnorm.backends.triton import backend as tb
from strictnorm.backends.tuning import for_rows
from strictnorm.bench import NORM_SHAPES
from strictnorm.reference import next_pow2

SHAPES = shapes_from_env(NORM_SHAPES)
DIRECTIONS = os.environ.get("SWEEP_DIRECTIONS", "fwd,bwd").split(",")
MAX_TILE = int(os.environ.get("SWEEP_MAX_TILE", "16384"))  # lanes a program (rows x padded row) beyond one row
MAX_LANES_PER_THREAD = 64


def configs(n: int, m: int) -> list[tb.TileChoice]:
    """With SWEEP_PIPELINES=1, pipeline_configs(n, m). Otherwise rows a program, warps and (where N <= 3/4 of its
    padded length) the column split: up to MAX_TILE lanes a program (one row at least), every thread at least one
    lane and at most MAX_LANES_PER_THREAD."""
    if os.environ.get("SWEEP_PIPELINES") == "1":
        return with_variants(pipeline_configs(n, m))
    out = []
    tile_rows = sorted(int(v) for v in os.environ.get("SWEEP_TILE_ROWS", "1,2,4,8,16,32").split(","))
    tile_warps = [int(v) for v in os.environ.get("SWEEP_TILE_WARPS", "1,2,4,8,16,32").split(",")]
    for split in sorted({False, tb.column_tiles(n, True) != tb.column_tiles(n, False)}):
        pa, t = tb.column_tiles(n, split)
        for rows in tile_rows:
            lanes = rows * (pa + t)
            if rows > 1 and lanes > MAX_TILE:
                break
            out += [tb.TileChoice(rows, w, split) for w in tile_warps
                    if 32 * w <= lanes <= 32 * w * MAX_LANES_PER_THREAD]
    if os.environ.get("SWEEP_WFIRST") == "1":  # each also with the forward's weight loaded before the sum
        out += [dataclasses.replace(c, w_first=True) for c in out]
    chunks = [int(v) for v in os.environ.get("SWEEP_CHUNKS", "").split(",") if v]
    stages = [int(v) for v in os.environ.get("SWEEP_STAGES", "1").split(",")]
    programs_per_sm = [int(v) for v in os.environ.get("SWEEP_PROGRAMS", "2,4").split(",")]
    warps = [int(v) for v in os.environ.get("SWEEP_WARPS", "1,2,4,8,16").split(",")]
    out += [tb.TileChoice(rows, w, chunk=c, programs_per_sm=programs, stages=st) for c in chunks if c < next_pow2(n)
            for rows in (1, 2) for w in warps if 32 * w <= rows * c <= 32 * w * MAX_LANES_PER_THREAD
            for programs in programs_per_sm for st in stages]
    return with_variants(out)


def with_variants(out: list[tb.TileChoice]) -> list[tb.TileChoice]:
    """out (with SWEEP_BASE's fields), and with SWEEP_WARP_BLOCKS=1 each of its choices also in warp blocks; with
    SWEEP_W_ROWS=1 each of those
    also with the forward's weight loaded the other way (TileChoice.w_rows); with SWEEP_DROP_RSTD=1 each of those also
    with an inference call's rstd store the other way (TileChoice.drop_rstd); with SWEEP_MAX_REGISTERS=64,... each of
    those also with ptxas's registers a thread bounded by each value (TileChoice.max_registers); with SWEEP_REWIDEN=1
    each of those also with the forward's bf16 rows held as loaded (TileChoice.rewiden)."""
    out = [dataclasses.replace(c, **json.loads(os.environ.get("SWEEP_BASE", "{}"))) for c in out]
    if os.environ.get("SWEEP_WARP_BLOCKS") == "1":
        out = out + [dataclasses.replace(c, warp_blocks=True) for c in out]
    if os.environ.get("SWEEP_W_ROWS") == "1":  # the forward's shared weight loaded in the rows' layout
        out = out + [dataclasses.replace(c, w_rows=not c.w_rows) for c in out]
    if os.environ.get("SWEEP_DROP_RSTD") == "1":  # an inference call's forward without rstd's store (fwd_nr)
        out = out + [dataclasses.replace(c, drop_rstd=not c.drop_rstd) for c in out]
    caps = [int(v) for v in os.environ.get("SWEEP_MAX_REGISTERS", "").split(",") if v]
    out = out + [dataclasses.replace(c, max_registers=cap) for cap in caps for c in out]
    if os.environ.get("SWEEP_REWIDEN") == "1":
        out = out + [dataclasses.replace(c, rewiden=not c.rewiden) for c in out]
    if os.environ.get("SWEEP_DENSE") == "1":
        out = out + [dataclasses.replace(c, dense=not c.dense) for c in out]
    return out


def pipeline_configs(n: int, m: int) -> list[tb.TileChoice]:
    """The choice for M x N of the direction swept (the backward's, or the forward's with SWEEP_DIRECTIONS=fwd), with
    its warps and twice them, each with every pipelining (TileChoice: programs_per_sm, prefetch, stages; in the
    forward each makes the grid persistent, so without either it is the choice itself and is not repeated)."""
    direction = DIRECTIONS[0] if DIRECTIONS in (["fwd"], ["bwd_dx"]) else "bwd"
    p = next_pow2(n)
    entry = ORIGINAL_TABLE[direction].get(p)
    if entry is None and direction == "bwd_dx":  # not listed: the "bwd" entry (backend.row_tile)
        entry = ORIGINAL_TABLE["bwd"].get(p)
    entry = entry or tb.TileChoice(split=tb.DEFAULT_SPLIT["fwd" if direction == "fwd" else "bwd"])
    tile = tb.row_tile(n, direction, m)
    base = dataclasses.replace(entry if isinstance(entry, tb.TileChoice) else for_rows(entry, m),
                               rows=tile.rows, num_warps=tile.num_warps, chunk=0)
    pipelines = ((True, 1), (False, 2), (False, 3), (True, 2)) if direction == "fwd" else \
        ((False, 1), (True, 1), (False, 2), (False, 3))
    out = [base] if direction == "fwd" else []  # the choice itself (measured as a configuration, see best_tunings)
    factors = [float(v) for v in os.environ.get("SWEEP_WARP_FACTORS", "1,2").split(",")]
    row_factors = [float(v) for v in os.environ.get("SWEEP_ROW_FACTORS", "1").split(",")]
    for rows in sorted({max(1, int(tile.rows * f)) for f in row_factors}):
        for warps in sorted({max(1, int(tile.num_warps * f)) for f in factors}):
            if warps * 32 > rows * (tile.pa + tile.t) or warps > 32:
                continue
            for programs in [int(v) for v in os.environ.get("SWEEP_PROGRAMS", "2,4").split(",")]:
                for prefetch, stages in pipelines:
                    out.append(dataclasses.replace(base, rows=rows, num_warps=warps, programs_per_sm=programs,
                                                   prefetch=prefetch, stages=stages))
    return out


def use(choice: tb.TileChoice | None, n: int, backend) -> None:
    """The backend's tiles for N's padded length set to `choice` in both directions (None: the backend's own
    table); its cached plans cleared (a plan keeps the tile it was made with)."""
    p = next_pow2(n)
    for direction, table in tb.TILE_TABLE.items():
        if choice is None:
            table.pop(p, None)
            if p in ORIGINAL_TABLE[direction]:
                table[p] = ORIGINAL_TABLE[direction][p]
        else:
            table[p] = choice
    backend._fwd_plans.clear()
    backend._bwd_plans.clear()


ORIGINAL_TABLE = {direction: dict(table) for direction, table in tb.TILE_TABLE.items()}


BOUND_GAIN = 1.05  # a smaller row count gets its own (bounded) entry where its fastest beats the general one by this


def best_tunings(results: list[dict]) -> dict:
    """Per direction and padded length, the configuration with the least mean slowdown against each shape's
    fastest (over the shapes of that length where it ran bitwise at all), as STRICTNORM_TRITON_TUNING reads it;
    where a shape with fewer rows than the length's largest runs its fastest configuration BOUND_GAIN times faster
    than that one, the entry is bounded: [[M, its fastest], ..., [null, the least mean slowdown]]."""
    best: dict[str, dict[str, dict]] = {"fwd": {}, "bwd": {}, "bwd_dx": {}}
    for direction in best:
        # the backend's own choice is measured twice (as itself and as one of configs()): once counts
        ok = [r for r in results if r["direction"] == direction and r.get("bitwise") and "us" in r and not r["default"]]
        for p in sorted({next_pow2(r["N"]) for r in ok}):
            mine = [r for r in ok if next_pow2(r["N"]) == p]
            shapes = {(r["M"], r["N"]) for r in mine}
            fastest = {s: min(r["us"] for r in mine if (r["M"], r["N"]) == s) for s in shapes}
            ratios: dict[tuple, list[float]] = {}
            for r in mine:
                ratios.setdefault(_key(r), []).append(r["us"] / fastest[(r["M"], r["N"])])
            full = {k: sum(v) / len(v) for k, v in ratios.items() if len(v) == len(shapes)}
            if not full:
                continue
            general = min(full, key=full.get)
            entries = []
            for m, n in sorted(shapes)[:-1]:  # ascending rows; the largest takes the general choice
                here = {_key(r): r["us"] for r in mine if (r["M"], r["N"]) == (m, n)}
                if here.get(general, float("inf")) > BOUND_GAIN * fastest[(m, n)]:
                    entries.append([m, _knobs(min(here, key=here.get))])
            best[direction][str(p)] = entries + [[None, _knobs(general)]] if entries else _knobs(general)
    return best


def _key(r: dict) -> tuple:
    return (r["rows"], r["num_warps"], r["split"], r.get("w_first", False), r.get("chunk", 0),
            r.get("programs_per_sm", 4), r.get("prefetch", False), r.get("stages", 1), r.get("warp_blocks", False),
            r.get("max_registers", 0), r.get("w_rows", False), r.get("drop_rstd", False), r.get("rewiden", False),
            r.get("dense", False), r.get("rcp_rn", False))


def _knobs(key: tuple) -> dict:
    (rows, warps, split, w_first, chunk, programs, prefetch, stages, warp_blocks, max_registers, w_rows, drop_rstd,
     rewiden, dense, rcp_rn) = key
    knobs = {"rows": rows, "num_warps": warps, "split": split, "w_first": w_first}
    extra = {"chunk": chunk, "programs_per_sm": programs, "prefetch": prefetch, "stages": stages,
             "warp_blocks": warp_blocks, "max_registers": max_registers, "w_rows": w_rows, "drop_rstd": drop_rstd,
             "rewiden": rewiden, "dense": dense, "rcp_rn": rcp_rn}
    defaults = {"chunk": 0, "programs_per_sm": 4, "prefetch": False, "stages": 1, "warp_blocks": False,
                "max_registers": 0, "w_rows": False, "drop_rstd": False, "rewiden": False, "dense": False,
                "rcp_rn": False}
    return {**knobs, **{k: v for k, v in extra.items() if v != defaults[k]}}


def _write(ceiling: float, results: list[dict]) -> None:
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": ceiling, "rows": results, "best": best_tunings(results)}, f, indent=1)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(best_tunings(results), f, indent=1)


def _tile(n: int, m: int, direction: str, case: Case) -> tb.RowTile:
    """The tile the backend takes for the case's M x N in `direction`, as its plans choose it (the forward's
    warp-block entry where its warp blocks apply; the stages the device's shared memory holds)."""
    limit = tb._smem_optin(case.x.device)
    if direction.startswith("bwd"):
        return tb.stages_that_fit(tb.row_tile(n, direction, m), 2 * case.x.element_size(), limit)
    piece = tb._warp_block_piece([case.x, case.w], (row_layout(case.x)[1],), 0, case.x.dtype)
    return tb.stages_that_fit(tb.forward_tile(n, m, piece), case.x.element_size(), limit)


def main() -> None:
    sw = Sweep.make("triton", iters=9, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    timer, ceiling, triton = sw.timer, sw.ceiling, sw.backend
    results = []
    for m, n in SHAPES:
        case = Case.make(sw.ref, timer.device, m, n, sw.spec)
        for choice in [None] + configs(n, m):
            use(choice, n, triton)
            for direction in DIRECTIONS:
                if choice is not None and choice.warp_blocks and choice.chunk and direction.startswith("bwd"):
                    continue  # the backward's chunks take no warp blocks: its kernel is the one measured without
                tile = _tile(n, m, direction, case)
                row = dict(M=m, N=n, direction=direction, default=choice is None, rows=tile.rows,
                           num_warps=tile.num_warps, split=tile.t > 0, w_first=tile.w_first, chunk=tile.chunk,
                           programs_per_sm=tile.programs_per_sm, prefetch=tile.prefetch, stages=tile.stages,
                           warp_blocks=tile.warp_blocks, max_registers=tile.max_registers, w_rows=tile.w_rows,
                           drop_rstd=tile.drop_rstd, rewiden=tile.rewiden, dense=tile.dense, rcp_rn=tile.rcp_rn)
                row.update(measure(timer, triton, case, direction, ceiling))
                results.append(row)
                print(json.dumps(row), flush=True)
        use(None, n, triton)
        _write(ceiling, results)  # after each shape: a run cut by a time limit keeps what it measured
    print(f"\nbest per shape (all rows bitwise: {all(r.get('bitwise') for r in results)}): us (rows, warps, split, "
          "w_first, chunk, programs an SM, prefetch, stages, warp blocks, registers bound, weight in the rows' "
          "layout, inference without rstd, rows held as loaded, dense); the "
          "backend's own choice")
    for m, n in SHAPES:
        line = f"{m:>7d}x{n:<6d}"
        for direction in ("fwd", "fwd_nr", "bwd", "bwd_dx"):
            ok = [r for r in results if (r["M"], r["N"], r["direction"]) == (m, n, direction) and "us" in r]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                own = next((r for r in ok if r["default"]), None)
                line += (f"  {direction} {b['us']:7.1f} ({b['rows']}, {b['num_warps']}, {int(b['split'])}, "
                         f"{int(b['w_first'])}, {b['chunk']}, {b['programs_per_sm']}, {int(b['prefetch'])}, "
                         f"{b['stages']}, {int(b.get('warp_blocks', False))}, {b.get('max_registers', 0)}, "
                         f"{int(b.get('w_rows', False))}, {int(b.get('drop_rstd', False))}, "
                         f"{int(b.get('rewiden', False))}, {int(b.get('dense', False))})"
                         f" own {own['us'] if own else float('nan'):7.1f}")
        print(line)


if __name__ == "__main__":
    main()
