"""What torch.compile makes of the HF-style RMSNorm at a shape: its kernels' names, launch shapes, registers and
kernel-only times, beside strictnorm's backends and Liger at the same shape, and the Triton source Inductor wrote.

PERF.md's anchors put torch.compile ahead of every other anchor at 128 x 4096 (forward 1.9 us, backward 4.7 on an
H200), a shape where strictnorm's forward trails Liger's. This probe shows where that time comes from: each provider's
kernels one by one (torch.profiler, L2 flushed before each call, median over the iterations, as strictnorm.bench),
with the grid and block the profiler recorded. The providers are strictnorm.bench's (torch.compile of its HF-style
module, static shapes, as PERF.md's anchor script compiles it: each shape its own kernels).

Run on the GPU machine: python3 bench/inductor_probe.py OUT_DIR [MxN ...] (default 128x4096 4096x128 65536x128).
Writes OUT_DIR/inductor-probe.json and the Triton sources Inductor generated, OUT_DIR/inductor-src.tar.xz.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

# Inductor's generated sources land here (read when torch.compile first runs), collected at the end
CACHE = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

import torch  # noqa: E402

from strictnorm.bench import Timer, environment, norm_providers  # noqa: E402

# strictnorm.bench's providers this probe takes apart (torch.compile of its HF-style module), under shorter names
PROVIDERS = {"torch.compile": "torch.compile", "strictnorm triton fast": "strictnorm triton",
             "strictnorm cuda fast": "strictnorm cuda", "Liger": "Liger"}


def kernels_of(fn, timer: Timer, trace_dir: str) -> list[dict]:
    """Each CUDA kernel of one call: name, grid, block, registers, median us over the timer's iterations."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    per: dict[int, list[float]] = {}
    info: list[dict] = []
    for i in range(timer.iters):
        timer.flush_l2()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        path = os.path.join(trace_dir, f"t{i}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
        events.sort(key=lambda e: e["ts"])
        for k, e in enumerate(events):
            per.setdefault(k, []).append(e["dur"])
            if i == 0:
                a = e.get("args", {})
                info.append({"name": e["name"][:120], "grid": a.get("grid"), "block": a.get("block"),
                             "registers": a.get("registers per thread"), "shared": a.get("shared memory")})
    for k, row in enumerate(info):
        row["us"] = statistics.median(per.get(k, [float("nan")]))
    return info


def main(argv: list[str]) -> int:
    out_dir = argv[0] if argv else "."
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in (argv[1:] or ["128x4096", "4096x128", "65536x128"])]
    os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda")
    timer = Timer(device, 15)
    available, skipped = norm_providers(device, compile_anchor=True)
    providers = {short: (lambda x, w, f=available[name]: f(x, w, None)) for name, short in PROVIDERS.items()
                 if name in available}
    result: dict = {"env": environment(), "rows": [], "skipped": skipped}
    trace_dir = tempfile.mkdtemp(prefix="traces-")
    for m, n in shapes:
        g = torch.Generator(device=device).manual_seed(m + n)
        x = torch.randn(m, n, device=device, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device=device, generator=g)).bfloat16()
        dy = torch.randn(m, n, device=device, generator=g).bfloat16()
        for name, fn in providers.items():
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

            def fwd(fn=fn, x=x, w=w):
                return fn(x, w)

            def step(fn=fn, xg=xg, wg=wg, dy=dy):
                torch.autograd.grad(fn(xg, wg), (xg, wg), dy)

            try:
                row = {"provider": name, "M": m, "N": n, "fwd": kernels_of(fwd, timer, trace_dir),
                       "fwd_us": timer.kernel_us(fwd), "step": kernels_of(step, timer, trace_dir),
                       "step_us": timer.kernel_us(step)}
            except Exception as e:  # a provider that raises is reported, not fatal
                row = {"provider": name, "M": m, "N": n, "error": f"{type(e).__name__}: {e}"[:300]}
            result["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    with open(os.path.join(out_dir, "inductor-probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    sources = glob.glob(os.path.join(CACHE, "**", "*.py"), recursive=True)
    if sources:
        subprocess.run(["tar", "-cJf", os.path.join(out_dir, "inductor-src.tar.xz"), "-C", CACHE,
                        *[os.path.relpath(s, CACHE) for s in sources]], check=False)
    print(f"\n{'provider':18s} {'M x N':>11s} {'fwd us':>7s} {'step us':>8s}  kernels (grid x block: us)")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['provider']:18s} {r['M']:>5d}x{r['N']:<5d} ERROR {r['error'][:80]}")
            continue
        for part in ("fwd", "step"):
            ks = "; ".join(f"{k['name'][:38]} {k['grid']}x{k['block']} r{k['registers']}: {k['us']:.2f}"
                           for k in r[part])
            head = f"{r['provider']:18s} {r['M']:>5d}x{r['N']:<5d}" if part == "fwd" else " " * 30
            print(f"{head} {part:4s} {r[part + '_us']:7.2f}  {ks}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
