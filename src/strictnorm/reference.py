"""The numerical contract in plain PyTorch, on any device. These functions define the bits.

Every fp32 operation here is a single IEEE operation rounded once. Two PyTorch behaviours
would break that and are avoided on purpose:
- fp32 `torch.sqrt` on the CPU is not always correctly rounded, and on CUDA `tensor / scalar`
  is computed as a multiplication by the reciprocal. Division and square root are therefore
  taken in float64 and rounded once to fp32, which gives exactly the IEEE fp32 result
  (float64 carries more than 2·24 + 2 bits, so the double rounding is innocuous).
- No op is fused: each line below is one rounded operation.

Inputs of dtype float64 run the same formulas in float64 ("checking mode"): that is the
float64 computation the accuracy tests compare against, and what gradcheck differentiates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import NormSpec, compute_dtype

# Rows per chunk when the reference folds or sums dW contributions (bounds its temporaries).
_CHUNK_ROWS = 4096


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def exact_mean_scale(n: int) -> float:
    """1 / n where n is a power of two, else 0.0. A kernel may take a row's mean as sum * (1 / n) then: 2^-k is exact
    in fp32, so the product is the same rounding of the same exact quotient as div_rn(sum, n), subnormal results,
    infinities and NaN included; one multiply where an IEEE division takes about ten instructions."""
    return 1.0 / n if n > 0 and n & (n - 1) == 0 else 0.0


def div_rn(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE division a / b in a's dtype (fp32 or float64), rounded once."""
    b = torch.as_tensor(b, dtype=torch.float64, device=a.device)
    if a.dtype == torch.float64:
        return torch.div(a, b)
    return torch.div(a.double(), b).to(a.dtype)


def sqrt_rn(a: torch.Tensor) -> torch.Tensor:
    """IEEE square root in a's dtype (fp32 or float64), rounded once."""
    if a.dtype == torch.float64:
        return torch.sqrt(a)
    return torch.sqrt(a.double()).to(a.dtype)


def rd(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to nearest even into dtype (no-op when v already has it)."""
    return v.to(dtype)


def canon_sum(v: torch.Tensor) -> torch.Tensor:
    """The canonical row reduction over the last dimension.

    A balanced pairwise tree over index order, adjacent first: the row is zero-padded (+0.0) to
    P = next_pow2(N) lanes, then each level adds lanes (2j, 2j+1). The order depends on N only.
    """
    n = v.shape[-1]
    p = next_pow2(n)
    if p != n:
        v = F.pad(v, (0, p - n))
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def compute_rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd = 1 / sqrt((canon_sum(xf * xf) / N) + eps), each step one rounded op. Shape (...,)."""
    n = xf.shape[-1]
    ss = canon_sum(xf * xf)
    mean = div_rn(ss, float(n))
    return div_rn(torch.ones_like(mean), sqrt_rn(mean + eps))


def effective_weight(weight: torch.Tensor | None, spec: NormSpec, x_dtype: torch.dtype,
                     cd: torch.dtype, device: torch.device) -> torch.Tensor:
    """wf = f32(w) + f32(offset), added in fp32 (never in the weight dtype); 1.0 without a weight.

    In casting mode "none" the weight is then rounded to x's dtype, as every op there is in x's dtype.
    """
    if weight is None:
        return torch.ones((), dtype=cd, device=device)
    wf = weight.to(cd) + spec.offset
    if spec.mode == "none":
        wf = rd(rd(wf, x_dtype), cd)
    return wf


def normalized_as_used(xf: torch.Tensor, rstd: torch.Tensor, spec: NormSpec,
                       x_dtype: torch.dtype, cd: torch.dtype) -> torch.Tensor:
    """The normalized row as y's scaling step sees it: xf * rstd in gemma mode; rounded to x's dtype
    and widened back (exact) in llama mode; in none mode also with rstd rounded to x's dtype first."""
    if spec.mode == "gemma":
        return xf * rstd[..., None]
    if spec.mode == "none":
        rstd = rd(rd(rstd, x_dtype), cd)
    return rd(rd(xf * rstd[..., None], x_dtype), cd)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, spec: NormSpec
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """y (x.shape, spec.out_dtype) and rstd (x.shape[:-1], fp32; float64 in checking mode).

    weight is (N,) or, for per-head QK-norm, (H, N) broadcasting over x's (..., H, N).
    """
    cd = compute_dtype(x.dtype)
    xf = x.to(cd)
    rstd = compute_rstd(xf, spec.eps)
    wf = effective_weight(weight, spec, x.dtype, cd, x.device)
    y = normalized_as_used(xf, rstd, spec, x.dtype, cd) * wf
    if spec.mode == "none":  # every op in x's dtype
        y = rd(rd(y, x.dtype), cd)
    return rd(y, spec.out_dtype), rstd


def dw_contributions(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, spec: NormSpec
                     ) -> torch.Tensor:
    """Each row's dW contribution (x.shape, fp32): f32(dy) times the normalized row as y used it."""
    cd = compute_dtype(x.dtype)
    return dy.to(cd) * normalized_as_used(x.to(cd), rstd, spec, x.dtype, cd)


def rms_norm_backward_dx(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                         rstd: torch.Tensor, spec: NormSpec, dres: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """dx = rd((g - xh * c) * rstd [+ f32(dres)], x.dtype) with g = f32(dy) * wf, c = canon_sum(xh * g) / N.

    dres is the gradient arriving through a fused add's residual_out; it is added in fp32 before the
    single rounding.
    """
    cd = compute_dtype(x.dtype)
    n = x.shape[-1]
    xf = x.to(cd)
    xh = xf * rstd[..., None]
    g = dy.to(cd) * effective_weight(weight, spec, x.dtype, cd, x.device)
    c = div_rn(canon_sum(xh * g), float(n))
    dx = (g - xh * c[..., None]) * rstd[..., None]
    if dres is not None:
        dx = dx + dres.to(cd)
    return rd(dx, x.dtype)


def left_fold_rows(rows: torch.Tensor) -> torch.Tensor:
    """acc = +0.0; for each row in ascending order: acc = acc + f32(row). rows: (R, ...) -> (...)."""
    out_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    acc = torch.zeros(rows.shape[1:], dtype=out_dtype, device=rows.device)
    for start in range(0, rows.shape[0], _CHUNK_ROWS):
        _fold_into(acc, rows[start:start + _CHUNK_ROWS].to(out_dtype))
    return acc


def _fold_into(acc: torch.Tensor, rows: torch.Tensor) -> None:
    """acc = acc + rows[r] for r ascending, each add one rounded op (the strict fold's step)."""
    for r in range(rows.shape[0]):
        acc.add_(rows[r])


def reduce_dw(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, spec: NormSpec,
              weight: torch.Tensor, dw_mode: str) -> torch.Tensor:
    """dW in weight's dtype and shape: the rows' contributions reduced over rows in logical order.

    strict: the ascending fp32 left fold from +0.0. fast: a deterministic chunked sum (the reference
    makes no promise on its bits beyond run-to-run determinism on one machine).
    A per-head weight (H, N) reduces each head over its own rows.
    """
    n = x.shape[-1]
    groups = weight.shape[0] if weight.dim() == 2 else 1
    x_rows = x.reshape(-1, groups, n)
    dy_rows = dy.reshape(-1, groups, n)
    rstd_rows = rstd.reshape(-1, groups)
    cd = compute_dtype(x.dtype)
    acc = torch.zeros((groups, n), dtype=cd, device=x.device)
    for start in range(0, x_rows.shape[0], _CHUNK_ROWS):
        sl = slice(start, start + _CHUNK_ROWS)
        contrib = dw_contributions(dy_rows[sl], x_rows[sl], rstd_rows[sl], spec)
        if dw_mode == "strict":
            _fold_into(acc, contrib)
        else:
            acc.add_(contrib.sum(0))
    return acc.reshape(weight.shape).to(weight.dtype)
