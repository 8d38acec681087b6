"""Host time of the pieces of an eager strictnorm call, timed apart (no profiler: it inflates small calls).

Each figure is the median over 5 loops of 2000 calls, microseconds per call, no synchronization in a loop
(the inputs are tiny: the GPU never holds the host back). Run on the GPU machine:
    python3 bench/host_breakdown.py [out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

import strictnorm as sn
from strictnorm.backends.layout import forward_outputs, forward_views, signature
from strictnorm.backends.registry import get_backend
from strictnorm.contract import make_spec

_NOOP = r"""
extern "C" __global__ void noop(const float* a, long long s0, long long s1, float* y, long long rows, int n,
                                 float eps) {
    if (rows < 0) y[0] = a[0] + eps;
}
"""


def per_call_us(fn: Callable[[], object], calls: int = 2000, loops: int = 5, gpu: bool = True) -> float:
    """Median host µs a call; gpu: synchronize the device between loops (so queued kernels never pile up)."""
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for _ in range(100):
        fn()
    sync()
    out = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(out)


def _noop_launchers(dev: int) -> dict[str, Callable[[], object]]:
    """The same empty kernel launched through cuda.core's launch and through cuLaunchKernel with a
    parameter block built once (strictnorm's LoadedKernel). (LoadedKernel calling cuLaunchKernel through ctypes
    instead of the driver bindings was slower on an H200 machine: 8.6 against 7.6 us; results/2026-11-30-h200-run13.)"""
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, Stream, launch

    from strictnorm.backends.cuda.nvrtc import LoadedKernel, current_stream

    d = Device(dev)
    d.set_current()
    major, minor = d.compute_capability
    code = Program(_NOOP, code_type="c++", options=ProgramOptions(arch=f"sm_{major}{minor}")).compile("cubin")
    kernel = code.get_kernel("noop")
    a = torch.zeros(4, device="cuda")
    handle = torch.cuda.current_stream(dev).cuda_stream
    stream = Stream.from_handle(handle)
    cfg = LaunchConfig(grid=(1, 1, 1), block=128, shmem_size=0)
    i64 = np.int64

    def core() -> None:
        launch(stream, LaunchConfig(grid=(1, 1, 1), block=128, shmem_size=0), kernel, a.data_ptr(), i64(4),
               i64(0), a.data_ptr(), i64(1), np.int32(4), np.float32(1e-6))

    def core_cfg() -> None:
        launch(stream, cfg, kernel, a.data_ptr(), i64(4), i64(0), a.data_ptr(), i64(1), np.int32(4),
               np.float32(1e-6))

    loaded = LoadedKernel(code, kernel)

    def packed() -> None:
        loaded.launch(current_stream(dev), (1, 1, 1), 128, 0, a.data_ptr(), 4, 0, a.data_ptr(), 1, np.int32(4),
                      np.float32(1e-6))

    return {"launch: cuda.core launch (new LaunchConfig)": core, "launch: cuda.core launch (cached config)": core_cfg,
            "launch: strictnorm LoadedKernel (packed block)": packed}


def _triton_forward_pieces(tb, x: torch.Tensor, w: torch.Tensor, spec) -> dict[str, Callable[[], object]]:
    """The Triton backend's eager forward (backend.rms_norm_fwd) taken apart: its plan lookup, its outputs, the int16
    views it stores bf16 through, and its launcher with the arguments already built."""
    from strictnorm.backends.triton.backend import _store_view

    dev = x.get_device()
    tb.rms_norm_fwd(x, w, None, spec)  # plans and compiles
    key = (dev, signature(x, w, None), spec)
    plan = tb._fwd_plans[key]
    y, rstd, _ = forward_outputs(x, None, spec.out_dtype)
    xk, wk, rk = plan.views.inputs(x, w, None)
    args = (xk, *plan.views.lay.args(), rk, *plan.views.rlay.args(), y, wk, plan.wsg, _store_view(y),
            rstd, *plan.scalars)
    launcher = plan.launch
    kernel = launcher.kernel
    return {
        "triton: signature + plan lookup": lambda: tb._fwd_plans.get((dev, signature(x, w, None), spec)),
        "triton: forward_outputs (y, rstd)": lambda: forward_outputs(x, None, spec.out_dtype),
        "triton: forward_outputs, no rstd": lambda: forward_outputs(x, None, spec.out_dtype, need_rstd=False),
        "triton: views.inputs + lay.args": lambda: (plan.views.inputs(x, w, None), plan.views.lay.args(),
                                                    plan.views.rlay.args()),
        "triton: _store_view (bf16 as int16)": lambda: _store_view(y),
        "triton: kernel.launch_metadata": lambda: kernel.launch_metadata(plan.grid, 0, *args, *launcher.constexprs),
        "triton: launcher, prepared args": lambda: launcher(plan.grid, dev, *args),
    }


def _cute_forward_pieces(x: torch.Tensor, w: torch.Tensor, spec) -> dict[str, Callable[[], object]]:
    """The cute backend's eager forward taken apart: its planned launch with every output reused, with rstd the
    shared sink, with a fresh rstd and with fresh y and rstd (what a fresh tensor costs the call convention)."""
    from strictnorm.backends.layout import rstd_sink

    try:
        cute = get_backend("cute")
        cute.rms_norm_fwd(x, w, None, spec)  # plans and compiles
        plan = cute._fwd_plans[(x.get_device(), signature(x, w, None), spec)]
    except Exception as e:  # no DSL here, say: the other cute rows fail the same way
        print(f"cute forward pieces: {type(e).__name__}: {e}"[:200], flush=True)
        return {}
    y, rstd, _ = forward_outputs(x, None, spec.out_dtype)
    eps, off = spec.eps, spec.offset
    return {
        "cute: signature + plan lookup": lambda: cute._fwd_plans.get((x.get_device(), signature(x, w, None), spec)),
        "cute: launch, y and rstd reused": lambda: plan(x, w, None, y, rstd, None, eps, off),
        "cute: launch, y reused, rstd the sink": lambda: plan(x, w, None, y, rstd_sink(x.device, 4), None, eps, off),
        "cute: launch, y reused, fresh rstd": lambda: plan(x, w, None, y, x.new_empty(4, dtype=torch.float32), None,
                                                           eps, off),
        "cute: launch, fresh y and rstd": lambda: plan(x, w, None, *forward_outputs(x, None, spec.out_dtype)[:2], None,
                                                       eps, off),
    }


class _PassThrough(torch.autograd.Function):
    """An autograd node with no work: forward allocates its output, backward hands back tensors made beforehand.
    A backward through it is the autograd engine's own cost (its device thread, the node's bookkeeping)."""

    @staticmethod
    def forward(ctx, x, w, grads):
        ctx.grads = grads
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return *ctx.grads, None


def _backward_pieces(xg: torch.Tensor, wg: torch.Tensor, dy: torch.Tensor, backend: str = "cuda") -> dict[str, float]:
    """Where an eager backward's host time goes: the engine alone (_PassThrough), strictnorm's backward with the
    time inside its backend call summed apart (ops._direct_bwd wrapped: the engine runs it on its device thread),
    then a cProfile of that call on that thread (printed)."""
    import cProfile
    import pstats

    from strictnorm import ops

    grads = (torch.empty_like(xg), torch.empty_like(wg))
    y_pass = _PassThrough.apply(xg, wg, grads)
    y_sn = sn.rms_norm(xg, wg, backend=backend)
    results = {"backward only, an empty autograd node (the engine)": per_call_us(
        lambda: torch.autograd.grad(y_pass, (xg, wg), dy, retain_graph=True))}
    direct, prof = ops._direct_bwd, None
    spans = [0.0, 0.0]  # over the same calls: the whole backward step, and the time inside the backend call

    def timed(*args):
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        out = direct(*args)
        if prof is not None:
            prof.disable()
        spans[1] += time.perf_counter() - t0
        return out

    def step_call():
        t0 = time.perf_counter()
        torch.autograd.grad(y_sn, (xg, wg), dy, retain_graph=True)
        spans[0] += time.perf_counter() - t0

    ops._direct_bwd = timed
    try:
        step = per_call_us(step_call)
        results[f"backward only, sn {backend}, timed inside"] = step
        # the inside's share of those calls' time (first calls included on both sides), at the step's median
        results["  of it inside the backend call (device thread)"] = step * spans[1] / spans[0]
        prof = cProfile.Profile()
        for _ in range(500):
            torch.autograd.grad(y_sn, (xg, wg), dy, retain_graph=True)
        torch.cuda.synchronize()
    finally:
        ops._direct_bwd = direct
    print("cProfile of 500 backend backward calls on the engine's device thread (tottime):", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return results


def _profile_step(step: Callable[[], object]) -> None:
    """torch.profiler's CPU view of eager training steps (every thread, the autograd engine's included)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60), flush=True)


def main() -> None:
    dev = torch.cuda.current_device()
    x = torch.randn(4, 4096, device="cuda").bfloat16()
    w = torch.ones(4096, device="cuda").bfloat16()
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    spec = make_spec(torch.bfloat16, 1e-6, 0.0, "llama", torch.bfloat16)
    cb, tb = get_backend("cuda"), get_backend("triton")
    y, rstd, _ = cb.rms_norm_fwd(x, w, None, spec)
    cases: dict[str, Callable[[], object]] = {
        "torch.empty (4, 4096) bf16": lambda: torch.empty((4, 4096), dtype=torch.bfloat16, device=x.device),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(dev),
        "forward_views": lambda: forward_views(x, w, None, torch.bfloat16),
        # ways to allocate a forward's fp32 rstd (one per row): forward_outputs' torch.empty costs most of its time
        "rstd: torch.empty(shape, dtype, device)": lambda: torch.empty(x.shape[:-1], dtype=torch.float32,
                                                                       device=x.device),
        "rstd: torch.empty(int, dtype, device)": lambda: torch.empty(4, dtype=torch.float32, device=x.device),
        "rstd: x.new_empty(shape, dtype)": lambda: x.new_empty(x.shape[:-1], dtype=torch.float32),
        "rstd: empty_like(x[..., 0], fp32, contiguous)": lambda: torch.empty_like(
            x[..., 0], dtype=torch.float32, memory_format=torch.contiguous_format),
        "rstd: empty_like(x.select(-1, 0), fp32)": lambda: torch.empty_like(x.select(-1, 0), dtype=torch.float32),
        "x.device": lambda: x.device,
        **_noop_launchers(dev),
        "cuda backend rms_norm_fwd": lambda: cb.rms_norm_fwd(x, w, None, spec),
        "cuda backend rms_norm_fwd, no rstd": lambda: cb.rms_norm_fwd(x, w, None, spec, need_rstd=False),
        "triton backend rms_norm_fwd": lambda: tb.rms_norm_fwd(x, w, None, spec),
        "triton backend rms_norm_fwd, no rstd": lambda: tb.rms_norm_fwd(x, w, None, spec, need_rstd=False),
        **_triton_forward_pieces(tb, x, w, spec),
        "cuda backend rms_norm_bwd fast": lambda: cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "fast", True, None),
        "cuda backend rms_norm_bwd strict": lambda: cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True,
                                                                    None),
        "torch F.rms_norm forward": lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6),
        "sn.rms_norm cuda forward": lambda: sn.rms_norm(x, w, backend="cuda"),
        "sn.rms_norm triton forward": lambda: sn.rms_norm(x, w, backend="triton"),
        "cute backend rms_norm_fwd": lambda: get_backend("cute").rms_norm_fwd(x, w, None, spec),
        "cute backend rms_norm_fwd, no rstd": lambda: get_backend("cute").rms_norm_fwd(x, w, None, spec,
                                                                                      need_rstd=False),
        "sn.rms_norm cute forward": lambda: sn.rms_norm(x, w, backend="cute"),
        **_cute_forward_pieces(x, w, spec),
        "cute backend rms_norm_bwd fast": lambda: get_backend("cute").rms_norm_bwd(dy, x, w, rstd, None, spec, "fast",
                                                                                   True, None),
        "triton backend rms_norm_bwd fast": lambda: tb.rms_norm_bwd(dy, x, w, rstd, None, spec, "fast", True, None),
        "sn.rms_norm_with_rstd cuda forward": lambda: sn.rms_norm_with_rstd(x, w, backend="cuda"),
        # the forward that records an autograd node (the graph dropped unused): against the rows without grad, what
        # the node costs each
        "torch F.rms_norm forward, recording": lambda: torch.nn.functional.rms_norm(xg, (4096,), wg, 1e-6),
        "sn.rms_norm cuda forward, recording": lambda: sn.rms_norm(xg, wg, backend="cuda"),
        "torch F.rms_norm fwd+bwd (autograd)": lambda: torch.autograd.grad(
            torch.nn.functional.rms_norm(xg, (4096,), wg, 1e-6), (xg, wg), dy),
        "sn.rms_norm cuda fwd+bwd (autograd)": lambda: torch.autograd.grad(
            sn.rms_norm(xg, wg, backend="cuda"), (xg, wg), dy),
        "sn.rms_norm triton fwd+bwd (autograd)": lambda: torch.autograd.grad(
            sn.rms_norm(xg, wg, backend="triton"), (xg, wg), dy),
    }
    y_cuda = sn.rms_norm(xg, wg, backend="cuda")
    y_torch = torch.nn.functional.rms_norm(xg, (4096,), wg, 1e-6)
    cases["backward only, sn cuda (retain_graph)"] = lambda: torch.autograd.grad(y_cuda, (xg, wg), dy,
                                                                                 retain_graph=True)
    cases["backward only, F.rms_norm (retain_graph)"] = lambda: torch.autograd.grad(y_torch, (xg, wg), dy,
                                                                                    retain_graph=True)
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = per_call_us(fn)
        except Exception as e:  # report and go on: one broken piece must not hide the others
            results[name] = f"{type(e).__name__}: {e}"[:200]
        print(f"{name:45s} {results[name]:8.1f} us" if isinstance(results[name], float)
              else f"{name:45s} {results[name]}", flush=True)
    try:
        for name, us in _backward_pieces(xg, wg, dy).items():
            results[name] = us
            print(f"{name:45s} {us:8.1f} us", flush=True)
    except Exception as e:  # as above
        print(f"backward pieces: {type(e).__name__}: {e}"[:200], flush=True)
    _profile_step(lambda: torch.autograd.grad(sn.rms_norm(xg, wg, backend="cuda"), (xg, wg), dy))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us_per_call": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
