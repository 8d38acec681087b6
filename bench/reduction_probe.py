"""What the Triton forward's canonical row sum costs: one-row-a-program kernels that differ only in how they sum a
row's squares. Each reads a bf16 row and the weight and writes y (bf16) and rstd, as the forward does.
- canon: strictnorm's canon_sum (the contract's balanced tree: one tl.sum over a pair a level, so each level whose
  pairs span warps is a shared-memory round trip with its barriers; triton 3.6, 4096 lanes, 8 warps: 8 bar.sync).
- tl.sum: Triton's own sum (its order, not the contract's: timed only; 2 bar.sync).
- warps: the contract's tree with the warps meeting once (2 bar.sync): the Triton forward's warp blocks (kernels.py,
  row_columns and canon_sum_warp_blocks; the module's notes). The row is loaded with its columns permuted so that each
  warp holds one aligned block of the row, summed within the warp; the blocks' sums meet in one tl.sum, whose
  butterfly over the warps (Triton's lowering, not its promise) then pairs adjacent blocks first. Its bits are
  checked here against the reference's.

Each canonical kernel's rstd is checked against the reference's bits; the tl.sum kernel's largest relative difference
from it is reported. PROBE_SHAPES=MxN,... (default 128x4096,8192x4096,262144x128), PROBE_WARPS=4,8 (warps a
program; at least one lane a thread), PROBE_VECTOR=8 (the load's S: 16 bytes of bf16; the warps kernel runs where
P >= 32 * S * warps). Kernel-only time as in strictnorm.bench. Run on the GPU machine:
    python3 bench/reduction_probe.py [out.json]
(Under TRITON_INTERPRET=1 on a CPU it runs the kernels on CPU tensors: a check, not a measurement.)
    python3 bench/reduction_probe.py --compiled P WARPS [VECTOR]
compiles the three kernels for sm_90 without a GPU and prints, as JSON, each one's bar.sync count and the xor distances
of the shuffles between its first and second barrier (the warps' partials combined: [WARPS/2, ..., 1] is the butterfly
the warps kernel's order needs).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from strictnorm.backends.triton.kernels import _rstd, canon_sum, canon_sum_warp_blocks, row_columns
from strictnorm.bench import Timer
from strictnorm.reference import compute_rstd, next_pow2

EPS = 1e-6


# the kernels' row sums (constexpr: a jitted kernel reads no other globals)
CANON, TL_SUM, WARPS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def probe_kernel(X, W, Y, RSTD, N, eps, P: tl.constexpr, LOG2P: tl.constexpr, SUM: tl.constexpr,
                 NW: tl.constexpr, S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = row_columns(P, NW if SUM == WARPS else 0, S)  # the forward's own (kernels.py)
    mask = cols < N
    x = tl.reshape(tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32), (1, P))
    w = tl.reshape(tl.load(W + cols, mask=mask, other=0.0).to(tl.float32), (1, P))
    if SUM == CANON:
        ss = canon_sum(x * x, 1, P, LOG2P)
    elif SUM == TL_SUM:
        ss = tl.sum(x * x, axis=1)
    else:
        ss = canon_sum_warp_blocks(x * x, 1, P, NW, S)
    rstd = _rstd(ss, N, eps, 1)  # the forward's own
    tl.store(RSTD + row + tl.arange(0, 1), rstd)
    y = (x * rstd[:, None]).to(tl.bfloat16).to(tl.float32) * w
    tl.store(Y + row * N + tl.reshape(cols, (1, P)), y.to(tl.bfloat16), mask=tl.reshape(mask, (1, P)))


def _log2(v: int) -> int:
    return v.bit_length() - 1


def run(x: torch.Tensor, w: torch.Tensor, kind: tl.constexpr, warps: int,
        vector: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of one probe kernel over x's rows (vector: the warps kernel's S)."""
    m, n = x.shape
    p = next_pow2(n)
    y, rstd = torch.empty_like(x), torch.empty(m, dtype=torch.float32, device=x.device)
    probe_kernel[(m,)](x, w, y, rstd, n, EPS, P=p, LOG2P=_log2(p), SUM=kind.value, NW=warps, S=vector,
                       num_warps=warps, enable_fp_fusion=False)
    return y, rstd


def compiled_reduction(kind: tl.constexpr, p: int, warps: int, vector: int = 8) -> dict:
    """The probe kernel compiled for sm_90 (no GPU needed; not interpreted): its barriers and the xor distances of the
    shuffles between its first and second barrier."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(P=p, LOG2P=_log2(p), SUM=kind.value, NW=warps, S=vector)
    sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "N": "i32", "eps": "fp32"}
    sig.update({name: "constexpr" for name in const})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # pointers and N as the JIT sees N % 16 == 0
    ptx = triton.compile(ASTSource(probe_kernel, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]
    between = (ptx.split("bar.sync") + ["", ""])[1]
    return {"barriers": ptx.count("bar.sync"),
            "xors": [int(v) for v in re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+),", between)]}


def main() -> None:
    if sys.argv[1:2] == ["--compiled"]:
        p, warps, vector = (int(v) for v in (sys.argv[2:] + ["8"])[:3])
        print(json.dumps({name: compiled_reduction(kind, p, warps, vector)
                          for name, kind in (("canon", CANON), ("tl.sum", TL_SUM), ("warps", WARPS))}))
        return
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu" if interpreting or not torch.cuda.is_available() else "cuda")
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("PROBE_SHAPES", "128x4096,8192x4096,262144x128").split(",")]
    warps_list = [int(v) for v in os.environ.get("PROBE_WARPS", "4,8").split(",")]
    vector = int(os.environ.get("PROBE_VECTOR", "8"))
    timer = None if dev.type == "cpu" else Timer(dev, iters=9)
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    print(f"{'M x N':>14s} warps   canon_sum us   warps us   tl.sum us   canon/tl.sum   warps/tl.sum"
          "   tl.sum rstd max rel diff")
    for m, n in shapes:
        x = torch.randn(m, n, device=dev, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).bfloat16()
        want = compute_rstd(x.float(), EPS)
        for warps in warps_list:
            if 32 * warps > next_pow2(n):
                continue
            row = dict(M=m, N=n, warps=warps)
            y, rstd = run(x, w, CANON, warps)
            row["canon_bitwise"] = bool(torch.equal(rstd, want))
            kinds = {"canon_us": CANON, "sum_us": TL_SUM}
            if next_pow2(n) >= 32 * vector * warps:  # the warps kernel: each warp a block of whole pieces
                y_warps, rstd_warps = run(x, w, WARPS, warps, vector)
                row["warps_bitwise"] = bool(torch.equal(rstd_warps, want) and torch.equal(y_warps, y))
                kinds["warps_us"] = WARPS
            _, rstd_sum = run(x, w, TL_SUM, warps)
            row["sum_rel_diff"] = float(((rstd_sum - rstd).abs() / rstd.abs()).max())
            if timer is not None:
                for key, kind in kinds.items():
                    row[key] = timer.kernel_us(lambda x=x, w=w, c=kind, k=warps: run(x, w, c, k, vector))
                warps_us = row.get("warps_us", float("nan"))
                print(f"{m:>7d} x {n:<5d} {warps:5d} {row['canon_us']:14.2f} {warps_us:10.2f} {row['sum_us']:11.2f} "
                      f"{row['canon_us'] / row['sum_us']:14.3f} {warps_us / row['sum_us']:14.3f} "
                      f"{row['sum_rel_diff']:26.2e}", flush=True)
            results.append(row)
    print(f"canon_sum rstd bitwise with the reference everywhere: {all(r['canon_bitwise'] for r in results)}")
    warps_rows = [r for r in results if "warps_bitwise" in r]
    print(f"the warps kernel's rstd and y bitwise with canon_sum's ({len(warps_rows)} cases): "
          f"{all(r['warps_bitwise'] for r in warps_rows)}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
