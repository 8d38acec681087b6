"""Tuning sweep for the strict left fold's ring (kernels/fold.cu): columns per CTA, rows per stage and the
consumer's whole-stage unroll, the ring's shared memory (past 48 KB: opted into), on plain fp32 rows and on
the RMSNorm strict dW (bf16 dy and x), whose contributions may be stored column-major; fold_chain
(chain_rows: items spread over every SM, the sums handed from item to item); and fold_stream (stream: converting
warps load rows into registers and hand fp32 addends to the folding warps).
SWEEP_FOLD_CASES=text,... limits the cases to names containing one; SWEEP_FOLD_KNOBS=chain (or stream, smem,
ring, wide, base, or several: base,stream) limits the configurations to fold_chain's, fold_stream's, the rings past
48 KB / column-major, the 48 KB rings, the rings of 32 columns past 48 KB, or the default ring (FoldTuning()); the
default (no FoldTuning) is always timed, and every other configuration checked against it.
SWEEP_FOLD_PLAIN / SWEEP_FOLD_DW=MxN,... replace the shapes; SWEEP_FOLD_RING, SWEEP_FOLD_CHAIN and SWEEP_FOLD_STREAM
the configurations (below).

Any configuration must give the same bits (the order is the rows' order): each is checked against the
default configuration, and the plain folds up to 16384 rows against the Python loop. Kernel-only time as
in strictnorm.bench. Run on the GPU machine:
    python3 bench/sweep_fold.py [out.json]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from strictnorm.backends.cuda.backend import FoldTuning
from strictnorm.backends.layout import row_layout
from strictnorm.backends.registry import get_backend
from strictnorm.bench import CHAIN_NS_PER_ROW, Timer, copy_ceiling_gbps

TUNINGS = [None, FoldTuning()] + [FoldTuning(cols=c, rows_per_stage=r, full_stage=f)
                    for c in (8, 16, 32) for r in (64, 128, 256) for f in (False, True)]
# bigger rings (more stages in flight; the dW fold converting stages of 256 or 512 rows)
TUNINGS += [FoldTuning(cols=c, rows_per_stage=r, smem_bytes=kb * 1024, column_major=cm)
            for c in (8, 16) for r in (128, 256, 512) for kb in (48, 96, 200) for cm in (False, True)
            if (kb, cm) != (48, False)]
# wide rings: a warp's 32 columns (64 bytes of every bf16 row), many stages in flight
TUNINGS += [FoldTuning(cols=32, rows_per_stage=r, smem_bytes=kb * 1024, column_major=cm)
            for r in (64, 128, 256) for kb in (96, 200) for cm in (False, True)]
# fold_chain: items of chain_rows rows x cols columns spread over every SM
TUNINGS += [FoldTuning(cols=c, chain_rows=r, smem_bytes=200 * 1024) for c in (4, 8, 16) for r in (512, 1024, 2048, 4096)
            if c * (r + 4) * 4 + 16 <= 200 * 1024]
# fold_stream: converter warps loading rows into registers (the planner's own choice, then columns x rows a stage,
# then fewer or more converting warps)
TUNINGS += [FoldTuning(stream=True)] + [FoldTuning(stream=True, cols=c, rows_per_stage=r)
                                        for c, r in ((8, 64), (8, 128), (16, 32), (16, 64), (16, 128), (32, 32),
                                                     (32, 64), (64, 16), (64, 32), (128, 16))]
TUNINGS += [FoldTuning(stream=True, cols=c, rows_per_stage=r, convert_warps=v)
            for c, r in ((16, 64), (32, 64), (64, 32)) for v in (4, 12, 16)]
# the addend buffers padded after each group of 8 columns (the converters' stores free of bank conflicts)
TUNINGS += [FoldTuning(stream=True, cols=c, rows_per_stage=r, convert_warps=v, pad_groups=True)
            for c, r, v in ((32, 64, 8), (32, 64, 4), (16, 64, 4), (16, 64, 8), (64, 32, 8))]
# SWEEP_FOLD_STREAM=cols:rows:convert_warps:buffers[:pad[:isolate[:prefetch]]],... replaces the fold_stream
# configurations (0: the planner's; pad 1: pad_groups; isolate 1: the consumers alone on their sub-partitions;
# prefetch 1: the converters' next stage loaded before the current one is stored)
if os.environ.get("SWEEP_FOLD_STREAM"):
    TUNINGS = [t for t in TUNINGS if t is None or not t.stream] + [
        FoldTuning(stream=True, **dict(zip(("cols", "rows_per_stage", "convert_warps", "buffers", "pad_groups",
                                            "isolate", "prefetch"),
                                           map(int, v.split(":")), strict=False)))
        for v in os.environ["SWEEP_FOLD_STREAM"].split(",")]
# SWEEP_FOLD_RING=cols:rows_per_stage:kb,... replaces the ring configurations other than FoldTuning() (kb: the ring's
# shared memory in KB; past 48 opted into; knobs "ring" and "smem" select them as their sizes say)
if os.environ.get("SWEEP_FOLD_RING"):
    TUNINGS = [t for t in TUNINGS if t is None or t == FoldTuning() or t.chain_rows or t.stream] + [
        FoldTuning(cols=int(c), rows_per_stage=int(r), smem_bytes=int(kb) * 1024)
        for c, r, kb in (v.split(":") for v in os.environ["SWEEP_FOLD_RING"].split(","))]
# SWEEP_FOLD_CHAIN=cols:chain_rows,... replaces the fold_chain configurations
if os.environ.get("SWEEP_FOLD_CHAIN"):
    TUNINGS = [t for t in TUNINGS if t is None or not t.chain_rows] + [
        FoldTuning(cols=int(c), chain_rows=int(r), smem_bytes=200 * 1024)
        for c, r in (v.split(":") for v in os.environ["SWEEP_FOLD_CHAIN"].split(","))]
PLAIN = [(16384, 128), (262144, 128), (4096, 4096), (1024, 8192)]
STRICT_DW = [(262144, 128), (32768, 4096)]  # rows x N of bf16 dy and x; llama contributions


def _shapes(var: str, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """SWEEP_FOLD_PLAIN / SWEEP_FOLD_DW=MxN,MxN replace the shape lists."""
    text = os.environ.get(var)
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")] if text else default


PLAIN, STRICT_DW = _shapes("SWEEP_FOLD_PLAIN", PLAIN), _shapes("SWEEP_FOLD_DW", STRICT_DW)


def _cases(dev: torch.device):
    g = torch.Generator(device=dev).manual_seed(0)
    cb = get_backend("cuda")
    for m, n in PLAIN:
        c = torch.randn(m, n, device=dev, generator=g)
        ref = None
        if m <= 16384:
            ref = torch.zeros(n, device=dev)
            for r in c:
                ref = ref + r
        yield f"fold {m}x{n}", m, n, (lambda c=c: cb.left_fold(c)), ref
    for m, n in STRICT_DW:
        dy = torch.randn(m, n, device=dev, generator=g).bfloat16()
        x = torch.randn(m, n, device=dev, generator=g).bfloat16()
        rstd = torch.rand(m, device=dev, generator=g) + 0.5
        (dk, dlay), (xk, xlay) = row_layout(dy), row_layout(x)
        yield f"strict dW {m}x{n}", m, n, (lambda dk=dk, dlay=dlay, xk=xk, xlay=xlay, rstd=rstd:
                                           cb.fold(dk, dlay, xk, xlay, rstd, 1, 1)), None


def _strict_backward(timer: Timer, name: str, m: int, n: int, timed: list[dict]) -> list[dict]:
    """SWEEP_FOLD_BACKWARD=1: the whole strict backward (dx pass, then the dW fold) of a strict dW case with the
    default fold and with the case's fastest fold_stream, timed queued (Timer.queued_us: the host ahead, as in a
    training step); its dx and dW checked against the default's."""
    from strictnorm.contract import make_spec

    cb = get_backend("cuda")
    dev = timer.device
    g = torch.Generator(device=dev).manual_seed(1)
    dy, x = (torch.randn(m, n, device=dev, generator=g).bfloat16() for _ in range(2))
    w = (torch.randn(n, device=dev, generator=g) * 0.5 + 1).bfloat16()
    rstd = torch.rand(m, device=dev, generator=g) + 0.5
    spec = make_spec(x.dtype, 1e-6, 0.0, "llama", x.dtype)
    bwd = lambda: cb.rms_norm_bwd(dy, x, w, rstd, None, spec, "strict", True, None)  # noqa: E731
    streams = [r for r in timed if r.get("stream") and "us" in r]
    best = min(streams, key=lambda r: r["us"]) if streams else None
    out, want = [], None
    for tuning in [None] + ([FoldTuning(**{k: best[k] for k in FoldTuning.__dataclass_fields__})] if best else []):
        cb.fold_tuning = tuning
        got = bwd()
        want = want or got
        out.append({"case": f"strict backward {m}x{n}", "M": m, "N": n, "fold": "default" if tuning is None else
                    dataclasses.asdict(tuning), "queued_us": timer.queued_us(bwd),
                    "bitwise_vs_default": all(torch.equal(p.view(torch.int16), q.view(torch.int16))
                                              for p, q in zip(got, want, strict=True))})
        print(json.dumps(out[-1]), flush=True)
    cb.fold_tuning = None
    return out


def main() -> None:
    dev = torch.device("cuda")
    timer = Timer(dev, iters=9)
    ceiling = copy_ceiling_gbps(dev)
    cb = get_backend("cuda")
    rows = []
    only = [t for t in os.environ.get("SWEEP_FOLD_CASES", "").split(",") if t]
    knobs = os.environ.get("SWEEP_FOLD_KNOBS", "")
    ring = lambda t: not t.chain_rows and not t.stream  # noqa: E731
    kinds = {"base": lambda t: t == FoldTuning(), "chain": lambda t: t.chain_rows > 0, "stream": lambda t: t.stream,
             "smem": lambda t: ring(t) and (t.smem_bytes > 48 * 1024 or t.column_major),
             "ring": lambda t: ring(t) and t.smem_bytes <= 48 * 1024 and not t.column_major,
             "wide": lambda t: ring(t) and t.cols == 32 and t.smem_bytes > 48 * 1024}
    # "base": the default ring (FoldTuning()), e.g. "base,stream": the default against the ring and fold_stream's
    tunings = [None] + list(dict.fromkeys(t for t in TUNINGS[1:]
                                          if not knobs or any(kinds[k](t) for k in knobs.split(","))))
    for name, m, n, fn, ref in _cases(dev):
        if only and not any(t in name for t in only):
            continue
        cb.fold_tuning = None
        base = fn()
        chain_us = m * CHAIN_NS_PER_ROW / 1e3
        for tu in tunings:
            cb.fold_tuning = tu
            row = {"case": name, "M": m, "N": n, **(dataclasses.asdict(tu) if tu else {"default": True})}
            try:
                out = fn()
                row["bitwise_vs_default"] = bool(torch.equal(out.view(torch.int32), base.view(torch.int32)))
                if ref is not None:
                    row["bitwise_vs_loop"] = bool(torch.equal(out.view(torch.int32), ref.view(torch.int32)))
                row["us"] = timer.kernel_us(fn)
                row["x_chain_floor"] = row["us"] / chain_us
            except Exception as e:  # e.g. a shape whose shared memory does not fit
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        cb.fold_tuning = None
        if name.startswith("strict dW") and os.environ.get("SWEEP_FOLD_BACKWARD"):
            rows.extend(_strict_backward(timer, name, m, n, [r for r in rows if r["case"] == name]))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": ceiling, "rows": rows}, f, indent=1)
    ok = all(r.get("bitwise_vs_default", False) and r.get("bitwise_vs_loop", True) for r in rows
             if "us" in r or "queued_us" in r)
    print(f"\ncopy ceiling {ceiling:.0f} GB/s; every timed configuration bitwise: {ok}")
    for r in rows:
        if "queued_us" in r:
            print(f"{r['case']:>24}: queued {r['queued_us']:8.1f} us, fold {r['fold']}")
    for name in dict.fromkeys(r["case"] for r in rows if "us" in r):
        timed = [r for r in rows if r["case"] == name and "us" in r]
        default = next(r for r in timed if r.get("default")) if any(r.get("default") for r in timed) else None
        best = min(timed, key=lambda r: r["us"]) if timed else None
        if best:
            knobs = {k: best[k] for k in ("cols", "rows_per_stage", "full_stage", "smem_bytes", "column_major",
                                          "chain_rows", "stream", "convert_warps", "buffers",
                                          "pad_groups", "isolate", "prefetch") if k in best}
            print(f"{name:>24}: default {default['us'] if default else float('nan'):8.1f} us, best {best['us']:8.1f}"
                  f" us ({best['x_chain_floor']:.2f}x chain floor) {knobs or 'default'}")


if __name__ == "__main__":
    main()
