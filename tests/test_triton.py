"""Triton backend, bit for bit against the reference. On a CPU machine these run under the Triton
interpreter (TRITON_INTERPRET=1, set by conftest.py); on a GPU they run the compiled kernels."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from conftest import HAS_CUDA
from helpers import (
    bits_diff,
    bits_equal,
    check_random_case,
    check_special_values,
    fast_dw_excess,
    guarded,
    randn,
    random_case,
    zero_dy_case,
)

import strictnorm as sn
from strictnorm.backends.registry import get_backend
from strictnorm.reference import next_pow2

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from strictnorm.backends.triton.kernels import _rstd  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
MODES = ["llama", "gemma", "none"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _leaf(t, device):
    """A fresh leaf on device: `t.to(device)` alone returns t itself on the CPU, and gradients of two
    runs would then accumulate into one tensor (and compare equal to themselves)."""
    return t.detach().to(device).clone().requires_grad_(True)


def _run(backend, x, w, dy, *, mode, offset, dw, res=None, dres=None, qk=False, device="cpu"):
    xs = _leaf(x, device)
    ws = _leaf(w, device) if w is not None else None
    kw = dict(offset=offset, casting_mode=mode, dw=dw, backend=backend)
    if res is not None:
        rs = _leaf(res, device)
        y, z = sn.fused_add_rms_norm(xs, rs, ws, **kw)
        torch.autograd.backward([y, z], [dy.to(device), dres.to(device)])
        return {"y": y, "z": z, "dx": xs.grad, "dres": rs.grad, "dw": ws.grad}
    if qk:
        y = sn.qk_norm(xs, ws, **kw)
        rstd = None
    else:
        y, rstd = sn.rms_norm_with_rstd(xs, ws, **kw)
    y.backward(dy.to(device))
    out = {"y": y, "dx": xs.grad}
    if rstd is not None:
        out["rstd"] = rstd
    if ws is not None:
        out["dw"] = ws.grad
    return out


def _assert_same(want, got, skip=()):
    for k in want:
        if k in skip:
            continue
        assert bits_equal(want[k], got[k]), f"{k} differs: {bits_diff(want[k], got[k])}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
# On a GPU every case compiles kernels (device time); test_gpu.py's grid covers the shapes there.
# N = 5 and 40 take two column tiles (kernels.py, tiled_canon_sum); the rest one.
@pytest.mark.parametrize("m, n", [(3, 1), (2, 5), (5, 7), (6, 40), (9, 64), (4, 100), (2, 1000)] if not HAS_CUDA
                         else [(4, 100)])
def test_rms_norm_bitwise(mode, dtype, m, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(m, n, dtype=dtype, gen=g)
    w = randn(n, dtype=torch.bfloat16 if dtype != torch.float32 else torch.float32, gen=g, scale=0.1)
    dy = randn(m, n, dtype=dtype, gen=g)
    offset = 1.0 if mode == "gemma" else 0.0
    want = _run("torch", x, w, dy, mode=mode, offset=offset, dw="strict")
    got = _run("triton", x, w, dy, mode=mode, offset=offset, dw="strict", device=DEV)
    _assert_same(want, got)


@pytest.mark.skipif(not HAS_CUDA, reason="the compiled kernels (under the interpreter both widenings are one path)")
@pytest.mark.parametrize("candidate", ["rewiden-128.json", "rcp-128.json", "dense-128.json", "dense-rewiden-128.json"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [4096, 5000, 20000, 20001])
def test_forward_candidate_tiles_bitwise(candidate, mode, dtype, m, seed, monkeypatch):
    """The P = 128 forward in the tiles of a tuning file of bench/candidates: bf16 rows held as loaded across the sum
    (TileChoice.rewiden; rewiden-128.json: 8 x 4 to 16384 rows, 32 x 4 to 65536), the table's tiles with rstd's
    reciprocal by rcp_rn (TileChoice.rcp_rn; rcp-128.json), those without masks where the rows fill them too
    (TileChoice.dense; dense-128.json), and with bf16 rows held as loaded too (dense-rewiden-128.json): y and rstd the
    reference's in every casting mode, and the inference forward's y, with a bf16 weight and an fp32 one, fp16 rows
    (rewiden does not apply), a residual and rows that do not fill the tiles (5000 and 20001: the masked kernel)."""
    from pathlib import Path

    from strictnorm.backends.triton import backend as tb

    monkeypatch.setattr(tb, "TILE_TABLE", {k: dict(v) for k, v in tb.TILE_TABLE.items()})
    monkeypatch.setenv("STRICTNORM_TRITON_TUNING", str(Path(__file__).resolve().parents[1] / "bench" / "candidates"
                                                       / candidate))
    tb._load_tuning_file()
    tile = tb.forward_tile(128, m, 8)
    triton_backend = get_backend("triton")
    monkeypatch.setattr(triton_backend, "_fwd_plans", {})  # plans made with the table's own tiles stay unused
    g = torch.Generator().manual_seed(seed)
    x, res = randn(m, 128, dtype=dtype, gen=g), randn(m, 128, dtype=dtype, gen=g)
    offset = 1.0 if mode == "gemma" else 0.0
    kw = dict(offset=offset, casting_mode=mode)
    for w in (randn(128, dtype=torch.bfloat16, gen=g, scale=0.1), randn(128, gen=g, scale=0.1)):
        want = sn.rms_norm_with_rstd(x, w, **kw, backend="torch")
        got = sn.rms_norm_with_rstd(x.to(DEV), w.to(DEV), **kw, backend="triton")
        assert bits_equal(want[0], got[0]) and bits_equal(want[1], got[1])
        with torch.no_grad():
            assert bits_equal(want[0], sn.rms_norm(x.to(DEV), w.to(DEV), **kw, backend="triton"))
        want_fused = sn.fused_add_rms_norm(x, res, w, **kw, backend="torch")
        got_fused = sn.fused_add_rms_norm(x.to(DEV), res.to(DEV), w.to(DEV), **kw, backend="triton")
        assert all(bits_equal(a, b) for a, b in zip(want_fused, got_fused, strict=True))
    dense = {plan.meta["DENSE"] for plan in triton_backend._fwd_plans.values()}
    assert dense == {tile.dense and m % tile.rows == 0}
    rcp = {plan.meta["RCP_RN"] for plan in triton_backend._fwd_plans.values()}
    assert rcp == {tile.rcp_rn and torch.version.hip is None}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rewiden", [False, True])
def test_dense_forward_bitwise_and_only_where_the_rows_allow(mode, dtype, rewiden, seed, monkeypatch):
    """TileChoice.dense (kernels.py, DENSE: no masks, 32-bit offsets, N compiled in) at P = 16 in tiles of 4 rows: the
    kernel without masks where the rows fill the tiles, N = P and the rows are contiguous (2D, 3D, with a residual),
    the masked one elsewhere (rows left over, N < P, rows further apart than N); y, rstd and the fused add's z the
    reference's every way, with a bf16 weight and an fp32 one."""
    from strictnorm.backends.triton import backend as tb

    monkeypatch.setattr(tb, "TILE_TABLE", {k: dict(v) for k, v in tb.TILE_TABLE.items()})
    tb.TILE_TABLE["fwd"][16] = tb.TileChoice(rows=4, num_warps=1, w_first=True, w_rows=True, dense=True,
                                             rewiden=rewiden)
    triton_backend = get_backend("triton")
    g = torch.Generator().manual_seed(seed)
    offset = 1.0 if mode == "gemma" else 0.0
    kw = dict(offset=offset, casting_mode=mode)
    wide = randn(8, 32, dtype=dtype, gen=g)
    cases = [(randn(8, 16, dtype=dtype, gen=g), True), (randn(2, 4, 16, dtype=dtype, gen=g), True),
             (randn(6, 16, dtype=dtype, gen=g), False), (randn(8, 13, dtype=dtype, gen=g), False),
             (wide[:, :16], False)]
    for x, dense in cases:
        n = x.shape[-1]
        # x on the device with its strides (Tensor.to makes a view with gaps contiguous)
        xd = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=DEV).copy_(x)
        assert xd.stride() == x.stride()
        for w in (randn(n, dtype=torch.bfloat16, gen=g, scale=0.1), randn(n, gen=g, scale=0.1)):
            monkeypatch.setattr(triton_backend, "_fwd_plans", {})
            want = sn.rms_norm_with_rstd(x, w, **kw, backend="torch")
            got = sn.rms_norm_with_rstd(xd, w.to(DEV), **kw, backend="triton")
            assert bits_equal(want[0], got[0]) and bits_equal(want[1], got[1]), (tuple(x.shape), x.stride())
            res = randn(*x.shape, dtype=dtype, gen=g)
            want_fused = sn.fused_add_rms_norm(x, res, w, **kw, backend="torch")
            got_fused = sn.fused_add_rms_norm(xd, res.to(DEV), w.to(DEV), **kw, backend="triton")
            assert all(bits_equal(a, b) for a, b in zip(want_fused, got_fused, strict=True))
            assert {plan.meta["DENSE"] for plan in triton_backend._fwd_plans.values()} == {dense}, tuple(x.shape)


def test_rcp_rn_only_where_compiled_for_nvidia(monkeypatch):
    """TileChoice.rcp_rn reaches the forward's RCP_RN only for kernels compiled for NVIDIA GPUs: not under the
    interpreter, not on ROCm, not where the tile does not ask for it."""
    from strictnorm.backends.triton import backend as tb

    tile = tb.RowTile(8, 128, 0, 2, rcp_rn=True)
    assert not tb.RowTile(8, 128, 0, 2).forward_constexprs()["RCP_RN"]
    monkeypatch.setattr(tb, "_interpreting", lambda: True)
    assert not tile.forward_constexprs()["RCP_RN"]
    monkeypatch.setattr(tb, "_interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert tile.forward_constexprs()["RCP_RN"]
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not tile.forward_constexprs()["RCP_RN"]


def test_dense_rows_asks_for_every_condition():
    """backend.dense_rows: a tile asking for DENSE gets it only for rows held whole in one tile of N = P lanes, rows
    filling the tiles, contiguous rows (one leading dim) and element offsets under 2^31."""
    from strictnorm.backends.layout import RowLayout, contiguous_layout
    from strictnorm.backends.triton import backend as tb

    tile = tb.RowTile(8, 128, 0, 2, dense=True)
    assert tb.dense_rows(tile, (contiguous_layout(64, 128),))
    assert tb.dense_rows(tile, (contiguous_layout(2**24 - 8, 128), contiguous_layout(2**24 - 8, 128)))
    assert not tb.dense_rows(tile, (contiguous_layout(2**24, 128),))  # 2^31 elements
    assert not tb.dense_rows(tile, (contiguous_layout(60, 128),))  # rows left over
    assert not tb.dense_rows(tile, (contiguous_layout(64, 100),))  # N < P
    assert not tb.dense_rows(tile, (contiguous_layout(64, 128), RowLayout(64, 128, 1, 1, 256, 0, 0)))  # rows apart
    assert not tb.dense_rows(tile, (RowLayout(64, 128, 4, 1, 2048, 128, 0),))  # two leading dims
    assert not tb.dense_rows(tb.RowTile(8, 128, 0, 2, chunk=64, dense=True), (contiguous_layout(64, 128),))
    assert not tb.dense_rows(tb.RowTile(8, 128, 0, 2, stages=2, dense=True), (contiguous_layout(64, 128),))
    assert not tb.dense_rows(tb.RowTile(1, 64, 32, 2, dense=True), (contiguous_layout(64, 80),))


@pytest.mark.parametrize("mode", MODES)
def test_fused_add_bitwise_with_residual_gradient(mode, seed):
    g = torch.Generator().manual_seed(seed)
    m, n = 6, 48
    x, res, dy, dres = (randn(m, n, dtype=torch.bfloat16, gen=g) for _ in range(4))
    w = randn(n, gen=g)  # mixed: fp32 weight, bf16 activations
    want = _run("torch", x, w, dy, mode=mode, offset=0.25, dw="strict", res=res, dres=dres)
    got = _run("triton", x, w, dy, mode=mode, offset=0.25, dw="strict", res=res, dres=dres, device=DEV)
    _assert_same(want, got)


@pytest.mark.parametrize("m, n", [(70, 96), (1031, 100), (1031, 80)])
def test_fast_dw_is_deterministic_and_close(m, n, seed):
    """The fast dW (per-program partial tiles summed at the end, then the partial rows in a fixed order) close
    to the strict one; 1031 rows: more blocks of 32 rows than the CPU's 16 programs, so each program
    accumulates several (N = 80: in two column tiles)."""
    g = torch.Generator().manual_seed(seed)
    x, dy = randn(m, n, dtype=torch.bfloat16, gen=g), randn(m, n, dtype=torch.bfloat16, gen=g)
    w = randn(n, gen=g)
    want = _run("torch", x, w, dy, mode="llama", offset=0.0, dw="strict")
    a = _run("triton", x, w, dy, mode="llama", offset=0.0, dw="fast", device=DEV)
    b = _run("triton", x, w, dy, mode="llama", offset=0.0, dw="fast", device=DEV)
    _assert_same(want, a, skip=("dw",))
    assert bits_equal(a["dw"], b["dw"])
    rel = ((a["dw"].cpu().double() - want["dw"].double()).norm() / want["dw"].double().norm()).item()
    assert rel < 1e-5


@pytest.mark.parametrize("m, n, xdt, wdt, mode", [
    (1, 7, torch.bfloat16, torch.bfloat16, "llama"), (5, 64, torch.float32, torch.float32, "gemma"),
    (37, 1000, torch.bfloat16, torch.float32, "none"), (128, 256, torch.float16, torch.bfloat16, "llama"),
    (256, 100, torch.bfloat16, torch.float16, "gemma"), (257, 100, torch.bfloat16, torch.bfloat16, "llama")])
def test_fast_dw_of_few_rows_by_columns(m, n, xdt, wdt, mode, seed):
    """Up to _DW_COLUMNS_ROWS rows (P <= _PARTIALS_MAX_P, dx not in place) the fast backward's last programs sum dW
    by columns in the dx pass's launch (kernels.py, _dw_columns), no partial rows: y, rstd and dx bit for bit, dW in
    the weight's dtype within the fast bound of the strict one and the same on a second call. Past the bound (257
    rows) the partial rows, as before."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    x, dy = randn(m, n, dtype=xdt, gen=g), randn(m, n, dtype=xdt, gen=g)
    w = (1 + 0.1 * randn(n, gen=g)).to(wdt)
    offset = 1.0 if mode == "gemma" else 0.0
    backend = get_backend("triton")
    backend._bwd_plans.clear()
    want = _run("torch", x, w, dy, mode=mode, offset=offset, dw="strict")
    a = _run("triton", x, w, dy, mode=mode, offset=offset, dw="fast", device=DEV)
    b = _run("triton", x, w, dy, mode=mode, offset=offset, dw="fast", device=DEV)
    (plan,) = backend._bwd_plans.values()
    by_columns = m <= tb._DW_COLUMNS_ROWS
    assert bool(plan.meta.get("DW_BN")) == by_columns and plan.meta["DW_PARTIALS"] != by_columns
    _assert_same(want, a, skip=("dw",))
    assert a["dw"].dtype == wdt and bits_equal(a["dw"], b["dw"])
    rel = fast_dw_excess(a["dw"].cpu(), want["dw"], dy, x, w, want["rstd"], mode, offset)
    assert rel < max(torch.finfo(wdt).eps / 2, 1e-5), rel


def test_fast_dw_by_columns_only_out_of_place():
    """The dW programs read dy and z while the row programs write dx: a backward whose dx may overwrite them (a dx_out
    given, as the in-place backward passes) keeps the partial rows; so do per-head weights (the strict fold)."""
    from strictnorm.backends.triton import backend as tb
    from strictnorm.contract import make_spec

    spec = make_spec(torch.bfloat16, 1e-6, 0.0, "llama", torch.bfloat16)
    z = torch.zeros(8, 256, dtype=torch.bfloat16)
    w, rstd = torch.ones(256, dtype=torch.bfloat16), torch.ones(8)
    plan = tb.TritonBackend()._plan_bwd(z, z, w, rstd, None, None, spec, "fast", True)
    assert plan.meta["DW_BN"] == 256 and plan.meta["DW_MB"] == 8 and not plan.meta["DW_PARTIALS"]
    tile = tb.row_tile(256, "bwd_dx", 8)
    rows_programs = tb._programs(tb._cdiv(8, tile.rows), tile, z.device, tile.prefetch or tile.stages > 1)
    assert plan.grid == (rows_programs + 1,)  # and one program for dW's 256 columns
    in_place = tb.TritonBackend()._plan_bwd(z, z, w, rstd, None, z, spec, "fast", True)
    assert not in_place.meta.get("DW_BN") and in_place.meta["DW_PARTIALS"]
    assert not tb.TritonBackend()._plan_bwd(z, z, w, rstd, None, None, spec, "strict", True).meta.get("DW_BN")


def test_no_weight_and_offsets(seed):
    g = torch.Generator().manual_seed(seed)
    x, dy = randn(4, 33, dtype=torch.float16, gen=g), randn(4, 33, dtype=torch.float16, gen=g)
    _assert_same(_run("torch", x, None, dy, mode="llama", offset=0.0, dw="strict"),
                 _run("triton", x, None, dy, mode="llama", offset=0.0, dw="strict", device=DEV))
    tiny = torch.full((33,), 0.00390625, dtype=torch.bfloat16)
    want = _run("torch", x, tiny, dy, mode="gemma", offset=1.0, dw="strict")
    got = _run("triton", x, tiny, dy, mode="gemma", offset=1.0, dw="strict", device=DEV)
    _assert_same(want, got)


def test_strided_multidim_input(seed):
    g = torch.Generator().manual_seed(seed)
    base = randn(3, 5, 2, 40, dtype=torch.bfloat16, gen=g)
    x = base[:, 1:4, :, 3:33]  # non-contiguous in every leading dim, offset inside the row
    w = randn(30, dtype=torch.bfloat16, gen=g)
    dy = randn(3, 3, 2, 30, dtype=torch.bfloat16, gen=g)
    want = _run("torch", x, w, dy, mode="llama", offset=0.0, dw="strict")
    got = _run("triton", x, w, dy, mode="llama", offset=0.0, dw="strict", device=DEV)
    _assert_same(want, got)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dw", ["strict", "fast"])
@pytest.mark.parametrize("d", [32, 40])  # 40: the backward's two column tiles
def test_qk_norm_on_fused_qkv_view(per_head, dw, d, seed):
    g = torch.Generator().manual_seed(seed)
    b, s, h = 2, 3, 4
    qkv = randn(b, s, 3 * h * d, dtype=torch.bfloat16, gen=g)
    w = randn(h, d, gen=g) if per_head else randn(d, gen=g)
    dy = randn(b, s, h, d, dtype=torch.bfloat16, gen=g)
    k = qkv[..., h * d:2 * h * d].view(b, s, h, d)
    want = _run("torch", k, w, dy, mode="gemma", offset=1.0, dw="strict", qk=True)
    kd = qkv.to(DEV)[..., h * d:2 * h * d].view(b, s, h, d)
    got = _run("triton", kd, w, dy, mode="gemma", offset=1.0, dw=dw, qk=True, device=DEV)
    _assert_same(want, got, skip=() if dw == "strict" or per_head else ("dw",))


def test_zero_rows(seed):
    x = torch.empty(0, 16, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    w = torch.ones(16, device=DEV, requires_grad=True)
    y = sn.rms_norm(x, w, dw="strict", backend="triton")
    y.sum().backward()
    assert y.shape == (0, 16) and bits_equal(w.grad, torch.zeros(16))


@triton.jit
def _rstd_kernel(SS, OUT, N, eps, ROWS: tl.constexpr, MEAN_SCALE: tl.constexpr, RCP_RN: tl.constexpr):
    """kernels._rstd of ROWS sums a program."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tl.store(OUT + i, _rstd(tl.load(SS + i), N, eps, ROWS, MEAN_SCALE, RCP_RN))


@pytest.mark.parametrize("rcp_rn", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_CUDA or torch.version.hip is not None, reason="rcp_rn: compiled for NVIDIA GPUs only"))])
@pytest.mark.parametrize("n, eps", [(128, 0.0), (128, 2.0 ** -20), (1000, 0.0), (5120, 1e-5)])
def test_rstd_is_the_references_on_every_kind_of_sum(n, eps, rcp_rn, seed):
    """kernels._rstd (the mean by 2^-k where N is a power of two; the reciprocal by div_rn, or by rcp_rn on NVIDIA)
    against the reference's div_rn(1, sqrt_rn(div_rn(ss, N) + eps)) on random bit patterns of a non-negative fp32 sum:
    subnormal, normal and huge sums, +0, inf and NaN."""
    from strictnorm.reference import div_rn, exact_mean_scale, sqrt_rn

    count, rows = (1 << 22, 1024) if HAS_CUDA else (1 << 10, 256)
    g = torch.Generator().manual_seed(seed)
    ss = torch.randint(0, 1 << 31, (count,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ss[:6] = torch.tensor([0.0, float("inf"), float("nan"), 2.0 ** -149, 2.0 ** -126, 3.4e38])
    eps32 = torch.tensor(eps, dtype=torch.float32)
    want = div_rn(torch.ones_like(ss), sqrt_rn(div_rn(ss, float(n)) + eps32))
    out = torch.empty(count, dtype=torch.float32, device=DEV)
    _rstd_kernel[(count // rows,)](ss.to(DEV), out, n, eps32.item(), ROWS=rows, MEAN_SCALE=exact_mean_scale(n),
                                   RCP_RN=rcp_rn)
    assert bits_equal(out.cpu(), want), bits_diff(out.cpu(), want)


def test_batch_invariance(seed):
    g = torch.Generator().manual_seed(seed)
    n = 200
    x = randn(40, n, dtype=torch.bfloat16, gen=g).to(DEV)
    w = randn(n, dtype=torch.bfloat16, gen=g).to(DEV)
    full = sn.rms_norm(x, w, backend="triton")
    for lo, hi in [(0, 1), (5, 6), (3, 40), (39, 40)]:
        assert bits_equal(sn.rms_norm(x[lo:hi], w, backend="triton"), full[lo:hi])


@pytest.mark.parametrize("dtype", DTYPES)
def test_left_fold(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = (randn(130, 7, 3, gen=g) * torch.logspace(-10, 10, 3)).to(dtype).transpose(1, 2)
    want = sn.reduce_rows_left_fold(rows, backend="torch")
    got = sn.reduce_rows_left_fold(rows.to(DEV), backend="triton")
    assert bits_equal(want, got)
    adversarial = torch.tensor([[1e20, float("inf")], [1.0, 1.0], [-1e20, -float("inf")], [1.0, 2.0]])
    out = sn.reduce_rows_left_fold(adversarial.to(DEV), backend="triton").cpu()
    assert out[0].item() == 1.0 and torch.isnan(out[1])


def test_subnormal_and_extreme_values(seed):
    """bf16 rounding of subnormals and near-overflow values goes through the integer path."""
    x = torch.tensor([[1e-39, -3e-39, 1e-45, 2.0], [3e38, -3e38, 1.0, 0.5]], dtype=torch.float32)
    w = torch.tensor([1.0, 0.5, 2.0, 1e-38])
    for out in (torch.bfloat16, torch.float16, torch.float32):
        want = sn.rms_norm(x, w, backend="torch", out_dtype=out)
        got = sn.rms_norm(x.to(DEV), w.to(DEV), backend="triton", out_dtype=out)
        assert bits_equal(want, got)


def test_strided_weight_and_mixed_residual_dtype(seed):
    g = torch.Generator().manual_seed(seed)
    n = 40
    x, dy, dres = (randn(6, n, dtype=torch.bfloat16, gen=g) for _ in range(3))
    res = randn(6, n, gen=g)  # fp32 residual stream beside bf16 activations
    w = randn(2 * n, gen=g)[::2]  # a weight view with stride 2
    want = _run("torch", x, w, dy, mode="llama", offset=0.0, dw="strict", res=res, dres=dres.float())
    got = _run("triton", x, w, dy, mode="llama", offset=0.0, dw="strict", res=res, dres=dres.float(), device=DEV)
    _assert_same(want, got)
    assert want["z"].dtype == torch.float32 and want["dx"].dtype == torch.bfloat16
    wh = randn(4, 2 * 16, gen=g)[:, ::2]  # per-head weight, strided
    q = randn(2, 3, 4, 16, dtype=torch.bfloat16, gen=g)
    dq = randn(2, 3, 4, 16, dtype=torch.bfloat16, gen=g)
    _assert_same(_run("torch", q, wh, dq, mode="gemma", offset=1.0, dw="strict", qk=True),
                 _run("triton", q, wh, dq, mode="gemma", offset=1.0, dw="strict", qk=True, device=DEV))


def test_in_place_backward(seed):
    g = torch.Generator().manual_seed(seed)
    x, dy = randn(6, 48, dtype=torch.bfloat16, gen=g), randn(6, 48, dtype=torch.bfloat16, gen=g)
    w = randn(48, dtype=torch.bfloat16, gen=g)
    want = _run("torch", x, w, dy, mode="llama", offset=0.0, dw="strict")
    buf = dy.clone().to(DEV)
    xs, ws = _leaf(x, DEV), _leaf(w, DEV)
    sn.rms_norm(xs, ws, dw="strict", in_place=True, backend="triton").backward(buf)
    assert bits_equal(buf, want["dx"]) and bits_equal(xs.grad, want["dx"]) and bits_equal(ws.grad, want["dw"])


def test_fast_dw_of_long_rows_is_the_strict_fold(seed):
    """Past P = 8192 the fast dW takes the strict fold (faster there on an H200): same bits as strict."""
    g = torch.Generator().manual_seed(seed)
    m, n = 24, 8200  # more rows than the interpreter's 16 programs: partials would reassociate
    x, dy = randn(m, n, dtype=torch.bfloat16, gen=g), randn(m, n, dtype=torch.bfloat16, gen=g)
    w = randn(n, dtype=torch.bfloat16, gen=g)
    want = _run("torch", x, w, dy, mode="gemma", offset=1.0, dw="strict")
    got = _run("triton", x, w, dy, mode="gemma", offset=1.0, dw="fast", device=DEV)
    _assert_same(want, got)


@pytest.mark.parametrize("n", [7, 40, 100] if not HAS_CUDA else [7, 1000, 5120, 18432])
def test_triton_reads_nothing_past_its_inputs(n, seed):
    """Every input between NaN guard bands of next_pow2(N) elements: a kernel that loads a padded lane
    from memory instead of masking it turns its row into NaN (see test_gpu.py's CUDA counterpart)."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec
    from strictnorm.reference import next_pow2

    tb, tr = get_backend("triton"), get_backend("torch")
    guard = max(16, next_pow2(n))
    g = torch.Generator().manual_seed(seed)
    for mode in ("llama", "gemma", "none"):
        x, res, dy, dres = (guarded(torch.randn(5, n, generator=g).to(DEV).bfloat16(), guard) for _ in range(4))
        w = guarded((torch.randn(n, generator=g) * 0.1).to(DEV).bfloat16(), guard)
        spec = make_spec(torch.bfloat16, 1e-6, 0.5, mode, torch.bfloat16)
        want, got = tr.rms_norm_fwd(x, w, res, spec), tb.rms_norm_fwd(x, w, res, spec)
        for name, a, b in zip(("y", "rstd", "z"), want, got, strict=True):
            assert bits_equal(a, b), f"{name} at {n} {mode}"
        z, rstd = guarded(want[2], guard), guarded(want[1], guard)
        want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
        for dw_mode in ("strict", "fast"):
            got_dx, got_dw = tb.rms_norm_bwd(dy, z, w, rstd, dres, spec, dw_mode, True, None)
            assert bits_equal(want_dx, got_dx), f"dx at {n} {mode} dw={dw_mode}"
            assert got_dw.isfinite().all()
            if dw_mode == "strict":
                assert bits_equal(want_dw, got_dw), f"dw at {n} {mode}"


@pytest.mark.parametrize("n", [5, 7, 8, 40, 64, 100])  # 5 and 40: two column tiles
def test_signed_zeros_of_a_zero_dy_row(n, seed):
    """helpers.zero_dy_case: the signs of dx's zeros for zero dy rows. Two ways to get them wrong: padded
    lanes computed from zero-filled inputs (0 * (0 + offset) is -0.0, canon_sum pads with +0.0), and a
    reduction that starts from +0.0 (numpy's sum, behind tl.sum in the Triton interpreter)."""
    from strictnorm.backends.registry import get_backend

    dy, z, w, rstd, spec, want_dx = zero_dy_case(n, DEV, torch.Generator().manual_seed(seed))
    for dw_mode in ("strict", "fast"):
        got_dx, _ = get_backend("triton").rms_norm_bwd(dy, z, w, rstd, None, spec, dw_mode, True, None)
        assert bits_equal(want_dx, got_dx), f"dw={dw_mode}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter, on inf * 0 and the like
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [7, 64, 100])
@pytest.mark.parametrize("dtype, fused", [(torch.bfloat16, False), (torch.float16, True)])
def test_special_values_bitwise(mode, n, dtype, fused, seed):
    """helpers.check_special_values: signed zeros, subnormals, the largest values, infinities and NaN (one
    kind a row) through the forward and backward, bit for bit."""
    from strictnorm.backends.registry import get_backend

    check_special_values(get_backend("triton"), n, dtype, fused, mode, DEV, torch.Generator().manual_seed(seed))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter, on inf * 0 and the like
def test_random_configurations_bitwise(seed):
    """helpers.random_case: 24 random configurations (dtypes, modes, offsets, strides, per-head weights,
    special values) a run, each against the reference. (Before session 5's fixes such a run found about
    one mismatch in 30: subnormal bf16 inputs and signed zeros.)"""
    import random

    from strictnorm.backends.registry import get_backend

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(24 if not HAS_CUDA else 8):
        check_random_case(get_backend("triton"), random_case(rng, gen, DEV))


def test_row_tiles_split_only_rows_well_below_their_padded_length():
    """Two column tiles (PA = P / 2 and T = next_pow2(N - PA) lanes) where T < PA, i.e. N <= 3/4 P, when
    asked (by default the backward); one tile of P lanes otherwise."""
    from strictnorm.backends.triton.backend import DEFAULT_SPLIT, column_tiles, row_tile

    assert DEFAULT_SPLIT == {"fwd": False, "bwd": True}
    for n, pa, t in ((1, 1, 0), (5, 4, 1), (7, 8, 0), (40, 32, 8), (100, 128, 0), (5120, 4096, 1024),
                     (6144, 4096, 2048), (6145, 8192, 0), (18432, 16384, 2048), (65536, 65536, 0)):
        assert column_tiles(n, True) == (pa, t), n
        assert column_tiles(n, False) == (next_pow2(n), 0)
        for direction in ("fwd", "bwd"):
            tile = row_tile(n, direction)
            assert tile.pa + tile.t >= n and tile.num_warps & (tile.num_warps - 1) == 0


def test_tile_table_and_tuning_file(tmp_path, monkeypatch):
    """A TILE_TABLE entry sets rows, warps and split for its padded length only; STRICTNORM_TRITON_TUNING's
    file fills the table when the backend module loads."""
    from strictnorm.backends.triton import backend as tb

    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {}, "bwd": {}})
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"fwd": {"32768": {"rows": 2, "num_warps": 16, "split": True}}}))
    monkeypatch.setenv("STRICTNORM_TRITON_TUNING", str(path))
    tb._load_tuning_file()
    assert tb.row_tile(18432, "fwd") == tb.RowTile(2, 16384, 2048, 16)
    assert tb.row_tile(30000, "fwd") == tb.RowTile(2, 32768, 0, 16)  # N > 3/4 P: one tile
    assert tb.row_tile(18432, "bwd") == tb.RowTile(1, 16384, 2048, 32)  # the defaults
    assert tb.row_tile(4096, "fwd") == tb.RowTile(1, 4096, 0, 8)
    # a file's "fwd" entry drops the built-in "fwd_wb" entry of its P (which would shadow it), not the others'
    wb = tb.TileChoice(rows=1, num_warps=16, split=True, warp_blocks=True)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {}, "fwd_wb": {32768: wb, 8192: wb}, "bwd": {}})
    tb._load_tuning_file()
    assert tb.TILE_TABLE["fwd_wb"] == {8192: wb}
    assert tb.forward_tile(18432, 2048, 8) == tb.RowTile(2, 16384, 2048, 16)


def test_forward_tile_at_128_columns_depends_on_the_row_count():
    """P = 128's forward: 16 rows of 8 warps a program up to 16384 rows (up to 4096 with the weight loaded first), 8
    rows of 2 warps past them (and where the row count is unknown) with the weight loaded first, in the rows' layout,
    and an inference call's rstd not stored; every column count of that padded length alike."""
    from strictnorm.backends.triton import backend as tb

    past = tb.RowTile(8, 128, 0, 2, w_first=True, w_rows=True, drop_rstd=True)
    for n in (65, 100, 128):
        assert tb.forward_tile(n, 1, 8) == tb.RowTile(16, 128, 0, 8, w_first=True), n
        assert tb.forward_tile(n, 4096, 8) == tb.RowTile(16, 128, 0, 8, w_first=True), n
        assert tb.forward_tile(n, 4097, 8) == tb.RowTile(16, 128, 0, 8), n
        assert tb.forward_tile(n, 16384, 8) == tb.RowTile(16, 128, 0, 8), n
        assert tb.forward_tile(n, 16385, 8) == past, n
        assert tb.forward_tile(n, None, 8) == past, n


def test_rewiden_candidate_tuning_file_gives_its_tiles(monkeypatch):
    """bench/candidates/rewiden-128.json (a tuning file) loads: P = 128's forward holds bf16 rows as loaded in 8 rows
    of 4 warps from 4097 to 16384 rows and 32 of 4 to 65536, the table's own tiles below and past them."""
    from pathlib import Path

    from strictnorm.backends.triton import backend as tb

    monkeypatch.setattr(tb, "TILE_TABLE", {k: dict(v) for k, v in tb.TILE_TABLE.items()})
    monkeypatch.setenv("STRICTNORM_TRITON_TUNING",
                       str(Path(__file__).resolve().parents[1] / "bench" / "candidates" / "rewiden-128.json"))
    tb._load_tuning_file()
    held = dict(w_first=True, w_rows=True, drop_rstd=True, rewiden=True)
    assert tb.forward_tile(128, 4096, 8) == tb.RowTile(16, 128, 0, 8, w_first=True)
    assert tb.forward_tile(128, 4097, 8) == tb.forward_tile(128, 16384, 8) == tb.RowTile(8, 128, 0, 4, **held)
    assert tb.forward_tile(128, 16385, 8) == tb.forward_tile(128, 65536, 8) == tb.RowTile(32, 128, 0, 4, **held)
    assert tb.forward_tile(128, 65537, 8) == tb.RowTile(8, 128, 0, 2, w_first=True, w_rows=True, drop_rstd=True)


def test_forward_warp_block_entry_only_where_its_warp_blocks_apply(monkeypatch):
    """TILE_TABLE["fwd_wb"] gives the forward's tile where that tile takes warp blocks (16-byte pieces known, the
    second column tile of whole pieces or one row's T / threads elements) and splits where its choice asks for two
    column tiles; elsewhere the "fwd" entry (P = 32768: 18432 columns split in warp blocks; 16400 (T = 16 lanes, fewer
    than the threads), 30000 (no split) and unaligned rows in column chunks)."""
    from strictnorm.backends.triton import backend as tb

    assert tb.forward_tile(18432, 2048, 8) == tb.RowTile(1, 16384, 2048, 16, warp_blocks=True, max_registers=64)
    assert tb.forward_tile(18432, 2048, 8).forward_constexprs(8)["WB_ST"] == 4
    assert tb.forward_tile(20480, None, 8) == tb.RowTile(1, 16384, 4096, 16, warp_blocks=True, max_registers=64)
    for n, piece in ((16400, 8), (30000, 8), (18432, 0), (24576 + 16, 8)):
        assert tb.forward_tile(n, 2048, piece) == tb.row_tile(n, "fwd", 2048), (n, piece)
        assert tb.forward_tile(n, 2048, piece).chunk == 4096
    assert tb.forward_tile(4096, 4096, 8) == tb.row_tile(4096, "fwd", 4096)  # no "fwd_wb" entry
    monkeypatch.setattr(tb, "TILE_TABLE", {**tb.TILE_TABLE, "fwd_wb": {}})
    assert tb.forward_tile(18432, 2048, 8) == tb.row_tile(18432, "fwd", 2048)


def test_pipeline_stages_fit_the_shared_memory():
    """Rows held whole keep stages - 1 blocks of their loads in shared memory: a tile asking for more stages than the
    device's opt-in shared memory holds gets fewer (H200: 227 KB a block; 3 stages of one row of bf16 z and dy fit
    at 18432 columns in two tiles, 148 KB, not at 30000 in one, 263 KB); chunks and an unknown limit are left
    alone."""
    from strictnorm.backends.triton import backend as tb

    h200 = 227 * 1024
    split, whole = tb.RowTile(1, 16384, 2048, 16, stages=3), tb.RowTile(1, 32768, 0, 16, stages=3)
    assert tb.stages_that_fit(split, 4, h200).stages == 3 and tb.stages_that_fit(whole, 4, h200).stages == 2
    assert tb.stages_that_fit(whole, 4, 0).stages == 3
    held = tb.RowTile(1, 65536, 0, 16, stages=3)
    assert tb.stages_that_fit(held, 4, h200).stages == 1 and tb.stages_that_fit(held, 2, h200).stages == 2
    chunked = tb.RowTile(2, 32768, 0, 8, chunk=4096, stages=3)
    assert tb.stages_that_fit(chunked, 4, h200) == chunked


def test_backward_tile_depends_on_in_kernel_partials(monkeypatch):
    """The backward's tile comes from TILE_TABLE["bwd"] where the kernel adds the fast dW's partials, else from
    "bwd_dx" where it lists the padded length (the strict dW, no weight gradient, per-head weights), else from "bwd".
    The table: at N = 18432 rows held whole for every mode, dw="fast" taking the strict fold (no partials) as
    dw="strict" does; at 40000 (P = 65536) rows in column chunks for every mode, with partials for dw="fast"."""
    from strictnorm.backends.triton import backend as tb
    from strictnorm.contract import make_spec

    assert tb.row_tile(18432, "bwd") == tb.row_tile(18432, "bwd_dx") and tb.row_tile(18432, "bwd").chunk == 0
    assert tb.row_tile(4096, "bwd_dx") == tb.row_tile(4096, "bwd")  # not listed: the "bwd" entry
    listed = tb.TileChoice(rows=1, num_warps=4)
    monkeypatch.setattr(tb, "TILE_TABLE", {**tb.TILE_TABLE, "bwd_dx": {4096: listed}})
    assert tb.row_tile(4096, "bwd_dx") == tb.RowTile(1, 4096, 0, 4) != tb.row_tile(4096, "bwd")
    monkeypatch.undo()
    spec = make_spec(torch.bfloat16, 1e-6, 0.0, "llama", torch.bfloat16)
    for n, fast_partials, chunked in ((18432, False, False), (40000, True, True)):
        z = torch.zeros(3, n, dtype=torch.bfloat16)
        w, rstd = torch.ones(n), torch.ones(3)
        for dw_mode, need_dw, partials in (("fast", True, fast_partials), ("strict", True, False),
                                           ("fast", False, False)):
            plan = tb.TritonBackend()._plan_bwd(z, z, w, rstd, None, None, spec, dw_mode, need_dw)
            assert plan.meta["DW_PARTIALS"] == partials and (plan.meta["CHUNK"] > 0) == chunked, (n, dw_mode)


def test_persistent_grid_leaves_sms_to_the_fold():
    """_programs with sms_left (TritonBackend.share_sms_with_fold): the persistent grid on all SMs but those (one
    at least); a grid of a program a block untouched. The CPU stands in for 4 SMs."""
    from strictnorm.backends.triton import backend as tb

    tile = tb.row_tile(4096, "bwd")
    cpu = torch.device("cpu")
    assert tile.programs_per_sm == 2
    assert tb._programs(10**6, tile, cpu, True) == 8
    assert tb._programs(10**6, tile, cpu, True, sms_left=1) == 6
    assert tb._programs(10**6, tile, cpu, True, sms_left=10) == 2
    assert tb._programs(5, tile, cpu, True, sms_left=1) == 5
    assert tb._programs(10**6, tile, cpu, False, sms_left=1) == 10**6


@pytest.mark.parametrize("n, split, qk, chunk", [(5, True, False, 0), (40, False, False, 0), (40, True, True, 0),
                                                 (5, False, False, 2), (40, False, False, 8), (40, False, True, 16),
                                                 (64, False, False, 8)])
def test_forward_weight_first_and_column_chunks_give_the_reference_bits(n, split, qk, chunk, seed, monkeypatch):
    """TileChoice.w_first (the forward's weight loaded with the rows, before their sum) and TileChoice.chunk (rows in
    column chunks, chunks past N all padding) against the reference: one or two column tiles, fused add, per-head
    weights, a negative offset."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    p = next_pow2(n)
    choice = tb.TileChoice(rows=2, w_first=not chunk, split=split, chunk=chunk)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {p: choice}, "bwd": {}})
    monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
    tile = tb.row_tile(n, "fwd")
    assert tile.w_first != bool(chunk) and tile.chunk == chunk
    x, w, dy, kw = _per_head_or_fused_case(n, qk, 4, "strict", g)
    _assert_same(_run("torch", x, w, dy, **kw), _run("triton", x, w, dy, **kw))


@pytest.mark.parametrize("n, split, qk, w_first, persistent", [(128, False, False, False, False),
                                                                (128, False, False, True, False),
                                                                (100, False, True, False, False),
                                                                (40, True, False, True, False),
                                                                (64, False, False, False, True),
                                                                (5, False, True, True, True)])
def test_forward_weight_in_the_rows_layout_gives_the_reference_bits(n, split, qk, w_first, persistent, seed,
                                                                     monkeypatch):
    """TileChoice.w_rows (the forward's shared weight loaded as (rows, lanes) in the rows' layout) against the
    reference: one or two column tiles, fused add or per-head weights (which are loaded per row already), the weight
    first or after the sum, the persistent grid (the weight loaded once a program)."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    choice = tb.TileChoice(rows=4, num_warps=2, w_first=w_first, split=split, w_rows=True, prefetch=persistent)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {next_pow2(n): choice}, "bwd": {}})
    monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
    tile = tb.row_tile(n, "fwd")
    assert tile.w_rows and tile.forward_constexprs()["W_ROWS"] and tile.forward_persistent == persistent
    x, w, dy, kw = _per_head_or_fused_case(n, qk, 11, "strict", g)
    _assert_same(_run("torch", x, w, dy, **kw), _run("triton", x, w, dy, **kw))


@pytest.mark.parametrize("n, chunk", [(128, 0), (100, 0), (64, 16)])
def test_inference_forward_drops_rstd_only_where_its_tile_says(n, chunk, seed, monkeypatch):
    """TileChoice.drop_rstd: an inference call (no grad, so no rstd asked for) compiles the forward without rstd's
    store (STORE_RSTD False) and gives the reference's y; a call that needs rstd, for the same inputs, has its own plan
    that stores it and gives the reference's rstd; rows in column chunks store it always."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    choice = tb.TileChoice(rows=4, num_warps=2, w_rows=True, drop_rstd=True, chunk=chunk)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {next_pow2(n): choice}, "bwd": {}})
    triton = get_backend("triton")
    monkeypatch.setattr(triton, "_fwd_plans", {})
    x, w = randn(9, n, dtype=torch.bfloat16, gen=g).to(DEV), randn(n, gen=g).to(DEV)
    kw = dict(offset=-0.5, casting_mode="gemma")
    want_y, want_rstd = sn.rms_norm_with_rstd(x, w, backend="torch", **kw)
    with torch.no_grad():
        y = sn.rms_norm(x, w, backend="triton", **kw)
    y2, rstd = sn.rms_norm_with_rstd(x, w, backend="triton", **kw)
    assert bits_equal(y, want_y) and bits_equal(y2, want_y) and bits_equal(rstd, want_rstd)
    stores = sorted(plan.meta["STORE_RSTD"] for plan in triton._fwd_plans.values())
    assert stores == ([True, True] if chunk else [False, True])


def test_register_bound_reaches_the_launch_options_and_keeps_the_bits(seed, monkeypatch):
    """TileChoice.max_registers becomes Triton's maxnreg in both directions' launch options (absent where 0); the
    interpreter drops it, so here the plan's options and the bits are checked (the bound's effect on the GPU:
    test_gpu's warp-block tiles)."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    bounded = tb.TileChoice(rows=2, num_warps=2, split=True, max_registers=64)
    assert "maxnreg" not in tb._tile_of(600, tb.TileChoice(rows=2)).meta()
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {1024: bounded}, "bwd": {1024: bounded}})
    backend = get_backend("triton")
    monkeypatch.setattr(backend, "_fwd_plans", {})
    monkeypatch.setattr(backend, "_bwd_plans", {})
    x, w, dy, kw = _per_head_or_fused_case(600, False, 5, "strict", g)
    _assert_same(_run("torch", x, w, dy, **kw), _run("triton", x, w, dy, **kw))
    plans = [*backend._fwd_plans.values(), *backend._bwd_plans.values()]
    assert len(plans) >= 2 and all(p.meta["maxnreg"] == 64 and p.meta["T"] > 0 for p in plans)


@pytest.mark.parametrize("n, warps, qk, persistent, chunk", [(256, 1, False, False, 0), (512, 2, True, False, 0),
                                                            (2048, 2, False, False, 0), (1024, 4, False, True, 0),
                                                            (2048, 8, True, False, 0), (2000, 2, False, False, 512),
                                                            (2048, 4, True, False, 1024)])
def test_forward_warp_blocks_give_the_reference_bits(n, warps, qk, persistent, chunk, seed, monkeypatch):
    """TileChoice.warp_blocks (the row's columns loaded permuted so each warp holds one block, the blocks' sums taken
    last; under the interpreter the blocks un-permuted and summed by canon_sum): y, z and rstd against the reference,
    with one to eight warps, one to four repeats of a warp's pieces, fused add or per-head weights, the persistent
    grid, rows in column chunks (each chunk in warp blocks; N = 2000: the last chunk part padding). Where the rows are
    not 16-byte aligned (N = 1000) or two column tiles are too small for a warp's pieces (N = 40), no warp blocks."""
    from strictnorm.backends.triton import backend as tb

    monkeypatch.setattr(tb, "_num_sms", lambda device: 4)
    g = torch.Generator().manual_seed(seed)
    p = next_pow2(n)
    choice = tb.TileChoice(rows=2, num_warps=warps, warp_blocks=True, programs_per_sm=1, prefetch=persistent,
                           chunk=chunk)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {p: choice, 1024: choice, 64: tb.TileChoice(split=True,
                                                                                               warp_blocks=True)},
                                           "bwd": {}})
    monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
    x, w, dy, kw = _per_head_or_fused_case(n, qk, 7, "strict", g)
    w = w.bfloat16()  # every row-long tensor of one element size (backend._warp_block_piece)
    _assert_same(_run("torch", x, w, dy, **kw), _run("triton", x, w, dy, **kw))
    (plan,) = get_backend("triton")._fwd_plans.values()
    assert (plan.meta["WB_NW"], plan.meta["WB_S"], plan.meta["PERSISTENT"]) == (warps, 8, persistent)
    for m, cols in ((4, 1000), (3, 40)):  # unaligned rows; two column tiles (40 <= 3/4 of 64)
        monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
        xs, dys = (randn(m, cols, dtype=torch.bfloat16, gen=g) for _ in range(2))
        ws, kws = randn(cols, gen=g), dict(mode="gemma", offset=1.0, dw="strict", device=DEV)
        _assert_same(_run("torch", xs, ws, dys, **kws), _run("triton", xs, ws, dys, **kws))
        (plan,) = get_backend("triton")._fwd_plans.values()
        assert plan.meta["WB_NW"] == 0


@pytest.mark.parametrize("n, rows, warps, case, tail_piece", [(2304, 1, 4, "qk", 2), (1152, 2, 2, "fused", 0),
                                                               (1536, 2, 1, "fused", 8), (2304, 4, 2, "qk", 0)])
def test_forward_warp_blocks_in_two_column_tiles(n, rows, warps, case, tail_piece, seed, monkeypatch):
    """Two column tiles (TileChoice.split: PA = P / 2 lanes, then T) in warp blocks: the first tile's blocks, and the
    second's (of whole pieces, or of T / threads elements where one row is a tile), meet in one reduction; with more
    rows and less than a piece a thread, neither tile takes warp blocks. y, z and rstd against the
    reference, with fused add or per-head weights; the second tile's columns 64 times the first's, so that its own
    sum's order shows in rstd's bits."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    choice = tb.TileChoice(rows=rows, num_warps=warps, split=True, warp_blocks=True)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {next_pow2(n): choice}, "bwd": {}})
    monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
    x, w, dy, kw = _per_head_or_fused_case(n, case == "qk", 9, "strict", g)
    x[..., next_pow2(n) // 2:] *= 64
    w = w.bfloat16()  # every row-long tensor of one element size (backend._warp_block_piece)
    _assert_same(_run("torch", x, w, dy, **kw), _run("triton", x, w, dy, **kw))
    (plan,) = get_backend("triton")._fwd_plans.values()
    blocks = warps if tail_piece else 0
    assert (plan.meta["T"] > 0, plan.meta["WB_NW"], plan.meta["WB_ST"]) == (True, blocks, tail_piece)


@pytest.mark.parametrize("n, rows, warps, split, case, dw, tail_piece", [
    (1024, 2, 4, False, "fused fp32", "fast", 0), (1536, 2, 1, True, "fused fp32", "fast", 4),
    (2304, 1, 4, True, "qk fp32", "strict", 2), (1024, 1, 4, False, "qk", "fast", 0),
    (1000, 1, 4, False, "fused", "strict", 0), (2304, 1, 2, True, "fused", "strict", 4)])
def test_backward_warp_blocks(n, rows, warps, split, case, dw, tail_piece, seed, monkeypatch):
    """The backward's rows held whole in warp blocks (TileChoice.warp_blocks in its table entry; two column tiles
    as in the forward): dx, the residual's gradient and the strict dW against the reference, the fast dW (partials
    a program, at permuted columns) the same bits as with the columns in order; rows not 16-byte aligned (1000
    columns) take the columns in order. The second column tile's columns 64 times the first's. fp32 rows: the row
    sum's last bit shows in dx (a bf16 dx rounds most of it away)."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    x, w, dy, kw = _per_head_or_fused_case(n, case.startswith("qk"), 9, dw, g)
    x[..., next_pow2(n) // 2:] *= 64
    dtype = torch.float32 if case.endswith("fp32") else torch.bfloat16
    x, dy, w = x.to(dtype), dy.to(dtype), w.to(dtype)  # every row-long tensor of one element size
    kw.update({k: kw[k].to(dtype) for k in ("res", "dres") if k in kw})
    triton = get_backend("triton")
    outs = {}
    for blocks in (True, False):
        choice = tb.TileChoice(rows=rows, num_warps=warps, split=split, warp_blocks=blocks, programs_per_sm=1,
                               prefetch=rows == 2)
        monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {}, "bwd": {next_pow2(n): choice}})
        monkeypatch.setattr(triton, "_fwd_plans", {})
        monkeypatch.setattr(triton, "_bwd_plans", {})
        outs[blocks] = _run("triton", x, w, dy, **kw)
        (plan,) = triton._bwd_plans.values()
        taken = warps if blocks and n % 16 == 0 else 0
        assert (plan.meta["WB_NW"], plan.meta["WB_ST"]) == (taken, tail_piece if taken and split else 0)
        assert plan.meta["WB_S"] == (16 // x.element_size() if taken else 8)
    _assert_same(_run("torch", x, w, dy, **kw), outs[True], skip=("dw",) if dw == "fast" else ())
    _assert_same(outs[False], outs[True])


def test_forward_warp_blocks_only_where_every_row_tensor_has_one_element_size(seed, monkeypatch):
    """Warp blocks rely on the compiler's layout of the rows, which a 32-bit weight or y beside 16-bit rows (or the
    other way) can change: such calls take the columns in order, with the same bits."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {1024: tb.TileChoice(rows=1, num_warps=4, warp_blocks=True)},
                                           "bwd": {}})
    x16 = randn(3, 1024, dtype=torch.bfloat16, gen=g).to(DEV)
    x32, w32 = randn(3, 1024, gen=g).to(DEV), randn(1024, gen=g).to(DEV)
    for x, w, out_dtype, blocks in ((x16, w32, None, 0), (x32, w32, torch.bfloat16, 0), (x16, w32.bfloat16(), None, 4),
                                    (x16, None, None, 4), (x16, w32.bfloat16(), torch.float32, 0)):
        monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
        kw = dict(casting_mode="gemma", offset=1.0 if w is not None else 0.0, out_dtype=out_dtype)
        want = sn.rms_norm_with_rstd(x, w, backend="torch", **kw)
        got = sn.rms_norm_with_rstd(x, w, backend="triton", **kw)
        assert all(bits_equal(a, b) for a, b in zip(want, got, strict=True))
        (plan,) = get_backend("triton")._fwd_plans.values()
        assert plan.meta["WB_NW"] == blocks


def test_forward_warp_blocks_only_on_checked_triton_releases(seed, monkeypatch):
    """On a Triton release whose lowering was not checked, a tile asking for warp blocks takes the columns in order."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {1024: tb.TileChoice(rows=1, num_warps=4, warp_blocks=True)},
                                           "bwd": {}})
    x, w = randn(3, 1024, dtype=torch.bfloat16, gen=g).to(DEV), randn(1024, dtype=torch.bfloat16, gen=g).to(DEV)
    for releases, blocks in ((tb.WARP_BLOCK_TRITON_RELEASES, 4), (("2.0",), 0)):
        monkeypatch.setattr(tb, "WARP_BLOCK_TRITON_RELEASES", releases)
        monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
        want = sn.rms_norm_with_rstd(x, w, casting_mode="llama", backend="torch")
        got = sn.rms_norm_with_rstd(x, w, casting_mode="llama", backend="triton")
        assert all(bits_equal(a, b) for a, b in zip(want, got, strict=True))
        (plan,) = get_backend("triton")._fwd_plans.values()
        assert plan.meta["WB_NW"] == blocks


def test_forward_warp_blocks_in_fp32_rows(seed, monkeypatch):
    """Warp blocks of fp32 rows (4-element pieces) against the reference (y and rstd), llama casting, on strided views:
    rows 1040 apart (16-byte aligned: warp blocks) and 1030 apart (not: the columns in order)."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {1024: tb.TileChoice(rows=1, num_warps=4, warp_blocks=True)},
                                           "bwd": {}})
    for stride, blocks in ((1040, 4), (1030, 0)):
        monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
        x, w = randn(5, stride, gen=g).to(DEV)[:, :1024], randn(1024, gen=g).to(DEV)  # .to would compact a view
        want = sn.rms_norm_with_rstd(x, w, casting_mode="llama", backend="torch")
        got = sn.rms_norm_with_rstd(x, w, casting_mode="llama", backend="triton")
        assert all(bits_equal(a, b) for a, b in zip(want, got, strict=True))
        (plan,) = get_backend("triton")._fwd_plans.values()
        assert plan.views.lay.s0 == stride and (plan.meta["WB_NW"], plan.meta["WB_S"]) == (blocks, 4 if blocks else 8)


def _per_head_or_fused_case(n: int, qk: bool, rows: int, dw: str, g: torch.Generator):
    """bf16 inputs of N columns with a negative offset: qk_norm of (3, rows, 2, N) views with per-head weights (gemma),
    or the fused add of (rows + 1, N) rows with the residual's gradient and one zero dy row (none); _run's arguments."""
    if qk:
        x, dy = (randn(3, rows, 2, n, dtype=torch.bfloat16, gen=g) for _ in range(2))
        return x, randn(2, n, gen=g), dy, dict(mode="gemma", offset=-0.5, dw=dw, qk=True, device=DEV)
    x, res, dy, dres = (randn(rows + 1, n, dtype=torch.bfloat16, gen=g) for _ in range(4))
    dy[rows // 2] = 0.0
    return x, randn(n, gen=g), dy, dict(mode="none", offset=-0.5, dw=dw, res=res, dres=dres, device=DEV)


@pytest.mark.parametrize("n", [5, 40])
def test_one_and_two_column_tiles_give_the_same_bits(n, seed, monkeypatch):
    """The split rows' tree(tile 1) + (tree(tile 2) + 0.0) against the one-tile kernel, forward and backward
    with a residual and its gradient, a zero dy row and a negative offset (strict dW: the fast dW's partial
    sums over rows follow the launch's warps, which differ between the two)."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    x, res, dy, dres = (randn(5, n, dtype=torch.bfloat16, gen=g) for _ in range(4))
    dy[2] = 0.0
    w = randn(n, gen=g)
    outs = []
    for split in (True, False):
        monkeypatch.setattr(tb, "DEFAULT_SPLIT", {"fwd": split, "bwd": split})
        monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
        monkeypatch.setattr(get_backend("triton"), "_bwd_plans", {})
        outs.append(_run("triton", x, w, dy, mode="gemma", offset=-0.5, dw="strict", res=res, dres=dres,
                         device=DEV))
    _assert_same(outs[0], outs[1])


@pytest.mark.parametrize("n, split, qk", [(5, True, False), (40, False, False), (40, True, True), (64, False, False)])
def test_backward_prefetch_and_stages_give_the_same_bits(n, split, qk, seed, monkeypatch):
    """TileChoice.prefetch (the next block's rows loaded before this block's sums) and TileChoice.stages (the loop's
    loads pipelined by Triton) change no bit: y and dx against the reference, and dW fast (partials per program: the
    same programs either way; per-head weights: the strict fold) equal to the kernel without either. One program per
    SM, so programs stride over blocks and the last prefetch runs past the end; fused add with its gradient, or
    per-head weights."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    p = next_pow2(n)
    x, w, dy, kw = _per_head_or_fused_case(n, qk, 22, "fast", g)
    want = _run("torch", x, w, dy, **kw)
    outs = []
    for prefetch, stages in ((False, 1), (True, 1), (False, 2), (True, 3)):
        choice = tb.TileChoice(rows=2, split=split, programs_per_sm=1, prefetch=prefetch, stages=stages)
        monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {}, "bwd": {p: choice}})
        monkeypatch.setattr(get_backend("triton"), "_bwd_plans", {})
        tile = tb.row_tile(n, "bwd")
        assert (tile.prefetch, tile.stages, tile.t > 0) == (prefetch, stages, split and n < 3 * p // 4)
        outs.append(_run("triton", x, w, dy, **kw))
        _assert_same(want, outs[-1], skip=("dw",))
        _assert_same(outs[0], outs[-1])


@pytest.mark.parametrize("n, split, qk", [(5, True, False), (40, False, True), (40, True, True), (64, False, False)])
def test_forward_persistent_grid_gives_the_same_bits(n, split, qk, seed, monkeypatch):
    """The forward's persistent grid (rows held whole, programs striding over blocks with the next block prefetched
    into registers and/or the loop's loads pipelined; a shared weight loaded once a program) changes no bit: y, z and
    rstd against the reference. Four programs (one an SM of four, the GPU's SMs counted as four), so programs stride
    over blocks and the last prefetch runs past the end; the fused add, or per-head weights (loaded per block); the
    weight first or after the sum."""
    from strictnorm.backends.triton import backend as tb

    monkeypatch.setattr(tb, "_num_sms", lambda device: 4)
    g = torch.Generator().manual_seed(seed)
    p = next_pow2(n)
    x, w, dy, kw = _per_head_or_fused_case(n, qk, 22, "strict", g)
    want = _run("torch", x, w, dy, **kw)
    for prefetch, stages, w_first in ((True, 1, False), (False, 2, True), (True, 3, False)):
        choice = tb.TileChoice(rows=2, split=split, programs_per_sm=1, prefetch=prefetch, stages=stages,
                               w_first=w_first)
        monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {p: choice}, "bwd": {}})
        monkeypatch.setattr(get_backend("triton"), "_fwd_plans", {})
        assert tb.row_tile(n, "fwd").forward_persistent
        _assert_same(want, _run("triton", x, w, dy, **kw))
        (plan,) = get_backend("triton")._fwd_plans.values()
        assert plan.grid == (4,) and plan.meta["PERSISTENT"] and plan.meta["PREFETCH"] == prefetch


@pytest.mark.parametrize("n, qk, chunk", [(5, False, 2), (40, False, 8), (40, True, 16), (64, False, 8),
                                          (100, False, 32)])
def test_backward_column_chunks_give_the_same_bits(n, qk, chunk, seed, monkeypatch):
    """TileChoice.chunk in the backward (rows in column chunks, chunks past N all padding; the fast dW's partials in a
    row of global memory per program; the chunk loops' loads in 2 or 3 stages): y and dx against the reference; with
    one row a block, dW fast equal to the held rows' kernel (each program's partials folded over its blocks in the
    same order) and, with two, within the fast dW's bound of the strict one. One program per SM: programs stride over
    blocks, adding to their partial rows. Fused add with its gradient and a zero dy row, or per-head weights (the
    strict fold)."""
    from strictnorm.backends.triton import backend as tb

    g = torch.Generator().manual_seed(seed)
    p = next_pow2(n)
    x, w, dy, kw = _per_head_or_fused_case(n, qk, 22, "fast", g)
    want = _run("torch", x, w, dy, **{**kw, "dw": "strict"})
    monkeypatch.setattr(tb, "_DW_COLUMNS_ROWS", 0)  # 22 rows: the partials, not the few rows' dW by columns
    for rows in (1, 2):
        outs = []
        for c in (0, chunk):
            choice = tb.TileChoice(rows=rows, split=False, programs_per_sm=1, chunk=c, stages=1 + (c > 0) * rows)
            monkeypatch.setattr(tb, "TILE_TABLE", {"fwd": {}, "bwd": {p: choice}})
            monkeypatch.setattr(get_backend("triton"), "_bwd_plans", {})
            assert tb.row_tile(n, "bwd").chunk == c
            outs.append(_run("triton", x, w, dy, **kw))
            _assert_same(want, outs[-1], skip=("dw",))
        if rows == 1 or qk:
            _assert_same(outs[0], outs[1])
        else:
            from strictnorm.contract import make_spec

            z = want["z"].detach().cpu()  # on the CPU: the case ran on DEV
            rstd = get_backend("torch").rms_norm_fwd(z, None, None, make_spec(z.dtype, 1e-6, 0.0, "none", z.dtype))[1]
            excess = fast_dw_excess(outs[1]["dw"].cpu(), want["dw"].cpu(), dy, z, w, rstd, "none", -0.5)
            assert excess == 0.0, f"fast dW beyond its bound by {excess}"


@pytest.mark.parametrize("n", [100, 4096])
def test_forward_without_rstd_still_stores_it(n, seed, monkeypatch):
    """need_rstd=False (an inference call) takes the same kernel as a call that keeps rstd where its tile does not
    drop the store (TileChoice.drop_rstd; its own plan, the same constexprs): the Triton forward stores rstd there (a
    kernel compiled without that store ran 22% slower on an H200 at 32768 x 4096: ptxas then issued a block's last row
    load after the first's use; bench/NOTES.md, run 27), into the backend's sink instead of a fresh tensor, and
    returns None for it. y and residual_out are the reference's bits, and the sink holds the reference's rstd."""
    from strictnorm.backends.layout import rstd_sink
    from strictnorm.contract import make_spec

    tr = get_backend("triton")
    monkeypatch.setattr(tr, "_fwd_plans", {})
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(9, n, generator=g).bfloat16().to(DEV) for _ in range(2))
    w = torch.randn(n, generator=g).bfloat16().to(DEV)
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    want = get_backend("torch").rms_norm_fwd(x, w, res, spec)
    got = tr.rms_norm_fwd(x, w, res, spec)
    assert all(bits_equal(a, b) for a, b in zip(want, got, strict=True))
    y, rstd, z = tr.rms_norm_fwd(x, w, res, spec, need_rstd=False)
    assert rstd is None and bits_equal(want[0], y) and bits_equal(want[2], z)
    assert bits_equal(want[1], rstd_sink(x.device, 9)[:9])
    keeps, drops = (plan.meta for plan in tr._fwd_plans.values())
    assert keeps == drops and keeps["STORE_RSTD"]
    out = sn.fused_add_rms_norm(x, res, w, offset=1.0, casting_mode="gemma", backend="triton")  # no autograd
    assert bits_equal(want[0], out[0]) and bits_equal(want[2], out[1])


def test_direct_launch_passes_every_constexpr_in_order():
    """A plan's direct launches (backend._Launcher) pass the launch's arguments, then every constexpr in the kernel's
    order, as Triton's JIT does: the plan's value, else the parameter's default; a runtime parameter among them is
    a clear error."""
    from strictnorm.backends.triton import backend as tb
    from strictnorm.backends.triton import kernels as k

    fn = k.rms_bwd_kernel
    params = list(inspect.signature(fn.fn).parameters.values())
    runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
    assert [p.name for p in params[:len(runtime)]] == runtime  # runtime parameters first
    meta = dict(ROWS=2, PA=64, LOG2PA=6, T=0, LOG2T=0, MODE=1, XDT=1, HAS_W=True, PER_HEAD=False, HAS_DRES=False,
                DW_PARTIALS=True, PREFETCH=True, num_warps=4)
    tail = tb.constexpr_tail(fn, len(runtime), meta)
    # the rest: their defaults
    assert tail == (2, 64, 6, 0, 0, 1, 1, True, False, False, True, True, 1, 0, 0, 1, 0, 0, 8, 0, 0.0, False, 0, 0, 0)
    with pytest.raises(TypeError, match="not constexprs"):
        tb.constexpr_tail(fn, len(runtime) - 1, meta)
