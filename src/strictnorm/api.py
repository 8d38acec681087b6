"""Public functional API: validate, pick the backend, call the custom op."""

from __future__ import annotations

import torch

from . import ops
from .backends.registry import resolve
from .contract import (
    KERNEL_DTYPES,
    StrictNormError,
    check_norm_input,
    check_same,
    check_weight,
)


def _check_backend_dtypes(backend: str, *tensors: torch.Tensor | None) -> None:
    if backend == "torch":
        return
    for t in tensors:
        if t is not None and t.dtype not in KERNEL_DTYPES:
            raise StrictNormError(
                f"backend {backend!r} takes {', '.join(map(str, KERNEL_DTYPES))}; got {t.dtype} "
                "(float64 runs on the torch reference backend only)")


def _norm(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
          offset: float, casting_mode: str, dw: str, out_dtype: torch.dtype | None, in_place: bool,
          backend: str | None, heads: int | None, need_rstd: bool = False):
    n = check_norm_input(x)
    check_weight(weight, x, n, heads=heads)
    if residual is not None:
        check_norm_input(residual, "residual")
        check_same(x, residual, "x and residual")
    name = resolve(backend, x.device, "rms_norm")
    _check_backend_dtypes(name, x, weight, residual)
    return ops.rms_norm(x, weight, residual, eps, offset, casting_mode, out_dtype, dw, in_place, name, need_rstd)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             offset: float = 0.0, casting_mode: str = "llama", dw: str = "fast",
             out_dtype: torch.dtype | None = None, in_place: bool = False,
             backend: str | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of x (..., N), as docs/contract.md defines it.

    weight: (N,) of fp32/bf16/fp16 or None (scale exactly 1). offset is added to the weight in fp32
    (Gemma: 1.0). casting_mode: "llama", "gemma" or "none". dw: how the backward reduces the weight
    gradient over rows, "strict" (ascending fp32 left fold) or "fast" (deterministic partials).
    out_dtype: y's dtype, x's by default. in_place: the backward writes dx into dy's buffer.
    """
    y, _, _ = _norm(x, weight, None, eps, offset, casting_mode, dw, out_dtype, in_place, backend, None)
    return y


def rms_norm_with_rstd(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                       offset: float = 0.0, casting_mode: str = "llama", dw: str = "fast",
                       out_dtype: torch.dtype | None = None, backend: str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm that also returns the fp32 rstd of each row (x.shape[:-1])."""
    y, rstd, _ = _norm(x, weight, None, eps, offset, casting_mode, dw, out_dtype, False, backend, None, True)
    return y, rstd


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                       eps: float = 1e-6, *, offset: float = 0.0, casting_mode: str = "llama",
                       dw: str = "fast", out_dtype: torch.dtype | None = None, in_place: bool = False,
                       backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out): residual_out = rd(f32(x) + f32(residual), residual.dtype), y = rms_norm(residual_out).

    Gradients reach x, residual and weight, including a gradient arriving through residual_out.
    y's dtype defaults to residual's.
    """
    y, _, z = _norm(x, weight, residual, eps, offset, casting_mode, dw, out_dtype, in_place, backend, None)
    return y, z


def qk_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
            offset: float = 0.0, casting_mode: str = "llama", dw: str = "fast",
            out_dtype: torch.dtype | None = None, in_place: bool = False,
            backend: str | None = None) -> torch.Tensor:
    """RMSNorm over head_dim of q or k shaped (..., H, D), e.g. (B, S, H, D).

    weight: (D,) shared by all heads, or (H, D) per head. x may be a strided view (a slice of a fused
    QKV projection): it is read in place, not copied.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise StrictNormError("qk_norm takes x shaped (..., H, D) with at least two dimensions")
    y, _, _ = _norm(x, weight, None, eps, offset, casting_mode, dw, out_dtype, in_place, backend, x.shape[-2])
    return y


def reduce_rows_left_fold(rows: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """fp32 sum over dim 0 as the ascending left fold acc = acc + f32(row) from +0.0.

    rows: (R, ...) fp32/bf16/fp16, any strides; R = 0 gives zeros. Bitwise equal to the Python loop.
    """
    if not isinstance(rows, torch.Tensor):
        raise StrictNormError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dim() < 1:
        raise StrictNormError("rows must have at least one dimension (the rows)")
    if rows.dtype not in KERNEL_DTYPES + (torch.float64,):
        raise StrictNormError(f"rows has unsupported dtype {rows.dtype}; expected one of {KERNEL_DTYPES}")
    name = resolve(backend, rows.device, "left_fold")
    _check_backend_dtypes(name, rows)
    return ops.left_fold(rows, name)
