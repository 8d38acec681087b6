"""torch.library custom ops and their autograd: the one path every public function goes through.

Custom ops make strictnorm opaque to torch.compile (no graph break, no retracing into kernels)
and capturable in CUDA graphs. The backend is resolved in Python before the op is called and
travels as a string argument, so a compiled graph keeps the backend it was traced with.
"""

from __future__ import annotations

import torch

from .backends.registry import get_backend
from .contract import NormSpec, validated_spec

_LIB = "strictnorm"


def _spec(eps: float, offset: float, mode: str, out_dtype: torch.dtype | None, x_dtype: torch.dtype) -> NormSpec:
    """For the backward ops, whose scalars were validated and rounded by the forward."""
    return NormSpec(eps=eps, offset=offset, mode=mode, out_dtype=out_dtype or x_dtype)


def _rstd_dtype(x_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if x_dtype == torch.float64 else torch.float32


@torch.library.custom_op(f"{_LIB}::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                 eps: float, offset: float, mode: str, out_dtype: torch.dtype | None,
                 dw_mode: str, in_place: bool, backend: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, rstd, residual_out); residual_out is an empty tensor when there is no residual.
    dw_mode and in_place only steer the backward; they are arguments so the autograd context sees them."""
    norm_dtype = residual.dtype if residual is not None else x.dtype
    spec = validated_spec(norm_dtype, eps, offset, mode, out_dtype, dw_mode, weight is not None, in_place)
    y, rstd, z = get_backend(backend).rms_norm_fwd(x, weight, residual, spec)
    return y, rstd, (z if z is not None else x.new_empty(0))


@rms_norm_fwd.register_fake
def _(x, weight, residual, eps, offset, mode, out_dtype, dw_mode, in_place, backend):
    norm_dtype = residual.dtype if residual is not None else x.dtype
    validated_spec(norm_dtype, eps, offset, mode, out_dtype, dw_mode, weight is not None, in_place)
    y = x.new_empty(x.shape, dtype=out_dtype or norm_dtype)
    rstd = x.new_empty(x.shape[:-1], dtype=_rstd_dtype(norm_dtype))
    z = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty(0)
    return y, rstd, z


@torch.library.custom_op(f"{_LIB}::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                 dres: torch.Tensor | None, offset: float, mode: str, dw_mode: str, need_dw: bool,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, dw); dw is an empty tensor when not needed."""
    spec = _spec(0.0, offset, mode, dy.dtype, z.dtype)
    dz, dw = get_backend(backend).rms_norm_bwd(dy, z, weight, rstd, dres, spec, dw_mode, need_dw, None)
    return dz, (dw if dw is not None else z.new_empty(0))


@rms_norm_bwd.register_fake
def _(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend):
    dw = weight.new_empty(weight.shape) if need_dw else z.new_empty(0)
    return z.new_empty(z.shape), dw


@torch.library.custom_op(f"{_LIB}::rms_norm_bwd_inplace", mutates_args=("dy",))
def rms_norm_bwd_inplace(dy: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                         dres: torch.Tensor | None, offset: float, mode: str, dw_mode: str, need_dw: bool,
                         backend: str) -> torch.Tensor:
    """Writes dz into dy's buffer and returns dw (empty when not needed)."""
    spec = _spec(0.0, offset, mode, dy.dtype, z.dtype)
    _, dw = get_backend(backend).rms_norm_bwd(dy, z, weight, rstd, dres, spec, dw_mode, need_dw, dy)
    return dw if dw is not None else z.new_empty(0)


@rms_norm_bwd_inplace.register_fake
def _(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend):
    return weight.new_empty(weight.shape) if need_dw else z.new_empty(0)


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, offset, mode, out_dtype, dw_mode, in_place, backend = inputs
    y, rstd, z = output
    fused = residual is not None
    ctx.save_for_backward(z if fused else x, weight, rstd)
    ctx.fused = fused
    ctx.x_dtype = x.dtype
    norm_dtype = z.dtype if fused else x.dtype
    spec = validated_spec(norm_dtype, eps, offset, mode, out_dtype, dw_mode, weight is not None, in_place)
    ctx.args = (spec.offset, mode, dw_mode, in_place, backend)


def _backward(ctx, dy, _drstd, dres):
    z, weight, rstd = ctx.saved_tensors
    offset, mode, dw_mode, in_place, backend = ctx.args
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dres = dres if ctx.fused else None
    # In place only into a dense buffer of dz's dtype (autograd may hand over an expanded dy).
    if in_place and dy.is_contiguous() and dy.dtype == z.dtype:
        dw = rms_norm_bwd_inplace(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend)
        dz = dy
    else:
        dz, dw = rms_norm_bwd(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend)
    dw = dw if need_dw else None
    if ctx.fused:
        dx = dz if ctx.x_dtype == dz.dtype else dz.to(ctx.x_dtype)
        return dx, dw, dz, None, None, None, None, None, None, None
    return dz, dw, None, None, None, None, None, None, None, None


torch.library.register_autograd(f"{_LIB}::rms_norm_fwd", _backward, setup_context=_setup_context)


@torch.library.custom_op(f"{_LIB}::left_fold", mutates_args=())
def left_fold(rows: torch.Tensor, backend: str) -> torch.Tensor:
    return get_backend(backend).left_fold(rows)


@left_fold.register_fake
def _(rows, backend):
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return rows.new_empty(rows.shape[1:], dtype=dtype)
