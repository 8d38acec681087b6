"""What the kernel backends share: any (..., N) tensor as rows read in place, and the views and
output buffers a forward or backward pass needs around its kernels.

A kernel addresses row r (logical row-major index over the leading dims) of a view with leading
dims coalesced into (R0, R1, G) and strides (s0, s1, sg), unit stride along N:
    g = r % G;  t = r // G;  offset = (t // R1) * s0 + (t % R1) * s1 + g * sg.
G is the head dimension for per-head QK-norm weights, so that row r uses weight row g.
Anything that does not fit (a strided last dimension, more than three non-mergeable leading
dims) is copied first: that costs memory traffic, never a different bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    rows: int
    n: int
    r1: int
    g: int
    s0: int
    s1: int
    sg: int

    def args(self) -> tuple[int, int, int]:
        return self.s0, self.s1, self.sg


def _coalesce(sizes: list[int], strides: list[int]) -> list[tuple[int, int]]:
    dims = [(s, st) for s, st in zip(sizes, strides, strict=True) if s != 1]
    out: list[tuple[int, int]] = []
    for size, stride in reversed(dims):
        if out and stride == out[-1][0] * out[-1][1]:
            inner_size, inner_stride = out.pop()
            out.append((size * inner_size, inner_stride))
        else:
            out.append((size, stride))
    return list(reversed(out))


def _fits(t: torch.Tensor, per_head: bool) -> RowLayout | None:
    n = t.shape[-1]
    if t.numel() == 0:  # nothing to address (strides of empty tensors can be anything)
        return RowLayout(rows=0, n=n, r1=1, g=1, s0=n, s1=0, sg=0)
    if n > 1 and t.stride(-1) != 1:
        return None
    lead = list(t.shape[:-1])
    strides = list(t.stride()[:-1])
    if per_head:
        g, sg = lead.pop(), strides.pop()
    else:
        g, sg = 1, 0
    outer = _coalesce(lead, strides)
    if not per_head and len(outer) == 3:  # a third non-mergeable leading dim: let G carry it
        g, sg = outer.pop()
    if len(outer) > 2:
        return None
    # one leading dim goes first with R1 = 1: kernels then address row r at r * s0, with no division
    outer = outer + [(1, 0)] * (2 - len(outer))
    (r0, s0), (r1, s1) = outer
    return RowLayout(rows=r0 * r1 * g, n=n, r1=r1, g=g, s0=s0, s1=s1, sg=sg)


def row_layout(t: torch.Tensor, per_head: bool = False) -> tuple[torch.Tensor, RowLayout]:
    """(tensor to pass to the kernel, its RowLayout); the tensor is t itself whenever possible."""
    if not per_head and t.is_contiguous():  # the common case, without walking the strides
        return t, contiguous_layout(t.numel() // t.shape[-1] if t.shape[-1] else 0, t.shape[-1])
    layout = _fits(t, per_head)
    if layout is None:
        t = t.contiguous()
        layout = _fits(t, per_head)
        assert layout is not None
    return t, layout


def contiguous_layout(rows: int, n: int) -> RowLayout:
    return RowLayout(rows=rows, n=n, r1=1, g=1, s0=n, s1=0, sg=0)


def shared_layouts(*tensors: torch.Tensor | None, per_head: bool = False
                   ) -> tuple[list[torch.Tensor | None], RowLayout, list[RowLayout]]:
    """Views of same-shaped tensors that one kernel can address with one (R1, G) and its own strides.

    Returns (tensors to pass, the first one's layout, each one's layout); None entries stay None. When
    the tensors' leading dims coalesce differently, all are made contiguous (a copy, never other bits).
    A returned tensor that is not the one given is a copy: outputs written there must be copied back.
    """
    views = [row_layout(t, per_head) if t is not None else (None, None) for t in tensors]
    lays = [lay for _, lay in views if lay is not None]
    if any((q.r1, q.g) != (lays[0].r1, lays[0].g) for q in lays):
        dense = contiguous_layout(lays[0].rows, lays[0].n)
        views = [(t.contiguous(), dense) if t is not None else (None, None) for t in tensors]
    return [t for t, _ in views], views[0][1], [lay for _, lay in views]


def unit_stride(weight: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels index the weight's last dimension with unit stride (a copy of N values otherwise)."""
    if weight is None or weight.stride(-1) == 1 or weight.shape[-1] == 1:
        return weight
    return weight.contiguous()


@dataclass
class ForwardViews:
    """What a kernel backend's forward needs besides its kernel: addressable views and outputs."""

    weight: torch.Tensor | None
    per_head: bool
    x: torch.Tensor
    lay: RowLayout
    res: torch.Tensor  # x itself when there is no residual
    rlay: RowLayout
    y: torch.Tensor
    rstd: torch.Tensor
    z: torch.Tensor | None  # residual_out


def forward_views(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                  out_dtype: torch.dtype) -> ForwardViews:
    weight = unit_stride(weight)
    per_head = weight is not None and weight.dim() == 2
    (xk, rk), lay, (_, rlay) = shared_layouts(x, residual, per_head=per_head)
    if residual is None:
        rk, rlay = xk, lay
    return ForwardViews(weight, per_head, xk, lay, rk, rlay, *forward_outputs(x, residual, out_dtype))


def forward_outputs(x: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype, need_rstd: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A forward's fresh, dense outputs: y, the fp32 rstd per row (None where not needed), residual_out (None
    without a residual)."""
    # empty_like and new_empty: less of torch.empty's argument parsing (host time per call; on an H200 machine, rstd
    # by torch.empty(shape, dtype=, device=) 3.1 us, by new_empty 2.4: bench/results/2026-12-03-h200-run35); dense
    return (torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[:-1], dtype=torch.float32) if need_rstd else None,
            torch.empty_like(x, dtype=residual.dtype, memory_format=torch.contiguous_format)
            if residual is not None else None)


class RstdSink:
    """Per device, an fp32 buffer for the rstd a forward must store but nobody reads (the caller dropped it, and the
    kernel is faster keeping its store): allocating a fresh rstd each call cost more host time than the rest of a
    forward's outputs (bench/host_breakdown.py). Kernels on several streams may write it at once (values nobody reads).
    A sink outgrown is kept, never freed: a CUDA graph captured with it writes to it at every replay."""

    def __init__(self) -> None:
        self._sinks: dict[int | None, torch.Tensor] = {}
        self.kept: list[torch.Tensor] = []  # every sink ever made

    def __call__(self, device: torch.device, rows: int) -> torch.Tensor:
        """At least `rows` fp32 elements on device (doubled when outgrown)."""
        sink = self._sinks.get(device.index)
        if sink is None or sink.numel() < rows:
            sink = torch.empty(max(rows, 2 * sink.numel() if sink is not None else 0), dtype=torch.float32,
                               device=device)
            self._sinks[device.index] = sink
            self.kept.append(sink)
        return sink


rstd_sink = RstdSink()  # shared by the backends


@dataclass
class BackwardViews:
    """Addressable views for a backward pass; dx_kernel is where the kernel writes dx (copy it into dx
    afterwards when they differ)."""

    weight: torch.Tensor | None
    per_head: bool
    z: torch.Tensor
    lay: RowLayout
    dy: torch.Tensor
    dlay: RowLayout
    dx: torch.Tensor
    dx_kernel: torch.Tensor
    xlay: RowLayout
    dres: torch.Tensor  # dy when there is no residual gradient
    elay: RowLayout
    rstd: torch.Tensor


def backward_views(dy: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                   dres: torch.Tensor | None, dx_out: torch.Tensor | None) -> BackwardViews:
    weight = unit_stride(weight)
    per_head = weight is not None and weight.dim() == 2
    dx = dx_out if dx_out is not None else torch.empty_like(z, memory_format=torch.contiguous_format)
    (zk, dyk, dxk, dresk), lay, (_, dlay, xlay, elay) = shared_layouts(z, dy, dx, dres, per_head=per_head)
    if dres is None:
        dresk, elay = dyk, dlay
    return BackwardViews(weight, per_head, zk, lay, dyk, dlay, dx, dxk, xlay, dresk, elay, rstd.contiguous())


# ---- plans: the views' decisions, reused for every call with the same input signature ------------------
# What forward_views / backward_views decide (copies, layouts) depends on shapes, strides and dtypes only,
# never on values: a kernel backend decides once per signature and afterwards only applies the decision.

def signature(*tensors: torch.Tensor | None) -> tuple:
    """Shape, strides, dtype and 16-byte alignment of the start of each tensor (None stays None): all a
    plan may depend on. Outputs the backends allocate come from torch's caching allocator (512-byte
    aligned blocks)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


PLANS_MAX = 4096  # plans a backend keeps per kind; beyond, its cache starts over (e.g. ever-new shapes)


def remember(plans: dict, key: tuple, plan):
    """Store plan under key in a bounded plan cache; returns plan."""
    if len(plans) >= PLANS_MAX:
        plans.clear()
    plans[key] = plan
    return plan


@dataclass(frozen=True)
class ForwardPlan:
    """forward_views' decisions: which inputs are read through a contiguous copy, and the row layouts."""

    copy_weight: bool
    copy_x: bool
    copy_res: bool
    per_head: bool
    lay: RowLayout
    rlay: RowLayout

    @staticmethod
    def of(v: ForwardViews, x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None
           ) -> ForwardPlan:
        """The decisions in v, the views forward_views made of these inputs."""
        return ForwardPlan(v.weight is not weight, v.x is not x, residual is not None and v.res is not residual,
                           v.per_head, v.lay, v.rlay)

    def inputs(self, x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(x, weight, residual or x) as the kernel reads them."""
        xk = x.contiguous() if self.copy_x else x
        w = weight.contiguous() if self.copy_weight else weight
        return xk, w, xk if residual is None else (residual.contiguous() if self.copy_res else residual)


@dataclass(frozen=True)
class BackwardPlan:
    """backward_views' decisions; copy_dx: the kernel writes a contiguous copy of dx, copied back after."""

    copy_weight: bool
    copy_z: bool
    copy_dy: bool
    copy_dx: bool
    copy_dres: bool
    copy_rstd: bool
    per_head: bool
    lay: RowLayout
    dlay: RowLayout
    xlay: RowLayout
    elay: RowLayout

    @staticmethod
    def of(v: BackwardViews, dy: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
           dres: torch.Tensor | None) -> BackwardPlan:
        """The decisions in v, the views backward_views made of these inputs."""
        return BackwardPlan(v.weight is not weight, v.z is not z, v.dy is not dy, v.dx_kernel is not v.dx,
                            dres is not None and v.dres is not dres, v.rstd is not rstd, v.per_head, v.lay, v.dlay,
                            v.xlay, v.elay)

    def inputs(self, dy: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
               dres: torch.Tensor | None, dx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(dy, z, weight, rstd, dres or dy, dx) as the kernel reads and writes them."""
        dyk = dy.contiguous() if self.copy_dy else dy
        return (dyk, z.contiguous() if self.copy_z else z, weight.contiguous() if self.copy_weight else weight,
                rstd.contiguous() if self.copy_rstd else rstd,
                dyk if dres is None else (dres.contiguous() if self.copy_dres else dres),
                dx.contiguous() if self.copy_dx else dx)
