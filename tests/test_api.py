"""Custom ops, torch.compile, backend selection, nn modules and the CLI (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import bits_equal, randn

import strictnorm as sn
from strictnorm import ops
from strictnorm.backends import registry


def test_opcheck_custom_ops(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(4, 16, gen=g).requires_grad_(True)
    w = randn(16, gen=g).requires_grad_(True)
    r = randn(4, 16, gen=g).requires_grad_(True)
    args = (x, w, None, 1e-6, 0.0, "llama", None, "strict", False, "torch")
    torch.library.opcheck(ops.rms_norm_fwd, args)
    torch.library.opcheck(ops.rms_norm_fwd, (x, w, r, 1e-6, 1.0, "gemma", None, "fast", False, "torch"))
    torch.library.opcheck(ops.left_fold, (randn(5, 3, gen=g), "torch"))


def test_torch_compile_fullgraph_no_graph_break(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(6, 32, dtype=torch.bfloat16, gen=g)
    res = randn(6, 32, dtype=torch.bfloat16, gen=g)
    w = randn(32, gen=g)

    def block(x, res, w):
        y, z = sn.fused_add_rms_norm(x, res, w, backend="torch", casting_mode="gemma", offset=1.0)
        return sn.rms_norm(y * 2, w, backend="torch"), z

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y, z = compiled(xs, res, ws)
    (y.float().sum() + z.float().sum()).backward()
    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ye, ze = block(xe, res, we)
    (ye.float().sum() + ze.float().sum()).backward()
    assert bits_equal(y, ye) and bits_equal(z, ze)
    assert bits_equal(xs.grad, xe.grad) and bits_equal(ws.grad, we.grad)
    y2, _ = compiled(randn(3, 32, dtype=torch.bfloat16, gen=g), randn(3, 32, dtype=torch.bfloat16, gen=g), w)
    assert y2.shape == (3, 32)


def test_backend_selection_order(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert registry.resolve(None, cpu, "rms_norm") == "torch"  # CPU tensors: the reference
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    assert registry.resolve(None, cpu, "rms_norm") == "torch"
    monkeypatch.setenv(registry.ENV_VAR, "cuda")
    with pytest.raises(sn.BackendUnavailable, match="environment variable STRICTNORM_BACKEND"):
        registry.resolve(None, cpu, "left_fold")
    with pytest.raises(sn.BackendUnavailable, match="cuda.*cannot run on cpu"):
        registry.resolve("cuda", cpu, "rms_norm")
    assert registry.resolve("torch", cpu, "rms_norm") == "torch"  # the argument beats the environment


def test_explicit_unavailable_backend_names_the_reason():
    with pytest.raises(sn.BackendUnavailable, match="cuda.*cannot run on cpu.*NVIDIA"):
        sn.reduce_rows_left_fold(torch.ones(3, 2), backend="cuda")


def test_modules_and_gemma_presets(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(3, 5, 64, dtype=torch.bfloat16, gen=g)
    m = sn.RMSNorm(64, eps=1e-5, backend="torch")
    assert bits_equal(m(x), sn.rms_norm(x, torch.ones(64), 1e-5, backend="torch"))
    gm = sn.GemmaRMSNorm(64, backend="torch")
    assert (gm.weight == 0).all() and gm.offset == 1.0 and gm.casting_mode == "gemma"
    assert bits_equal(gm(x), sn.rms_norm(x, torch.zeros(64), offset=1.0, casting_mode="gemma", backend="torch"))
    f = sn.FusedAddRMSNorm(64, backend="torch")
    y, z = f(x, x)
    assert bits_equal(z, (x.float() * 2).bfloat16())
    q = sn.QKNorm(16, num_heads=4, backend="torch")
    assert q.weight.shape == (4, 16)
    qx = randn(2, 3, 4, 16, dtype=torch.bfloat16, gen=g)
    assert q(qx).shape == qx.shape
    assert sn.GemmaQKNorm(16, backend="torch").weight.abs().sum() == 0
    assert "offset=1.0" in repr(gm)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "strictnorm.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_info():
    p = _cli("info")
    assert p.returncode == 0, p.stderr
    assert "torch" in p.stdout and "automatic choice for rms_norm" in p.stdout


def test_cli_verify_writes_json(tmp_path):
    out = tmp_path / "v.json"
    p = _cli("verify", "--backend", "torch", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert data["results"] and all(r["ok"] for r in data["results"])
    assert "verify: 4 passed, 0 failed" in p.stdout


def test_eager_path_skips_the_custom_op_dispatcher(monkeypatch, seed):
    """Eager calls run the backend through a plain autograd.Function (less host time), with the same
    bits as the custom op that torch.compile sees."""
    g = torch.Generator().manual_seed(seed)
    x = randn(5, 24, dtype=torch.bfloat16, gen=g)
    w = randn(24, gen=g)
    dy = randn(5, 24, dtype=torch.bfloat16, gen=g)
    via_op = ops.rms_norm_fwd(x, w, None, 1e-6, 1.0, "gemma", None, "strict", False, "torch")
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y_op = ops.rms_norm_fwd(xa, wa, None, 1e-6, 1.0, "gemma", None, "strict", False, "torch")[0]
    y_op.backward(dy)

    def refuse(*args, **kwargs):
        raise AssertionError("the custom op was dispatched in eager mode")

    monkeypatch.setattr(ops, "rms_norm_fwd", refuse)
    y, rstd = sn.rms_norm_with_rstd(x, w, offset=1.0, casting_mode="gemma", dw="strict", backend="torch")
    assert bits_equal(y, via_op[0]) and bits_equal(rstd, via_op[1])
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    sn.rms_norm(xb, wb, offset=1.0, casting_mode="gemma", dw="strict", backend="torch").backward(dy)
    assert bits_equal(xb.grad, xa.grad) and bits_equal(wb.grad, wa.grad)


def test_inference_calls_tell_the_backend_that_rstd_is_not_used(monkeypatch, seed):
    """Without autograd, rms_norm, fused_add_rms_norm and qk_norm ask the backend for no rstd (the CUDA backend
    then allocates and stores none), rms_norm_with_rstd asks for it, and a call that records a graph always gets it
    (the backward needs it); every result the same bits either way."""
    from strictnorm.backends.registry import get_backend

    backend = get_backend("torch")
    asked: list[bool] = []
    original = backend.rms_norm_fwd

    def recording(x, weight, residual, spec, need_rstd=True):
        asked.append(need_rstd)
        return original(x, weight, residual, spec, need_rstd)

    g = torch.Generator().manual_seed(seed)
    x, res = randn(6, 4, 32, dtype=torch.bfloat16, gen=g), randn(6, 4, 32, dtype=torch.bfloat16, gen=g)
    w = randn(32, gen=g)
    want_y = sn.rms_norm(x, w, backend="torch")
    want_fused = sn.fused_add_rms_norm(x, res, w, backend="torch")
    want_qk = sn.qk_norm(x, w, backend="torch")
    monkeypatch.setattr(backend, "rms_norm_fwd", recording)
    assert bits_equal(sn.rms_norm(x, w, backend="torch"), want_y)
    assert all(bits_equal(a, b) for a, b in zip(sn.fused_add_rms_norm(x, res, w, backend="torch"), want_fused,
                                               strict=True))
    assert bits_equal(sn.qk_norm(x, w, backend="torch"), want_qk)
    assert asked == [False, False, False]
    y, rstd = sn.rms_norm_with_rstd(x, w, backend="torch")
    assert asked[-1] is True and bits_equal(y, want_y) and rstd.shape == x.shape[:-1]
    wg = w.clone().requires_grad_(True)
    sn.rms_norm(x, wg, backend="torch").sum().backward()
    assert asked[-1] is True and wg.grad is not None
    with torch.no_grad():
        sn.rms_norm(x, wg, backend="torch")
    assert asked[-1] is False
