"""torch.library custom ops and their autograd, plus the eager fast path that shares their code.

Custom ops make strictnorm opaque to torch.compile (no graph break, no retracing into kernels).
The backend is resolved in Python before the op is called and travels as a string argument, so a
compiled graph keeps the backend it was traced with. In eager mode `rms_norm` below skips the
custom-op dispatcher (an autograd.Function calling the same backend functions).
"""

from __future__ import annotations

import functools

import torch

from .backends.registry import get_backend
from .contract import NormSpec, validated_spec

_LIB = "strictnorm"


@functools.lru_cache(maxsize=256)  # a NormSpec built per backward call costs ~1 us of host time
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


def _save(ctx, x, weight, residual, z, rstd, spec: NormSpec, dw_mode: str, in_place: bool, backend: str) -> None:
    fused = residual is not None
    ctx.save_for_backward(z if fused else x, weight, rstd)
    ctx.fused = fused
    ctx.x_dtype = x.dtype
    ctx.y_dtype = spec.out_dtype
    ctx.args = (spec.offset, spec.mode, dw_mode, in_place, backend)


def _grads(ctx, dy, dres, bwd, bwd_inplace):
    """(dx, dw, dresidual) from the saved forward; bwd/bwd_inplace run the backward (as custom ops
    under torch.compile, as direct backend calls in eager mode)."""
    z, weight, rstd = ctx.saved_tensors
    offset, mode, dw_mode, in_place, backend = ctx.args
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dres = dres if ctx.fused else None
    if dy is None:  # y unused (the eager path does not materialize zero gradients): only residual_out's
        dy = torch.zeros(z.shape, dtype=ctx.y_dtype, device=z.device)
    # In place only into a dense buffer of dz's dtype (autograd may hand over an expanded dy).
    if in_place and dy.is_contiguous() and dy.dtype == z.dtype:
        dw = bwd_inplace(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend)
        dz = dy
    else:
        dz, dw = bwd(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend)
    dw = dw if need_dw else None
    if ctx.fused:
        return (dz if ctx.x_dtype == dz.dtype else dz.to(ctx.x_dtype)), dw, dz
    return dz, dw, None


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, offset, mode, out_dtype, dw_mode, in_place, backend = inputs
    y, rstd, z = output
    norm_dtype = residual.dtype if residual is not None else x.dtype
    spec = validated_spec(norm_dtype, eps, offset, mode, out_dtype, dw_mode, weight is not None, in_place)
    _save(ctx, x, weight, residual, z, rstd, spec, dw_mode, in_place, backend)


def _backward(ctx, dy, _drstd, dres):
    return *_grads(ctx, dy, dres, rms_norm_bwd, rms_norm_bwd_inplace), None, None, None, None, None, None, None


torch.library.register_autograd(f"{_LIB}::rms_norm_fwd", _backward, setup_context=_setup_context)


# ---- eager fast path -----------------------------------------------------------------------------
# Dispatching through a custom op costs tens of microseconds of Python per call. Outside
# torch.compile and tensor subclasses (fake tensors, ...), the same backend functions run through
# a plain autograd.Function instead: identical kernels and bits, a fraction of the host time.

def _direct_bwd(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend):
    spec = _spec(0.0, offset, mode, dy.dtype, z.dtype)
    return get_backend(backend).rms_norm_bwd(dy, z, weight, rstd, dres, spec, dw_mode, need_dw, None)


def _direct_bwd_inplace(dy, z, weight, rstd, dres, offset, mode, dw_mode, need_dw, backend):
    spec = _spec(0.0, offset, mode, dy.dtype, z.dtype)
    return get_backend(backend).rms_norm_bwd(dy, z, weight, rstd, dres, spec, dw_mode, need_dw, dy)[1]


class _EagerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, spec, dw_mode, in_place, backend):
        y, rstd, z = get_backend(backend).rms_norm_fwd(x, weight, residual, spec)
        _save(ctx, x, weight, residual, z, rstd, spec, dw_mode, in_place, backend)
        ctx.mark_non_differentiable(rstd)
        # unused outputs (rstd, usually residual_out) get None instead of zero tensors: two fewer fills
        # per backward, ~75 us of host time per step on an H200 machine (bench/results/2026-11-29-h200-run4)
        ctx.set_materialize_grads(False)
        return y, rstd, z  # z None without a residual: no placeholder tensor to allocate (~2 us of host time)

    @staticmethod
    def backward(ctx, dy, _drstd, dres):
        return *_grads(ctx, dy, dres, _direct_bwd, _direct_bwd_inplace), None, None, None, None


def _plain(t: torch.Tensor | None) -> bool:
    # is_meta, not t.device.type: building a torch.device costs ~0.3 us of host time per call
    return t is None or (type(t) is torch.Tensor and not t.is_meta)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
             offset: float, mode: str, out_dtype: torch.dtype | None, dw_mode: str, in_place: bool,
             backend: str, need_rstd: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, rstd, residual_out): the custom op under torch.compile (residual_out an empty tensor without a residual),
    else the eager path (residual_out None without a residual). need_rstd False: the caller drops rstd, so an
    eager call without autograd lets the backend skip it (rstd may then be None)."""
    if torch.compiler.is_compiling() or not (_plain(x) and _plain(weight) and _plain(residual)):
        return rms_norm_fwd(x, weight, residual, eps, offset, mode, out_dtype, dw_mode, in_place, backend)
    norm_dtype = residual.dtype if residual is not None else x.dtype
    spec = validated_spec(norm_dtype, eps, offset, mode, out_dtype, dw_mode, weight is not None, in_place)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                    or (residual is not None and residual.requires_grad)):
        return _EagerNorm.apply(x, weight, residual, spec, dw_mode, in_place, backend)
    return get_backend(backend).rms_norm_fwd(x, weight, residual, spec, need_rstd)  # inference: no autograd node


@torch.library.custom_op(f"{_LIB}::left_fold", mutates_args=())
def left_fold(rows: torch.Tensor, backend: str) -> torch.Tensor:
    return get_backend(backend).left_fold(rows)


@left_fold.register_fake
def _(rows, backend):
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return rows.new_empty(rows.shape[1:], dtype=dtype)
