"""Backend `torch`: the reference implementation itself, on any device PyTorch supports."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference as ref
from ..contract import NormSpec


class TorchBackend:
    name = "torch"
    ops = frozenset({"rms_norm", "left_fold"})

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def rms_norm_fwd(self, x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec,
                     need_rstd: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
        z = None
        if residual is not None:
            cd = torch.float64 if torch.float64 in (x.dtype, residual.dtype) else torch.float32
            z = (x.to(cd) + residual.to(cd)).to(residual.dtype).contiguous()
            x = z
        y, rstd = ref.rms_norm_forward(x, weight, spec)
        return y.contiguous(), rstd.contiguous(), z

    def rms_norm_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, rstd: Tensor, dres: Tensor | None,
                     spec: NormSpec, dw_mode: str, need_dw: bool, dx_out: Tensor | None
                     ) -> tuple[Tensor, Tensor | None]:
        dz = ref.rms_norm_backward_dx(dy, z, weight, rstd, spec, dres).contiguous()  # as the protocol says
        dw = ref.reduce_dw(dy, z, rstd, spec, weight, dw_mode) if need_dw else None
        if dx_out is not None:
            dx_out.copy_(dz)
            dz = dx_out
        return dz, dw

    def left_fold(self, rows: Tensor) -> Tensor:
        return ref.left_fold_rows(rows)
