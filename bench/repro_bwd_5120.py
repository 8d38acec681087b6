"""Replays the intermittent CUDA backward failure (bench/NOTES.md, "Open correctness failure"): the calls of
tests/test_gpu.py::test_cuda_backward_bitwise[tables-5120] in the test's order (rows 1, 37, 409; modes llama,
gemma, none; strict, fast twice, in place), on fresh seeds or the given ones. On a mismatch it reports what
differs and then narrows the cause down, each step on the same inputs:
  - were the inputs changed by the calls (compared with copies taken before);
  - does the same call again, a fresh backend (new plans, the loaded kernels), a fresh kernel cache (the cubin
    loaded again from disk) and a fresh compile (no disk cache) reproduce it;
  - is dx unwritten (dx pre-filled with a sentinel and passed as the output).
Run on the GPU machine, also under compute-sanitizer (memcheck, racecheck, initcheck):
    python3 bench/repro_bwd_5120.py [iterations] [seed ...]
"""

from __future__ import annotations

import os
import sys

import torch

from strictnorm.backends.cuda.backend import CudaBackend
from strictnorm.backends.cuda.nvrtc import KernelCache
from strictnorm.backends.registry import get_backend
from strictnorm.contract import make_spec

N = 5120
SENTINEL = 12352.0  # exact in bf16, far from any dx here


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = got.view(torch.int16) != want.view(torch.int16)
    rows = diff.reshape(-1, N).any(dim=1).nonzero().flatten()
    return (f"{int(diff.sum())} elements in {rows.numel()} rows differ (first rows {rows[:8].tolist()}), "
            f"NaN {int(got.isnan().sum())}, sentinel {int((got == SENTINEL).sum())}")


def narrow_down(inputs: tuple, spec, want: torch.Tensor, saved: tuple) -> list[str]:
    dy, z, w, rstd, dres = inputs
    same = [bits_equal(a, b) if a is not None else None for a, b in zip(inputs, saved, strict=True)]
    lines = [f"  inputs unchanged (dy, z, w, rstd, dres): {same}"]
    shared, reloaded = CudaBackend(), CudaBackend()
    shared._cache = get_backend("cuda")._kernels()  # new plans, the kernels already loaded
    reloaded._cache = KernelCache()  # new plans, the cubins loaded again from the disk cache
    attempts = {"same backend again": get_backend("cuda"), "fresh backend, loaded kernels": shared,
                "fresh kernel cache (disk cubin)": reloaded}
    for name, backend in attempts.items():
        got, _ = backend.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
        lines.append(f"  {name}: {'ok' if bits_equal(got, want) else describe(got, want)}")
        out = torch.full_like(dy, SENTINEL)
        got, _ = backend.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, out)
        lines.append(f"  {name}, sentinel output: {'ok' if bits_equal(got, want) else describe(got, want)}")
    old = os.environ.get("STRICTNORM_CACHE_DIR")
    os.environ["STRICTNORM_CACHE_DIR"] = f"/tmp/strictnorm-repro-{os.getpid()}"
    try:
        fresh = CudaBackend()
        got, _ = fresh.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
        lines.append(f"  fresh compile: {'ok' if bits_equal(got, want) else describe(got, want)}")
    finally:
        if old is None:
            del os.environ["STRICTNORM_CACHE_DIR"]
        else:
            os.environ["STRICTNORM_CACHE_DIR"] = old
    return lines


def one_seed(seed: int) -> list[str]:
    cb, tr = get_backend("cuda"), get_backend("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    problems = []
    for m in (1, 37, max(1, (1 << 21) // N)):
        for mode in ("llama", "gemma", "none"):
            z = torch.randn(m, N, device="cuda", generator=g).bfloat16()
            w = (torch.randn(N, device="cuda", generator=g) * 0.1).bfloat16()
            dy = torch.randn(m, N, device="cuda", generator=g).bfloat16()
            dres = torch.randn(m, N, device="cuda", generator=g).bfloat16() if m != 37 else None
            spec = make_spec(torch.bfloat16, 1e-6, 0.5, mode, torch.bfloat16)
            _, rstd, _ = tr.rms_norm_fwd(z, w, None, spec)
            inputs = (dy, z, w, rstd, dres)
            saved = tuple(t.clone() if t is not None else None for t in inputs)
            want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
            got_dx, got_dw = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
            torch.cuda.synchronize()
            where = f"seed {seed} {m}x{N} {mode}"
            if not bits_equal(want_dx, got_dx):
                problems.append(f"{where}: dx {describe(got_dx, want_dx)}")
                problems += narrow_down(inputs, spec, want_dx, saved)
            if not bits_equal(want_dw, got_dw):
                problems.append(f"{where}: dw differs")
            fast1 = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", True, None)[1]
            fast2 = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", True, None)[1]
            if not bits_equal(fast1, fast2):
                problems.append(f"{where}: fast dw not deterministic")
            buf = dy.clone()
            _, in_place_dw = cb.rms_norm_bwd(buf, z, w, rstd, dres, spec, "strict", True, buf)
            if not (bits_equal(buf, want_dx) and bits_equal(in_place_dw, got_dw)):
                problems.append(f"{where}: in place: dx {describe(buf, want_dx)}")
    return problems


def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    seeds = [int(s) for s in sys.argv[2:]] or [int.from_bytes(os.urandom(4), "little") for _ in range(iterations)]
    bad = 0
    for seed in seeds:
        for line in one_seed(seed):
            bad += not line.startswith("  ")
            print(line, flush=True)
    print(f"{len(seeds)} seeds, test_cuda_backward_bitwise's calls at N = {N}: {bad} mismatches")


if __name__ == "__main__":
    main()
