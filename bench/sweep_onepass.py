"""Sweep of onepass.cu's knobs (OnepassTuning): the one-pass strict backward's time per shape and configuration,
each checked bitwise against the two-pass strict backward (the backend's default: dx pass, then the dW fold),
beside the two-pass time; both timed with the host ahead of the GPU (Timer.queued_us: the gap between the two
passes' kernels counts, as in a training step). SWEEP_SHAPES=MxN,... replaces the shapes. Run on the GPU machine:
    python3 bench/sweep_onepass.py [out.json]
"""

from __future__ import annotations

import json
import os
import sys

import torch
from overlap_probe import save_rows, variant

from strictnorm.backends.cuda.backend import OnepassTuning
from strictnorm.backends.registry import get_backend
from strictnorm.bench import Timer, copy_ceiling_gbps
from strictnorm.contract import make_spec

SHAPES = [(32768, 4096), (8192, 8192), (16384, 4096), (2048, 18432)]
TUNINGS = [OnepassTuning(), OnepassTuning(dx_groups=1, c_warps=1), OnepassTuning(b_warps=8),
           OnepassTuning(dx_warps=8, dx_groups=4), OnepassTuning(c_warps=4), OnepassTuning(depth=3, tiles=6),
           OnepassTuning(rows=64, depth=4, tiles=6), OnepassTuning(rows=256, depth=1, tiles=2)]


def main() -> None:
    dev = torch.device("cuda")
    timer = Timer(dev, iters=7)
    ceiling = copy_ceiling_gbps(dev)
    cb = get_backend("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    text = os.environ.get("SWEEP_SHAPES")
    shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")] if text else SHAPES
    rows = []
    for m, n in shapes:
        x = torch.randn(m, n, device=dev, generator=g).bfloat16()
        dy = torch.randn(m, n, device=dev, generator=g).bfloat16()
        w = (torch.randn(n, device=dev, generator=g) * 0.5 + 1).bfloat16()
        rstd = torch.rand(m, device=dev, generator=g) + 0.5
        spec = make_spec(x.dtype, 1e-6, 0.0, "llama", x.dtype)

        def bwd(dy=dy, x=x, w=w, rstd=rstd, spec=spec):
            return cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)

        outs: dict = {}
        two_pass = variant(timer, bwd, outs, "two_pass", queued=True, onepass_strict=False)
        floor = 6 * m * n / ceiling / 1e3
        for tuning in TUNINGS:
            cb._bwd_plans.clear()
            row = {"m": m, "n": n, "tuning": str(tuning), "floor_us": floor, "two_pass_us": two_pass}
            try:
                row["us"] = variant(timer, bwd, outs, "onepass", queued=True, onepass_strict=True,
                                    onepass_tuning=tuning)
                row["applied"] = any(p.onepass is not None for p in cb._bwd_plans.values())
                row["same_bits"] = all(torch.equal(p.view(torch.int16), q.view(torch.int16))
                                       for p, q in zip(outs["two_pass"], outs["onepass"], strict=True))
            except Exception as e:  # a configuration that does not fit: recorded, the sweep goes on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    cb._bwd_plans.clear()
    print(f"copy {ceiling:.0f} GB/s; queued us (the host ahead), strict backward, bf16 llama")
    print(f"{'M x N':>14} {'floor':>7} {'two pass':>8} {'one pass':>8} bits  tuning")
    for r in rows:
        us = f"{r['us']:8.1f}" if "us" in r and r.get("applied") else f"{'n/a':>8}"
        bits = ("same " if r.get("same_bits") else "DIFF ") if "us" in r else "     "
        print(f"{r['m']:>7} x {r['n']:<5} {r['floor_us']:7.1f} {r['two_pass_us']:8.1f} {us} {bits} {r['tuning']}"
              f"{'  ' + r['error'] if 'error' in r else ''}")
    save_rows(ceiling, rows)


if __name__ == "__main__":
    main()
