"""Tensors on a GPU other than the current one: every GPU backend's entry points switch to the tensors' GPU
(backends/base.on_tensor_device) and switch back. The guard's logic is tested on the CPU; its effect on a machine
with two GPUs (skipped with fewer)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from helpers import bits_equal, check_random_case, random_case

import strictnorm as sn
from strictnorm.backends import base
from strictnorm.backends.cuda.backend import CudaBackend
from strictnorm.backends.cute.backend import CuteBackend
from strictnorm.backends.registry import get_backend, status
from strictnorm.backends.triton.backend import TritonBackend

ENTRY_POINTS = {
    CudaBackend: ("rms_norm_fwd", "rms_norm_bwd", "left_fold", "launch_fold", "sum_rows"),
    TritonBackend: ("rms_norm_fwd", "rms_norm_bwd", "left_fold"),
    CuteBackend: ("rms_norm_fwd", "rms_norm_bwd", "left_fold"),
}


@pytest.mark.parametrize("cls", list(ENTRY_POINTS), ids=lambda c: c.__name__)
def test_every_gpu_entry_point_is_device_guarded(cls):
    """The methods that users and the other backends call (the Backend protocol, and the CUDA backend's folds and
    partial-row sum that the Triton and cute backends borrow) carry the guard."""
    missing = [m for m in ENTRY_POINTS[cls] if not getattr(getattr(cls, m), "device_guarded", False)]
    assert not missing, f"{cls.__name__}: no device guard on {missing}"


class _OnDevice:
    """Stands for a tensor: only get_device() is asked."""

    def __init__(self, index: int) -> None:
        self.index = index

    def get_device(self) -> int:
        return self.index


@pytest.mark.parametrize("index, switched", [(-1, False), (0, False), (1, True)])
def test_device_guard_switches_only_to_another_gpu(monkeypatch, index, switched):
    """A CPU tensor (-1) or one on the current GPU runs as it is; one on another GPU runs inside
    torch.cuda.device(its index), which restores the caller's device on the way out (also on an error)."""
    current, entered = [0], []

    @contextlib.contextmanager
    def device(i: int):
        entered.append(i)
        before, current[0] = current[0], i
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)

    class Backend:
        @base.on_tensor_device
        def run(self, t, value, fail=False):
            if fail:
                raise ValueError("inside")
            return value, current[0]

    want_device = index if switched else 0
    assert Backend().run(_OnDevice(index), "v") == ("v", want_device)
    assert Backend().run(t=_OnDevice(index), value="v") == ("v", want_device)  # the tensor by keyword
    assert entered == ([index, index] if switched else []) and current[0] == 0
    with pytest.raises(ValueError, match="inside"):
        Backend().run(_OnDevice(index), "v", fail=True)
    assert current[0] == 0


# ---- two GPUs ------------------------------------------------------------------------------------------------

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")
GPU_BACKENDS = ["cuda", "triton", "cute"]


def _on_second_gpu(name: str):
    if not status(name, torch.device("cuda:1")).available:
        pytest.skip(f"backend {name!r} unavailable: {status(name, torch.device('cuda:1')).reason}")
    return get_backend(name)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_random_cases_on_a_non_current_gpu(name, seed):
    """Random configurations (dtypes, modes, offsets, strided rows, per-head weights, special values) on cuda:1 while
    cuda:0 is current: the reference's bits for y, rstd, residual_out, dx and the strict dW; cuda:0 stays current."""
    backend = _on_second_gpu(name)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    with torch.cuda.device(0):
        for _ in range(24):
            check_random_case(backend, random_case(rng, gen, "cuda:1"))
            assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)


def _case(device: str, rows: int, n: int, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, n, device=device, generator=g).to(torch.bfloat16)
    res = torch.randn(rows, n, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, device=device, generator=g) * 0.1).to(torch.bfloat16)
    dy = torch.randn(rows, n, device=device, generator=g).to(torch.bfloat16)
    return x, res, w, dy


def _step(backend: str, x, res, w, dy, dw: str):
    """fused_add_rms_norm forward and backward through autograd: (y, residual_out, dx, dresidual, dw)."""
    xs, rs, ws = (t.clone().requires_grad_(True) for t in (x, res, w))
    y, z = sn.fused_add_rms_norm(xs, rs, ws, offset=1.0, casting_mode="gemma", dw=dw, backend=backend)
    torch.autograd.backward((y, z), (dy, dy))
    return y, z, xs.grad, rs.grad, ws.grad


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("rows, n, dw", [(2048, 4096, "fast"), (20000, 128, "strict"), (300, 18432, "fast")])
def test_same_shapes_on_both_gpus(name, rows, n, dw, seed):
    """One signature on cuda:0, then on cuda:1 (cuda:0 current), then on cuda:0 again: the plans, compiled kernels
    and side streams of one GPU are never used for the other. Sizes that take the persistent grids, the fast dW's
    partial rows and (20000 rows, strict) the fold beside the dx pass. Bits against the reference on each GPU."""
    _on_second_gpu(name)
    with torch.cuda.device(0):
        for device in ("cuda:0", "cuda:1", "cuda:0"):
            data = _case(device, rows, n, seed)
            want, got = _step("torch", *data, "strict"), _step(name, *data, dw)
            for what, a, b in zip(("y", "residual_out", "dx", "dresidual"), want, got, strict=False):
                assert a.device == b.device == torch.device(device)
                assert bits_equal(a, b), f"{what} on {device}"
            assert got[4].device == torch.device(device) and got[4].isfinite().all()
            if dw == "strict":
                assert bits_equal(want[4], got[4]), f"strict dw on {device}"
            assert torch.cuda.current_device() == 0
            rows_in = torch.randn(777, 129, device=device).to(torch.bfloat16)
            assert bits_equal(sn.reduce_rows_left_fold(rows_in, backend=name),
                              sn.reduce_rows_left_fold(rows_in, backend="torch"))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
