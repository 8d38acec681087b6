"""The reference implementation against the contract, written independently where it can be."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import bits_equal, f32, randn, tree_sum_py

import strictnorm as sn
from strictnorm import reference as ref
from strictnorm.contract import NormSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = ["llama", "gemma", "none"]


def spec(mode="llama", out=torch.float32, offset=0.0, eps=1e-6):
    return NormSpec(eps=f32(eps), offset=offset, mode=mode, out_dtype=out)


# ---- building blocks -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 100, 1000, 65536])
def test_canon_sum_is_the_adjacent_first_tree(n, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over many binades so that any other order gives other bits
    rows = 4 if n < 65536 else 1
    v = randn(rows, n, gen=g) * torch.logspace(-6, 6, n)
    got = ref.canon_sum(v.float())
    for r in range(rows):
        assert got[r].item() == tree_sum_py([float(t) for t in v[r]]), f"row {r}"


def test_canon_sum_order_is_not_a_left_fold():
    # pins the tree: a left fold of these gives 0.0, the tree gives 2.0
    v = torch.tensor([[1e20, 1.0, -1e20, 1.0]])
    assert ref.canon_sum(v).item() == f32(f32(1e20 + 1.0) + f32(-1e20 + 1.0))


def test_div_and_sqrt_are_ieee_fp32(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.cat([torch.rand(4000, generator=g) * 1e4, torch.rand(100, generator=g) * 1e-40]).float()
    b = (torch.rand(4100, generator=g) * 7000 + 1).float()
    q = ref.div_rn(a, b)
    s = ref.sqrt_rn(a)
    for i in range(0, 4100, 7):
        assert q[i].item() == f32(a[i].item() / b[i].item())
        assert s[i].item() == f32(math.sqrt(a[i].item()))


@pytest.mark.parametrize("n", [1, 2, 128, 4096, 65536, 1 << 20, 3, 100, 18432])
def test_mean_by_multiplication_is_the_division_where_n_is_a_power_of_two(n, seed):
    """exact_mean_scale(n) (the kernels' mean of a power of two's squares: sum * 2^-k) gives div_rn(sum, n)'s bits
    on random fp32 bit patterns of every exponent (subnormal results, infinities and NaN included), and is 0 (keep
    the division) where n is not a power of two."""
    scale = ref.exact_mean_scale(n)
    if n & (n - 1):
        assert scale == 0.0
        return
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([0.0, 1.0, 2.0**-126, 2.0**-149, 3.0 * 2.0**-140, float("inf"), float("nan"),
                             torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny])
    s = torch.cat([bits.view(torch.float32), specials])
    assert bits_equal(s * torch.tensor(scale, dtype=torch.float32), ref.div_rn(s, float(n)))


# ---- forward ---------------------------------------------------------------------------------------

def _scalar_row_forward(x_row, w, mode, xdtype, offset, eps):
    """One row of the forward, element by element with Python scalars (independent of reference.py)."""
    def rd(v, dt):
        return torch.tensor(v, dtype=torch.float32).to(dt).float().item()

    xs = [float(t) for t in x_row.float()]
    ss = tree_sum_py([f32(v * v) for v in xs])
    rstd = f32(1.0 / f32(math.sqrt(f32(f32(ss / len(xs)) + f32(eps)))))
    out = []
    for v, wv in zip(xs, w, strict=True):
        wf = f32(float(wv) + offset)
        if mode == "gemma":
            out.append(f32(f32(v * rstd) * wf))
        elif mode == "llama":
            out.append(f32(rd(f32(v * rstd), xdtype) * wf))
        else:
            r = rd(rstd, xdtype)
            out.append(rd(rd(f32(v * r), xdtype) * rd(wf, xdtype), xdtype))
    return rstd, out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_scalar_formula(mode, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = 37
    x = randn(3, n, dtype=dtype, gen=g)
    w = randn(n, dtype=torch.bfloat16, gen=g)
    y, rstd = ref.rms_norm_forward(x, w, spec(mode, torch.float32, offset=0.5))
    for r in range(3):
        want_rstd, want_y = _scalar_row_forward(x[r], w.float(), mode, dtype, 0.5, 1e-6)
        assert rstd[r].item() == want_rstd
        assert y[r].tolist() == want_y


def test_gemma_offset_is_added_in_fp32():
    w = torch.full((16,), 0.00390625, dtype=torch.bfloat16)
    assert (w + 1.0).float()[0].item() == 1.0  # what adding in bf16 would do
    x = torch.ones(2, 16)
    y = sn.rms_norm(x, w, 0.0, offset=1.0, casting_mode="gemma", backend="torch")
    assert (y == 1.00390625).all()
    y = sn.rms_norm(x.bfloat16(), w, 0.0, offset=1.0, casting_mode="gemma", backend="torch", out_dtype=torch.float32)
    assert (y == 1.00390625).all()


@pytest.mark.parametrize("n", [1, 7, 128, 1000])
def test_batch_invariance(n, seed):
    """A row gives the same y, rstd and dx alone, in a big batch, at another position, with padding."""
    g = torch.Generator().manual_seed(seed)
    row = randn(1, n, dtype=torch.bfloat16, gen=g)
    dy_row = randn(1, n, dtype=torch.bfloat16, gen=g)
    w = randn(n, dtype=torch.bfloat16, gen=g)

    def run(x, dy, at):
        x = x.clone().requires_grad_(True)
        y, rstd = sn.rms_norm_with_rstd(x, w, backend="torch")
        y.backward(dy)
        return y[at], rstd[at], x.grad[at]

    alone = run(row, dy_row, 0)
    for m, at in [(1000, 0), (1000, 999), (37, 11)]:
        x = randn(m, n, dtype=torch.bfloat16, gen=g)
        dy = randn(m, n, dtype=torch.bfloat16, gen=g)
        x[at], dy[at] = row[0], dy_row[0]
        inside = run(x, dy, at)
        for a, b in zip(alone, inside, strict=True):
            assert bits_equal(a, b)
    # padded: the row inside a wider buffer (strided view), surrounded by other data
    buf = randn(5, n + 9, dtype=torch.bfloat16, gen=g)
    buf[2, 3:3 + n] = row[0]
    view = buf[:, 3:3 + n]
    y, rstd = sn.rms_norm_with_rstd(view, w, backend="torch")
    assert bits_equal(y[2], alone[0]) and bits_equal(rstd[2], alone[1])


# ---- backward and dW -------------------------------------------------------------------------------

def test_left_fold_is_pinned_by_a_non_associative_case():
    rows = torch.tensor([[1e20], [1.0], [-1e20], [1.0]])
    assert sn.reduce_rows_left_fold(rows, backend="torch").item() == 1.0
    assert sn.reduce_rows_left_fold(rows.bfloat16(), backend="torch").item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_left_fold_equals_python_loop(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = randn(300, 6, 5, dtype=dtype, gen=g, scale=1e3).transpose(1, 2)  # non-contiguous, multi-dim
    acc = torch.zeros(5, 6)
    for r in rows:
        acc = acc + r.float()
    assert bits_equal(sn.reduce_rows_left_fold(rows, backend="torch"), acc)
    assert bits_equal(sn.reduce_rows_left_fold(rows[:0], backend="torch"), torch.zeros(5, 6))


def test_left_fold_keeps_negative_zero():
    rows = torch.tensor([[-0.0], [-0.0]])
    out = sn.reduce_rows_left_fold(rows, backend="torch")
    assert math.copysign(1.0, out.item()) == 1.0  # +0.0 + -0.0 = +0.0: the fold starts from +0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strict_dw_equals_python_loop(mode, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    m, n = 50, 24
    x = randn(m, n, dtype=dtype, gen=g).requires_grad_(True)
    w = randn(n, dtype=torch.float32, gen=g).requires_grad_(True)
    dy = randn(m, n, dtype=dtype, gen=g)
    y, rstd = sn.rms_norm_with_rstd(x, w, casting_mode=mode, dw="strict", backend="torch")
    y.backward(dy)
    acc = torch.zeros(n)
    xf = x.detach().float()
    for r in range(m):
        if mode == "gemma":
            xn = xf[r] * rstd[r]
        elif mode == "llama":
            xn = (xf[r] * rstd[r]).to(dtype).float()
        else:
            xn = (xf[r] * rstd[r].to(dtype).float()).to(dtype).float()
        acc = acc + dy[r].float() * xn
    assert bits_equal(w.grad, acc)


def _float64_norm(x, w, offset, mode, res=None):
    """The same formulas in float64 through plain autograd (no strictnorm code)."""
    z = x + res if res is not None else x
    rstd = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
    return z * rstd * (w + offset), z


TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dw", ["strict", "fast"])
def test_accuracy_against_float64(mode, dtype, dw, seed):
    g = torch.Generator().manual_seed(seed)
    m, n = 64, 1000
    x = randn(m, n, dtype=dtype, gen=g)
    w = randn(n, gen=g, scale=0.1)
    dy = randn(m, n, dtype=dtype, gen=g)
    xs = x.clone().requires_grad_(True)
    ws = w.clone().requires_grad_(True)
    y = sn.rms_norm(xs, ws, offset=1.0, casting_mode=mode, dw=dw, backend="torch")
    y.backward(dy)
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    y64, _ = _float64_norm(x64, w64, 1.0, mode)
    y64.backward(dy.double())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(y, y64) < TOL[dtype]
    assert rel(xs.grad, x64.grad) < TOL[dtype] * 2
    assert rel(ws.grad, w64.grad) < TOL[dtype] * 2


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    wh = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    for mode in MODES:
        assert torch.autograd.gradcheck(
            lambda x, w, mode=mode: sn.rms_norm(x, w, offset=0.5, casting_mode=mode, backend="torch"), (x, w))
        assert torch.autograd.gradcheck(
            lambda x, r, w, mode=mode: sn.fused_add_rms_norm(x, r, w, casting_mode=mode, backend="torch"),
            (x, r, w))
    assert torch.autograd.gradcheck(lambda q, w: sn.qk_norm(q, w, backend="torch"), (q, wh))


# ---- fused add, QK-norm, shapes and dtypes --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_gradients_including_residual_out(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    m, n = 16, 40
    x, res = randn(m, n, dtype=dtype, gen=g), randn(m, n, dtype=dtype, gen=g)
    w = randn(n, gen=g)
    dy, dz = randn(m, n, dtype=dtype, gen=g), randn(m, n, dtype=dtype, gen=g)
    xs, rs, ws = (t.clone().requires_grad_(True) for t in (x, res, w))
    y, z = sn.fused_add_rms_norm(xs, rs, ws, backend="torch", casting_mode="gemma", dw="strict")
    assert bits_equal(z, (x.float() + res.float()).to(dtype))
    torch.autograd.backward([y, z], [dy, dz])
    # dx = rd(dnorm + f32(dz)): the residual_out gradient is added in fp32 before rounding
    zz = z.detach().clone().requires_grad_(True)
    w2 = w.clone().requires_grad_(True)
    y2 = sn.rms_norm(zz, w2, casting_mode="gemma", dw="strict", backend="torch")
    _, rstd = sn.rms_norm_with_rstd(zz.detach(), w, casting_mode="gemma", backend="torch")
    dnorm = ref.rms_norm_backward_dx(dy, z.detach(), w, rstd, spec("gemma", dtype), dres=dz)
    assert bits_equal(xs.grad, dnorm) and bits_equal(rs.grad, dnorm)
    y2.backward(dy)
    assert bits_equal(ws.grad, w2.grad)
    # and accurate against float64
    x64, r64, w64 = (t.double().requires_grad_(True) for t in (x, res, w))
    y64, z64 = _float64_norm(x64, w64, 0.0, "gemma", r64)
    torch.autograd.backward([y64, z64], [dy.double(), dz.double()])
    assert ((xs.grad.double() - x64.grad).norm() / x64.grad.norm()) < TOL[dtype] * 2


@pytest.mark.parametrize("used", ["y", "z"])
def test_fused_add_gradient_through_one_output(used, seed):
    """Only y or only residual_out reaches the loss: the unused output's gradient is zero (the eager path
    passes None for it instead of a zero tensor) and the result equals passing that zero explicitly."""
    g = torch.Generator().manual_seed(seed)
    m, n = 9, 24
    x, res, w = randn(m, n, dtype=torch.bfloat16, gen=g), randn(m, n, dtype=torch.bfloat16, gen=g), randn(n, gen=g)
    grad = randn(m, n, dtype=torch.bfloat16, gen=g)
    zero = torch.zeros_like(grad)
    results = []
    for explicit in (False, True):
        xs, rs, ws = (t.clone().requires_grad_(True) for t in (x, res, w))
        y, z = sn.fused_add_rms_norm(xs, rs, ws, backend="torch", dw="strict")
        if explicit:
            torch.autograd.backward([y, z], [grad, zero] if used == "y" else [zero, grad])
        else:
            (y if used == "y" else z).backward(grad)
        results.append((xs.grad, rs.grad, ws.grad))
    (gx, gr, gw), (ex, er, ew) = results
    assert bits_equal(gx, ex) and bits_equal(gr, er)
    assert (gw is None and ew is None) or bits_equal(gw, ew)
    if used == "z":
        assert bits_equal(gx, grad) and not gw.any()


def test_qk_norm_per_head_weight_and_strided_view(seed):
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = 2, 3, 4, 16
    qkv = randn(b, s, 3 * h * d, dtype=torch.bfloat16, gen=g)
    k = qkv[..., h * d:2 * h * d].view(b, s, h, d)
    assert not k.is_contiguous()
    wh = randn(h, d, gen=g)
    y = sn.qk_norm(k, wh, backend="torch")
    for head in range(h):
        want = sn.rms_norm(k[:, :, head].contiguous(), wh[head], backend="torch")
        assert bits_equal(y[:, :, head], want)
    # per-head dW: each head folds its own rows, in (b, s) order
    kk = k.detach().clone().requires_grad_(True)
    ww = wh.clone().requires_grad_(True)
    dy = randn(b, s, h, d, dtype=torch.bfloat16, gen=g)
    sn.qk_norm(kk, ww, dw="strict", backend="torch").backward(dy)
    for head in range(h):
        w1 = wh[head].clone().requires_grad_(True)
        sn.rms_norm(k[:, :, head].contiguous(), w1, dw="strict", backend="torch").backward(dy[:, :, head])
        assert bits_equal(ww.grad[head], w1.grad)


def test_mixed_dtypes_and_out_dtype(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(5, 33, dtype=torch.bfloat16, gen=g)
    w = randn(33, gen=g)
    y = sn.rms_norm(x, w, backend="torch")
    assert y.dtype == torch.bfloat16
    y32 = sn.rms_norm(x, w, backend="torch", out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert bits_equal(y32.to(torch.bfloat16), y)  # one rounding either way in llama mode


def test_multidim_noncontiguous_and_empty(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(3, 4, 10, dtype=torch.float16, gen=g).transpose(0, 1)
    w = randn(10, dtype=torch.float16, gen=g)
    y = sn.rms_norm(x, w, backend="torch")
    assert y.shape == x.shape
    assert bits_equal(y, sn.rms_norm(x.contiguous(), w, backend="torch"))
    e = torch.empty(0, 10, dtype=torch.float16, requires_grad=True)
    wg = w.clone().requires_grad_(True)
    ye = sn.rms_norm(e, wg, dw="strict", backend="torch")
    assert ye.shape == (0, 10)
    ye.sum().backward()
    assert bits_equal(wg.grad, torch.zeros(10, dtype=torch.float16))
    one = randn(7, 1, gen=g)
    y1 = sn.rms_norm(one, None, eps=0.0, backend="torch")  # N = 1: x / |x|, up to rounding
    assert ((y1.abs() - 1).abs() <= 2**-22).all() and bits_equal(y1.sign(), one.sign())


def test_in_place_backward_writes_dy_buffer(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(8, 32, dtype=torch.bfloat16, gen=g)
    w = randn(32, dtype=torch.bfloat16, gen=g)
    dy = randn(8, 32, dtype=torch.bfloat16, gen=g)
    xa = x.clone().requires_grad_(True)
    sn.rms_norm(xa, w, backend="torch").backward(dy.clone())
    buf = dy.clone()
    xb = x.clone().requires_grad_(True)
    sn.rms_norm(xb, w, backend="torch", in_place=True).backward(buf)
    assert bits_equal(xb.grad, xa.grad)
    assert bits_equal(buf, xa.grad)  # dx landed in dy's buffer
    with pytest.raises(sn.StrictNormError, match="in_place"):
        sn.rms_norm(xb, w, backend="torch", in_place=True, out_dtype=torch.float32)


# ---- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda x, w: sn.rms_norm(x, w[:5]), "weight has shape"),
    (lambda x, w: sn.rms_norm(x.int(), w), "unsupported dtype"),
    (lambda x, w: sn.rms_norm(x, w.int()), "weight has unsupported dtype"),
    (lambda x, w: sn.rms_norm(x, w, eps=-1e-6), "eps must be >= 0"),
    (lambda x, w: sn.rms_norm(x, w, eps=float("nan")), "eps must be finite"),
    (lambda x, w: sn.rms_norm(x, w, eps=float("inf")), "eps must be finite"),
    (lambda x, w: sn.rms_norm(x, w, eps=1e39), "overflows fp32"),
    (lambda x, w: sn.rms_norm(x, w, casting_mode="fp8"), "unknown casting_mode"),
    (lambda x, w: sn.rms_norm(x, w, dw="exactish"), "unknown dw mode"),
    (lambda x, w: sn.rms_norm(x[:, :0], None), "N = 0"),
    (lambda x, w: sn.rms_norm(torch.ones(2, 65537), None), "larger than the supported maximum"),
    (lambda x, w: sn.rms_norm(x, None, offset=1.0), "offset needs a weight"),
    (lambda x, w: sn.rms_norm(x, w, offset=float("nan")), "offset must be finite"),
    (lambda x, w: sn.fused_add_rms_norm(x, x[:, :3], w), "shapes differ"),
    (lambda x, w: sn.qk_norm(x, torch.ones(3, 8)), "weight has shape"),
    (lambda x, w: sn.rms_norm(torch.ones(()), None), "at least one dimension"),
    (lambda x, w: sn.rms_norm(x, w, backend="nope"), "unknown backend"),
    (lambda x, w: sn.rms_norm(x.double(), w.double(), backend="triton"), "triton|cannot run"),
])
def test_bad_inputs_raise_clear_errors(call, match):
    x = torch.randn(4, 8)
    w = torch.randn(8)
    x0, w0 = x.clone(), w.clone()
    with pytest.raises((sn.StrictNormError, sn.BackendUnavailable), match=match):
        call(x, w)
    assert bits_equal(x, x0) and bits_equal(w, w0)  # nothing mutated


def test_weight_on_other_device_is_an_error():
    x = torch.randn(2, 4)
    w = torch.randn(4, device="meta")
    with pytest.raises(sn.StrictNormError, match="weight is on meta"):
        sn.rms_norm(x, w)


def test_non_finite_inputs_stay_in_their_row():
    x = torch.randn(3, 8)
    x[1, 2] = float("inf")
    x[2, 5] = float("nan")
    y = sn.rms_norm(x, torch.ones(8), backend="torch")
    assert torch.isfinite(y[0]).all()
    assert torch.isnan(y[1]).any() and torch.isnan(y[2]).all()
