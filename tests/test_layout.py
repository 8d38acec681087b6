"""Row layouts: any (..., N) view addressed in place as rows (R0, R1, G) with strides."""

from __future__ import annotations

import torch

from strictnorm.backends.layout import RowLayout, row_layout


def _offsets(lay: RowLayout) -> list[int]:
    out = []
    for r in range(lay.rows):
        g, t = r % lay.g, r // lay.g
        out.append((t // lay.r1) * lay.s0 + (t % lay.r1) * lay.s1 + g * lay.sg)
    return out


def _check(t: torch.Tensor, per_head: bool = False, copied: bool = False) -> RowLayout:
    tk, lay = row_layout(t, per_head)
    assert (tk is not t) == copied
    base = tk.storage_offset()
    flat = tk.reshape(-1, t.shape[-1])  # logical rows in row-major order
    for r, off in enumerate(_offsets(lay)):
        row = torch.as_strided(tk, (t.shape[-1],), (1,), base + off)
        assert torch.equal(row, flat[r])
    return lay


def test_contiguous_rows_are_one_stride():
    lay = _check(torch.randn(7, 5))
    assert (lay.rows, lay.g) == (7, 1) and _offsets(lay) == [5 * r for r in range(7)]


def test_views_are_read_in_place():
    base = torch.randn(3, 5, 2, 40)
    _check(base[:, 1:4, :, 3:33])  # three leading dims, none mergeable with the next
    _check(base.transpose(0, 1)[..., :8])
    qkv = torch.randn(2, 6, 3 * 4 * 16)
    q = qkv[..., 4 * 16:8 * 16].view(2, 6, 4, 16)
    lay = _check(q, per_head=True)
    assert lay.g == 4 and lay.sg == 16


def test_unaddressable_layouts_are_copied():
    _check(torch.randn(4, 6).t(), copied=True)  # strided last dimension
    four = torch.as_strided(torch.randn(5000), (2, 3, 4, 5, 8), (2000, 500, 100, 13, 1))
    _check(four, copied=True)  # four leading dims, none mergeable
    _check(torch.randn(2, 3, 4, 5, 9)[:, :, ::2, ::2])  # looks strided, but merges into two dims


def test_empty_and_single_row():
    assert row_layout(torch.empty(0, 8))[1].rows == 0
    assert row_layout(torch.empty(0, 8).expand(0, 8))[1].rows == 0
    assert _check(torch.randn(9)).rows == 1


def test_shared_layouts_fall_back_to_dense_copies():
    from strictnorm.backends.layout import shared_layouts

    a = torch.randn(6, 4, 8)  # coalesces to one leading dim
    b = torch.randn(4, 6, 8).transpose(0, 1)  # the same shape, two leading dims
    (ak, bk), lay, lays = shared_layouts(a, b)
    assert ak is a and bk is not b and bk.is_contiguous() and torch.equal(bk, b)
    assert all((q.r1, q.g) == (lay.r1, lay.g) for q in lays)
    (ak, none), _, _ = shared_layouts(a, None)
    assert ak is a and none is None


def test_rstd_sink_grows_and_keeps_what_it_outgrew():
    """The sink for dropped rstd: one per device, at least the rows asked, doubled when outgrown; an outgrown sink
    stays alive (a CUDA graph captured with it writes it at every replay)."""
    from strictnorm.backends.layout import RstdSink

    sink = RstdSink()
    dev = torch.empty(1, device="cuda" if torch.cuda.is_available() else "cpu").device  # with its index, as a tensor's
    first = sink(dev, 10)
    assert first.numel() == 10 and first.dtype == torch.float32 and first.device == dev
    assert sink(dev, 7) is first
    grown = sink(dev, 11)
    assert grown.numel() == 20 and sink(dev, 20) is grown
    assert sink(dev, 100).numel() == 100
    assert [t.numel() for t in sink.kept] == [10, 20, 100]
