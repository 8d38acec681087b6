"""What the Triton forward's canonical row sum costs: two one-row-a-program kernels that differ only in how they sum
a row's squares, strictnorm's canon_sum (the contract's balanced tree: one tl.sum over a pair a level, so each level
whose pairs span warps is a shared-memory round trip with its barriers) and Triton's own tl.sum (its order, not the
contract's: timed only). Both read a bf16 row and the weight and write y (bf16) and rstd, as the forward does.

The canonical kernel's rstd is checked against the reference's bits; the tl.sum kernel's largest relative difference
from it is reported. PROBE_SHAPES=MxN,... (default 128x4096,8192x4096,262144x128), PROBE_WARPS=4,8 (warps a
program; at least one lane a thread). Kernel-only time as in strictnorm.bench. Run on the GPU machine:
    python3 bench/reduction_probe.py [out.json]
(Under TRITON_INTERPRET=1 on a CPU it runs the kernels on CPU tensors: a check, not a measurement.)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from strictnorm.backends.triton.kernels import _rstd, canon_sum
from strictnorm.bench import Timer
from strictnorm.reference import compute_rstd, next_pow2

EPS = 1e-6


@triton.jit
def probe_kernel(X, W, Y, RSTD, N, eps, P: tl.constexpr, LOG2P: tl.constexpr, CANON: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, P)
    mask = cols < N
    x = tl.reshape(tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32), (1, P))
    w = tl.reshape(tl.load(W + cols, mask=mask, other=0.0).to(tl.float32), (1, P))
    if CANON:  # noqa: SIM108 (a constexpr branch: only the one taken is compiled)
        ss = canon_sum(x * x, 1, P, LOG2P)
    else:
        ss = tl.sum(x * x, axis=1)
    rstd = _rstd(ss, N, eps, 1)  # the forward's own
    tl.store(RSTD + row + tl.arange(0, 1), rstd)
    y = (x * rstd[:, None]).to(tl.bfloat16).to(tl.float32) * w
    tl.store(Y + row * N + tl.reshape(cols, (1, P)), y.to(tl.bfloat16), mask=tl.reshape(mask, (1, P)))


def run(x: torch.Tensor, w: torch.Tensor, canon: bool, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of one probe kernel over x's rows."""
    m, n = x.shape
    p = next_pow2(n)
    y, rstd = torch.empty_like(x), torch.empty(m, dtype=torch.float32, device=x.device)
    probe_kernel[(m,)](x, w, y, rstd, n, EPS, P=p, LOG2P=p.bit_length() - 1, CANON=canon, num_warps=warps,
                       enable_fp_fusion=False)
    return y, rstd


def main() -> None:
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu" if interpreting or not torch.cuda.is_available() else "cuda")
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("PROBE_SHAPES", "128x4096,8192x4096,262144x128").split(",")]
    warps_list = [int(v) for v in os.environ.get("PROBE_WARPS", "4,8").split(",")]
    timer = None if dev.type == "cpu" else Timer(dev, iters=9)
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    print(f"{'M x N':>14s} warps   canon_sum us   tl.sum us   canon/tl.sum   tl.sum rstd max rel diff")
    for m, n in shapes:
        x = torch.randn(m, n, device=dev, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).bfloat16()
        want = compute_rstd(x.float(), EPS)
        for warps in warps_list:
            if 32 * warps > next_pow2(n):
                continue
            row = dict(M=m, N=n, warps=warps)
            _, rstd = run(x, w, True, warps)
            row["canon_bitwise"] = bool(torch.equal(rstd, want))
            _, rstd_sum = run(x, w, False, warps)
            row["sum_rel_diff"] = float(((rstd_sum - rstd).abs() / rstd.abs()).max())
            if timer is not None:
                for key, canon in (("canon_us", True), ("sum_us", False)):
                    row[key] = timer.kernel_us(lambda x=x, w=w, c=canon, k=warps: run(x, w, c, k))
                print(f"{m:>7d} x {n:<5d} {warps:5d} {row['canon_us']:14.2f} {row['sum_us']:11.2f} "
                      f"{row['canon_us'] / row['sum_us']:14.3f} {row['sum_rel_diff']:26.2e}", flush=True)
            results.append(row)
    print(f"canon_sum rstd bitwise with the reference everywhere: {all(r['canon_bitwise'] for r in results)}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
