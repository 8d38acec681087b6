"""Runs tests/test_gpu.py::test_cuda_backward_bitwise at N = 5120 ("tables" family) exactly as pytest does
(same function, same calls, same allocations), recording each CUDA backward call; at the first mismatch it
reports the call's plan, the tensors' addresses, whether the inputs hold NaN/Inf, and what a repeat of the
call gives (same plan; sentinel output; fresh plans; inputs at new addresses).
    python3 bench/repro_test_5120.py SEED
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
import test_gpu  # noqa: E402
from helpers import bits_equal  # noqa: E402

from strictnorm.backends.cuda.backend import CudaBackend  # noqa: E402
from strictnorm.backends.registry import get_backend  # noqa: E402

SENTINEL = 12352.0
cb = get_backend("cuda")
calls: list[tuple] = []
real_bwd = cb.rms_norm_bwd


def recording_bwd(*args):
    out = real_bwd(*args)
    calls.append((args, out))
    return out


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = got.view(torch.int16) != want.view(torch.int16)
    return (f"{int(diff.sum())} of {diff.numel()} differ, NaN {int(got.isnan().sum())}, "
            f"sentinel {int((got == SENTINEL).sum())}")


def diagnose(want: torch.Tensor) -> None:
    args, (got, _) = calls[-1]
    dy, z, w, rstd, dres, spec, dw_mode, need_dw, dx_out = args
    print("mismatch:", describe(got, want), "| mode", spec.mode, "dw", dw_mode, "dx_out", dx_out is not None)
    for name, t in (("dy", dy), ("z", z), ("w", w), ("rstd", rstd), ("dres", dres), ("got", got)):
        if t is not None:
            print(f"  {name}: ptr % 256 = {t.data_ptr() % 256}, ptr = {t.data_ptr():#x}, shape {tuple(t.shape)}, "
                  f"stride {t.stride()}, finite {bool(t.float().isfinite().all())}")
    plans = [(k, p) for k, p in cb._bwd_plans.items() if k[2] == spec.mode]
    for key, plan in plans:
        print("  plan", key[1][0][:2], "->", {f: getattr(plan, f) for f in ("rows", "grid", "threads", "shmem", "tail",
                                                                             "partial_rows")})
        print("    strict fold", plan.strict)
    print("  got again:", describe(real_bwd(*args)[0], want))
    out = torch.full_like(dy, SENTINEL)
    print("  sentinel output:", describe(real_bwd(dy, z, w, rstd, dres, spec, dw_mode, need_dw, out)[0], want))
    fresh = CudaBackend()
    fresh._cache = cb._kernels()
    print("  fresh plans:", describe(fresh.rms_norm_bwd(*args)[0], want))
    moved = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    print("  inputs at new addresses:", describe(real_bwd(*moved)[0], want))
    torch.cuda.synchronize()
    print("  after a synchronize, same call:", describe(real_bwd(*args)[0], want))


def checking_bits_equal(a, b):
    ok = bits_equal(a, b)
    if not ok and calls:
        diagnose(a)
    return ok


def main() -> None:
    seed = int(sys.argv[1])
    cb.rms_norm_bwd = recording_bwd
    test_gpu.bits_equal = checking_bits_equal
    try:
        test_gpu.test_cuda_backward_bitwise(5120, cb, seed)
        print(f"seed {seed}: passed")
    except AssertionError as e:
        print(f"seed {seed}: failed: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
