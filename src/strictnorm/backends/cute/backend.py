"""Backend `cute`: RMSNorm and FusedAddRMSNorm forward and backward as CuTe DSL kernels (kernels.py).

Weight and Gemma offset reach the kernels separately; the offset is added to the widened weight in
fp32 inside the forward and the backward. What the kernels do not cover runs on the CUDA backend's
kernels, which give the same bits (the contract fixes every bit, and both are tested against the
reference): the strict dW left fold, the fast dW's partial-row sum, and QK-norm with per-head (H, D)
weights. Hence the backend needs the CUDA backend too. It is offered by name (`backend="cute"`), not
chosen automatically, while it is slower than the CUDA backend (bench/results/).

Inputs: any (..., N) tensor whose leading dims merge into rows with one row stride and unit stride
along N is read in place; anything else is copied first (memory traffic, never other bits). Rows of
up to 32768 lanes (N <= 32768).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...contract import NormSpec
from ...reference import next_pow2
from ..base import no_join, on_tensor_device
from ..layout import forward_outputs, remember, row_layout, rstd_sink, signature

_MAX_P = 32768  # longest padded row the kernels' register mapping was built and tested for
_MIN_ARCH = (9, 0)
_INSTALL = "pip install 'strictnorm[cute]'"


def _kernels():
    from . import kernels

    return kernels


def _cuda():
    from ..registry import get_backend

    return get_backend("cuda")


def as_rows(t: Tensor) -> Tensor:
    """t as (rows, N) with unit stride along N and one row stride: a view where the layout allows,
    a contiguous copy otherwise."""
    n = t.shape[-1]
    try:
        rows = t.view(-1, n)
    except RuntimeError:  # leading dims that do not merge
        rows = t.reshape(-1, n)
    if n > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


def check_row_length(n: int) -> None:
    if next_pow2(n) > _MAX_P:
        raise ValueError(f"backend 'cute' handles rows of up to {_MAX_P} elements, got N = {n}; "
                         "use backend='cuda' or 'triton' (same bits)")


@dataclass(frozen=True)
class _BwdPlan:
    launch: object  # kernels.BackwardLaunch
    fold: bool  # the strict dW through the CUDA fold
    fold_sms: int
    into_out: bool  # dx written straight into dx_out
    rows_as_they_are: bool  # 2D rows with unit stride along N: no as_rows views


class CuteBackend:
    name = "cute"
    ops = frozenset({"rms_norm", "left_fold"})

    def __init__(self) -> None:
        # Where the CUDA fold runs beside this dx pass (CudaBackend.fold_beside_dx, opt-in), the SMs shared out as the
        # CUDA backend's are (CudaBackend.shared_fold_sms; same bits). Opt-in: 16384 x 4096 254 -> 266 us, 32768 x
        # 4096 497 -> 467 (kernel-only, bench/results/2026-12-01-h200-run19, call b), timed with the host's launch
        # gap between the two kernels, as the CUDA and Triton shares were before they lost with the host ahead.
        self.share_sms_with_fold = False
        self._fwd_plans: dict[tuple, object] = {}
        self._bwd_plans: dict[tuple, _BwdPlan] = {}

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"CuTe DSL kernels run on NVIDIA GPUs; tensors are on {device.type}"
        if torch.version.hip is not None or not torch.cuda.is_available():
            return "needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is False or this is ROCm)"
        if torch.cuda.get_device_capability(device) < _MIN_ARCH:
            return "needs a Hopper or newer GPU (compute capability >= 9.0)"
        try:
            _kernels()
        except Exception as e:  # the optional extra is missing or broken
            return f"nvidia-cutlass-dsl is not usable ({type(e).__name__}: {e}); {_INSTALL}"
        reason = _cuda().unavailable_reason(device)
        if reason is not None:
            return f"the strict dW fold and per-head weights run on the CUDA backend, which is unavailable: {reason}"
        return None

    @on_tensor_device
    def rms_norm_fwd(self, x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec,
                     need_rstd: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if weight is not None and weight.dim() == 2:  # per-head QK-norm weights
            return _cuda().rms_norm_fwd(x, weight, residual, spec, need_rstd)
        key = (x.get_device(), signature(x, weight, residual), spec, need_rstd)
        plan = self._fwd_plans.get(key)
        if plan is None:
            plan = remember(self._fwd_plans, key, self._plan_fwd(x, weight, residual, spec, need_rstd))
        y, rstd, z = forward_outputs(x, residual, spec.out_dtype, need_rstd)
        if not plan.rows:
            return y, rstd, z
        if weight is not None and weight.stride(-1) != 1:
            weight = weight.contiguous()
        if x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):  # rows as they are
            plan(x, weight, residual, y, rstd if rstd is not None else rstd_sink(x.device, plan.rows), z, spec.eps,
                 spec.offset)
        else:
            n = x.shape[-1]
            plan(as_rows(x), weight, as_rows(residual) if residual is not None else None, y.view(-1, n),
                 rstd.view(-1) if rstd is not None else rstd_sink(x.device, plan.rows),
                 z.view(-1, n) if z is not None else None, spec.eps, spec.offset)
        return y, rstd, z

    @staticmethod
    def _plan_fwd(x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec, need_rstd: bool):
        """The kernels' forward launch for inputs with this signature (their rows as as_rows makes them), for a
        training call or (need_rstd False) an inference call."""
        check_row_length(x.shape[-1])
        if weight is not None and weight.stride(-1) != 1:
            weight = weight.contiguous()
        return _kernels().plan_forward(as_rows(x), weight, as_rows(residual) if residual is not None else None,
                                       spec.mode, spec.out_dtype, need_rstd)

    @on_tensor_device
    def rms_norm_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, rstd: Tensor, dres: Tensor | None,
                     spec: NormSpec, dw_mode: str, need_dw: bool, dx_out: Tensor | None
                     ) -> tuple[Tensor, Tensor | None]:
        if weight is not None and weight.dim() == 2:
            return _cuda().rms_norm_bwd(dy, z, weight, rstd, dres, spec, dw_mode, need_dw, dx_out)
        key = (z.get_device(), signature(dy, z, weight, rstd, dres, dx_out), spec.mode, dw_mode, need_dw,
               self.share_sms_with_fold)
        plan = self._bwd_plans.get(key)
        if plan is None:
            plan = remember(self._bwd_plans, key, self._plan_bwd(dy, z, weight, dres, dx_out, spec, dw_mode, need_dw))
        if weight is not None and weight.stride(-1) != 1:
            weight = weight.contiguous()
        n = z.shape[-1]
        z2, dy2 = (z, dy) if plan.rows_as_they_are else (as_rows(z), as_rows(dy))
        rstd2 = rstd.reshape(-1).contiguous()
        dw, join = None, no_join
        if plan.fold:  # first, or beside the dx pass (fold_beside_dx): dx is its own buffer then
            cb = _cuda()
            dw, join = cb.strict_dw(*row_layout(dy2), *row_layout(z2), rstd2, spec.mode, weight,
                                    cb.fold_beside(None), sms=plan.fold_sms)
        dx = dx_out if plan.into_out else torch.empty_like(z, memory_format=torch.contiguous_format)
        part = None
        if plan.launch.rows:
            part = plan.launch(dy2, z2, weight, rstd2, as_rows(dres) if dres is not None else None,
                               dx if dx.dim() == 2 else dx.view(-1, n), spec.offset)
        join()
        if part is not None:
            dw = _cuda().sum_rows(part, weight.dtype)
        if dx_out is not None and dx is not dx_out:
            dx_out.copy_(dx)
            dx = dx_out
        return dx, dw

    def _plan_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, dres: Tensor | None, dx_out: Tensor | None,
                  spec: NormSpec, dw_mode: str, need_dw: bool) -> _BwdPlan:
        """The backward's decisions for inputs with this signature: the strict fold or the fast dW's partials, the
        kernels' launch (their rows as as_rows makes them), and whether dx is written straight into dx_out (in place:
        the kernel reads a thread's lanes of dy before it writes them; not where the fold reads dy beside it)."""
        n = z.shape[-1]
        check_row_length(n)
        if weight is not None and weight.stride(-1) != 1:
            weight = weight.contiguous()
        z2, dy2 = as_rows(z), as_rows(dy)
        rows = z2.shape[0]
        strict = dw_mode == "strict" or not _kernels().keeps_partials(n)
        fold = need_dw and (strict or rows == 0)
        fold_sms = _cuda().shared_fold_sms(n, True) if fold and self.share_sms_with_fold else 0
        partials = need_dw and not fold
        into_out = (dx_out is not None and not fold and dx_out.dtype == z.dtype and dx_out.is_contiguous()
                    and dx_out.shape == z.shape)
        dx = dx_out if into_out else torch.empty_like(z, memory_format=torch.contiguous_format)
        launch = _kernels().plan_backward(dy2, z2, weight, as_rows(dres) if dres is not None else None,
                                          dx.view(-1, n) if rows else dx.reshape(-1, n), spec.mode, partials,
                                          fold_sms)
        return _BwdPlan(launch, fold, fold_sms, into_out,
                        rows_as_they_are=z.dim() == dy.dim() == 2 and z.stride(-1) == dy.stride(-1) == 1)

    @on_tensor_device
    def left_fold(self, rows: Tensor) -> Tensor:
        return _cuda().left_fold(rows)
