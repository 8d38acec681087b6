"""nn.Modules over the functional API, with Gemma presets (offset 1.0, gemma casting, zero init)."""

from __future__ import annotations

import torch
from torch import nn

from . import api


class RMSNorm(nn.Module):
    """y = rms_norm(x, weight, eps) over the last dimension; see strictnorm.rms_norm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0,
                 casting_mode: str = "llama", dw: str = "fast", elementwise_affine: bool = True,
                 init: float = 1.0, in_place: bool = False, backend: str | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.dw = dw
        self.in_place = in_place
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.full((hidden_size,), init, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return api.rms_norm(x, self.weight, self.eps, offset=self.offset, casting_mode=self.casting_mode,
                            dw=self.dw, in_place=self.in_place, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, casting_mode={self.casting_mode!r}, "
                f"dw={self.dw!r}")


class FusedAddRMSNorm(RMSNorm):
    """(y, residual_out) = fused_add_rms_norm(x, residual, weight, eps)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return api.fused_add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset,
                                      casting_mode=self.casting_mode, dw=self.dw, in_place=self.in_place,
                                      backend=self.backend)


class QKNorm(RMSNorm):
    """RMSNorm over head_dim of (..., H, D); per-head weights (H, D) when num_heads is given."""

    def __init__(self, head_dim: int, eps: float = 1e-6, *, num_heads: int | None = None,
                 **kwargs) -> None:
        super().__init__(head_dim, eps, **kwargs)
        self.num_heads = num_heads
        if num_heads is not None and self.weight is not None:
            self.weight = nn.Parameter(self.weight.detach().expand(num_heads, head_dim).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return api.qk_norm(x, self.weight, self.eps, offset=self.offset, casting_mode=self.casting_mode,
                           dw=self.dw, in_place=self.in_place, backend=self.backend)


def _gemma(cls):
    """A Gemma preset of cls: weight stored as a delta from 1 (offset 1.0, zero init), gemma casting."""

    class Gemma(cls):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("offset", 1.0)
            kwargs.setdefault("casting_mode", "gemma")
            kwargs.setdefault("init", 0.0)
            super().__init__(*args, **kwargs)

    Gemma.__name__ = Gemma.__qualname__ = f"Gemma{cls.__name__}"
    Gemma.__doc__ = f"{cls.__name__} with Gemma's conventions: offset 1.0 added in fp32, gemma casting, zero init."
    return Gemma


GemmaRMSNorm = _gemma(RMSNorm)
GemmaFusedAddRMSNorm = _gemma(FusedAddRMSNorm)
GemmaQKNorm = _gemma(QKNorm)
