"""The fast dW's partial-row sum (partial_sum.cu) in one launch or in segments, alone and inside the fast backward.

partial_sum_shape cuts R partial rows into segments where its column blocks leave SMs idle, and a second launch then
sums the segment rows, and kernel-only time counts both (run 26: from this probe's first runs the planner segments
only from 16 rows a thread; the Triton backward's 528 partial rows at 262144 x 128 took two launches before). This
probe times, with the planner's shape and with one segment forced: the sum alone for a few (R, N), and the whole
fast backward (bf16, llama) of a few shapes for the Triton and CUDA backends. One segment sums in another fixed
order (the fast dW's bits may differ; dx may not). Run on the GPU machine:
    python3 bench/partial_probe.py [out.json]
PARTIAL_SHAPES=RxN,... (the sums), PARTIAL_NORM=MxN,... (the backwards).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from strictnorm.backends.cuda import backend as cuda_backend
from strictnorm.backends.registry import get_backend
from strictnorm.bench import Timer
from strictnorm.contract import make_spec

PLANNED = cuda_backend.partial_sum_shape


def one_segment(rows: int, n: int, num_sms: int) -> cuda_backend.PartialSumShape:
    return dataclasses.replace(PLANNED(rows, n, num_sms), segments=1, seg_rows=rows)


def _shapes(var: str, default: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in os.environ.get(var, default).split(",") if s]


def main() -> None:
    dev = torch.device("cuda")
    timer = Timer(dev, iters=9)
    cb = get_backend("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for rule, shape_fn in (("planned", PLANNED), ("one segment", one_segment)):
        cuda_backend.partial_sum_shape = shape_fn
        cb._fold_plans.clear()  # the partial-sum plans are cached per (rows, N)
        for r, n in _shapes("PARTIAL_SHAPES", "528x128,1056x128,264x4096,528x4096"):
            part = torch.randn(r, n, device=dev, generator=g)
            us = timer.kernel_us(lambda part=part: cb.sum_rows(part))
            row = {"what": "sum_rows", "rule": rule, "R": r, "N": n, "segments": shape_fn(r, n, sms).segments, "us": us}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        for m, n in _shapes("PARTIAL_NORM", "262144x128,65536x128,8192x4096"):
            x, dy = (torch.randn(m, n, device=dev, generator=g).bfloat16() for _ in range(2))
            w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).bfloat16()
            spec = make_spec(x.dtype, 1e-6, 0.0, "llama", x.dtype)
            for name in ("triton", "cuda"):
                b = get_backend(name)
                _, rstd, _ = b.rms_norm_fwd(x, w, None, spec)
                fn = lambda b=b, x=x, w=w, dy=dy, rstd=rstd, spec=spec: b.rms_norm_bwd(  # noqa: E731
                    dy, x, w, rstd, None, spec, "fast", True, None)
                dx, dw = fn()
                row = {"what": "fast backward", "rule": rule, "backend": name, "M": m, "N": n,
                       "us": timer.kernel_us(fn), "dx_sum": float(dx.float().sum()), "dw_sum": float(dw.float().sum())}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    cuda_backend.partial_sum_shape = PLANNED
    print(f"\n{'what':>14} {'backend':>7} {'shape':>12} {'planned us':>10} {'one segment us':>14}")
    keyed: dict[tuple, dict] = {}
    for r in rows_out:
        key = (r["what"], r.get("backend", ""), r.get("M", r.get("R")), r["N"])
        keyed.setdefault(key, {})[r["rule"]] = r["us"]
    for (what, name, m, n), us in keyed.items():
        print(f"{what:>14} {name:>7} {m:>6}x{n:<5} {us.get('planned', float('nan')):10.1f}"
              f" {us.get('one segment', float('nan')):14.1f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
