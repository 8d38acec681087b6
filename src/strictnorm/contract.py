"""The numerical contract's vocabulary: casting modes, dW modes, dtype rules and input checks.

Every public entry point validates here, before any backend runs, so that every backend sees
the same well-formed inputs and a bad call fails the same way everywhere (and mutates nothing).
docs/contract.md is the prose form of what this module and reference.py implement.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

CASTING_MODES = ("llama", "gemma", "none")
DW_MODES = ("strict", "fast")
# dtypes a norm input may have on a kernel backend; float64 is accepted by the reference only,
# as the "same formulas evaluated in float64" used for accuracy checks and gradcheck.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
MAX_N = 65536


class StrictNormError(ValueError):
    """A call that the contract does not define (bad shape, dtype, device, mode or eps)."""


@dataclass(frozen=True)
class NormSpec:
    """Everything besides tensors that fixes the bits of a norm's result."""

    eps: float  # already rounded to fp32 (see fp32_eps)
    offset: float  # already rounded to fp32
    mode: str
    out_dtype: torch.dtype


def fp32_value(value: float, what: str) -> float:
    """Round a Python float once to fp32 (the contract's eps and offset are fp32 numbers)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise StrictNormError(f"{what} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise StrictNormError(f"{what} must be finite, got {value}")
    rounded = torch.tensor(float(value), dtype=torch.float32).item()
    if not math.isfinite(rounded):
        raise StrictNormError(f"{what}={value} overflows fp32")
    return rounded


@functools.lru_cache(maxsize=1024)
def validated_spec(norm_dtype: torch.dtype, eps: float, offset: float, mode: str,
                   out_dtype: torch.dtype | None, dw: str, has_weight: bool, in_place: bool) -> NormSpec:
    """Checks the non-tensor arguments of a norm call and rounds eps and offset to fp32.

    Called inside the custom op and its fake (meta) implementation, so eager calls and
    torch.compile traces both run it, and Dynamo never has to trace it.
    """
    spec = make_spec(norm_dtype, eps, offset, mode, out_dtype)
    check_dw_mode(dw)
    if not has_weight and spec.offset != 0.0:
        raise StrictNormError("offset needs a weight (without one the scale is exactly 1.0)")
    if in_place and spec.out_dtype != norm_dtype:
        raise StrictNormError(
            f"in_place backward writes dx into dy's buffer, so out_dtype ({spec.out_dtype}) must equal "
            f"the normalized input's dtype ({norm_dtype})")
    return spec


def make_spec(x_dtype: torch.dtype, eps: float, offset: float, mode: str,
              out_dtype: torch.dtype | None) -> NormSpec:
    if mode not in CASTING_MODES:
        raise StrictNormError(f"unknown casting_mode {mode!r}; expected one of {CASTING_MODES}")
    eps32 = fp32_value(eps, "eps")
    if eps32 < 0:
        raise StrictNormError(f"eps must be >= 0, got {eps}")
    off32 = fp32_value(offset, "offset")
    out = x_dtype if out_dtype is None else out_dtype
    if out not in REFERENCE_DTYPES:
        raise StrictNormError(f"unsupported out_dtype {out}; expected one of {KERNEL_DTYPES}")
    return NormSpec(eps=eps32, offset=off32, mode=mode, out_dtype=out)


def check_dw_mode(dw: str) -> str:
    if dw not in DW_MODES:
        raise StrictNormError(f"unknown dw mode {dw!r}; expected one of {DW_MODES}")
    return dw


def check_norm_input(x: torch.Tensor, name: str = "x") -> int:
    """Checks a norm input (..., N) and returns N."""
    if not isinstance(x, torch.Tensor):
        raise StrictNormError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in REFERENCE_DTYPES:
        raise StrictNormError(f"{name} has unsupported dtype {x.dtype}; expected one of {KERNEL_DTYPES}")
    if x.dim() < 1:
        raise StrictNormError(f"{name} must have at least one dimension (the normalized one)")
    n = x.shape[-1]
    if n == 0:
        raise StrictNormError(f"{name} has an empty last dimension (N = 0): nothing to normalize")
    if n > MAX_N:
        raise StrictNormError(f"N = {n} is larger than the supported maximum {MAX_N}")
    return n


def check_weight(weight: torch.Tensor | None, x: torch.Tensor, n: int, *,
                 heads: int | None = None) -> None:
    """weight must be (N,), or (H, N) for per-head QK-norm, on x's device."""
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor):
        raise StrictNormError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
    if weight.dtype not in REFERENCE_DTYPES:
        raise StrictNormError(f"weight has unsupported dtype {weight.dtype}; expected one of {KERNEL_DTYPES}")
    if weight.device != x.device:
        raise StrictNormError(f"x is on {x.device} but weight is on {weight.device}")
    # element-wise comparisons: under torch.compile with dynamic shapes N may be symbolic while the weight's
    # shape is static, and a tuple membership test then fails to trace
    shape = weight.shape
    if not ((weight.dim() == 1 and shape[0] == n)
            or (heads is not None and weight.dim() == 2 and shape[0] == heads and shape[1] == n)):
        want = f"({n},)" if heads is None else f"({n},) or ({heads}, {n})"
        raise StrictNormError(f"weight has shape {tuple(shape)}; expected {want}")


def check_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise StrictNormError(f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.device != b.device:
        raise StrictNormError(f"{what}: devices differ, {a.device} vs {b.device}")


def compute_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """fp32 for every contract dtype; float64 only for the reference's checking mode."""
    return torch.float64 if x_dtype == torch.float64 else torch.float32
