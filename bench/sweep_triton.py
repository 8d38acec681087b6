"""Tuning sweep for the Triton row kernels: elements per program and warps, at the PERF.md shapes.

Any configuration gives the same bits (checked here too); only the speed changes. Kernel-only
time as in strictnorm.bench. Run on the GPU machine: python3 bench/sweep_triton.py [out.json]
"""

from __future__ import annotations

import json
import sys

import torch

import strictnorm as sn
from strictnorm.backends.triton import backend as tb
from strictnorm.bench import NORM_SHAPES, Timer
from strictnorm.reference import next_pow2


def _measure(timer: Timer, x, w, xg, wg, dy) -> tuple[float, float]:
    fwd = timer.kernel_us(lambda: sn.rms_norm(x, w, backend="triton"))
    fb = timer.kernel_us(lambda: torch.autograd.grad(sn.rms_norm(xg, wg, backend="triton"), (xg, wg), dy))
    return fwd, fb


def main() -> None:
    timer = Timer(torch.device("cuda"), 9)
    original = tb._row_tile
    results = []
    for m, n in NORM_SHAPES:
        x = torch.randn(m, n, device="cuda").bfloat16()
        w = torch.randn(n, device="cuda").bfloat16()
        dy = torch.randn(m, n, device="cuda").bfloat16()
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        want = None
        for tile in (2048, 4096, 8192, 16384):
            for elems_per_warp in (256, 512, 1024, 2048, 4096, 8192):  # 8192: 4 warps at P = 32768
                def row_tile(n_, split=None, tile=tile, epw=elems_per_warp):
                    t = original(n_, split)  # the column tiles as the backend splits them
                    rows = max(1, tile // next_pow2(n_))
                    warps = 1 << max(0, min(5, (rows * (t.pa + t.t) // epw).bit_length() - 1))
                    return tb.RowTile(rows, t.pa, t.t, warps)

                tb._row_tile = row_tile
                try:
                    y = sn.rms_norm(x, w, backend="triton")
                    dx, dw = torch.autograd.grad(sn.rms_norm(xg, wg, backend="triton"), (xg, wg), dy)
                    if want is None:
                        want = (y, dx)
                    same = bool(torch.equal(y, want[0]) and torch.equal(dx, want[1]))
                    fwd, fb = _measure(timer, x, w, xg, wg, dy)
                    row = dict(M=m, N=n, tile=tile, elems_per_warp=elems_per_warp, fwd_us=fwd, bwd_us=fb - fwd,
                               same_bits=same)
                except Exception as e:  # e.g. out of registers / shared memory
                    row = dict(M=m, N=n, tile=tile, elems_per_warp=elems_per_warp, error=repr(e)[:200])
                finally:
                    tb._row_tile = original
                results.append(row)
                print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    print("\nbest per shape (fwd, bwd):")
    for m, n in NORM_SHAPES:
        ok = [r for r in results if r["M"] == m and r["N"] == n and "fwd_us" in r]
        bf = min(ok, key=lambda r: r["fwd_us"])
        bb = min(ok, key=lambda r: r["bwd_us"])
        print(f"{m:>7d}x{n:<6d} fwd {bf['fwd_us']:7.1f} (tile {bf['tile']}, epw {bf['elems_per_warp']})"
              f"  bwd {bb['bwd_us']:7.1f} (tile {bb['tile']}, epw {bb['elems_per_warp']})"
              f"  all same bits: {all(r['same_bits'] for r in ok)}")


if __name__ == "__main__":
    main()
