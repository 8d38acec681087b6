"""One call of each norm kernel inside a profiler range, for Nsight Compute:
    ncu --profile-from-start off --clock-control none [sections] python3 bench/ncu_probe.py M N case...
Cases: cuda-fwd, cuda-bwd (the tables' block shapes); cuda-fwd-uneven / cuda-bwd-uneven (the tables' entry with
the per-lane paths compiled: EVEN off);
cuda-fwd-hold<V> / cuda-fwd-stream<T> / cuda-bwd-hold<V> / cuda-bwd-stream<T> (a fixed block shape);
triton-fwd, triton-bwd, cute-fwd, cute-bwd, liger-fwd, liger-bwd, quack-fwd, quack-bwd; fwdnr for fwd (cuda, triton,
cute): an inference call's forward (need_rstd False), as the bench times it; fold-plain (the strict left fold of x's
rows; fold-plain32: of x's rows in fp32, as in the bench's fold table) and fold-dw (the strict dW fold:
contributions recomputed from dy, x and rstd, the kernel behind dw="strict", as the backend picks it), fold-dw<C>
(the ring with C columns a CTA, 128 rows a stage, whole stages converted);
onepass-strict (the one-pass strict backward, kernels/onepass.cu, default knobs). bf16 x, dy and weight,
llama mode, fast dW but where named strict.
Warm-up calls (compiles) run outside the range; each case's range holds one call.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from strictnorm.backends.cuda.backend import NormTuning
from strictnorm.backends.registry import get_backend
from strictnorm.contract import make_spec

EPS = 1e-6


def case_fn(name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor):
    spec = make_spec(x.dtype, EPS, 0.0, "llama", x.dtype)
    backend, op, *shape = name.split("-")
    if backend == "fold":
        from strictnorm.backends.cuda.backend import FoldTuning
        from strictnorm.backends.layout import row_layout

        cb = get_backend("cuda")
        if op in ("plain", "plain32"):  # plain32: x's rows widened to fp32 first (the fold table's rows)
            rows = x.float() if op == "plain32" else x
            return lambda: cb.left_fold(rows)
        cols = op[2:]  # dw32: a 32-column ring
        cb.fold_tuning = FoldTuning(cols=int(cols), rows_per_stage=128, full_stage=True) if cols else None
        return lambda: cb.strict_dw(*row_layout(dy), *row_layout(x), rstd, "llama", w)
    if backend == "onepass":
        cb = get_backend("cuda")
        cb.onepass_strict = True
        return lambda: cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
    if backend == "cute":
        b = get_backend("cute")
        if op in ("fwd", "fwdnr"):
            return lambda: b.rms_norm_fwd(x, w, None, spec, need_rstd=op == "fwd")
        return lambda: b.rms_norm_bwd(dy, x, w, rstd, None, spec, "fast", True, None)
    if backend in ("cuda", "triton"):
        b = get_backend(backend)
        b.fwd_tuning = b.bwd_tuning = None  # the tables (or STRICTNORM_CUDA_TUNING)
        if shape and shape[0] == "uneven":
            from strictnorm.backends.cuda.backend import BWD_TABLE, FWD_TABLE, tuning_for

            m, n = x.shape
            b.fwd_tuning = dataclasses.replace(tuning_for(FWD_TABLE, n, m), even=False)
            b.bwd_tuning = dataclasses.replace(tuning_for(BWD_TABLE, n, m), even=False)
        elif shape:  # cuda-fwd-hold16, cuda-bwd-stream256
            kind = shape[0]
            tu = (NormTuning(values=int(kind[4:])) if kind.startswith("hold")
                  else NormTuning(hold_max_p=0, stream_threads=int(kind[6:]), partial_blocks_per_sm=0))
            b.fwd_tuning = b.bwd_tuning = tu
        if op in ("fwd", "fwdnr"):
            return lambda: b.rms_norm_fwd(x, w, None, spec, need_rstd=op == "fwd")
        return lambda: b.rms_norm_bwd(dy, x, w, rstd, None, spec, "fast", True, None)
    if backend == "liger":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        xg = x.detach().requires_grad_(op == "bwd")
        wg = w.detach().requires_grad_(op == "bwd")
        if op == "fwd":
            return lambda: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
        y = LigerRMSNormFunction.apply(xg, wg, EPS, 0.0, "llama", False)
        return lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    if backend == "quack":
        from quack.rmsnorm import rmsnorm

        xg = x.detach().requires_grad_(op == "bwd")
        wg = w.detach().requires_grad_(op == "bwd")
        if op == "fwd":
            return lambda: rmsnorm(x, w, eps=EPS)
        y = rmsnorm(xg, wg, eps=EPS)
        return lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    raise SystemExit(f"unknown case {name}")


def main() -> None:
    m, n, cases = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    rstd = get_backend("torch").rms_norm_fwd(x, w, None, make_spec(x.dtype, EPS, 0.0, "llama", x.dtype))[1]
    for name in cases:
        fn = case_fn(name, x, w, dy, rstd)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {name}", flush=True)


if __name__ == "__main__":
    main()
