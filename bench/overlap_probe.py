"""The strict backward with its dW fold beside the dx pass (a side stream) against one after the other.

Both read every row of x and dy and neither needs the other's results, so they may run at once (the hope:
rows one reads still in L2 when the other reads them; run 8 saw little overlap, bench/NOTES.md). Per shape and
backend (cuda, triton): kernel-only time (strictnorm.bench's Timer: kernels side by side counted once) of
the strict backward in both settings, of the dx pass alone (need_dw=False) and of the fold alone; for cuda
also beside with the dx pass one block per row group ("rows grid": its persistent grid-stride blocks that
do not fit beside the fold's would start late with a whole share of rows each) and the one-pass strict
backward (kernels/onepass.cu, CudaBackend.onepass_strict); every dx and dW checked bitwise between the
settings. OVERLAP_SHAPES=MxN,... replaces the shapes;
OVERLAP_SWEEP=sweep.json (bench/sweep_fold.py's output) runs each shape's fold in the configuration that was
fastest there for the strict dW (the default where the sweep has no such case). Run on the GPU machine:
    python3 bench/overlap_probe.py [out.json]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from strictnorm.backends.cuda.backend import BWD_TABLE, FoldTuning, tuning_for
from strictnorm.backends.layout import row_layout
from strictnorm.backends.registry import get_backend
from strictnorm.bench import Timer, copy_ceiling_gbps
from strictnorm.contract import make_spec

SHAPES = [(32768, 4096), (16384, 4096), (8192, 4096), (2048, 4096), (8192, 8192), (2048, 18432), (262144, 128),
          (65536, 128), (16384, 128)]


def _shapes() -> list[tuple[int, int]]:
    text = os.environ.get("OVERLAP_SHAPES")
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")] if text else SHAPES


def best_tuning(m: int, n: int) -> FoldTuning | None:
    path = os.environ.get("OVERLAP_SWEEP")
    if not path:
        return None
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["case"] == f"strict dW {m}x{n}" and "us" in r
                and r["bitwise_vs_default"]]
    if not rows:
        return None
    best = min(rows, key=lambda r: r["us"])
    return None if best.get("default") else FoldTuning(**{k: best[k] for k in FoldTuning.__dataclass_fields__
                                                          if k in best})


def variant(timer: Timer, bwd, outs: dict, key: str, queued: bool = False, **settings) -> float:
    """Kernel-only us of bwd (queued: Timer.queued_us, the host ahead of the GPU) with these CudaBackend attributes
    set (restored after); its outputs in outs[key]."""
    cb = get_backend("cuda")
    saved = {k: getattr(cb, k) for k in settings}
    for k, v in settings.items():
        setattr(cb, k, v)
    try:
        outs[key] = bwd()
        return timer.queued_us(bwd) if queued else timer.kernel_us(bwd)
    finally:
        for k, v in saved.items():
            setattr(cb, k, v)


def measure(timer: Timer, m: int, n: int, ceiling: float, g: torch.Generator) -> list[dict]:
    dev = torch.device("cuda")
    cb = get_backend("cuda")
    x = torch.randn(m, n, device=dev, generator=g).bfloat16()
    dy = torch.randn(m, n, device=dev, generator=g).bfloat16()
    w = (torch.randn(n, device=dev, generator=g) * 0.5 + 1).bfloat16()
    rstd = torch.rand(m, device=dev, generator=g) + 0.5
    spec = make_spec(x.dtype, 1e-6, 0.0, "llama", x.dtype)
    rows = []
    for name in ("cuda", "triton"):
        b = get_backend(name)

        def bwd(need_dw: bool = True, b=b):
            return b.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", need_dw, None)

        row = {"m": m, "n": n, "backend": name, "floor_us": 6 * m * n / ceiling / 1e3}
        cb.fold_tuning = best_tuning(m, n)
        row["fold_tuning"] = str(cb.fold_tuning)
        outs = {}
        row["serial"] = variant(timer, bwd, outs, "serial", fold_beside_dx=False)
        row["beside"] = variant(timer, bwd, outs, "beside", fold_beside_dx=True)
        if name == "cuda":
            # the one-pass strict backward (kernels/onepass.cu), where it applies (this shape's plans only)
            cb._bwd_plans.clear()
            row["onepass"] = variant(timer, bwd, outs, "onepass", onepass_strict=True)
            if not any(p.onepass is not None for p in cb._bwd_plans.values()):
                del row["onepass"]
            # the dx pass one block per row group (no grid-stride share left for late blocks)
            row["beside_rows_grid"] = variant(timer, bwd, outs, "rows_grid", fold_beside_dx=True,
                                              bwd_tuning=dataclasses.replace(tuning_for(BWD_TABLE, n, m),
                                                                             persistent=False))
        row["same_bits"] = all(torch.equal(p.view(torch.int16), q.view(torch.int16))
                               for other in outs.values() for p, q in zip(outs["serial"], other, strict=True))
        row["dx_only"] = timer.kernel_us(lambda: bwd(False))
        if name == "cuda":
            row["fold_only"] = timer.kernel_us(
                lambda: cb.strict_dw(*row_layout(dy), *row_layout(x), rstd, "llama", w))
        cb.fold_tuning = None
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    dev = torch.device("cuda")
    timer = Timer(dev, iters=9)
    ceiling = copy_ceiling_gbps(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = [row for m, n in _shapes() for row in measure(timer, m, n, ceiling, g)]
    print(f"copy {ceiling:.0f} GB/s; kernel-only us, strict backward (dx + strict dW), bf16 llama")
    print(f"{'M x N':>14} {'backend':>7} {'floor':>7} {'serial':>8} {'beside':>8} {'rows grid':>9} "
          f"{'one pass':>8} {'dx only':>8} {'fold':>8} bits")
    nan = float("nan")
    for r in rows_out:
        print(f"{r['m']:>7} x {r['n']:<5} {r['backend']:>7} {r['floor_us']:7.1f} {r['serial']:8.1f} "
              f"{r['beside']:8.1f} {r.get('beside_rows_grid', nan):9.1f} {r.get('onepass', nan):8.1f} "
              f"{r['dx_only']:8.1f} {r.get('fold_only', nan):8.1f} {'same' if r['same_bits'] else 'DIFFER'}")
    save_rows(ceiling, rows_out)


def save_rows(ceiling: float, rows: list[dict]) -> None:
    """The run's rows and copy ceiling as JSON, to the path given as the first argument (if any)."""
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
