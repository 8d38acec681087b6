"""Each kernel of a provider's forward + backward call on its own: name and median duration, the way the bench times
the whole (torch.profiler, L2 flushed before every call, warm-up calls first). The bench's backward figure is the
union of these intervals less the forward's; this says which kernel holds the time (the dx pass, the fast dW's
partial-row sum, a zero fill autograd adds, ...).

    python3 bench/kernel_split.py OUT.json [--shapes 128x4096,4096x128] [--only cuda,triton,Quack] [--iters 30]

--only keeps the providers whose name contains one of the words (the bench's provider names: "strictnorm cuda
fast", "Quack", ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from strictnorm.bench import Timer, _norm_inputs, environment, norm_providers, parse_shapes


def kernels_of_one_call(timer: Timer, fn) -> list[tuple[str, float, float]]:
    """(name, start us from the first kernel's start, duration us) of every GPU kernel of one call."""
    from torch.profiler import ProfilerActivity, profile

    timer.flush_l2()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    t0 = events[0][0] if events else 0.0
    return [(name, start - t0, end - start) for start, end, name in events]


def split(timer: Timer, fn, iters: int) -> list[dict]:
    """The median start and duration of each kernel of the call, in launch order (calls whose kernel list differs
    from the first are left out and counted)."""
    for _ in range(3):
        fn()
    runs = [kernels_of_one_call(timer, fn) for _ in range(iters)]
    names = [k[0] for k in runs[0]]
    same = [r for r in runs if [k[0] for k in r] == names]
    return [{"kernel": name[:90], "start_us": statistics.median(r[i][1] for r in same),
             "us": statistics.median(r[i][2] for r in same), "calls": len(same)}
            for i, name in enumerate(names)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="128x4096,4096x128,16384x128,262144x128,32768x4096")
    ap.add_argument("--only", default="strictnorm cuda fast,strictnorm triton fast,strictnorm cute fast,Quack")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    timer = Timer(dev, args.iters)
    providers, _ = norm_providers(dev, compile_anchor=False)
    words = [w.strip() for w in args.only.split(",")]
    chosen = {name: f for name, f in providers.items() if any(w in name for w in words)}
    result = {"environment": environment(), "rows": []}
    for m, n in parse_shapes(args.shapes):
        x, w, dy, r = _norm_inputs(dev, m, n)
        for name, f in chosen.items():
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

            def fwd_bwd(f=f, xg=xg, wg=wg, r=r, dy=dy):
                torch.autograd.grad(f(xg, wg, r), (xg, wg), dy)

            try:
                kernels = split(timer, fwd_bwd, args.iters)
            except Exception as e:  # a provider that fails is reported, not fatal
                print(f"{m}x{n} {name}: {type(e).__name__}: {e}"[:300], flush=True)
                continue
            result["rows"].append({"M": m, "N": n, "provider": name, "kernels": kernels})
            print(f"{m}x{n} {name}", flush=True)
            for k in kernels:
                print(f"    {k['start_us']:8.2f} +{k['us']:8.2f} us  {k['kernel']}", flush=True)
        del x, w, dy, r
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
