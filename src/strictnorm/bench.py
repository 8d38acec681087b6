"""`strictnorm bench`: strictnorm and the anchors side by side, in one process and one run.

Two figures per provider and op: kernel-only time (the sum of the op's CUDA kernel durations from
torch.profiler, L2 flushed before each timed call, median over iterations; the method behind the
anchor figures in PERF.md) and eager time (triton.testing.do_bench: what a Python caller sees,
host cost included). Bytes are counted (forward: read x, write y; backward: read x, dy, write dx),
and the device-to-device copy bandwidth is measured in the same run as the ceiling.

Presets: `norm` (the PERF.md grid, bf16, llama casting), `fold` (the strict left fold on the seed's
shapes, against the Python loop and a one-thread-per-column kernel), `quick` (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from . import api

NORM_SHAPES = [(128, 4096), (2048, 4096), (8192, 4096), (32768, 4096), (8192, 8192), (2048, 18432), (262144, 128)]
FOLD_SHAPES = ([(r, 128) for r in (1, 16, 256, 1024, 4096, 16384, 65536, 262144)]
               + [(r, 4096) for r in (1, 64, 1024, 4096)] + [(1024, c) for c in (64, 512, 4096, 8192)])
CHAIN_NS_PER_ROW = 4 / 1.98  # one dependent fp32 add: 4 cycles at ~1.98 GHz


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
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["git_commit"] = None
    return env


class Timer:
    """Kernel-only time through torch.profiler, with the L2 flushed before every timed call."""

    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def kernel_us(self, fn: Callable[[], object]) -> float:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        per_iter = []
        for _ in range(self.iters):
            self.flush.zero_()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            per_iter.append(sum(e.device_time_total for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA))
        return statistics.median(per_iter)

    @staticmethod
    def eager_us(fn: Callable[[], object]) -> float:
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def copy_ceiling_gbps() -> float:
    from triton.testing import do_bench

    x = torch.empty(1024**3, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def norm_providers(compile_anchor: bool) -> tuple[dict[str, Callable], dict[str, str]]:
    """name -> f(x, w, eps) returning y; and name -> reason for each anchor that is missing."""
    eps = 1e-6
    providers: dict[str, Callable] = {
        "torch F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps),
    }
    skipped: dict[str, str] = {}
    if compile_anchor:
        def hf_llama(x, w):
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        compiled = torch.compile(hf_llama)
        providers["torch.compile"] = compiled
    else:
        skipped["torch.compile"] = "not requested (--compile)"
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        providers["Liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    except Exception as e:  # an anchor that is not installed is reported, not fatal
        skipped["Liger"] = repr(e)[:160]
    try:
        from quack.rmsnorm import rmsnorm as quack_rmsnorm

        providers["Quack"] = lambda x, w: quack_rmsnorm(x, w, eps=eps)
    except Exception as e:
        skipped["Quack"] = repr(e)[:160]
    providers["strictnorm fast"] = lambda x, w: api.rms_norm(x, w, eps, dw="fast", backend="triton")
    providers["strictnorm strict"] = lambda x, w: api.rms_norm(x, w, eps, dw="strict", backend="triton")
    return providers, skipped


def bench_norm(timer: Timer, shapes, ceiling: float, compile_anchor: bool, log, rows: list[dict]) -> dict:
    """Appends one row per (shape, provider) to rows as it goes; returns the anchors that are missing."""
    providers, skipped = norm_providers(compile_anchor)
    for m, n in shapes:
        for name, fn in providers.items():
            row = {"provider": name, "M": m, "N": n}
            try:
                row.update(_norm_one(timer, fn, m, n, ceiling))
            except Exception as e:  # a provider that raises is reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            log(row)
        torch.cuda.empty_cache()
    _ratios(rows)
    return skipped


def _norm_one(timer: Timer, fn: Callable, m: int, n: int, ceiling: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def fwd():
        return fn(x, w)

    def fwd_bwd():
        torch.autograd.grad(fn(xg, wg), (xg, wg), dy)

    row = {"fwd_us": timer.kernel_us(fwd)}
    row["bwd_us"] = timer.kernel_us(fwd_bwd) - row["fwd_us"]
    row["fwd_eager_us"] = timer.eager_us(fwd)
    row["fwdbwd_eager_us"] = timer.eager_us(fwd_bwd)
    fwd_bytes = 4 * m * n + 2 * n
    bwd_bytes = 6 * m * n + 4 * n + 4 * m
    row["fwd_GBps"] = fwd_bytes / row["fwd_us"] / 1e3
    row["bwd_GBps"] = bwd_bytes / row["bwd_us"] / 1e3 if row["bwd_us"] > 0 else None
    row["fwd_frac_copy"] = row["fwd_GBps"] / ceiling
    row["bwd_frac_copy"] = row["bwd_GBps"] / ceiling if row["bwd_GBps"] else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    row["peak_MB_fwdbwd"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def _ratios(rows: list[dict]) -> None:
    """Each row's speed-up over the best anchor at its shape (anchor time / own time; > 1 is faster)."""
    for key in ("fwd_us", "bwd_us"):
        best: dict[tuple, float] = {}
        for r in rows:
            if not r["provider"].startswith("strictnorm") and r.get(key, 0) > 0:
                k = (r["M"], r["N"])
                best[k] = min(best.get(k, float("inf")), r[key])
        for r in rows:
            k = (r["M"], r["N"])
            if k in best and r.get(key, 0) > 0:
                r[f"{key[:3]}_speedup_vs_best_anchor"] = best[k] / r[key]


def host_cost_us(n_calls: int = 2000) -> dict[str, float]:
    providers, _ = norm_providers(False)
    x = torch.randn(4, 4096, device="cuda").bfloat16()
    w = torch.ones(4096, device="cuda").bfloat16()
    out = {}
    for name, fn in providers.items():
        try:
            for _ in range(50):
                fn(x, w)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_calls):
                fn(x, w)
            out[name] = (time.perf_counter() - t0) / n_calls * 1e6
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
    row = {"M": m, "N": n, "bytes_floor_us": m * n * 4 / (ceiling / 2) / 1e3,
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


def _print_tables(result: dict) -> None:
    print(f"\ncopy ceiling {result['copy_GBps']:.0f} GB/s  ({result['env'].get('gpu')})")
    if result.get("norm"):
        print(f"\n{'provider':18s} {'M x N':>13s} {'fwd us':>8s} {'%copy':>6s} {'bwd us':>8s} {'%copy':>6s}"
              f" {'fwd x':>6s} {'bwd x':>6s} {'eager f':>8s} {'eager fb':>8s}")
        for r in result["norm"]:
            if "error" in r:
                print(f"{r['provider']:18s} {r['M']:>6d}x{r['N']:<6d} ERROR {r['error'][:70]}")
                continue
            print(f"{r['provider']:18s} {r['M']:>6d}x{r['N']:<6d} {r['fwd_us']:8.1f} {100 * r['fwd_frac_copy']:5.0f}%"
                  f" {r['bwd_us']:8.1f} {100 * (r['bwd_frac_copy'] or 0):5.0f}%"
                  f" {r.get('fwd_speedup_vs_best_anchor', 0):6.2f} {r.get('bwd_speedup_vs_best_anchor', 0):6.2f}"
                  f" {r['fwd_eager_us']:8.1f} {r['fwdbwd_eager_us']:8.1f}")
    if result.get("host_us"):
        print("\nhost us per eager forward call:",
              ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in result["host_us"].items()))
    if result.get("fold"):
        print(f"\n{'rows x cols':>13s} {'loop us':>9s} {'1thr/col':>9s} {'triton':>9s} {'strictnorm':>10s}"
              f" {'floor':>7s} {'x floor':>7s} bitwise")
        for r in result["fold"]:
            floor = max(r["bytes_floor_us"], r["chain_floor_us"])
            bw = all(v for k, v in r.items() if k.endswith("_bitwise"))
            nan = float("nan")
            print(f"{r['M']:>6d}x{r['N']:<6d} {r.get('python_loop_us', nan):9.0f}"
                  f" {r.get('cuda_one_thread_per_column_us', nan):9.1f} {r.get('triton_fold_us', nan):9.1f}"
                  f" {r.get('strictnorm_cuda_fold_us', nan):10.1f} {floor:7.1f} {r.get('fold_over_floor', nan):7.2f}"
                  f" {bw}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strictnorm bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("norm", "fold", "all", "quick"), default="all")
    p.add_argument("--iters", type=int, default=15, help="timed iterations per measurement (median)")
    p.add_argument("--compile", action="store_true", help="include the torch.compile anchor (slow to build)")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("strictnorm bench needs a CUDA GPU (kernel timings); nothing measured", file=sys.stderr)
        return 2
    result: dict = {"env": environment(), "method": __doc__}
    print(json.dumps(result["env"]), flush=True)

    def log(row):
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    timer = Timer(args.iters)
    result["copy_GBps"] = copy_ceiling_gbps()
    norm_shapes = [(128, 4096), (2048, 4096)] if args.preset == "quick" else NORM_SHAPES
    fold_shapes = [(1024, 128), (1024, 4096)] if args.preset == "quick" else FOLD_SHAPES
    if args.preset in ("norm", "all", "quick"):
        result["norm"] = []
        result["skipped_anchors"] = bench_norm(timer, norm_shapes, result["copy_GBps"], args.compile, log,
                                               result["norm"])
        result["host_us"] = host_cost_us()
    if args.preset in ("fold", "all", "quick"):
        result["fold"] = []
        bench_fold(timer, fold_shapes, result["copy_GBps"], log, result["fold"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _print_tables(result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
