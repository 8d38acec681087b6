"""What a backend implements. Inputs reach a backend already validated (see contract.py)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from ..contract import NormSpec

# Op names a backend may provide. "rms_norm" covers rms_norm, fused_add_rms_norm and qk_norm
# (forward and backward); "left_fold" is reduce_rows_left_fold.
OPS = ("rms_norm", "left_fold")

# The codes the kernels (CUDA C++, Triton, CuTe DSL) take for a casting mode and for an element dtype.
MODE_CODES = {"llama": 0, "gemma": 1, "none": 2}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


_Method = TypeVar("_Method", bound=Callable)


def on_tensor_device(method: _Method) -> _Method:
    """Runs a GPU backend's method with its first argument's GPU current where another one is.

    Triton's JIT compiles, loads and launches for the current device, a driver launch goes to the current
    context and an NVRTC module is loaded into it: a tensor on cuda:1 while cuda:0 is current would reach the
    wrong GPU. torch's own ops guard themselves; strictnorm's entry points do the same (torch.cuda.device),
    and leave the caller's current device as it was. Where the tensor's GPU is already current (the usual
    case) the method runs directly: one device query of host time."""

    first = list(inspect.signature(method).parameters)[1]  # the tensor argument, after self

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        index = (args[0] if args else kwargs[first]).get_device()
        if index < 0 or index == torch.cuda.current_device():
            return method(self, *args, **kwargs)
        with torch.cuda.device(index):
            return method(self, *args, **kwargs)

    guarded.device_guarded = True  # tests check that every entry point carries the guard
    return guarded  # type: ignore[return-value]


def no_join() -> None:
    """The join of work that was not forked onto another stream (see CudaBackend.launch_fold)."""


class Backend(Protocol):
    name: str
    ops: frozenset[str]

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when the backend can run on device, else a sentence that says why not."""

    def rms_norm_fwd(self, x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                     spec: NormSpec, need_rstd: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(y, rstd, residual_out). With a residual, the norm's input is
        z = rd(f32(x) + f32(residual), residual.dtype), returned as residual_out (contiguous).
        y is contiguous with x's shape and spec.out_dtype; rstd is fp32 with shape x.shape[:-1].
        weight is None, (N,), or (H, N) applied per head over x's (..., H, N). need_rstd False: the caller
        does not use rstd, and a backend may return None for it (an inference call: one allocation less)."""

    def rms_norm_bwd(self, dy: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None,
                     rstd: torch.Tensor, dres: torch.Tensor | None, spec: NormSpec, dw_mode: str,
                     need_dw: bool, dx_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(dz, dw). dz in z's dtype and contiguous (the custom op's fake says so: a compiled graph may
        view it), written into dx_out when given (in-place backward);
        dw in weight's dtype and shape when need_dw, else None."""

    def left_fold(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 ascending left fold over dim 0 from +0.0."""
