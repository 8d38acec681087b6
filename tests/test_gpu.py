"""GPU tests (skipped without CUDA): the full shape grid bit for bit, batch invariance, determinism,
CUDA graph replay, and the CUDA strict fold against the Python loop."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA
from helpers import (
    bits_equal,
    check_fused_add_graph_replay,
    check_random_case,
    check_special_values,
    extreme_mean_rows,
    fast_dw_excess,
    guarded,
    partial_sum_model,
    random_case,
    zero_dy_case,
)

import strictnorm as sn
from strictnorm.backends.registry import get_backend, status

pytestmark = pytest.mark.gpu
DEV = "cuda"
GRID_N = [1, 7, 64, 127, 128, 512, 1000, 4096, 5120, 8192, 18432, 65536]


def _rows_for(n: int) -> list[int]:
    big = max(1, min(1 << 20, (1 << 25) // n))  # up to 1M rows, at most 32M elements
    return sorted({1, 255, min(4097, big), big})


def _data(m, n, dtype, wdtype, seed, per_head=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, n, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, device=DEV, generator=g) * 0.1).to(wdtype)
    dy = torch.randn(m, n, device=DEV, generator=g).to(dtype)
    return x, w, dy


def _fwd_bwd(backend, x, w, dy, mode, dw, offset=0.0):
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y, rstd = sn.rms_norm_with_rstd(xs, ws, offset=offset, casting_mode=mode, dw=dw, backend=backend)
    y.backward(dy)
    return y, rstd, xs.grad, ws.grad


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_reference_is_device_independent(seed):
    x, w, dy = _data(300, 1000, torch.bfloat16, torch.bfloat16, seed)
    gpu = _fwd_bwd("torch", x, w, dy, "llama", "strict", 1.0)
    cpu = _fwd_bwd("torch", x.cpu(), w.cpu(), dy.cpu(), "llama", "strict", 1.0)
    for a, b in zip(gpu, cpu, strict=True):
        assert bits_equal(a, b)


# Every N in bf16/llama; the other modes and dtypes on a subset (each case compiles kernels: device time).
GRID = ([(n, torch.bfloat16, "llama") for n in GRID_N]
        + [(n, torch.bfloat16, mode) for n in (7, 1000, 4096, 18432) for mode in ("gemma", "none")]
        + [(n, dt, "llama") for n in (1000, 65536) for dt in (torch.float16, torch.float32)])


@pytest.mark.parametrize("n, dtype, mode", GRID)
def test_triton_grid_bitwise(n, dtype, mode, seed):
    for m in _rows_for(n):
        x, w, dy = _data(m, n, dtype, torch.float32 if mode == "none" else dtype, seed + m)
        offset = 1.0 if mode == "gemma" else 0.0
        dw = "strict" if m <= 4097 else "fast"  # the reference's strict loop is one launch per row
        want = _fwd_bwd("torch", x, w, dy, mode, dw, offset)
        got = _fwd_bwd("triton", x, w, dy, mode, dw, offset)
        for name, a, b in zip(("y", "rstd", "dx", "dw"), want, got, strict=True):
            if name == "dw" and dw == "fast":
                # the fast dW reassociates the fp32 sum, so the rounded results may differ by an ulp of the
                # weight's dtype here and there (a bf16 ulp in 8 of 4096 entries is ~1.7e-4 of the norm). k of
                # m rows left out or counted twice move it by ~sqrt(k / m): a program's share (m / 528 rows at
                # most, ~0.04) is far above the bound; a single row of 1M (~1e-3) is below a bf16 weight's
                # resolution, which no bound on the rounded dW could see
                # (beyond the summation's own slack: helpers.fast_dw_excess)
                tol = max(torch.finfo(a.dtype).eps / 2, 1e-5)
                rel = fast_dw_excess(b, a, dy, x, w, want[1], mode, offset)
                assert rel < tol, f"{m}x{n} {mode} dw fast rel {rel}"
            else:
                assert bits_equal(a, b), f"{name} differs at {m}x{n} {dtype} {mode}"


@pytest.mark.parametrize("m, n", [(2048, 18432), (300, 18432), (4099, 12000), (700, 65536), (9000, 5120)])
def test_triton_fast_dw_of_long_rows(m, n, seed):
    """The fast dW where rows are long (the grid test above takes the strict dW there, from its row counts): y and dx
    bit for bit, the fast dW within its bound of the strict one and the same on a second call; rows held whole or in
    column chunks, with partials per program in registers or in global memory (TILE_TABLE decides)."""
    x, w, dy = _data(m, n, torch.bfloat16, torch.bfloat16, seed)
    want = _fwd_bwd("torch", x, w, dy, "gemma", "strict", 1.0)
    got = _fwd_bwd("triton", x, w, dy, "gemma", "fast", 1.0)
    for name, a, b in zip(("y", "rstd", "dx"), want, got, strict=False):
        assert bits_equal(a, b), f"{name} differs at {m}x{n}"
    rel = fast_dw_excess(got[3], want[3], dy, x, w, want[1], "gemma", 1.0)
    assert rel < torch.finfo(torch.bfloat16).eps / 2, f"{m}x{n} dw fast rel {rel}"
    assert bits_equal(got[3], _fwd_bwd("triton", x, w, dy, "gemma", "fast", 1.0)[3])


@pytest.mark.parametrize("n, dtype", [(30000, torch.float32), (30000, torch.bfloat16), (24592, torch.float32)])
def test_triton_backward_of_rows_past_three_quarters_of_their_padded_length(n, dtype, seed):
    """Rows of more than 3/4 of P = 32768 lanes held whole in one tile: the strict backward's dx pass, its pipeline
    stages bounded by the shared memory (backend.stages_that_fit: fp32 z and dy of 32768 lanes need 256 KB a stage,
    more than a block may have), bitwise against the reference (dx and the strict dW), and the fast backward's dx."""
    x, w, dy = _data(257, n, dtype, dtype, seed)
    want = _fwd_bwd("torch", x, w, dy, "gemma", "strict", 1.0)
    for a, b in zip(want, _fwd_bwd("triton", x, w, dy, "gemma", "strict", 1.0), strict=True):
        assert bits_equal(a, b), f"{n} {dtype}"
    assert bits_equal(want[2], _fwd_bwd("triton", x, w, dy, "gemma", "fast", 1.0)[2])


def test_triton_register_bound_only_where_ptxas_exceeds_it(seed, monkeypatch):
    """The forward's P = 32768 entry bounds registers to 64 a thread (TileChoice.max_registers): the launched kernel
    keeps within it and gives the reference's bits; at 20480 columns (70 registers unbounded with triton 3.6) the
    launch keeps the bound (at 18432, 64 unbounded, _Launcher drops it)."""
    tb = get_backend("triton")
    for n in (18432, 20480):
        monkeypatch.setattr(tb, "_fwd_plans", {})
        x, w, _ = _data(300, n, torch.bfloat16, torch.bfloat16, seed + n)
        want = sn.rms_norm_with_rstd(x, w, casting_mode="llama", backend="torch")
        got = sn.rms_norm_with_rstd(x, w, casting_mode="llama", backend="triton")
        assert all(bits_equal(a, b) for a, b in zip(want, got, strict=True)), n
        (plan,) = tb._fwd_plans.values()
        assert plan.meta["maxnreg"] == 64 and plan.launch.kernel.n_regs <= 64, n
        if n == 20480:
            assert plan.launch.meta["maxnreg"] == 64


@pytest.mark.parametrize("n", [128, 4096, 8192])
def test_strict_dw_large_rows_cuda_vs_triton_fold(n, seed):
    """Two independent strict-fold implementations must agree at row counts the reference loop can't do."""
    m = (1 << 22) // n * 4
    x, w, dy = _data(m, n, torch.bfloat16, torch.bfloat16, seed)
    tb = get_backend("triton")
    via_cuda = _fwd_bwd("triton", x, w, dy, "llama", "strict")[3]
    tb.use_cuda_fold = False
    try:
        via_triton = _fwd_bwd("triton", x, w, dy, "llama", "strict")[3]
    finally:
        tb.use_cuda_fold = True
    assert bits_equal(via_cuda, via_triton)


@pytest.mark.parametrize("n", [128, 1000, 4096])
def test_batch_invariance(n, seed):
    x, w, dy = _data(100_000, n, torch.bfloat16, torch.bfloat16, seed)
    full = _fwd_bwd("triton", x, w, dy, "llama", "fast")
    for lo, hi in [(0, 1), (12345, 12346), (99_999, 100_000), (7, 1007), (50, 60_000)]:
        part = _fwd_bwd("triton", x[lo:hi], w, dy[lo:hi], "llama", "fast")
        for a, b in zip(full[:3], part[:3], strict=True):
            assert bits_equal(a[lo:hi], b), f"rows {lo}:{hi}"


def test_run_to_run_determinism(seed):
    x, w, dy = _data(32768, 4096, torch.bfloat16, torch.bfloat16, seed)
    first = _fwd_bwd("triton", x, w, dy, "llama", "fast")
    for _ in range(2):
        again = _fwd_bwd("triton", x, w, dy, "llama", "fast")
        for a, b in zip(first, again, strict=True):
            assert bits_equal(a, b)


@pytest.mark.parametrize("n", [1000, 4096])
def test_triton_direct_launches_give_the_jit_bits(n, seed):
    """A plan's first call goes through Triton's JIT, later ones launch its compiled kernel directly: fresh inputs of
    one signature against the reference (strict dW) and against a first call (fast dW), then rows starting off a
    16-byte boundary (another plan: the JIT specializes on alignment)."""
    tb = get_backend("triton")
    tb._fwd_plans.clear()
    tb._bwd_plans.clear()

    def run(backend, flat, w, dy, first, mode, dw, offset=0.0):
        leaf, ws = flat.clone().requires_grad_(True), w.clone().requires_grad_(True)
        xs = leaf[first:first + dy.numel()].view(dy.shape)
        y, rstd = sn.rms_norm_with_rstd(xs, ws, offset=offset, casting_mode=mode, dw=dw, backend=backend)
        y.backward(dy)
        return y, rstd, leaf.grad, ws.grad

    for step in range(4):
        x, w, dy = _data(300, n, torch.bfloat16, torch.bfloat16, seed + step)
        first = 1 if step == 3 else 0  # the last step's rows start one element off alignment
        flat = torch.cat([x.flatten(), x[0, :1]]) if first == 0 else torch.cat([x[0, :1], x.flatten()])
        strict = run("triton", flat, w, dy, first, "gemma", "strict", 0.5)
        for a, b in zip(run("torch", flat, w, dy, first, "gemma", "strict", 0.5), strict, strict=True):
            assert bits_equal(a, b), f"step {step}"
        fast = [run("triton", flat, w, dy, first, "llama", "fast") for _ in range(2)]
        for a, b in zip(*fast, strict=True):
            assert bits_equal(a, b), f"step {step}"
    launched = [p.launch.kernel is not None for p in (*tb._fwd_plans.values(), *tb._bwd_plans.values()) if p.launch]
    assert launched and all(launched)
    assert {k[1][0][3] for k in tb._fwd_plans} == {True, False}  # aligned and misaligned x: two plans


# The Triton forward in warp blocks (kernels.py's notes): rows, warps, the repeats of a warp's pieces (1 to 4), the
# W_FIRST / persistent / column-chunk variants, two column tiles (split: the second tile's pieces whole or
# smaller; with ptxas's registers bounded, where the bound spills); every dtype and casting mode, the fused add,
# per-head weights.
WARP_BLOCK_TILES = [(512, 1, 2, {}), (1024, 2, 4, {}), (4096, 1, 8, {"w_first": True}), (4096, 2, 8, {}),
                    (4096, 1, 4, {"prefetch": True, "stages": 2, "programs_per_sm": 2}), (5120, 1, 8, {}),
                    (8192, 1, 8, {}), (8192, 1, 16, {}), (16384, 1, 16, {}),
                    (18432, 1, 4, {"chunk": 4096, "stages": 3}), (18432, 2, 8, {"chunk": 2048}),
                    (18432, 1, 16, {"split": True}), (18432, 2, 8, {"split": True}),
                    (18432, 1, 8, {"split": True, "prefetch": True, "programs_per_sm": 2}),
                    (1152, 1, 2, {"split": True}), (16896, 1, 16, {"split": True}), (17408, 1, 16, {"split": True}),
                    (20480, 1, 16, {"split": True}), (20480, 1, 16, {"split": True, "max_registers": 64}),
                    (24576, 1, 16, {"split": True, "max_registers": 64})]
WARP_BLOCK_INPUTS = ["bf16 llama", "bf16 gemma", "fp16 none", "fp32 llama", "bf16 fused", "bf16 per-head"]


@pytest.mark.parametrize("n, rows, warps, knobs", WARP_BLOCK_TILES)
@pytest.mark.parametrize("inputs", WARP_BLOCK_INPUTS)
def test_triton_forward_warp_blocks_bitwise(n, rows, warps, knobs, inputs, seed, monkeypatch):
    """The Triton forward with the row in warp blocks, whose blocks' sums meet in one tl.sum (its butterfly's order is
    Triton's lowering: checked here) against the reference's bits: y, rstd, and z of the fused add, at 1, 255 and 4097
    rows; the plan really takes warp blocks."""
    from strictnorm.backends.triton import backend as tbm

    fwd = {**tbm.TILE_TABLE["fwd"], 1 << (n - 1).bit_length(): tbm.TileChoice(rows=rows, num_warps=warps,
                                                                              warp_blocks=True, **knobs)}
    monkeypatch.setattr(tbm, "TILE_TABLE", {**tbm.TILE_TABLE, "fwd": fwd, "fwd_wb": {}})
    tb = get_backend("triton")
    monkeypatch.setattr(tb, "_fwd_plans", {})
    kind, mode = inputs.split()[:2]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind]
    mode = mode if mode in ("llama", "gemma", "none") else "gemma"
    kw = dict(offset=1.0 if mode == "gemma" else 0.0, casting_mode=mode)
    for m in (1, 255, 4097):
        g = torch.Generator(device=DEV).manual_seed(seed + m)
        x = torch.randn(m, n, device=DEV, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(dtype)  # one element size (_warp_block_piece)
        if "fused" in inputs:
            res = torch.randn(m, n, device=DEV, generator=g).to(dtype)
            outs = [sn.fused_add_rms_norm(x, res, w, backend=b, **kw) for b in ("torch", "triton")]
        elif "per-head" in inputs:
            xh = x.view(m, 1, 1, n).expand(m, 1, 2, n).contiguous()
            wh = torch.stack([w, w.flip(0)])
            outs = [(sn.qk_norm(xh, wh, backend=b, **kw),) for b in ("torch", "triton")]
        else:
            outs = [sn.rms_norm_with_rstd(x, w, backend=b, **kw) for b in ("torch", "triton")]
        for a, b in zip(*outs, strict=True):
            assert bits_equal(a, b), f"{m}x{n} {inputs}"
    assert tb._fwd_plans and all(p.meta["WB_NW"] == warps for p in tb._fwd_plans.values())


# The Triton backward in warp blocks (rows held whole): the table's tiles at 4096 (prefetched, 2 programs an SM),
# 8192 (3 stages) and P = 32768 (the "bwd" entry, every dW mode: two column tiles at 18432, one at 30000; 16 warps,
# 3 stages), and others.
BACKWARD_WARP_BLOCK_TILES = [(4096, 1, 8, {"prefetch": True, "programs_per_sm": 2}), (4096, 2, 8, {}),
                             (8192, 1, 8, {"stages": 3, "programs_per_sm": 2}), (8192, 1, 16, {}),
                             (18432, 1, 16, {"split": True, "stages": 3, "programs_per_sm": 2}),
                             (30000, 1, 16, {"split": True, "stages": 3, "programs_per_sm": 2}),
                             (18432, 2, 8, {"split": True}), (1152, 1, 2, {"split": True})]
BACKWARD_WARP_BLOCK_INPUTS = ["fp32 llama fast", "fp32 gemma strict", "bf16 llama fast", "fp16 none strict",
                              "fp32 fused fast", "fp32 per-head strict"]


@pytest.mark.parametrize("n, rows, warps, knobs", BACKWARD_WARP_BLOCK_TILES)
@pytest.mark.parametrize("inputs", BACKWARD_WARP_BLOCK_INPUTS)
def test_triton_backward_warp_blocks_bitwise(n, rows, warps, knobs, inputs, seed, monkeypatch):
    """The Triton backward with its rows in warp blocks against the reference's bits: dx, the residual's gradient and
    the strict dW; the fast dW (its partials at permuted columns) the same bits as the same tile's with the columns
    in order. 255 and 4097 rows; fp32 rows where the row sum's last bit shows in dx. The plan really takes warp
    blocks."""
    from strictnorm.backends.triton import backend as tbm

    tb = get_backend("triton")
    kind, mode, dw = inputs.split()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind]
    casting = mode if mode in ("llama", "gemma", "none") else "gemma"
    kw = dict(offset=1.0 if casting == "gemma" else 0.0, casting_mode=casting, dw=dw)
    for m in (255, 4097):
        g = torch.Generator(device=DEV).manual_seed(seed + m)
        x, dy, res, dres = (torch.randn(m, n, device=DEV, generator=g).to(dtype) for _ in range(4))
        w = (1 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(dtype)  # one element size (_warp_block_piece)
        runs = {}
        for backend, blocks in (("torch", False), ("triton", False), ("triton", True)):
            choice = tbm.TileChoice(rows=rows, num_warps=warps, warp_blocks=blocks, **knobs)
            p = 1 << (n - 1).bit_length()
            monkeypatch.setattr(tbm, "TILE_TABLE", {**tbm.TILE_TABLE, "bwd": {**tbm.TILE_TABLE["bwd"], p: choice},
                                                    "bwd_dx": {**tbm.TILE_TABLE["bwd_dx"], p: choice}})
            monkeypatch.setattr(tb, "_bwd_plans", {})
            xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            if mode == "fused":
                rs = res.clone().requires_grad_(True)
                y, z = sn.fused_add_rms_norm(xs, rs, ws, backend=backend, **kw)
                torch.autograd.backward([y, z], [dy, dres])
                runs[backend, blocks] = (xs.grad, rs.grad, ws.grad)
            elif mode == "per-head":
                xh, dyh = (t.view(m, 1, 1, n).expand(m, 1, 2, n).contiguous() for t in (xs.detach(), dy))
                wh = torch.stack([w, w.flip(0)]).requires_grad_(True)
                xh.requires_grad_(True)
                sn.qk_norm(xh, wh, backend=backend, **kw).backward(dyh)
                runs[backend, blocks] = (xh.grad, wh.grad)
            else:
                y, _ = sn.rms_norm_with_rstd(xs, ws, backend=backend, **kw)
                y.backward(dy)
                runs[backend, blocks] = (xs.grad, ws.grad)
            if blocks:
                assert tb._bwd_plans and all(pl.meta["WB_NW"] == warps for pl in tb._bwd_plans.values())
        want, in_order, got = runs["torch", False], runs["triton", False], runs["triton", True]
        last = len(got) - (dw == "fast")  # the fast dW: against the same tile in order
        for a, b in zip(want[:last], got[:last], strict=True):
            assert bits_equal(a, b), f"{m}x{n} {inputs}"
        for a, b in zip(in_order, got, strict=True):
            assert bits_equal(a, b), f"{m}x{n} {inputs} (in order)"


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dw", ["fast", "strict"])
def test_cuda_graph_replay_with_new_inputs(backend, dw, seed):
    """Captured and replayed with new inputs; the strict dW fold forked onto its side stream and joined
    inside the capture (fold_beside_dx=True: it runs after the dx pass by default)."""
    seeds = iter(range(seed, seed + 10))
    cb = get_backend("cuda")
    cb.fold_beside_dx = True
    try:
        check_fused_add_graph_replay(backend, dw, lambda: _data(4096, 2048, torch.bfloat16, torch.bfloat16,
                                                                next(seeds)), replays=3)
    finally:
        cb.fold_beside_dx = False


@pytest.mark.parametrize("backend", ["cuda", "triton", "cute"])
def test_strict_fold_beside_the_dx_pass(backend, seed):
    """The strict dW fold runs on a side stream beside the dx pass (CudaBackend.fold_beside_dx): dx and dW
    equal the one-after-the-other run's and the reference's; an in-place backward (dx over dy, which the
    fold reads) still folds first, at a size where a race would show."""
    if not status(backend, torch.device(DEV)).available:
        pytest.skip(status(backend, torch.device(DEV)).reason)
    from strictnorm.contract import make_spec

    cb, b, tr = get_backend("cuda"), get_backend(backend), get_backend("torch")
    x, w, dy = _data(16384, 4096, torch.bfloat16, torch.bfloat16, seed)
    spec = make_spec(x.dtype, 1e-6, 1.0, "gemma", x.dtype)
    rstd = tr.rms_norm_fwd(x, w, None, spec)[1]
    want = tr.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
    try:
        got = {}
        for beside in (False, True):
            cb.fold_beside_dx = beside
            got[beside] = b.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
            buf = dy.clone()
            in_place = b.rms_norm_bwd(buf, x, w, rstd, None, spec, "strict", True, buf)
            assert in_place[0].data_ptr() == buf.data_ptr()
            assert bits_equal(in_place[0], want[0]) and bits_equal(in_place[1], want[1])
    finally:
        cb.fold_beside_dx = False
    for beside in (False, True):
        assert bits_equal(got[beside][0], want[0]) and bits_equal(got[beside][1], want[1])


@pytest.mark.parametrize("m, n", [(16384, 4096), (20011, 1000), (65536, 128)])
@pytest.mark.parametrize("chain_rows, fold_sms", [(0, 24), (512, 24), (0, None)])
def test_strict_fold_with_the_sms_shared_out(m, n, chain_rows, fold_sms, seed):
    """CudaBackend.fold_sms with the fold beside the dx pass (None: 32 SMs at 4096 columns; see _SHARED_FOLD_SMS):
    the fold's grid sized for that many SMs and the dx pass's for the rest, with the default fold or fold_chain items
    of chain_rows x 32 columns: the reference's dx and dW; an in-place backward (planned without the split) too."""
    from strictnorm.backends.cuda.backend import FoldTuning
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cuda"), get_backend("torch")
    x, w, dy = _data(m, n, torch.bfloat16, torch.bfloat16, seed)
    spec = make_spec(x.dtype, 1e-6, 0.0, "llama", x.dtype)
    rstd = tr.rms_norm_fwd(x, w, None, spec)[1]
    want = tr.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
    optin = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    cb.fold_sms, cb.fold_beside_dx = fold_sms, True
    cb.fold_tuning = FoldTuning(cols=32, chain_rows=chain_rows, smem_bytes=optin) if chain_rows else None
    try:
        got = cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
        buf = dy.clone()
        in_place = cb.rms_norm_bwd(buf, x, w, rstd, None, spec, "strict", True, buf)
    finally:
        cb.fold_sms, cb.fold_tuning, cb.fold_beside_dx = None, None, False
    for dx, dw in (got, in_place):
        assert bits_equal(dx, want[0]) and bits_equal(dw, want[1])


@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize("m, n", [(16384, 4096), (20011, 3000)])
def test_dx_pass_shares_the_sms_out_with_the_strict_fold(backend, m, n, seed):
    """share_sms_with_fold (opt-in) with the fold beside the dx pass: the CUDA fold sized for the CUDA backend's share
    (32 SMs at 4096 columns) and the backend's dx pass's persistent grid for the rest: the reference's dx and dW with
    a residual gradient and the Gemma offset, out of place and in place."""
    if not status(backend, torch.device(DEV)).available:
        pytest.skip(status(backend, torch.device(DEV)).reason)
    from strictnorm.contract import make_spec

    b, tr = get_backend(backend), get_backend("torch")
    x, w, dy = _data(m, n, torch.bfloat16, torch.bfloat16, seed)
    dres = torch.randn_like(dy)
    spec = make_spec(x.dtype, 1e-6, 1.0, "gemma", x.dtype)
    rstd = tr.rms_norm_fwd(x, w, None, spec)[1]
    want = tr.rms_norm_bwd(dy, x, w, rstd, dres, spec, "strict", True, None)
    cb = get_backend("cuda")
    b.share_sms_with_fold, cb.fold_beside_dx = True, True
    try:
        got = b.rms_norm_bwd(dy, x, w, rstd, dres, spec, "strict", True, None)
        buf = dy.clone()
        in_place = b.rms_norm_bwd(buf, x, w, rstd, dres, spec, "strict", True, buf)
    finally:
        b.share_sms_with_fold, cb.fold_beside_dx = False, False
    for dx, dw in (got, in_place):
        assert bits_equal(dx, want[0]) and bits_equal(dw, want[1])


@pytest.mark.parametrize("m, n, dtype, wdtype, mode", [
    (32773, 4096, torch.bfloat16, torch.bfloat16, "llama"), (4099, 1000, torch.bfloat16, torch.bfloat16, "gemma"),
    (2048, 18432, torch.bfloat16, torch.bfloat16, "llama"), (1000, 8192, torch.float16, torch.float32, "none"),
    (3001, 5120, torch.float32, torch.float32, "llama"), (777, 64, torch.bfloat16, torch.bfloat16, "gemma")])
def test_cuda_onepass_strict_backward_bitwise(m, n, dtype, wdtype, mode, seed):
    """onepass.cu (CudaBackend.onepass_strict: column-group CTAs exchanging row sums, dW folded in row order):
    dx and the strict dW equal the reference's, in a cooperative launch; run twice (the arrival counters are
    fresh per launch)."""
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cuda"), get_backend("torch")
    x, w, dy = _data(m, n, dtype, wdtype, seed)
    spec = make_spec(dtype, 1e-6, 1.0 if mode == "gemma" else -0.25, mode, dtype)
    rstd = tr.rms_norm_fwd(x, w, None, spec)[1]
    want = tr.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
    cb.onepass_strict = True
    try:
        for _ in range(2):
            got = cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
            assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
        assert any(p.onepass is not None for p in cb._bwd_plans.values())
    finally:
        cb.onepass_strict = False


def test_cuda_onepass_in_a_cuda_graph(seed):
    """The one-pass strict backward (a cooperative launch, fresh arrival counters each call) captured in a CUDA
    graph and replayed with new dy, z and rstd: the reference's bits each time."""
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cuda"), get_backend("torch")
    spec = make_spec(torch.bfloat16, 1e-6, 0.0, "llama", torch.bfloat16)
    x, w, dy = _data(8195, 4096, torch.bfloat16, torch.bfloat16, seed)
    rstd = tr.rms_norm_fwd(x, w, None, spec)[1]
    cb.onepass_strict = True
    try:
        cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)  # plan and compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
        for k in range(3):
            nx, nw, ndy = _data(8195, 4096, torch.bfloat16, torch.bfloat16, seed + 1 + k)
            x.copy_(nx), dy.copy_(ndy)
            rstd.copy_(tr.rms_norm_fwd(x, w, None, spec)[1])
            graph.replay()
            want = tr.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)
            assert bits_equal(out[0], want[0]) and bits_equal(out[1], want[1]), f"replay {k}"
    finally:
        cb.onepass_strict = False


def _loop(rows):
    acc = torch.zeros(rows.shape[1:], device=rows.device)
    for r in rows:
        acc = acc + r.float()
    return acc


# (4097, 2000): the plain ring of 16 columns x 512 rows in 96 KB; (4096, 4096), (6000, 3900): 32 x 128 in 96 KB
# (backend.default_ring, on an H200); (16384, 128), (20000, 136), (4100, 264): fold_stream's 8 isolated columns in
# stages of 512 or 128 rows (backend.default_stream, since run 23); (5000, 33): rows not 16-byte aligned, fold_simple;
# partial last stages and column stripes
@pytest.mark.parametrize("shape", [(1, 128), (100, 128), (16384, 128), (4096, 4096), (1024, 8192), (3, 5),
                                   (5000, 33), (777, 1000), (6000, 3900), (4097, 2000), (20000, 136), (4100, 264)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fold_equals_python_loop(shape, dtype, seed):
    assert status("cuda", torch.device(DEV)).available, status("cuda", torch.device(DEV)).reason
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = (torch.randn(*shape, device=DEV, generator=g) * 1e3).to(dtype)
    want = _loop(rows)
    cb = get_backend("cuda")
    assert bits_equal(cb.left_fold(rows), want)
    assert bits_equal(cb.left_fold(rows, ring=False), want)
    assert bits_equal(sn.reduce_rows_left_fold(rows), want)  # automatic choice on a GPU: cuda


@pytest.mark.parametrize("smem_kb, rows_per_stage, column_major", [(96, 256, False), (200, 256, False),
                                                                 (200, 512, False), (48, 128, True), (200, 256, True)])
def test_cuda_fold_rings_past_48kb(smem_kb, rows_per_stage, column_major, seed):
    """Rings opted into more than 48 KB of shared memory (FoldTuning.smem_bytes), and the dW fold's
    contributions stored column-major: the plain fold equals the Python loop and the strict dW fold (its
    stages converted by the producers; 5000 rows: a partial last stage) equals the default ring."""
    from strictnorm.backends.cuda.backend import FoldTuning
    from strictnorm.backends.layout import row_layout

    cb = get_backend("cuda")
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = torch.randn(3000, 128, device=DEV, generator=g).bfloat16()
    dy, x = (torch.randn(5000, 136, device=DEV, generator=g).bfloat16() for _ in range(2))
    rstd = torch.rand(5000, device=DEV, generator=g) + 0.5
    strict = [None, None]
    try:
        for k, tuning in enumerate((None, FoldTuning(rows_per_stage=rows_per_stage, smem_bytes=smem_kb * 1024,
                                                     column_major=column_major))):
            cb.fold_tuning = tuning
            assert bits_equal(cb.left_fold(rows), _loop(rows))
            strict[k] = cb.fold(*row_layout(dy), *row_layout(x), rstd, 1, 1)
    finally:
        cb.fold_tuning = None
    assert bits_equal(strict[0], strict[1])


@pytest.mark.parametrize("chain_rows, cols", [(512, 8), (4096, 8), (1024, 16)])
def test_cuda_fold_chain_bitwise(chain_rows, cols, seed):
    """fold_chain (FoldTuning.chain_rows: items spread over every SM, each continuing its predecessor's sums;
    thousands of items, so CTAs take many in turn and hand over across SMs): the plain fold equals the
    Python loop, the strict dW fold equals the default ring, run after run."""
    from strictnorm.backends.cuda.backend import FoldTuning
    from strictnorm.backends.layout import row_layout

    cb = get_backend("cuda")
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = (torch.randn(40000, 128, device=DEV, generator=g) * 1e3).bfloat16()
    dy, x = (torch.randn(100003, 136, device=DEV, generator=g).bfloat16() for _ in range(2))
    rstd = torch.rand(100003, device=DEV, generator=g) + 0.5
    want_plain = _loop(rows)
    cb.fold_tuning = FoldTuning()  # the ring (fold_chain is the default at these shapes)
    want_dw = cb.fold(*row_layout(dy), *row_layout(x), rstd, 1, 1)
    cb.fold_tuning = FoldTuning(cols=cols, chain_rows=chain_rows, smem_bytes=200 * 1024)
    try:
        for _ in range(3):
            assert bits_equal(cb.left_fold(rows), want_plain)
            assert bits_equal(cb.fold(*row_layout(dy), *row_layout(x), rstd, 1, 1), want_dw)
    finally:
        cb.fold_tuning = None


@pytest.mark.parametrize("cols, rows_per_stage, pad, isolate, prefetch, warps",
                         [(0, 0, False, False, False, 0), (8, 64, False, False, False, 0),
                          (16, 32, False, False, False, 0), (32, 64, False, False, False, 0),
                          (64, 16, False, False, False, 0), (128, 16, False, False, False, 0),
                          (0, 0, True, False, False, 0), (16, 64, True, False, False, 0),
                          (8, 256, False, True, False, 0), (32, 64, False, True, False, 0),
                          (64, 32, False, True, False, 0), (0, 0, False, False, True, 0),
                          (32, 64, False, False, True, 0), (8, 256, False, True, True, 0),
                          (16, 32, True, False, True, 0), (32, 64, False, False, True, 7),
                          (32, 32, False, False, True, 11), (8, 128, False, True, True, 0)])
def test_cuda_fold_stream_bitwise(cols, rows_per_stage, pad, isolate, prefetch, warps, seed):
    """fold_stream (FoldTuning.stream: converter warps loading rows into registers, handing fp32 addends to the
    consumer warps through mbarrier-guarded buffers): the plain fold of bf16 and fp32 rows equals the Python
    loop; the strict dW fold (5000 rows: a partial last stage; 4104 columns: a partial last column group) and
    per-head dW (4 groups) equal the one-thread-per-column kernel, run after run; several widths and stages, the
    buffers padded after each group of 8 columns or not, the consumer warps isolated on their sub-partitions or not,
    the converters' next stage loaded before the current one is stored (prefetch) or not, with the planner's count of
    converting warps (warps 0) or a given one."""
    from strictnorm.backends.cuda.backend import FoldTuning, fold_launch
    from strictnorm.backends.layout import row_layout

    cb = get_backend("cuda")
    g = torch.Generator(device=DEV).manual_seed(seed)
    plain = [(torch.randn(3001, 1000, device=DEV, generator=g) * 1e3).to(dt) for dt in (torch.bfloat16, torch.float32)]
    dy, x = (torch.randn(5000, 4104, device=DEV, generator=g).bfloat16() for _ in range(2))
    rstd = torch.rand(5000, device=DEV, generator=g) + 0.5
    want_plain = [_loop(p) for p in plain]
    want_dw = cb.fold(*row_layout(dy), *row_layout(x), rstd, 1, 1, ring=False)
    want_heads = cb.fold(*row_layout(dy), *row_layout(x), rstd, 2, 4, ring=False)
    cb.fold_tuning = FoldTuning(stream=True, cols=cols, rows_per_stage=rows_per_stage, pad_groups=pad, isolate=isolate,
                                prefetch=prefetch, convert_warps=warps)
    try:
        for _ in range(2):
            for p, want in zip(plain, want_plain, strict=True):
                assert bits_equal(cb.left_fold(p), want)
            assert bits_equal(cb.fold(*row_layout(dy), *row_layout(x), rstd, 1, 1), want_dw)
            assert bits_equal(cb.fold(*row_layout(dy), *row_layout(x), rstd, 2, 4), want_heads)
        props = torch.cuda.get_device_properties(DEV)
        fl = fold_launch(4104, torch.bfloat16, torch.bfloat16, 1, True, True, props.multi_processor_count,
                         cb.fold_tuning, rows=5000, smem_optin=props.shared_memory_per_block_optin)
        assert fl.kernel == "fold_stream"
        planned = [(p.block, p.shmem, p.grid) for p in cb._fold_plans.values() if hasattr(p, "block")]  # not sums
        assert (fl.block, fl.shmem, (fl.grid_x, 1, 1)) in planned
    finally:
        cb.fold_tuning = None


# (rows, columns, heads of an (H, D) weight or 0, the fold kernel the planner names). QK-norm: fold_chain from 65536
# rows up to 256 columns, fold_stream below and for (H, D) weights. Model widths of 4096-8192 columns: the ring
# of 32-column CTAs, or fold_stream where those outnumber the SMs, in 16- or 64-column CTAs (backend.default_dw_ring
# and default_stream, since run 30 on an H200; other GPUs plan their own).
DEFAULT_STRICT_CASES = {
    "qk_norm": ((65536, 128, 0, "fold_chain"), (40961, 64, 0, "fold_stream"), (65537, 256, 0, "fold_chain"),
                (32769, 520, 0, "fold_stream"), (12289, 1000, 0, "fold_stream"), (16383, 128, 0, "fold_stream"),
                (8 * 4099, 128, 8, "fold_stream")),
    "model_widths": ((2049, 5120, 0, "fold_stream"), (4097, 7168, 0, "fold_stream"), (8191, 8192, 0, "fold_stream"),
                     (2047, 6144, 0, "fold_ring"), (2048, 8192, 0, "fold_ring"), (3001, 4096, 0, "fold_ring")),
}


@pytest.mark.parametrize("cases", sorted(DEFAULT_STRICT_CASES))
def test_cuda_default_strict_backward(cases, seed):
    """The strict dW by default (DEFAULT_STRICT_CASES): bitwise equal to the reference's strict backward, gemma
    offset, odd row counts, 520 and 1000 columns. Each case is checked to have run the kernel the planner names (bf16
    rows of N % 8 != 0 are not 16-byte aligned and take fold_simple instead), on an H200 (SM count and shared
    memory decide)."""
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cuda"), get_backend("torch")
    props = torch.cuda.get_device_properties(DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    for m, n, heads, kernel in DEFAULT_STRICT_CASES[cases]:
        shape, w_shape = ((m // heads, heads, n), (heads, n)) if heads else ((m, n), (n,))
        z, dy = (torch.randn(shape, device=DEV, generator=g).bfloat16() for _ in range(2))
        w = (torch.randn(w_shape, device=DEV, generator=g) * 0.1).bfloat16()
        _, rstd, _ = tr.rms_norm_fwd(z, w, None, spec)
        want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, None, spec, "strict", True, None)
        cb._bwd_plans.clear()
        got_dx, got_dw = cb.rms_norm_bwd(dy, z, w, rstd, None, spec, "strict", True, None)
        assert bits_equal(want_dx, got_dx) and bits_equal(want_dw, got_dw), f"{m}x{n}"
        kernels = [p.strict.kernel_name for p in cb._bwd_plans.values()]
        if "H200" in props.name:  # the kernel the planner names there (other GPUs: their SM count and memory decide)
            assert kernels == [kernel], f"{m}x{n}: {kernels}"


def test_cuda_fold_adversarial_rows():
    cols = 40
    rows = torch.zeros(9, cols, device=DEV)
    rows[:, 0] = torch.tensor([1e20, 1.0, -1e20, 1.0, 0, 0, 0, 0, 0])
    rows[:, 1] = torch.tensor([1e38, 1e38, -1e38, 0, 0, 0, 0, 0, 0])  # overflows to inf, stays inf
    rows[:, 2] = torch.tensor([float("inf"), 1, float("-inf"), 0, 0, 0, 0, 0, 0])  # nan
    rows[:, 3] = torch.tensor([1e-45, 1e-45, -1e-45, 3e-39, 0, 0, 0, 0, 0])  # subnormals
    rows[:, 4] = torch.tensor([float("nan")] + [1.0] * 8)
    rows[:, 5] = -0.0
    rows[:, 6:] = torch.randn(9, cols - 6, device=DEV) * torch.logspace(-30, 30, cols - 6, device=DEV)
    want = _loop(rows)
    for ring in (True, False):
        got = get_backend("cuda").left_fold(rows, ring=ring)
        assert bits_equal(got, want)
    strided = torch.randn(300, 64, device=DEV)[:, ::2]  # misaligned for cp.async: the simple kernel serves
    assert bits_equal(get_backend("cuda").left_fold(strided), _loop(strided))


def test_cuda_fold_zero_rows_and_multidim():
    z = torch.empty(0, 3, 4, device=DEV)
    assert bits_equal(sn.reduce_rows_left_fold(z, backend="cuda"), torch.zeros(3, 4, device=DEV))
    r = torch.randn(1000, 3, 4, device=DEV).transpose(1, 2)
    assert bits_equal(sn.reduce_rows_left_fold(r, backend="cuda"), _loop(r))


# (2^19 + 64) rows of 4096: 2^31 + 262144 elements, row 2^19 starting exactly 2^31 elements in (64-bit offsets)
_PAST_2_31 = ((1 << 31) // 4096 + 64, 4096)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_norm_rows_past_2_31_elements(backend, seed, large_gpu_memory):
    """A batch of 2^31 + 262144 bf16 elements: the rows on both sides of the 2^31-element mark (and the first rows)
    give, inside the batch, the reference's bits for those rows alone (a row's y, rstd and dx do not depend on the
    batch): every offset computed in 64 bits."""
    m, n = _PAST_2_31
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, n, device=DEV, generator=g, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=DEV, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, device=DEV, generator=g) * 0.1).bfloat16()
    y, rstd, dx, _ = _fwd_bwd(backend, x, w, dy, "llama", "fast")
    for lo, hi in ((m - 128, m), (0, 8)):  # rows 2^19 - 64 ... 2^19 + 63 cross the mark
        want = _fwd_bwd("torch", x[lo:hi], w, dy[lo:hi], "llama", "fast")
        for got, ref in zip((y, rstd, dx), want[:3], strict=True):
            assert bits_equal(got[lo:hi], ref), f"rows {lo}:{hi}"


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_left_fold_of_rows_past_2_31_elements(backend, seed, large_gpu_memory):
    """The left fold over 2^31 + 262144 bf16 elements reads every row once, those past the 2^31-element mark
    included: small integers, whose fp32 sums are exact in any order, against their int64 sum."""
    m, n = _PAST_2_31
    g = torch.Generator(device=DEV).manual_seed(seed)
    ints = torch.randint(-4, 5, (m, n), device=DEV, generator=g, dtype=torch.int8)
    # |sum| <= 4 m < 2^24: exact in fp32. Summed a slab of rows at a time: a whole int64 copy of ints is 16 GiB
    want = sum(slab.sum(0, dtype=torch.int64) for slab in ints.split(1 << 16))
    got = sn.reduce_rows_left_fold(ints.to(torch.bfloat16), backend=backend)
    assert torch.equal(got, want.to(torch.float32))


def test_qk_norm_per_head_large(seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    b, s, h, d = 4, 2048, 8, 128
    qkv = torch.randn(b, s, 3 * h * d, device=DEV, generator=g).bfloat16()
    w = torch.randn(h, d, device=DEV, generator=g)
    dy = torch.randn(b, s, h, d, device=DEV, generator=g).bfloat16()
    outs = []
    for be in ("torch", "triton"):
        base = qkv.clone().requires_grad_(True)
        ws = w.clone().requires_grad_(True)
        y = sn.qk_norm(base[..., : h * d].view(b, s, h, d), ws, dw="strict", backend=be)
        y.backward(dy)
        outs.append((y, base.grad, ws.grad))
    for a, c in zip(*outs, strict=True):
        assert bits_equal(a, c)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_hf_training_loop(family, backend):
    """A few optimizer steps of a tiny patched model on each kernel backend: the loss follows the
    unpatched model, and two runs are identical bit for bit."""
    pytest.importorskip("transformers")
    from test_hf import _train

    base, _ = _train(family, patched=False, device=DEV)
    a, params_a = _train(family, patched=True, backend=backend, device=DEV)
    b, params_b = _train(family, patched=True, backend=backend, device=DEV)
    assert ((a - base).abs() / base.abs()).max() < 1e-4
    assert bits_equal(a, b)
    assert all(bits_equal(p, q) for p, q in zip(params_a, params_b, strict=True))


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_hf_patched_model_and_compiled_layer(backend, seed):
    """A patched Qwen3 model (RMSNorms and q/k norms) on a kernel backend: logits and gradients follow the
    unpatched model; a patched decoder layer compiles with fullgraph=True and dynamic shapes (Inductor)
    and its forward and input gradient follow eager at two sequence lengths."""
    pytest.importorskip("transformers")
    from test_hf import _loss_and_grads, _model, _rel

    from strictnorm import hf

    model = _model("qwen3", seed % 1000).to(DEV)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(seed)).to(DEV)
    logits0, grads0 = _loss_and_grads(model, ids)
    report = hf.patch_model(model, dw="strict", backend=backend)
    assert any(n.endswith(("q_norm", "k_norm")) for n in report.patched)
    logits1, grads1 = _loss_and_grads(model, ids)
    assert _rel(logits1, logits0) < 1e-5
    for name, g in grads0.items():
        assert _rel(grads1[name], g) < 1e-4, name
    layer = model.model.layers[0]
    # the layer's forward, not the module: torch 2.11's Dynamo cannot trace transformers' GradientCheckpointingLayer
    # .__call__ (str() of a tuple) with fullgraph=True, whatever the norms
    compiled = torch.compile(layer.forward, fullgraph=True, dynamic=True)
    for s in (8, 13):
        x = torch.randn(1, s, 64, device=DEV, requires_grad=True)
        pos = model.model.rotary_emb(x, torch.arange(s, device=DEV)[None])
        outs = [f(x, position_embeddings=pos) for f in (compiled, layer)]
        outs = [o[0] if isinstance(o, tuple) else o for o in outs]
        assert _rel(outs[0], outs[1]) < 1e-5
        grads = [torch.autograd.grad(o.square().sum(), x)[0] for o in outs]
        assert _rel(grads[0], grads[1]) < 1e-4


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_hf_block_cuda_graph_replay(backend, seed):
    """Forward + backward of a patched Qwen3 decoder layer (RMSNorms and q/k norms) captured once in a
    CUDA graph, replayed with new input values: output and every gradient equal eager, bit for bit."""
    pytest.importorskip("transformers")
    from test_hf import _model

    from strictnorm import hf

    model = _model("qwen3", seed).to(DEV)
    report = hf.patch_model(model, dw="strict", backend=backend)
    assert report.patched
    layer = model.model.layers[0]
    params = [p for p in layer.parameters() if p.requires_grad]
    g = torch.Generator(device=DEV).manual_seed(seed)
    pos = model.model.rotary_emb(torch.zeros(1, 8, 64, device=DEV), torch.arange(8, device=DEV)[None])

    def run(x, gy):
        out = layer(x, position_embeddings=pos)
        out = out[0] if isinstance(out, tuple) else out
        return (out, *torch.autograd.grad(out, [x, *params], gy))

    static_x = torch.randn(1, 8, 64, device=DEV, generator=g, requires_grad=True)
    static_gy = torch.randn(1, 8, 64, device=DEV, generator=g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled and loaded before the capture
        for _ in range(2):
            run(static_x, static_gy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(static_x, static_gy)
    for _ in range(2):
        x = torch.randn(1, 8, 64, device=DEV, generator=g)
        gy = torch.randn(1, 8, 64, device=DEV, generator=g)
        with torch.no_grad():
            static_x.copy_(x)
            static_gy.copy_(gy)
        graph.replay()
        want = run(x.clone().requires_grad_(True), gy)
        for a, b in zip(static_out, want, strict=True):
            assert bits_equal(a, b)


def _cuda_fwd_cases():
    bf16, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    for mode in ("llama", "gemma", "none"):
        for x_dt, r_dt, w_dt, y_dt in ((bf16, None, bf16, bf16), (f16, f32, f32, f32), (f32, None, None, f32),
                                       (bf16, bf16, f32, bf16)):
            yield mode, x_dt, r_dt, w_dt, y_dt


# The tuned tables; rows always read twice (no register hold; 256 threads a row: with 128, N = 65536 takes
# 64 pieces a thread, ~10 s of NVRTC per kernel, past the test's time limit in runs 6c and 6f); held in
# registers, 8 lanes a thread with the weight and the dW partials in registers too; held, 32 lanes a thread,
# weight reloaded per row, dW partials in shared memory and one block per row group (no grid-stride loop);
# held, 64 lanes a thread, the pieces wholly in the padding loaded and held too (untrimmed; every other family
# trims them); held, 32 lanes a thread, the backward's next row copied ahead into shared memory (staged, where
# EVEN: N a multiple of 8 here); the backward's xh and g kept in fp32 between its passes (f32); held, 32 lanes a
# thread, the weight's lanes loaded with each row's before its sum (with-row); held, 16 lanes a thread, the mean of
# rows of N = 2^k by the IEEE division (division; every other family multiplies by 2^-k there: NormTuning.mean_scale).
CUDA_TUNINGS = {"tables": {}, "stream": {"hold_max_p": 0, "stream_threads": 256},
                "hold8": {"values": 8},
                "hold32-smem": {"values": 32, "hold_weight": False, "dw_smem": True, "persistent": False},
                "hold64-untrimmed": {"values": 64, "hold_weight": False, "trim": False},
                "hold32-staged": {"values": 32, "staged": True},
                "hold16-f32": {"values": 16, "hold_f32": True, "staged": True},
                "hold32-with-row": {"values": 32, "hold_weight": False, "weight_with_row": True},
                "hold16-division": {"values": 16, "mean_scale": False}}


@pytest.fixture(params=list(CUDA_TUNINGS))
def cuda_backend(request):
    from strictnorm.backends.cuda.backend import NormTuning

    cb = get_backend("cuda")
    knobs = CUDA_TUNINGS[request.param]
    cb.fwd_tuning = cb.bwd_tuning = NormTuning(**knobs) if knobs else None
    yield cb
    cb.fwd_tuning = cb.bwd_tuning = None


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 128, 4096])
def test_cuda_mean_scale_bitwise_at_extreme_means(n, seed):
    """NormTuning.mean_scale (rms_norm.cu's MEAN_SHIFT) with eps = 0 on helpers.extreme_mean_rows (subnormal,
    overflowing and NaN mean squares beside ordinary rows): y, rstd and dx the reference's bits, Gemma offset."""
    from strictnorm.backends.cuda.backend import NormTuning
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cuda"), get_backend("torch")
    g = torch.Generator(device=DEV).manual_seed(seed)
    spec = make_spec(torch.bfloat16, 0.0, 1.0, "gemma", torch.bfloat16)
    cb.fwd_tuning = cb.bwd_tuning = NormTuning(values=16, mean_scale=True)
    try:
        for rows in (3, 1000):
            x = extreme_mean_rows(rows, n, g)
            w = (torch.randn(n, device=DEV, generator=g) * 0.5).bfloat16()
            dy = torch.randn(rows, n, device=DEV, generator=g).bfloat16()
            want_y, want_rstd, _ = tr.rms_norm_fwd(x, w, None, spec)
            y, rstd, _ = cb.rms_norm_fwd(x, w, None, spec)
            assert bits_equal(rstd, want_rstd) and bits_equal(y, want_y), f"{rows}x{n}"
            want_dx, _ = tr.rms_norm_bwd(dy, x, w, want_rstd, None, spec, "strict", False, None)
            assert bits_equal(cb.rms_norm_bwd(dy, x, w, want_rstd, None, spec, "fast", False, None)[0], want_dx)
    finally:
        cb.fwd_tuning = cb.bwd_tuning = None


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", GRID_N)
def test_cuda_forward_bitwise(n, cuda_backend, seed):
    """The CUDA forward (kernels/rms_norm.cu) against the reference: every mode, fused add, no weight,
    mixed dtypes, rows 1 to many, each block-shape family."""
    from strictnorm.contract import make_spec

    cb, tr = cuda_backend, get_backend("torch")
    g = torch.Generator(device=DEV).manual_seed(seed)
    for m in (1, 37, max(1, (1 << 22) // n)):
        for mode, x_dt, r_dt, w_dt, y_dt in _cuda_fwd_cases():
            x = torch.randn(m, n, device=DEV, generator=g).to(x_dt)
            res = torch.randn(m, n, device=DEV, generator=g).to(r_dt) if r_dt else None
            w = (torch.randn(n, device=DEV, generator=g) * 0.1).to(w_dt) if w_dt else None
            offset = 1.0 if mode == "gemma" and w is not None else 0.0
            spec = make_spec(r_dt or x_dt, 1e-6, offset, mode, y_dt)
            want, got = tr.rms_norm_fwd(x, w, res, spec), cb.rms_norm_fwd(x, w, res, spec)
            for name, a, b in zip(("y", "rstd", "z"), want, got, strict=True):
                assert (a is None) == (b is None)
                assert a is None or bits_equal(a, b), f"{name} at {m}x{n} {mode} {x_dt} {r_dt} {w_dt}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 128, 4096, 5120, 18432])
def test_cuda_forward_without_rstd(n, seed):
    """An inference call (need_rstd=False: the kernel compiled without the rstd store, no rstd tensor): y and
    residual_out the reference's bits, through the backend and through the API without autograd."""
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cuda"), get_backend("torch")
    g = torch.Generator(device=DEV).manual_seed(seed)
    for m, fused in ((1, False), (37, True), (max(1, (1 << 21) // n), False)):
        x = torch.randn(m, n, device=DEV, generator=g).bfloat16()
        res = torch.randn(m, n, device=DEV, generator=g).bfloat16() if fused else None
        w = (torch.randn(n, device=DEV, generator=g) * 0.1).bfloat16()
        spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
        want_y, _, want_z = tr.rms_norm_fwd(x, w, res, spec)
        y, rstd, z = cb.rms_norm_fwd(x, w, res, spec, need_rstd=False)
        assert rstd is None and bits_equal(want_y, y) and (z is None) == (res is None)
        assert z is None or bits_equal(want_z, z)
        got = sn.fused_add_rms_norm(x, res, w, offset=1.0, casting_mode="gemma", backend="cuda") if fused else (
            sn.rms_norm(x, w, offset=1.0, casting_mode="gemma", backend="cuda"), None)
        assert bits_equal(want_y, got[0]) and (z is None or bits_equal(want_z, got[1]))


def test_cuda_forward_strided_per_head_view(seed):
    from strictnorm.contract import make_spec

    g = torch.Generator(device=DEV).manual_seed(seed)
    b, s, h, d = 3, 100, 8, 128
    qkv = torch.randn(b, s, 3 * h * d, device=DEV, generator=g).bfloat16()
    k = qkv[..., h * d:2 * h * d].view(b, s, h, d)
    w = torch.randn(h, d, device=DEV, generator=g)
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    want = get_backend("torch").rms_norm_fwd(k, w, None, spec)
    got = get_backend("cuda").rms_norm_fwd(k, w, None, spec)
    assert bits_equal(want[0], got[0]) and bits_equal(want[1], got[1])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", GRID_N)
def test_cuda_backward_bitwise(n, cuda_backend, seed):
    """The CUDA backward (kernels/rms_norm.cu, BACKWARD) against the reference: dx bitwise with and
    without a residual gradient, strict dW bitwise, fast dW close and deterministic, in place, each
    block-shape family."""
    from strictnorm.contract import make_spec

    cb, tr = cuda_backend, get_backend("torch")
    g = torch.Generator(device=DEV).manual_seed(seed)
    for m in (1, 37, max(1, (1 << 21) // n)):
        for mode in ("llama", "gemma", "none"):
            z = torch.randn(m, n, device=DEV, generator=g).bfloat16()
            w = (torch.randn(n, device=DEV, generator=g) * 0.1).bfloat16()
            dy = torch.randn(m, n, device=DEV, generator=g).bfloat16()
            dres = torch.randn(m, n, device=DEV, generator=g).bfloat16() if m != 37 else None
            spec = make_spec(torch.bfloat16, 1e-6, 0.5, mode, torch.bfloat16)
            _, rstd, _ = tr.rms_norm_fwd(z, w, None, spec)
            strict = m <= 4096  # the reference's strict loop launches once per row
            want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict" if strict else "fast", True, None)
            got_dx, got_dw = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
            assert bits_equal(want_dx, got_dx), f"dx at {m}x{n} {mode}"
            if strict:
                assert bits_equal(want_dw, got_dw), f"dw at {m}x{n} {mode}"
            fast1 = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", True, None)[1]
            fast2 = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", True, None)[1]
            assert bits_equal(fast1, fast2)
            assert fast_dw_excess(fast1, got_dw, dy, z, w, rstd, mode, spec.offset) < 1e-2, f"fast dw at {m}x{n}"
            buf = dy.clone()
            _, in_place_dw = cb.rms_norm_bwd(buf, z, w, rstd, dres, spec, "strict", True, buf)
            assert bits_equal(buf, want_dx) and bits_equal(in_place_dw, got_dw)


def _guard_culprits(run, inputs: dict, guard: int, want) -> list[str]:
    """Which single input, alone between NaN guard bands, makes run(**inputs) differ from want."""
    culprits = []
    for name in inputs:
        one = {k: (guarded(v, guard) if k == name else v) for k, v in inputs.items()}
        if not bits_equal(want, run(**one)):
            culprits.append(name)
    return culprits


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 5120, 18432])
def test_cuda_reads_nothing_past_its_inputs(n, cuda_backend, seed):
    """Every input of the forward and backward (and the strict dW fold) sits right before and after NaN
    guard bands of next_pow2(N) elements: a kernel that loads a padded lane from memory instead of
    zero-filling it turns its row into NaN; a failure names the inputs read past their ends. (An all-NaN
    dx at N = 5120 was traced to memory outside the inputs: bench/NOTES.md.)"""
    from strictnorm.contract import make_spec
    from strictnorm.reference import next_pow2

    cb, tr = cuda_backend, get_backend("torch")
    guard = max(16, next_pow2(n))
    g = torch.Generator(device=DEV).manual_seed(seed)
    for m in (1, 37):
        for mode in ("llama", "gemma", "none"):
            x, res, dy, dres = (torch.randn(m, n, device=DEV, generator=g).bfloat16() for _ in range(4))
            w = (torch.randn(n, device=DEV, generator=g) * 0.1).bfloat16()
            spec = make_spec(torch.bfloat16, 1e-6, 0.5, mode, torch.bfloat16)
            want = tr.rms_norm_fwd(x, w, res, spec)
            got = cb.rms_norm_fwd(guarded(x, guard), guarded(w, guard), guarded(res, guard), spec)
            for k, (name, a, b) in enumerate(zip(("y", "rstd", "z"), want, got, strict=True)):
                if not bits_equal(a, b):
                    culprits = _guard_culprits(
                        lambda k=k, spec=spec, **t: cb.rms_norm_fwd(t["x"], t["w"], t["res"], spec)[k],
                        {"x": x, "w": w, "res": res}, guard, a)
                    pytest.fail(f"{name} at {m}x{n} {mode}: read past the end of {culprits}")
            z, rstd = want[2], want[1]
            for dw_mode in ("strict", "fast"):
                want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
                inputs = {"dy": dy, "z": z, "w": w, "rstd": rstd, "dres": dres}
                got_dx, got_dw = cb.rms_norm_bwd(*(guarded(t, guard) for t in inputs.values()), spec, dw_mode, True,
                                                 None)
                for k, (name, a, b) in enumerate((("dx", want_dx, got_dx), ("dw", want_dw, got_dw))):
                    ok = bool(b.isfinite().all()) if name == "dw" and dw_mode == "fast" else bits_equal(a, b)
                    if not ok:
                        def run(k=k, spec=spec, dw_mode=dw_mode, **t):
                            return cb.rms_norm_bwd(*t.values(), spec, dw_mode, True, None)[k]

                        culprits = _guard_culprits(run, inputs, guard, run(**inputs))
                        pytest.fail(f"{name} at {m}x{n} {mode} dw={dw_mode}: read past the end of {culprits}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 8, 5120])
def test_cuda_signed_zeros_of_a_zero_dy_row(n, cuda_backend, seed):
    """helpers.zero_dy_case on the CUDA backend: padded lanes must add +0.0, (-0) + (-0) must stay -0."""
    dy, z, w, rstd, spec, want_dx = zero_dy_case(n, DEV, torch.Generator().manual_seed(seed))
    for dw_mode in ("strict", "fast"):
        got_dx, _ = cuda_backend.rms_norm_bwd(dy, z, w, rstd, None, spec, dw_mode, True, None)
        assert bits_equal(want_dx, got_dx), f"dw={dw_mode}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 5120])
@pytest.mark.parametrize("dtype, fused", [(torch.bfloat16, False), (torch.float16, True)])
def test_cuda_special_values_bitwise(n, dtype, fused, cuda_backend, seed):
    """helpers.check_special_values on the CUDA backend, every casting mode and block-shape family."""
    for mode in ("llama", "gemma", "none"):
        check_special_values(cuda_backend, n, dtype, fused, mode, DEV, torch.Generator().manual_seed(seed))


def _row_bound_edges() -> list[tuple[str, str, int, int]]:
    """(backend, table, N, rows) on both sides of every row-bounded entry of the CUDA tables and the Triton tile
    table: where the plan changes ("fwd_nr": the CUDA inference forward's own table)."""
    from strictnorm.backends.cuda.backend import BWD_TABLE, FWD_INFERENCE_TABLE, FWD_TABLE
    from strictnorm.backends.triton.backend import TILE_TABLE

    tables = {("cuda", "fwd"): FWD_TABLE, ("cuda", "fwd_nr"): FWD_INFERENCE_TABLE, ("cuda", "bwd"): BWD_TABLE,
              ("triton", "fwd"): TILE_TABLE["fwd"], ("triton", "bwd"): TILE_TABLE["bwd"]}
    return [(backend, direction, p, rows) for (backend, direction), table in tables.items()
            for p, entries in sorted(table.items()) if isinstance(entries, tuple)
            for bound, _ in entries[:-1] for rows in (bound, bound + 1)]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend, direction, n, m", _row_bound_edges())
def test_table_row_bounds_bitwise(backend, direction, n, m, dtype, seed):
    """The tables' own entries (no tuning override) at the last row count of each bounded entry and the first of the
    next, in 16-bit and fp32 rows (which take twice the registers: a tile's register bound meets them too): the
    forward's y and rstd and the inference forward's y, the backward's dx and strict dW, and the fast backward's dx
    the reference's bits (gemma offset)."""
    from strictnorm.contract import make_spec

    if backend == "cuda":
        from strictnorm.backends.cuda.backend import BWD_TABLE, FWD_INFERENCE_TABLE, FWD_TABLE, tuning_for

        table = {"fwd": FWD_TABLE, "fwd_nr": FWD_INFERENCE_TABLE, "bwd": BWD_TABLE}[direction]
        assert tuning_for(table, n, m) is not tuning_for(table, n, m + 1) or tuning_for(table, n, m - 1) is not \
            tuning_for(table, n, m)  # the pair really straddles a bound
        assert get_backend("cuda").fwd_tuning is None and get_backend("cuda").bwd_tuning is None
    kb, tr = get_backend(backend), get_backend("torch")
    g = torch.Generator(device=DEV).manual_seed(seed + m)
    x = torch.randn(m, n, device=DEV, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(dtype)
    spec = make_spec(dtype, 1e-6, 1.0, "gemma", dtype)
    want = tr.rms_norm_fwd(x, w, None, spec)
    if direction.startswith("fwd"):
        if direction == "fwd":
            got = kb.rms_norm_fwd(x, w, None, spec)
            assert bits_equal(want[0], got[0]) and bits_equal(want[1], got[1])
        y, rstd, _ = kb.rms_norm_fwd(x, w, None, spec, need_rstd=False)
        assert rstd is None and bits_equal(want[0], y)
        return
    dy = torch.randn(m, n, device=DEV, generator=g).to(dtype)
    want_dx, want_dw = tr.rms_norm_bwd(dy, x, w, want[1], None, spec, "strict", True, None)  # a launch a row
    got_dx, got_dw = kb.rms_norm_bwd(dy, x, w, want[1], None, spec, "strict", True, None)
    assert bits_equal(want_dx, got_dx) and bits_equal(want_dw, got_dw)
    fast_dx, _ = kb.rms_norm_bwd(dy, x, w, want[1], None, spec, "fast", True, None)
    assert bits_equal(want_dx, fast_dx)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_random_configurations_bitwise(cuda_backend, seed):
    """helpers.random_case on the CUDA backend: 12 random configurations a family and run."""
    import random

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(12):
        check_random_case(cuda_backend, random_case(rng, gen, DEV))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_launch_from_a_thread_without_a_current_context(seed, monkeypatch):
    """Launches on threads where no CUDA context is current: torch's autograd engine runs a CUDA backward on
    its own device thread, which torch's runtime calls make current lazily, so a strictnorm launch can come
    first there (test_triton.py's first backward in a fresh worker failed so: CUDA_ERROR_INVALID_CONTEXT).
    The kernel is loaded on this thread first. A call planned here meets no context at its launch and retries
    (checked, else the test would test nothing); a call planned on the fresh thread gets the context from the
    kernel cache while planning and launches at once."""
    import threading

    from cuda.bindings import driver

    from strictnorm.backends.cuda import nvrtc
    from strictnorm.contract import make_spec

    x, w, _ = _data(64, 1024, torch.bfloat16, torch.bfloat16, seed)
    spec = make_spec(x.dtype, 1e-6, 0.0, "llama", x.dtype)
    cb, tr = get_backend("cuda"), get_backend("torch")
    cb.rms_norm_fwd(x, w, None, spec)  # the kernel loaded and this signature planned on this thread
    results: list = []
    launch = nvrtc.LoadedKernel._launch

    def recorded(self, *args):
        results.append((threading.get_ident(), launch(self, *args)))
        return results[-1][1]

    monkeypatch.setattr(nvrtc.LoadedKernel, "_launch", recorded)

    def on_fresh_thread(rows: torch.Tensor) -> tuple:
        out: dict = {}
        results.clear()  # thread identifiers may be reused once a thread has ended

        def run() -> None:
            try:
                (err,) = driver.cuCtxSetCurrent(driver.CUcontext(0))  # none current on this thread
                assert err == driver.CUresult.CUDA_SUCCESS
                out["got"] = cb.rms_norm_fwd(rows, w, None, spec)
                torch.cuda.synchronize()
            except Exception as e:  # re-raised on the test's thread
                out["error"] = e

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["got"], [code for ident, code in results if ident == thread.ident]

    ok, invalid = driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
    for rows, codes_expected in ((x, [invalid, ok]), (x[:63], [ok])):  # planned here; planned there
        got, codes = on_fresh_thread(rows)
        want = tr.rms_norm_fwd(rows, w, None, spec)
        assert bits_equal(want[0], got[0]) and bits_equal(want[1], got[1])
        assert codes == [int(c) for c in codes_expected], (rows.shape, codes)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton", "cute"])
@pytest.mark.parametrize("m, n", [(262144, 128), (4096, 128), (128, 4096), (8192, 4096), (999, 5120), (37, 1000)])
def test_cuda_backward_bitwise_dependent_partial_sum(backend, m, n, seed):
    """The fast dW's partial sum launched as the backward's dependent grid (CudaBackend.dependent_sum: scheduled
    while the backward's last blocks run, waiting for them on the GPU) gives the bits of plain launches, for
    calls queued back to back with a fresh dy each: a sum that read the partial-row buffer before this call's
    backward had written it would read another call's rows."""
    if not status(backend, torch.device(DEV)).available:
        pytest.skip(status(backend, torch.device(DEV)).reason)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch: sm_90 and newer")
    cb = get_backend("cuda")
    x, w, _ = _data(m, n, torch.bfloat16, torch.bfloat16, seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    dys = [torch.randn(m, n, device=DEV, generator=g).bfloat16() for _ in range(3)]
    cb.dependent_sum = False
    try:
        want = [_fwd_bwd(backend, x, w, dy, "llama", "fast")[3] for dy in dys]
    finally:
        cb.dependent_sum = True
    got = [_fwd_bwd(backend, x, w, dy, "llama", "fast")[3] for dy in dys]
    assert not bits_equal(want[0], want[1])
    for a, b in zip(got, want, strict=True):
        assert bits_equal(a, b)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, n, out_dtype", [(264, 4096, torch.bfloat16), (528, 8192, torch.float32),
                                                (16896, 128, torch.bfloat16), (37, 1000, torch.float16),
                                                (5, 7, torch.float32), (3000, 18432, torch.float32)])
def test_cuda_partial_sum_in_its_fixed_order(rows, n, out_dtype, seed):
    """The fast dW's sum of partial rows (CudaBackend.sum_rows, partial_sum.cu; the cute and Triton backends' too)
    equals its order's model bit for bit (two launches where the rows come in segments), run after run."""
    from strictnorm.backends.cuda.backend import _SUM_COLS, _SUM_THREADS, partial_sum_shape

    g = torch.Generator().manual_seed(seed)
    part = torch.randn(rows, n, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    shape = partial_sum_shape(rows, n, torch.cuda.get_device_properties(0).multi_processor_count)
    groups = _SUM_THREADS // (_SUM_COLS // shape.vec)
    want = partial_sum_model(part, shape.seg_rows, groups)
    if shape.segments > 1:
        want = partial_sum_model(want, shape.segments, groups)
    cb = get_backend("cuda")
    got = cb.sum_rows(part.to(DEV), out_dtype)
    assert bits_equal(want.reshape(n).to(out_dtype), got.cpu())
    assert bits_equal(got, cb.sum_rows(part.to(DEV), out_dtype))
    strided = torch.empty(rows, n + 3, device=DEV)[:, :n]  # rows not dense: summed from a copy
    strided.copy_(part)
    assert bits_equal(got, cb.sum_rows(strided, out_dtype))

