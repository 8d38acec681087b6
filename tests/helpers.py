"""Shared test helpers: independent scalar implementations of the contract's building blocks."""

from __future__ import annotations

import struct

import torch

from strictnorm.verify import (  # noqa: F401
    ZERO_DY_OFFSET,
    bits_diff,
    bits_equal,
    mismatches,
    sprinkle_specials,
    with_specials,
    zero_dy_rows,
)


def f32(v: float) -> float:
    """Round a Python float (double) to the nearest fp32, ties to even."""
    return struct.unpack("f", struct.pack("f", v))[0]


def tree_sum_py(vals: list[float]) -> float:
    """canon_sum written independently: recursive halves over a zero-padded power-of-two list."""
    p = 1
    while p < len(vals):
        p *= 2
    vals = list(vals) + [0.0] * (p - len(vals))

    def rec(lo: int, hi: int) -> float:
        if hi - lo == 1:
            return vals[lo]
        mid = (lo + hi) // 2
        return f32(rec(lo, mid) + rec(mid, hi))

    return rec(0, p)


def fast_dw_excess(fast: torch.Tensor, strict: torch.Tensor, dy: torch.Tensor, z: torch.Tensor, w: torch.Tensor,
                   rstd: torch.Tensor, mode: str, offset: float) -> float:
    """How far the fast dW (a reassociated fp32 sum, rounded to the weight's dtype) lies from the strict one,
    relative to the strict dW's norm, beyond each column's summation slack: 4 * 2**-24 * sum of |terms|. The
    rounding of a sum of m terms moves it by ~2**-24 times the sum of |terms| (the partial sums' sizes); where
    the terms cancel to near zero (N = 1, one column over millions of rows) that dwarfs the result, and a bound
    relative to |dW| alone fails on correct sums. A row left out moves a column by its |term|, ~1 / m of the
    sum of |terms|: caught while m < ~4M."""
    from strictnorm.backends.torch_ref import TorchBackend
    from strictnorm.contract import make_spec

    spec = make_spec(z.dtype, 1e-6, offset, mode, z.dtype)
    abs_terms = TorchBackend().rms_norm_bwd(dy.abs(), z.abs(), w, rstd, None, spec, "fast", True, None)[1]
    slack = 4 * 2.0**-24 * abs_terms.double().abs()
    f, s = fast.double(), strict.double()
    excess = ((f - s).abs() - slack).clamp_min(0)
    return (excess.norm() / s.norm().clamp_min(1e-30)).item()


def randn(*shape: int, dtype=torch.float32, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def check_fused_add_graph_replay(backend: str, dw: str, data, replays: int = 2) -> None:
    """FusedAddRMSNorm forward + backward on `backend` (gemma, offset 1.0, in-place backward, a gradient
    through residual_out too) captured once in a CUDA graph and replayed with new x, weight and dy from
    data() -> (x, w, dy): outputs and gradients equal the reference backend's bit for bit (dW too in
    strict mode)."""
    import strictnorm as sn

    x0, w0, dy0 = data()
    sx, sdy, sw = x0.clone(), dy0.clone(), w0.clone().requires_grad_(True)

    def step(name, x, w, dy):
        xs, rs = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
        y, res = sn.fused_add_rms_norm(xs, rs, w, casting_mode="gemma", offset=1.0, dw=dw, in_place=True,
                                       backend=name)
        torch.autograd.backward([y, res], [dy, dy])
        return y, res, xs.grad, rs.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # kernels compiled and loaded before the capture
        for _ in range(2):
            sw.grad = None
            step(backend, sx, sw, sdy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    sw.grad = None
    with torch.cuda.graph(graph):
        out = step(backend, sx, sw, sdy)
    for _ in range(replays):
        nx, nw, ndy = data()
        sx.copy_(nx)
        sdy.copy_(ndy)
        with torch.no_grad():
            sw.copy_(nw)
        graph.replay()
        torch.cuda.synchronize()
        ws = nw.clone().requires_grad_(True)
        want = step("torch", nx, ws, ndy)
        for a, b in zip(out, want, strict=True):
            assert bits_equal(a, b), bits_diff(a, b)
        if dw == "strict":
            assert bits_equal(sw.grad, ws.grad), bits_diff(sw.grad, ws.grad)


def guarded(t: torch.Tensor | None, guard: int) -> torch.Tensor | None:
    """A copy of t placed between two NaN-filled guard bands of `guard` elements in one buffer: a kernel
    that reads past either end of the tensor (a padded lane loaded instead of zero-filled) sees NaN,
    which reaches every output of its row. guard should be a multiple of 16 elements, so that the copy
    keeps the buffer's 16-byte alignment."""
    if t is None:
        return None
    buf = torch.full((2 * guard + t.numel(),), float("nan"), dtype=t.dtype, device=t.device)
    out = buf[guard:guard + t.numel()].view(t.shape)
    out.copy_(t)
    return out


# Row scales whose bf16 rows have a subnormal fp32 mean square (2^-66, 2^-72), one that overflows (2^70) or NaN, beside
# ordinary rows: with eps = 0 the mean's own bits reach rstd (the mean taken by 2^-k where N = 2^k).
EXTREME_MEAN_SCALES = (1.0, 2.0**-66, 2.0**-72, 2.0**70, 1.0, float("nan"))


def extreme_mean_rows(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 rows (on gen's device), row r scaled by EXTREME_MEAN_SCALES[r % 6]."""
    scales = torch.tensor(EXTREME_MEAN_SCALES, device=gen.device).repeat(-(-rows // len(EXTREME_MEAN_SCALES)))
    return (torch.randn(rows, n, device=gen.device, generator=gen) * scales[:rows, None]).bfloat16()


def zero_dy_case(n: int, device, gen: torch.Generator):
    """strictnorm.verify.zero_dy_rows on device, as (dy, z, w, rstd, spec, want_dx) with the reference's dx,
    checked to have the signed zeros the case is about."""
    from strictnorm.backends.torch_ref import TorchBackend
    from strictnorm.contract import make_spec

    z, w, dy = (t.to(device) for t in zero_dy_rows(n, gen))
    spec = make_spec(torch.bfloat16, 1e-6, ZERO_DY_OFFSET, "llama", torch.bfloat16)
    ref = TorchBackend()
    _, rstd, _ = ref.rms_norm_fwd(z, w, None, spec)
    want_dx, _ = ref.rms_norm_bwd(dy, z, w, rstd, None, spec, "strict", False, None)
    bits = want_dx[0].view(torch.int16)
    assert bool((bits == (0 if n & (n - 1) == 0 else -32768)).all()), "the case lost its signed zeros"
    return dy, z, w, rstd, spec, want_dx


def check_special_values(backend, n: int, dtype: torch.dtype, fused: bool, mode: str, device, gen: torch.Generator
                         ) -> None:
    """sprinkle_specials' rows (and residuals, gradients; the weight with zeros, subnormals and the largest
    values only) through backend's forward and backward with a negative offset: y, rstd, residual_out, dx
    and the strict dW equal the reference's bits (any NaN matches any NaN)."""
    from strictnorm.backends.torch_ref import TorchBackend
    from strictnorm.contract import make_spec

    rows = 11  # row 0 ordinary, then two of each kind
    x, w, dy = randn(rows, n, dtype=dtype, gen=gen), randn(n, dtype=torch.bfloat16, gen=gen), randn(
        rows, n, dtype=dtype, gen=gen)
    res, dres = (randn(rows, n, dtype=dtype, gen=gen), randn(rows, n, dtype=dtype, gen=gen)) if fused else (None, None)
    x, w, dy, res, dres = (None if t is None else t.to(device) for t in with_specials(gen, x, w, dy, res, dres))
    spec = make_spec(dtype, 1e-6, -0.5, mode, dtype)
    ref = TorchBackend()
    want, got = ref.rms_norm_fwd(x, w, res, spec), backend.rms_norm_fwd(x, w, res, spec)
    for name, a, b in zip(("y", "rstd", "z"), want, got, strict=True):
        assert (a is None and b is None) or bits_equal(a, b), f"{name} at N = {n}, {mode}, {dtype}"
    z = want[2] if fused else x
    want_dx, want_dw = ref.rms_norm_bwd(dy, z, w, want[1], dres, spec, "strict", True, None)
    got_dx, got_dw = backend.rms_norm_bwd(dy, z, w, want[1], dres, spec, "strict", True, None)
    assert bits_equal(want_dx, got_dx), f"dx at N = {n}, {mode}, {dtype}: {bits_diff(want_dx, got_dx)}"
    assert bits_equal(want_dw, got_dw), f"dw at N = {n}, {mode}, {dtype}: {bits_diff(want_dw, got_dw)}"
    # The largest weights make every row's sum overflow (beyond a few columns every dx is then NaN or infinite),
    # and one infinite or NaN row makes every column's dW NaN: the backward again on the rows whose values are all
    # finite (zeros, subnormals, the largest values) with a weight of zeros and subnormals, whose results are
    # mostly finite (checked, so that the comparison has something to compare).
    finite = x.isfinite().all(-1) & dy.isfinite().all(-1)
    for t in (res, dres):
        finite = finite if t is None else finite & t.isfinite().all(-1)
    w2 = sprinkle_specials(w.float().clamp(-4, 4).to(w.dtype), gen, "zeros subnormals")
    x2, dy2 = x[finite], dy[finite]
    res2, dres2 = (None if t is None else t[finite] for t in (res, dres))
    fwd2 = ref.rms_norm_fwd(x2, w2, res2, spec)
    z2 = fwd2[2] if fused else x2
    want_dx, want_dw = ref.rms_norm_bwd(dy2, z2, w2, fwd2[1], dres2, spec, "strict", True, None)
    got_dx, got_dw = backend.rms_norm_bwd(dy2, z2, w2, fwd2[1], dres2, spec, "strict", True, None)
    assert bool(want_dx[0].isfinite().all()) and want_dw.float().isfinite().float().mean() > 0.5
    assert bits_equal(want_dx, got_dx), f"finite dx at N = {n}, {mode}, {dtype}: {bits_diff(want_dx, got_dx)}"
    assert bits_equal(want_dw, got_dw), f"finite dw at N = {n}, {mode}, {dtype}: {bits_diff(want_dw, got_dw)}"


def random_case(rng, gen: torch.Generator, device) -> dict:
    """One random configuration for a differential test against the reference: N and rows (odd, even,
    powers of two), x / weight / residual / out / dy dtypes (the weight may be absent), casting mode,
    offset (negative ones too), strided rows, per-head (H, N) weights, rows with special values."""
    from strictnorm.contract import make_spec

    dts = [torch.bfloat16, torch.float16, torch.float32]
    n = rng.choice([1, 2, 3, 5, 7, 8, 16, 31, 33, 64, 100, 128, 129, 257, 1000])
    m = rng.choice([1, 2, 3, 5, 11])
    x_dt, w_dt = rng.choice(dts), rng.choice(dts + [None])
    r_dt = rng.choice([None, x_dt, torch.float32])
    norm_dt = r_dt or x_dt
    out_dt = rng.choice([norm_dt, torch.float32])
    per_head = w_dt is not None and r_dt is None and rng.random() < 0.2
    strided, specials = rng.random() < 0.3, rng.random() < 0.5
    shape = (m, 3, n) if per_head else (m, n)
    x = torch.randn(*shape, generator=gen).to(x_dt)
    if specials:
        x = sprinkle_specials(x.reshape(-1, n), gen).reshape(shape)
    if strided:  # the same values inside wider rows (made on the device: .to() of a view would be dense)
        wide = torch.zeros(*shape[:-1], 2 * n + 3, dtype=x_dt)
        wide[..., 1:n + 1] = x
        x = wide.to(device)[..., 1:n + 1]
    w = None if w_dt is None else (torch.randn(*shape[1:], generator=gen) * 0.5).to(w_dt)
    res = None if r_dt is None else torch.randn(*shape, generator=gen).to(r_dt)
    dy = torch.randn(*shape, generator=gen).to(out_dt)
    if specials:
        dy = sprinkle_specials(dy.reshape(-1, n), gen).reshape(shape)
    spec = make_spec(norm_dt, 1e-6, rng.choice([0.0, 1.0, -0.5, -1.0, 0.25]), rng.choice(["llama", "gemma", "none"]),
                     out_dt)
    move = (lambda t: None if t is None else t.to(device))
    return {"x": x if strided else move(x), "w": move(w), "res": move(res), "dy": move(dy), "spec": spec,
            "what": f"{m}x{n} x={x_dt} w={w_dt} res={r_dt} out={out_dt} {spec.mode} offset={spec.offset} "
                    f"strided={strided} per_head={per_head} specials={specials}"}


def check_random_case(backend, case: dict) -> None:
    """case's forward (y, rstd, residual_out) and backward (dx, strict dW where there is a weight) on
    backend equal the reference's bits."""
    from strictnorm.backends.torch_ref import TorchBackend

    ref, x, w, res, spec = TorchBackend(), case["x"], case["w"], case["res"], case["spec"]
    want, got = ref.rms_norm_fwd(x, w, res, spec), backend.rms_norm_fwd(x, w, res, spec)
    for name, a, b in zip(("y", "rstd", "residual_out"), want, got, strict=True):
        assert (a is None and b is None) or bits_equal(a, b), f"{name}: {case['what']}"
    z = want[2] if res is not None else x
    dy = case["dy"].to(z.dtype)  # the backward's dy has the norm input's dtype
    want_dx, want_dw = ref.rms_norm_bwd(dy, z, w, want[1], None, spec, "strict", w is not None, None)
    got_dx, got_dw = backend.rms_norm_bwd(dy, z, w, want[1], None, spec, "strict", w is not None, None)
    assert bits_equal(want_dx, got_dx), f"dx: {case['what']}: {bits_diff(want_dx, got_dx)}"
    assert (want_dw is None and got_dw is None) or bits_equal(want_dw, got_dw), f"dw: {case['what']}"


def slot_partial_rows_model(contrib: torch.Tensor, rpb: int, grid: int, combine: bool) -> torch.Tensor:
    """The fast dW's partial rows of a row kernel (rms_norm.cu's rms_bwd, the cute backward) on the CPU, from each
    row's fp32 dW contribution: block b takes row groups b, b + grid, ... of rpb rows, and its slot j left-folds rows
    g * rpb + j of them from +0.0 (one partial row a slot); with combine, the block's slot rows are then left-folded
    in slot order from +0.0 into one row a block."""
    contrib = contrib.float().cpu()
    rows, n = contrib.shape
    groups = -(-rows // rpb)
    out = []
    for b in range(grid):
        slots = []
        for j in range(rpb):
            acc = torch.zeros(n)
            for g in range(b, groups, grid):
                if g * rpb + j < rows:
                    acc = acc + contrib[g * rpb + j]
            slots.append(acc)
        if combine:
            total = torch.zeros(n)
            for acc in slots:
                total = total + acc
            slots = [total]
        out += slots
    return torch.stack(out)


def partial_sum_model(part: torch.Tensor, seg_rows: int, groups: int) -> torch.Tensor:
    """partial_sum.cu's order on the CPU: per segment and column, group g left-folds rows start + g, start + g +
    groups, ... from +0.0, then the group sums are left-folded in group order from +0.0 (fp32 adds, one at a time)."""
    rows, n = part.shape
    out = []
    for start in range(0, rows, seg_rows):
        seg = part[start:start + seg_rows]
        total = torch.zeros(n)
        for g in range(groups):
            acc = torch.zeros(n)
            for row in seg[g::groups]:
                acc = acc + row
            total = total + acc
        out.append(total)
    return torch.stack(out)
