"""Backend `triton`: the portable GPU path (NVIDIA and ROCm); also runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ...contract import NormSpec
from ...reference import next_pow2
from ..layout import RowLayout, backward_views, forward_views, row_layout
from ..registry import get_backend, status

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MODE = {"llama": 0, "gemma": 1, "none": 2}
# Elements one program keeps in flight; more rows per program when rows are short.
_TILE_ELEMS = 4096
# Longest padded row whose fast dW uses in-kernel partials (see rms_norm_bwd).
_PARTIALS_MAX_P = 8192
# Columns per program and unrolled rows per step of the Triton strict fold (the ROCm fold path).
_FOLD_BN = 64
_FOLD_UNROLL = 8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():
    from . import kernels

    return kernels


def _store_view(t: torch.Tensor) -> torch.Tensor:
    """bf16 outputs are written as int16 bit patterns (see kernels.py)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _row_tile(n: int) -> tuple[int, int, int, int]:
    """(ROWS, P, LOG2P, num_warps) for a row kernel: a function of N alone, so that one compiled
    kernel serves every row count (any choice gives the same bits; the tree is fixed by N)."""
    p = next_pow2(n)
    rows_per_prog = max(1, _TILE_ELEMS // p)
    num_warps = max(1, min(32, rows_per_prog * p // 512))
    return rows_per_prog, p, p.bit_length() - 1, num_warps


def _launch_opts(num_warps: int) -> dict:
    return {"num_warps": num_warps, "enable_fp_fusion": False}


class TritonBackend:
    name = "triton"
    ops = frozenset({"rms_norm", "left_fold"})

    def __init__(self) -> None:
        # The strict fold runs on the CUDA backend's kernel where that backend is available (same
        # bits, much faster); the Triton fold below serves ROCm and machines without NVRTC.
        self.use_cuda_fold = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"triton is not installed ({e}); pip install 'strictnorm[triton]'"
        if _interpreting():
            return None if device.type == "cpu" else "TRITON_INTERPRET=1 runs kernels on CPU tensors only"
        if device.type != "cuda":
            return f"Triton kernels run on GPUs (CUDA or ROCm); tensors are on {device.type}"
        return None

    # ---- forward -------------------------------------------------------------------------------
    def rms_norm_fwd(self, x: Tensor, weight: Tensor | None, residual: Tensor | None, spec: NormSpec
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
        v = forward_views(x, weight, residual, spec.out_dtype)
        if v.lay.rows == 0:
            return v.y, v.rstd, v.z
        n = v.lay.n
        rows_per_prog, p, log2p, num_warps = _row_tile(n)
        norm_dtype = residual.dtype if residual is not None else x.dtype
        _kernels().rms_fwd_kernel[(_cdiv(v.lay.rows, rows_per_prog),)](
            v.x, *v.lay.args(), v.res, *v.rlay.args(), _store_view(v.z) if v.z is not None else v.y,
            v.weight if v.weight is not None else v.x, (v.weight.stride(0) if v.per_head else 0),
            _store_view(v.y), v.rstd, v.lay.rows, n, v.lay.r1, v.lay.g, spec.eps, spec.offset,
            ROWS=rows_per_prog, P=p, LOG2P=log2p, MODE=_MODE[spec.mode], XDT=_DT[norm_dtype],
            YDT=_DT[spec.out_dtype], HAS_W=v.weight is not None, PER_HEAD=v.per_head,
            HAS_RES=residual is not None, **_launch_opts(num_warps))
        return v.y, v.rstd, v.z

    # ---- backward ------------------------------------------------------------------------------
    def rms_norm_bwd(self, dy: Tensor, z: Tensor, weight: Tensor | None, rstd: Tensor, dres: Tensor | None,
                     spec: NormSpec, dw_mode: str, need_dw: bool, dx_out: Tensor | None
                     ) -> tuple[Tensor, Tensor | None]:
        v = backward_views(dy, z, weight, rstd, dres, dx_out)
        n, rows = v.lay.n, v.lay.rows
        # fast dW: per-program fp32 partials in the dx pass (shared weight). Per-head weights take the
        # strict fold for both modes (it satisfies "fast" too: deterministic, fixed order).
        # Past P = 8192 the per-program partials (P fp32 values per program, held across rows) cost more
        # than the strict fold: 701 vs 291 us at 2048 x 18432 on an H200 (bench/results/2026-11-29-h200-run2);
        # the fold is deterministic too, so it serves dw="fast" there.
        partials = need_dw and dw_mode == "fast" and not v.per_head and next_pow2(n) <= _PARTIALS_MAX_P
        dw = None
        if rows == 0:
            if need_dw:
                dw = torch.zeros(weight.shape, dtype=weight.dtype, device=z.device)
            return v.dx, dw
        if need_dw and not partials:  # before the dx pass: in place, dx overwrites dy
            dw = self._fold(v.dy, v.dlay, v.z, v.lay, v.rstd, _MODE[spec.mode] + 1, _DT[z.dtype],
                            weight.shape[0] if v.per_head else 1).reshape(weight.shape).to(weight.dtype)
        rows_per_prog, p, log2p, num_warps = _row_tile(n)
        blocks = _cdiv(rows, rows_per_prog)
        nprog = min(blocks, _num_sms(z.device) * 4) if partials else blocks
        part = torch.empty((nprog, n), dtype=torch.float32, device=z.device) if partials else v.rstd  # unused then
        _kernels().rms_bwd_kernel[(nprog,)](
            v.dy, *v.dlay.args(), v.z, *v.lay.args(), v.weight if v.weight is not None else v.z,
            (v.weight.stride(0) if v.per_head else 0), v.rstd, v.dres, *v.elay.args(),
            _store_view(v.dx_kernel), *v.xlay.args(), part, rows, n, v.lay.r1, v.lay.g, spec.offset,
            ROWS=rows_per_prog, P=p, LOG2P=log2p, MODE=_MODE[spec.mode], XDT=_DT[z.dtype],
            HAS_W=v.weight is not None, PER_HEAD=v.per_head, HAS_DRES=dres is not None,
            DW_PARTIALS=partials, **_launch_opts(num_warps))
        if v.dx_kernel is not v.dx:
            v.dx.copy_(v.dx_kernel)
        if partials:
            dw = self._sum_rows(part, weight.dtype)
        return v.dx, dw

    # ---- strict fold ---------------------------------------------------------------------------
    def _cuda_available(self, t: Tensor) -> bool:
        return self.use_cuda_fold and t.device.type == "cuda" and status("cuda", t.device).available

    def _sum_rows(self, part: Tensor, dtype: torch.dtype) -> Tensor:
        """The fast dW's partial rows summed in a fixed order: the CUDA backend's fold where it is available
        (as the strict fold), else torch's sum over rows (deterministic on a given device)."""
        if self._cuda_available(part):
            return get_backend("cuda").sum_rows(part, dtype)
        return part.sum(0).to(dtype)

    def _fold(self, a: Tensor, alay: RowLayout, b: Tensor, blay: RowLayout, rstd: Tensor, what: int, xdt: int,
              groups: int) -> Tensor:
        if self._cuda_available(a):
            return get_backend("cuda").fold(a, alay, b, blay, rstd, what, groups)
        out = torch.empty((groups, alay.n), dtype=torch.float32, device=a.device)
        grid = (_cdiv(alay.n, _FOLD_BN), groups)
        _kernels().fold_kernel[grid](
            a, *alay.args(), b, *blay.args(), rstd, out, alay.rows // groups, alay.n, alay.r1, alay.g,
            groups, BN=_FOLD_BN, UNROLL=_FOLD_UNROLL, WHAT=what, XDT=xdt,
            **_launch_opts(2))
        return out

    def left_fold(self, rows: Tensor) -> Tensor:
        if rows.numel() == 0:
            return torch.zeros(rows.shape[1:], dtype=torch.float32, device=rows.device)
        flat = rows.reshape(rows.shape[0], -1)
        ak, lay = row_layout(flat)
        return self._fold(ak, lay, ak, lay, ak, 0, 0, 1).reshape(rows.shape[1:])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
