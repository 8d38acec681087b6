"""Host time of strictnorm's API layer alone: an eager rms_norm call with the backend replaced by a stub that returns
at once, and the layer's pieces. Runs anywhere (no GPU: CPU tensors, the kernels never run), so the Python around the
kernels can be trimmed and measured on a development machine; bench/host_breakdown.py times the whole call on a GPU.
Median over 5 loops of 20000 calls, microseconds per call. Usage: python bench/api_overhead.py
"""

from __future__ import annotations

from collections.abc import Callable

import host_breakdown
import torch

import strictnorm as sn
from strictnorm import ops
from strictnorm.backends.registry import resolve
from strictnorm.contract import check_norm_input, check_weight, validated_spec


def per_call_us(fn: Callable[[], object]) -> float:
    return host_breakdown.per_call_us(fn, calls=20000, gpu=False)


class _Stub:
    """A backend whose forward does nothing: what remains of a call is the API layer."""

    ops = ("rms_norm",)

    def rms_norm_fwd(self, x, weight, residual, spec, need_rstd=True):
        return x, (x if need_rstd else None), None


def main() -> None:
    x = torch.randn(4, 4096).bfloat16()
    w = torch.randn(4096).bfloat16()
    xg = x.clone().requires_grad_()
    stub = _Stub()
    pieces = {
        "check_norm_input": lambda: check_norm_input(x),
        "check_weight": lambda: check_weight(w, x, 4096),
        "resolve(None)": lambda: resolve(None, x.device, "rms_norm"),
        "validated_spec": lambda: validated_spec(x.dtype, 1e-6, 0.0, "llama", None, "fast", True, False),
    }
    for name, fn in pieces.items():
        print(f"{name:44s} {per_call_us(fn):6.2f}")
    real = ops.get_backend
    ops.get_backend = lambda name: stub  # the eager path's backend lookup
    try:
        calls = {
            "ops.rms_norm, stub backend": lambda: ops.rms_norm(x, w, None, 1e-6, 0.0, "llama", None, "fast", False,
                                                               "torch"),
            "sn.rms_norm, stub backend": lambda: sn.rms_norm(x, w),
            "sn.rms_norm, x requiring grad, stub backend": lambda: sn.rms_norm(xg, w),
        }
        for name, fn in calls.items():
            print(f"{name:44s} {per_call_us(fn):6.2f}")
    finally:
        ops.get_backend = real


if __name__ == "__main__":
    main()
