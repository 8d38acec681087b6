"""`strictnorm bench`: strictnorm and the anchors side by side, in one process and one run.

Two figures per provider and op: kernel-only time (the time the op's CUDA kernels ran from
torch.profiler: their durations summed, kernels running side by side counted once; L2 flushed before
each timed call, median over iterations; the method behind the anchor figures in PERF.md) and eager
time (triton.testing.do_bench: what a Python caller sees, host cost included). Bytes are counted
(forward: read x, write y; backward: read x, dy, write dx), and the device-to-device copy bandwidth
is measured in the same run as the ceiling. The backward is the forward-backward less the inference forward, as
PERF.md's anchors define it; each JSON row also gives the training forward timed alone (train_fwd_us) and the
forward-backward less it (bwd_only_us), which differ where a provider's training forward is not its inference forward
(torch.compile's graphs of their own; an rstd stored). With --compile the HF module is timed compiled twice: as
torch.compile makes it by default, and with Inductor's emulate_precision_casts, which keeps the module's casts and so
its eager bits (the default drops its round trip through x's dtype).

Sections: norm (forward and backward, bf16, llama casting; presets: the PERF.md grid, Llama-3 and
QK-norm shapes, or --shapes) with rounds in shuffled provider order and an A/A control (the same
provider measured twice: the run's noise) and a bytes-only reference (the same bytes moved by PyTorch's
copy and add kernels, no norm: each provider's time is also given over it); fold (--fold: the strict left
fold on the seed's shapes, against the Python loop and a one-thread-per-column kernel). On a CPU-only
machine the reference backend and the torch anchors are timed by wall clock, labelled as such.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import api
from .backends.registry import status

NORM_SHAPES = [(128, 4096), (2048, 4096), (8192, 4096), (32768, 4096), (8192, 8192), (2048, 18432), (262144, 128)]
FOLD_SHAPES = ([(r, 128) for r in (1, 16, 256, 1024, 4096, 16384, 65536, 262144)]
               + [(r, 4096) for r in (1, 64, 1024, 4096)] + [(1024, c) for c in (64, 512, 4096, 8192)])
CHAIN_NS_PER_ROW = 4 / 1.98  # one dependent fp32 add: 4 cycles at ~1.98 GHz
COMPILE_ANCHOR = "torch.compile"
# torch.compile of the same module with Inductor's emulate_precision_casts: by default Inductor drops the module's
# round trip through x's dtype (llama: (x * rstd).to(bf16) before the weight), a cheaper computation with other
# bits; with it on, the compiled module gives eager's bits (tests/test_bench.py), the computation strictnorm matches
COMPILE_EXACT_ANCHOR = "torch.compile (eager casts)"
HOLD_CYCLES = 4_000_000  # queued_us's sleep: ~2 ms at ~1.98 GHz, longer than the host takes to enqueue a call
# How Timer empties the L2 before a timed call (STRICTNORM_BENCH_FLUSH): "write" zeroes a 256 MB buffer, as PERF.md's
# anchors and triton's do_bench do, which leaves the L2 full of dirty lines that the timed call's first misses must
# write back; "read" sums the buffer instead, leaving clean lines. The anchors' figures are "write" figures; "read"
# is for telling how much of a small kernel's time is that write-back.
FLUSH_MODES = ("write", "read")


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}")
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
    from importlib import metadata

    for pkg in ("strictnorm", "triton", "cuda-core", "nvidia-cuda-nvrtc", "liger-kernel", "quack-kernels",
                "nvidia-cutlass-dsl"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    try:
        # "-dirty" when the files differ from that commit: the numbers then belong to uncommitted code
        env["git_commit"] = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["git_commit"] = None
    return env


class Timer:
    """Kernel-only and eager time of a callable on one device.

    CUDA: kernel-only time is the union of the call's kernel intervals from torch.profiler (busy_us: the
    sum of their durations where they run one after the other) with the L2 flushed before every timed call
    (median over iterations); eager time is triton's do_bench median.
    CPU: both figures are the wall-clock median of the call (there are no kernels to separate).
    """

    def __init__(self, device: torch.device, iters: int, flush: str | None = None) -> None:
        self.device = device
        self.iters = iters
        self.cuda = device.type == "cuda"
        self.flush_mode = flush or os.environ.get("STRICTNORM_BENCH_FLUSH", "write")
        if self.flush_mode not in FLUSH_MODES:
            raise ValueError(f"unknown L2 flush {self.flush_mode!r} (STRICTNORM_BENCH_FLUSH); expected one of "
                             f"{FLUSH_MODES}")
        self.flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device) if self.cuda else None
        if self.cuda and self.flush_mode == "read":
            self.flush.fill_(1)  # written once here; each flush then only reads it

    def flush_l2(self) -> None:
        """Empty the L2 of the timed call's data (FLUSH_MODES)."""
        if self.flush_mode == "write":
            self.flush.zero_()
        else:
            self.flush.sum()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def kernel_us(self, fn: Callable[[], object]) -> float:
        return self._median_us(fn, self._profiled_us)

    def _profiled_us(self, fn: Callable[[], object]) -> float:
        """One call alone under torch.profiler: the union of its kernels' intervals."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return busy_us([(e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA])

    def queued_us(self, fn: Callable[[], object]) -> float:
        """GPU time of the call with the host's launches ahead of the GPU, as in a busy training step: a sleep
        kernel holds the stream while the host enqueues the call, and CUDA events on the current stream time it
        from the sleep's end to the call's last kernel (a side stream joined back included). Unlike kernel_us it
        counts the gaps between the call's kernels, but never the host's time between its launches: where two
        kernels run side by side (the strict dW fold beside the dx pass) this is their real overlap, which
        kernel_us cannot see when the host launches the second one after the first has run. L2 flushed first."""
        return self._median_us(fn, self._held_us)

    @staticmethod
    def _held_us(fn: Callable[[], object]) -> float:
        """One call enqueued behind a sleep kernel, timed by events from the sleep's end."""
        torch.cuda._sleep(HOLD_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def _median_us(self, fn: Callable[[], object], once: Callable[[Callable[[], object]], float]) -> float:
        """Two warm-up calls, then the median of `once(fn)` over the iterations, L2 flushed before each; the
        wall clock on the CPU."""
        for _ in range(2):
            fn()
        self.sync()
        if not self.cuda:
            return self._wall_us(fn)
        times = []
        for _ in range(self.iters):
            self.flush_l2()
            times.append(once(fn))
        return statistics.median(times)

    def eager_us(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            return self._wall_us(fn)
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3

    def _wall_us(self, fn: Callable[[], object]) -> float:
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time some kernel of a call ran. Kernels on one
    stream add up; kernels running side by side (the strict dW fold beside the dx pass) count once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def copy_ceiling_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    numel = 1024**3 if device.type == "cuda" else 64 * 1024**2
    x = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    t = Timer(device, 9)
    us = t.eager_us(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / us / 1e3


def norm_bytes(m: int, n: int, x_size: int = 2, w_size: int = 2, fused: bool = False) -> tuple[int, int]:
    """(forward, backward) bytes moved at least: forward reads x and w, writes y (and rstd), and with
    the fused add also reads the residual and writes residual_out; backward reads x (or residual_out),
    dy, w, rstd and writes dx (one gradient serves x and the residual) and dW."""
    fwd = (4 if fused else 2) * m * n * x_size + n * w_size + 4 * m
    bwd = 3 * m * n * x_size + 2 * n * w_size + 4 * m
    return fwd, bwd


def _hf_llama(eps: float) -> Callable:
    def hf_llama(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    return hf_llama


def _hf_gemma(eps: float) -> Callable:
    def hf_gemma(x, w):
        xf = x.float()
        return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + w.float())).to(x.dtype)

    return hf_gemma


AA_CONTROL = "A/A: torch F.rms_norm"
BYTES_ONLY = "bytes only: copy, add"


class _BytesOnly(torch.autograd.Function):
    """The norm's bytes with no norm: the forward copies x (reads x, writes y), the backward adds x and dy (reads
    both, writes dx) with PyTorch's own elementwise kernels. Neither an anchor nor a norm: what moving exactly these
    bytes took in this run at this shape (launch, ramp and tail included), beside the copy ceiling's large copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return torch.add(x, dy), None


OPS = ("rms_norm", "fused_add", "qk_norm")
MODES = ("llama", "gemma", "none")
QK_HEADS = 8  # op qk_norm: rows M = tokens x QK_HEADS, weight (QK_HEADS, N) per head


def norm_providers(device: torch.device, compile_anchor: bool, op: str = "rms_norm", mode: str = "llama"
                   ) -> tuple[dict[str, Callable], dict[str, str]]:
    """name -> f(x, w, r) returning y (r: the residual, used by op "fused_add"), and name -> why, for
    each anchor that is missing. The A/A control is the first provider measured a second time under
    another name: the difference between the two is the noise of this run. Anchors are speed
    references in their own numerics (e.g. F.rms_norm knows no Gemma offset); strictnorm runs `mode`.
    For op "qk_norm", x (M, N) is viewed as (M / QK_HEADS, QK_HEADS, N) with a per-head weight."""
    eps = 1e-6
    offset = 1.0 if mode == "gemma" else 0.0
    native = lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)  # noqa: E731
    if op == "qk_norm":  # F.rms_norm takes no per-head weight: the norm, then the scale
        native = lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * w  # noqa: E731
    eager_name, eager = ("HF gemma eager", _hf_gemma(eps)) if mode == "gemma" else ("HF llama eager", _hf_llama(eps))
    base = {"torch F.rms_norm": native, eager_name: eager}
    skipped: dict[str, str] = {}
    if compile_anchor:
        # static shapes, as PERF.md's anchors compile it, and bench_norm resets dynamo at each shape: under automatic
        # dynamic shapes the second shape's recompile made one dynamic kernel that every later shape ran (run 53:
        # forward 1323 us at 262144 x 128, against 33 for the copy of its bytes)
        base[COMPILE_ANCHOR] = torch.compile(eager, dynamic=False)
        base[COMPILE_EXACT_ANCHOR] = torch.compile(eager, dynamic=False, options={"emulate_precision_casts": True})
    else:
        skipped[COMPILE_ANCHOR] = skipped[COMPILE_EXACT_ANCHOR] = "not requested (--compile)"
    if device.type == "cuda" and op == "rms_norm":
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            base["Liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, eps, offset, mode, False)
        except Exception as e:  # an anchor that is not installed is reported, not fatal
            skipped["Liger"] = repr(e)[:160]
        if mode == "llama":
            try:
                from quack.rmsnorm import rmsnorm as quack_rmsnorm

                base["Quack"] = lambda x, w: quack_rmsnorm(x, w, eps=eps)
            except Exception as e:
                skipped["Quack"] = repr(e)[:160]
        else:
            skipped["Quack"] = f"Quack's rmsnorm has no {mode} casting mode"
    else:
        skipped["Liger"] = skipped["Quack"] = "GPU only" if device.type != "cuda" else f"not measured for {op}"
    if op != "fused_add":  # the fused op moves other bytes (the residual in and out)
        base[BYTES_ONLY] = _BytesOnly.apply
    # anchors as f(x, w, r): for the fused op, the add then the norm, as an eager model runs them
    if op == "fused_add":
        providers = {name: (lambda x, w, r, f=f: f(x + r, w)) for name, f in base.items()}
    elif op == "qk_norm":
        providers = {name: (lambda x, w, r, f=f: f(_heads(x), w).reshape(x.shape)) for name, f in base.items()}
    else:
        providers = {name: (lambda x, w, r, f=f: f(x, w)) for name, f in base.items()}
    providers = {"torch F.rms_norm": providers["torch F.rms_norm"], AA_CONTROL: providers["torch F.rms_norm"],
                 **providers}
    # cute runs per-head QK-norm weights on the CUDA kernels: not timed under its name for qk_norm
    kernel_backends = ([b for b in ("cuda", "triton", "cute") if status(b, device).available
                        and not (b == "cute" and op == "qk_norm")] if device.type == "cuda" else [])
    kw = {"offset": offset, "casting_mode": mode}
    for backend in kernel_backends or ["torch"]:
        label = f"strictnorm {backend}" if device.type == "cuda" else "strictnorm torch"
        for dw in ("fast", "strict"):
            if op == "fused_add":
                providers[f"{label} {dw}"] = (lambda x, w, r, dw=dw, b=backend: api.fused_add_rms_norm(
                    x, r, w, eps, dw=dw, backend=b, **kw)[0])
            elif op == "qk_norm":
                providers[f"{label} {dw}"] = (lambda x, w, r, dw=dw, b=backend: api.qk_norm(
                    _heads(x), w, eps, dw=dw, backend=b, **kw).reshape(x.shape))
            else:
                providers[f"{label} {dw}"] = (lambda x, w, r, dw=dw, b=backend: api.rms_norm(
                    x, w, eps, dw=dw, backend=b, **kw))
    return providers, skipped


def _heads(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] % QK_HEADS:
        raise ValueError(f"op qk_norm needs M divisible by {QK_HEADS} heads, got M = {x.shape[0]}")
    return x.view(-1, QK_HEADS, x.shape[-1])


def bench_norm(timer: Timer, shapes, ceiling: float, providers: dict[str, Callable], rounds: int, log,
               rows: list[dict], seed: int = 0, op: str = "rms_norm", dtype: torch.dtype = torch.bfloat16) -> None:
    """Per shape: `rounds` rounds, providers in a fresh random order each round; each figure is the
    median over rounds. Appends one row per (shape, provider) as it goes."""
    rng = random.Random(seed)
    for i, (m, n) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] {op} {m}x{n}: {len(providers)} providers x {rounds} rounds", file=sys.stderr,
              flush=True)  # progress
        if {COMPILE_ANCHOR, COMPILE_EXACT_ANCHOR} & set(providers):  # each shape its own static graphs, none carried
            torch._dynamo.reset()
        inputs = _norm_inputs(timer.device, m, n, dtype, op)
        per: dict[str, list[dict]] = {name: [] for name in providers}
        errors: dict[str, str] = {}
        for _ in range(rounds):
            order = list(providers)
            rng.shuffle(order)
            for name in order:
                if name in errors:
                    continue
                try:
                    per[name].append(_norm_once(timer, providers[name], *inputs))
                except Exception as e:  # a provider that raises is reported, not fatal
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
        for name in providers:
            row = {"provider": name, "op": op, "M": m, "N": n, "dtype": str(dtype).replace("torch.", ""),
                   "device": timer.device.type}
            if name in errors:
                row["error"] = errors[name]
            else:
                for key in per[name][0]:
                    row[key] = statistics.median(r[key] for r in per[name])
                row.update(_derived(row, m, n, ceiling, op == "fused_add", dtype.itemsize))
                row["peak_MB_fwdbwd"] = _peak_mb(timer.device, providers[name], *inputs)
            rows.append(row)
            log(row)
        del inputs
        if timer.cuda:
            torch.cuda.empty_cache()
    ratios(rows)


def _norm_inputs(device: torch.device, m: int, n: int, dtype: torch.dtype = torch.bfloat16, op: str = "rms_norm"):
    g = torch.Generator(device=device).manual_seed(m * 7 + n)
    x = torch.randn(m, n, device=device, generator=g).to(dtype)
    w_shape = (QK_HEADS, n) if op == "qk_norm" else (n,)
    w = (1 + 0.1 * torch.randn(w_shape, device=device, generator=g)).to(dtype)
    dy = torch.randn(m, n, device=device, generator=g).to(dtype)
    r = torch.randn(m, n, device=device, generator=g).to(dtype)
    return x, w, dy, r


class NormCalls(NamedTuple):
    """A provider's timed calls on one shape's inputs."""

    fwd: Callable[[], object]  # the inference forward
    fwd_bwd: Callable[[], object]  # the forward with the backward of every input (on clones that require grad)
    train_fwd: Callable[[], object]  # fwd_bwd's forward alone (its graph built, then dropped)


def norm_calls(fn: Callable, x, w, dy, r) -> NormCalls:
    xg, wg, rg = (t.clone().requires_grad_(True) for t in (x, w, r))

    def fwd():
        return fn(x, w, r)

    def fwd_bwd():
        torch.autograd.grad(fn(xg, wg, rg), (xg, wg, rg), dy, allow_unused=True)

    def train_fwd():
        fn(xg, wg, rg)

    return NormCalls(fwd, fwd_bwd, train_fwd)


def _norm_once(timer: Timer, fn: Callable, x, w, dy, r) -> dict:
    """bwd_us is the forward-backward less the inference forward, as PERF.md's anchors define it; where a provider's
    training forward differs from its inference forward (a compiled graph of its own, an rstd store) that is not its
    backward kernels' time: bwd_only_us (the forward-backward less the training forward, timed alone) is."""
    calls = norm_calls(fn, x, w, dy, r)
    fwd_us, fwd_bwd_us = timer.kernel_us(calls.fwd), timer.kernel_us(calls.fwd_bwd)
    train_fwd_us = timer.kernel_us(calls.train_fwd)
    return {"fwd_us": fwd_us, "bwd_us": fwd_bwd_us - fwd_us, "train_fwd_us": train_fwd_us,
            "bwd_only_us": fwd_bwd_us - train_fwd_us,
            "fwd_eager_us": timer.eager_us(calls.fwd), "fwdbwd_eager_us": timer.eager_us(calls.fwd_bwd)}


def _derived(row: dict, m: int, n: int, ceiling: float, fused: bool, x_size: int = 2) -> dict:
    fwd_bytes, bwd_bytes = norm_bytes(m, n, x_size, x_size, fused=fused)
    out = {"fwd_GBps": fwd_bytes / row["fwd_us"] / 1e3 if row["fwd_us"] > 0 else None,
           "bwd_GBps": bwd_bytes / row["bwd_us"] / 1e3 if row["bwd_us"] > 0 else None}
    out["fwd_frac_copy"] = out["fwd_GBps"] / ceiling if out["fwd_GBps"] else None
    out["bwd_frac_copy"] = out["bwd_GBps"] / ceiling if out["bwd_GBps"] else None
    return out


def _peak_mb(device: torch.device, fn: Callable, x, w, dy, r) -> float | None:
    if device.type != "cuda":
        return None
    xg, wg, rg = (t.clone().requires_grad_(True) for t in (x, w, r))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(fn(xg, wg, rg), (xg, wg, rg), dy, allow_unused=True)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def ratios(rows: list[dict]) -> None:
    """Each row's speed-up over the best anchor at its shape: best anchor time / own time (> 1: faster).
    Anchors are the providers not named strictnorm, the A/A control and the bytes-only reference excluded.
    Where the bytes-only reference ran, each row's time over its time too (1.0: as fast as moving the bytes)."""
    for key in ("fwd_us", "bwd_us"):
        best: dict[tuple, float] = {}
        floor: dict[tuple, float] = {}
        for r in rows:
            if r.get(key, 0) <= 0:
                continue
            k = (r["M"], r["N"])
            if r["provider"] == BYTES_ONLY:
                floor[k] = r[key]
            elif not r["provider"].startswith("strictnorm") and r["provider"] != AA_CONTROL:
                best[k] = min(best.get(k, float("inf")), r[key])
        for r in rows:
            k = (r["M"], r["N"])
            if k in best and r.get(key, 0) > 0:
                r[f"{key[:3]}_speedup_vs_best_anchor"] = best[k] / r[key]
            if k in floor and r.get(key, 0) > 0:
                r[f"{key[:3]}_over_bytes_only"] = r[key] / floor[k]


def aa_spread(rows: list[dict]) -> dict[str, float]:
    """Largest relative difference between the A/A control and its twin, per figure: the run's noise."""
    out = {}
    for key in ("fwd_us", "bwd_us", "fwd_eager_us", "fwdbwd_eager_us"):
        diffs = []
        for a in rows:
            if a["provider"] != AA_CONTROL or key not in a:
                continue
            for b in rows:
                if b["provider"] == "torch F.rms_norm" and (b["M"], b["N"]) == (a["M"], a["N"]) and b.get(key):
                    diffs.append(abs(a[key] - b[key]) / b[key])
        if diffs:
            out[key] = max(diffs)
    return out


def host_cost_us(device: torch.device, providers: dict[str, Callable], n_calls: int = 2000) -> dict[str, float]:
    """Host time of one eager forward call on a tiny input (no synchronization inside the loop)."""
    x = torch.randn(4, 4096, device=device).bfloat16()
    w = torch.ones(4096, device=device).bfloat16()
    out = {}
    for name, fn in providers.items():
        if name == AA_CONTROL:
            continue
        try:
            for _ in range(50):
                fn(x, w, None)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_calls):
                fn(x, w, None)
            out[name] = (time.perf_counter() - t0) / n_calls * 1e6
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"[:200]
    return out


def bench_fold(timer: Timer, shapes, ceiling: float, log, rows: list[dict]) -> None:
    for m, n in shapes:
        row = _fold_one(timer, m, n, ceiling)
        rows.append(row)
        log(row)


def _fold_one(timer: Timer, m: int, n: int, ceiling: float) -> dict:
    from .backends.registry import get_backend, status

    g = torch.Generator(device="cuda").manual_seed(m + n)
    c = torch.randn(m, n, device="cuda", generator=g)
    # the bytes floor: the fp32 rows read once at the copy ceiling's rate (bytes read plus written a second: a read
    # stream moves as many); runs 1-20 counted reads at half that rate, a floor twice too high where bytes rule
    row = {"M": m, "N": n, "bytes_floor_us": m * n * 4 / ceiling / 1e3,
           "chain_floor_us": m * CHAIN_NS_PER_ROW / 1e3}

    def loop():
        acc = torch.zeros(n, device="cuda")
        for r in c:
            acc = acc + r
        return acc

    ref = None
    if m <= 16384:  # the Python loop the strict fold replaces: one launch per row
        ref = loop()
        t0 = time.perf_counter()
        loop()
        torch.cuda.synchronize()
        row["python_loop_us"] = (time.perf_counter() - t0) * 1e6
    tb = get_backend("triton")
    variants = {"triton_fold": lambda: _triton_fold(tb, c)}
    if status("cuda", c.device).available:
        cb = get_backend("cuda")
        variants["cuda_one_thread_per_column"] = lambda: cb.left_fold(c, ring=False)
        variants["strictnorm_cuda_fold"] = lambda: cb.left_fold(c)
    for name, fn in variants.items():
        try:
            out = fn()
            if ref is not None:
                row[f"{name}_bitwise"] = bool(torch.equal(out.view(torch.int32), ref.view(torch.int32)))
            row[f"{name}_us"] = timer.kernel_us(fn)
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    if "strictnorm_cuda_fold_us" in row:
        row["fold_over_floor"] = row["strictnorm_cuda_fold_us"] / max(row["bytes_floor_us"], row["chain_floor_us"])
    return row


def _triton_fold(tb, c):
    old = tb.use_cuda_fold
    tb.use_cuda_fold = False
    try:
        return tb.left_fold(c)
    finally:
        tb.use_cuda_fold = old


def print_tables(result: dict, out=sys.stdout) -> None:
    dev = result["env"].get("gpu") or "cpu (wall-clock timings)"
    print(f"\ncopy ceiling {result['copy_GBps']:.0f} GB/s  ({dev})", file=out)
    nan = float("nan")
    if result.get("norm"):
        print(f"\n{'provider':22s} {'M x N':>13s} {'fwd us':>9s} {'%copy':>6s} {'bwd us':>9s} {'%copy':>6s}"
              f" {'fwd x':>6s} {'bwd x':>6s} {'f/byte':>6s} {'b/byte':>6s} {'eager f':>9s} {'eager fb':>9s}", file=out)
        for r in result["norm"]:
            if "error" in r:
                print(f"{r['provider']:22s} {r['M']:>6d}x{r['N']:<6d} ERROR {r['error'][:70]}", file=out)
                continue
            print(f"{r['provider']:22s} {r['M']:>6d}x{r['N']:<6d} {r['fwd_us']:9.1f}"
                  f" {100 * (r['fwd_frac_copy'] or 0):5.0f}% {r['bwd_us']:9.1f} {100 * (r['bwd_frac_copy'] or 0):5.0f}%"
                  f" {r.get('fwd_speedup_vs_best_anchor', nan):6.2f} {r.get('bwd_speedup_vs_best_anchor', nan):6.2f}"
                  f" {r.get('fwd_over_bytes_only', nan):6.2f} {r.get('bwd_over_bytes_only', nan):6.2f}"
                  f" {r['fwd_eager_us']:9.1f} {r['fwdbwd_eager_us']:9.1f}", file=out)
        print("(fwd x / bwd x: best anchor's time over this provider's; > 1 is faster. f/byte, b/byte: this"
              f" provider's time over '{BYTES_ONLY}''s, the same bytes moved by a copy and an add)", file=out)
    if result.get("aa_spread"):
        print("A/A control, largest relative difference: "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in result["aa_spread"].items()), file=out)
    if result.get("skipped_anchors"):
        print("skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped_anchors"].items()), file=out)
    if result.get("host_us"):
        print("host us per eager forward call: " + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in result["host_us"].items()), file=out)
    if result.get("fold"):
        print(f"\n{'rows x cols':>13s} {'loop us':>9s} {'1thr/col':>9s} {'triton':>9s} {'strictnorm':>10s}"
              f" {'floor':>7s} {'x floor':>7s} bitwise", file=out)
        for r in result["fold"]:
            floor = max(r["bytes_floor_us"], r["chain_floor_us"])
            bw = all(v for k, v in r.items() if k.endswith("_bitwise"))
            print(f"{r['M']:>6d}x{r['N']:<6d} {r.get('python_loop_us', nan):9.0f}"
                  f" {r.get('cuda_one_thread_per_column_us', nan):9.1f} {r.get('triton_fold_us', nan):9.1f}"
                  f" {r.get('strictnorm_cuda_fold_us', nan):10.1f}"
                  f" {floor:7.1f} {r.get('fold_over_floor', nan):7.2f} {bw}", file=out)


def write_csv(result: dict, path: str) -> None:
    """One line per (section, shape, provider) with every numeric figure as a column."""
    rows = [dict(section="norm", **r) for r in result.get("norm", [])]
    rows += [dict(section="fold", provider="fold", **r) for r in result.get("fold", [])]
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def write_plot(result: dict, path: str) -> None:
    """GB/s per provider and shape, forward and backward, against the copy ceiling (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.get("norm", []) if "error" not in r and r["provider"] != AA_CONTROL]
    shapes = list(dict.fromkeys((r["M"], r["N"]) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, key, title in ((axes[0], "fwd_GBps", "forward"), (axes[1], "bwd_GBps", "backward (dx + dW)")):
        width = 0.8 / max(1, len(providers))
        for i, prov in enumerate(providers):
            vals = [next((r[key] or 0 for r in rows if r["provider"] == prov and (r["M"], r["N"]) == s), 0)
                    for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=prov)
        ax.axhline(result["copy_GBps"], color="k", linestyle="--", linewidth=1, label="copy ceiling")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"{m}x{n}" for m, n in shapes], rotation=30, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("GB/s (counted bytes)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"strictnorm bench, {result['env'].get('gpu') or 'cpu'}, {result['env']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(result: dict, path: str) -> None:
    """The tables of a run as markdown, for bench/results/ and the README to link to."""
    env = result["env"]
    lines = [f"# strictnorm bench, {env.get('gpu') or 'cpu (wall-clock timings)'}, {env['date']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in env.items() if v and k not in ("date", "gpu")), "",
             f"Copy ceiling measured in the same run: {result['copy_GBps']:.0f} GB/s. L2 emptied before each timed"
             f" call by {'reading' if result.get('flush') == 'read' else 'writing'} a 256 MB buffer.", ""]
    if result.get("norm"):
        lines += ["| provider | M × N | fwd µs | fwd % copy | bwd µs | bwd % copy | fwd vs best anchor |"
                  " bwd vs best anchor | fwd / bytes only | bwd / bytes only | eager fwd µs | eager fwd+bwd µs |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["norm"]:
            if "error" in r:
                lines.append(f"| {r['provider']} | {r['M']} × {r['N']} | error: {r['error'][:80]} |")
                continue
            lines.append(
                f"| {r['provider']} | {r['M']} × {r['N']} | {r['fwd_us']:.1f} | {100 * (r['fwd_frac_copy'] or 0):.0f}%"
                f" | {r['bwd_us']:.1f} | {100 * (r['bwd_frac_copy'] or 0):.0f}%"
                f" | {r.get('fwd_speedup_vs_best_anchor', float('nan')):.2f}×"
                f" | {r.get('bwd_speedup_vs_best_anchor', float('nan')):.2f}×"
                f" | {r.get('fwd_over_bytes_only', float('nan')):.2f}"
                f" | {r.get('bwd_over_bytes_only', float('nan')):.2f}"
                f" | {r['fwd_eager_us']:.1f} | {r['fwdbwd_eager_us']:.1f} |")
        lines += ["", f"'{BYTES_ONLY}': the same bytes moved by PyTorch's copy (forward) and add (backward) kernels,"
                  " no norm: the run's reference for what moving them takes at each shape.", ""]
    if result.get("aa_spread"):
        lines += ["A/A control (the same provider twice), largest relative difference: "
                  + ", ".join(f"{k} {100 * v:.1f}%" for k, v in result["aa_spread"].items()), ""]
    if result.get("fold"):
        lines += ["| rows × cols | Python loop µs | one thread per column µs | Triton fold µs | strictnorm µs |"
                  " floor µs | × floor | bitwise |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in result["fold"]:
            floor = max(r["bytes_floor_us"], r["chain_floor_us"])
            bw = all(v for k, v in r.items() if k.endswith("_bitwise"))
            cells = [r.get(k) for k in ("python_loop_us", "cuda_one_thread_per_column_us", "triton_fold_us",
                                        "strictnorm_cuda_fold_us")]
            text = " | ".join("–" if c is None else f"{c:.1f}" for c in cells)
            lines.append(f"| {r['M']} × {r['N']} | {text} | {floor:.1f} | {r.get('fold_over_floor', float('nan')):.2f}"
                         f" | {'yes' if bw else 'NO'} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"128x4096,2048x4096" -> [(128, 4096), (2048, 4096)]."""
    out = []
    for part in text.split(","):
        m, n = part.lower().split("x")
        out.append((int(m), int(n)))
    return out


PRESETS = {
    "perf": NORM_SHAPES,  # the PERF.md grid
    "llama": [(4096, 4096), (4096, 8192)],  # Llama-3 8B / 70B hidden sizes, 4096 tokens
    "qknorm": [(4096 * 32, 128), (4096 * 16, 256)],  # Qwen3 (head_dim 128) / Gemma 3 (256) q-norm rows
    "quick": [(64, 512), (256, 1000)],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strictnorm bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default="perf", help="shapes for the norm section")
    p.add_argument("--op", choices=OPS, default="rms_norm",
                   help="the norm section's op: RMSNorm, residual add + RMSNorm, or QK-norm with per-head weights")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="dtype of x, weight and dy")
    p.add_argument("--mode", choices=MODES, default="llama", help="strictnorm's casting mode (gemma: offset 1.0)")
    p.add_argument("--shapes", help="MxN list instead of the preset, e.g. 128x4096,2048x4096")
    p.add_argument("--only", help="comma-separated name parts: time only the providers whose names contain one")
    p.add_argument("--fold", action="store_true", help="also the strict-fold section (GPU)")
    p.add_argument("--no-norm", action="store_true", help="skip the norm section")
    p.add_argument("--rounds", type=int, default=3, help="rounds per shape, providers shuffled each round")
    p.add_argument("--iters", type=int, default=9, help="timed iterations per measurement (median)")
    p.add_argument("--compile", action="store_true", help="include the torch.compile anchor (slow to build)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--flush", choices=FLUSH_MODES, default=None,
                   help="how the L2 is emptied before each timed call (default: STRICTNORM_BENCH_FLUSH, else write, "
                        "as PERF.md's anchors)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--csv", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="PNG of GB/s per provider (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="the tables as markdown")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result: dict = {"env": environment(), "method": __doc__, "device": device.type}
    if device.type == "cpu":
        result["note"] = "CPU run: wall-clock timings of the reference backend and torch anchors, not GPU figures"
    print(json.dumps(result["env"]), file=sys.stderr, flush=True)

    def save(row=None):
        if row is not None:
            print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    timer = Timer(device, args.iters, args.flush)
    result["flush"] = timer.flush_mode
    result["copy_GBps"] = copy_ceiling_gbps(device)
    if not args.no_norm:
        shapes = parse_shapes(args.shapes) if args.shapes else PRESETS[args.preset]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        providers, result["skipped_anchors"] = norm_providers(device, args.compile, args.op, args.mode)
        if args.only:
            parts = [q.strip() for q in args.only.split(",") if q.strip()]
            providers = {k: f for k, f in providers.items() if any(q in k for q in parts)}
            result["only"] = parts
        result["norm"] = []
        result["case"] = {"op": args.op, "dtype": args.dtype, "mode": args.mode}
        bench_norm(timer, shapes, result["copy_GBps"], providers, args.rounds, save, result["norm"], op=args.op,
                   dtype=dtype)
        result["aa_spread"] = aa_spread(result["norm"])
        result["host_us"] = host_cost_us(device, {k: f for k, f in norm_providers(device, False)[0].items()
                                                  if not args.only or k in providers})
    if args.fold:
        if device.type != "cuda":
            result["fold_skipped"] = "the fold section times GPU kernels"
        else:
            result["fold"] = []
            bench_fold(timer, FOLD_SHAPES, result["copy_GBps"], save, result["fold"])
    save()
    if args.csv:
        write_csv(result, args.csv)
    if args.markdown:
        write_markdown(result, args.markdown)
    if args.plot:
        try:
            write_plot(result, args.plot)
        except ImportError as e:
            print(f"no plot: {e} (pip install 'strictnorm[bench]')", file=sys.stderr)
    print_tables(result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
