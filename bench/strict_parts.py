"""Where the CUDA strict backward's time goes: its parts timed alone and together (STRICT_TIMER, below).

For each shape (SWEEP_SHAPES, default the PERF.md ones with a strict bound far off): the dx pass alone (no dW), the
strict dW fold alone (from dy, x and rstd), the strict backward with the fold beside the dx pass (a side stream) and
after it (the default; beside: with the backend's default share of the SMs, CudaBackend.fold_sms), and the fast
backward; then one strict backward's kernels (start offset and duration) at the first shape, with the fold beside, to
show how much the two overlap.

With STRICT_FOLD_SMS, the fold beside with the SMs shared out (CudaBackend.fold_sms: the fold's grid for that many SMs,
the dx pass's for the rest; 0: both on every SM), for each fold of STRICT_RINGS (ring labels: r32x64s100 is 32 columns
a CTA, 64 rows a stage, 100 KB of shared memory, a trailing m the contributions stored column-major, r0 the default
fold; the ring's grid is its column stripes: at 4096 columns 512 stripes of 8 on every SM, 128 of 32 where it is sized
for 32-128 SMs) and fold_chain in items of each of STRICT_CHAIN_ROWS rows x STRICT_CHAIN_COLS columns, the fold alone
timed once for each. STRICT_BACKENDS=triton,cute adds those backends' strict backward with the fold after their
dx pass, beside it, and beside it with their share of the SMs (share_sms_with_fold). Every strict dW is checked
against the default fold's bits. Run on the GPU machine:
    python3 bench/strict_parts.py [out.json]
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

import torch
from sweep_cuda import Case, Sweep, shapes_from_env

from strictnorm.backends.cuda.backend import FoldTuning
from strictnorm.backends.layout import row_layout
from strictnorm.bench import HOLD_CYCLES

SHAPES = shapes_from_env([(32768, 4096), (8192, 8192), (2048, 18432), (262144, 128)])


def _ints(name: str, default: str) -> list[int]:
    return [int(v) for v in os.environ.get(name, default).split(",") if v]


FOLD_SMS = _ints("STRICT_FOLD_SMS", "")
CHAIN_ROWS = _ints("STRICT_CHAIN_ROWS", "0")
CHAIN_COLS = int(os.environ.get("STRICT_CHAIN_COLS", "32"))
# the rings by label (see the module's docstring; 0 in a field: the ring's own choice, e.g. r0x32 is its columns with
# 32 rows a stage; more shared memory than the 48 KB needing no opt-in lets more stages convert in flight)
RINGS = [v for v in os.environ.get("STRICT_RINGS", "r0").split(",") if v]
# kernel (the default): the union of the kernels' intervals (Timer.kernel_us), where the host's time between the
# fold's launch and the dx pass's is not GPU time but the two kernels overlap only as far as it lets them; queued:
# events around the call with the host's launches ahead of the GPU (Timer.queued_us), the overlap of a busy step
TIMER = os.environ.get("STRICT_TIMER", "kernel")
OTHER_BACKENDS = [v for v in os.environ.get("STRICT_BACKENDS", "").split(",") if v]


def _time(sw: Sweep, fn) -> float:
    """STRICT_TIMER's measure of fn."""
    return sw.timer.queued_us(fn) if TIMER == "queued" else sw.timer.kernel_us(fn)


def _fold_tunings(optin: int) -> list[tuple[str, FoldTuning | None]]:
    """(label, the fold's tuning): the ring of each of RINGS (r0: the default fold, None), then fold_chain at each of
    CHAIN_ROWS (0: none)."""
    out = []
    for cols, rows, kb, column_major in map(_ring_of, RINGS):
        smem = min(kb * 1024, optin) if kb else FoldTuning().smem_bytes
        label = f"r{cols}" + (f"x{rows}" if rows else "") + (f"s{smem // 1024}" if kb else "") + "m" * column_major
        out.append((label, FoldTuning(cols=cols, rows_per_stage=rows, smem_bytes=smem, column_major=column_major)
                    if cols or rows or kb or column_major else None))
    return out + [(f"c{chain}", FoldTuning(cols=CHAIN_COLS, chain_rows=chain, smem_bytes=optin))
                  for chain in CHAIN_ROWS if chain]


def _ring_of(label: str) -> tuple[int, int, int, bool]:
    """(columns, rows a stage, KB, column-major) of a ring's label: r32, r32x64, r0x32s100, r32x32m, ..."""
    m = re.fullmatch(r"r(\d+)(?:x(\d+))?(?:s(\d+))?(m?)", label)
    if m is None:
        raise ValueError(f"STRICT_RINGS: {label!r} is not a ring's label (r<columns>[x<rows>][s<KB>][m])")
    return int(m[1]), int(m[2] or 0), int(m[3] or 0), m[4] == "m"


def _parts(sw: Sweep, case: Case) -> dict:
    b, c = sw.backend, case
    strict = lambda: b.rms_norm_bwd(c.dy, c.x, c.w, c.rstd, None, c.spec, "strict", True, None)  # noqa: E731
    fold = lambda: b.strict_dw(*row_layout(c.dy), *row_layout(c.x), c.rstd, "llama", c.w)[0]  # noqa: E731
    want = fold()
    row = {"dx_only": lambda: b.rms_norm_bwd(c.dy, c.x, c.w, c.rstd, None, c.spec, "strict", False, None),
           "fold_only": fold,
           "fast": lambda: b.rms_norm_bwd(c.dy, c.x, c.w, c.rstd, None, c.spec, "fast", True, None)}
    out = {}
    for name, fn in row.items():
        out[name] = _time(sw, fn)
    for beside in (True, False):
        b.fold_beside_dx = beside
        out["strict_beside" if beside else "strict_after"] = _time(sw, strict)
        out["bitwise_beside" if beside else "bitwise_after"] = bool(torch.equal(strict()[1], want))
    out["shared"] = []
    optin = torch.cuda.get_device_properties(sw.timer.device).shared_memory_per_block_optin
    for label, tuning in _fold_tunings(optin) if FOLD_SMS else ():
        b.fold_tuning, b.fold_sms = tuning, 0
        try:
            alone = _time(sw, fold)
        except Exception as e:  # a chain item too large for the shared memory, say: recorded, not fatal
            out["shared"].append({"fold": label, "error": f"{type(e).__name__}: {e}"})
            continue
        for sms in FOLD_SMS:
            b.fold_sms, b.fold_beside_dx = sms, True
            out["shared"].append({"fold": label, "fold_alone_us": alone, "fold_sms": sms, "us": _time(sw, strict),
                                  "bitwise": bool(torch.equal(strict()[1], want))})
    b.fold_tuning, b.fold_sms, b.fold_beside_dx = None, None, False
    for name in OTHER_BACKENDS:
        from strictnorm.backends.registry import get_backend

        other = get_backend(name)
        other_strict = functools.partial(other.rms_norm_bwd, c.dy, c.x, c.w, c.rstd, None, c.spec, "strict", True, None)
        default = other.share_sms_with_fold
        for beside, share, suffix in ((False, False, ""), (True, False, "_beside"), (True, True, "_shared")):
            b.fold_beside_dx, other.share_sms_with_fold = beside, share
            out[f"{name}_strict{suffix}"] = _time(sw, other_strict)
            out[f"{name}_bitwise{suffix}"] = bool(torch.equal(other_strict()[1], want))
        b.fold_beside_dx, other.share_sms_with_fold = False, default
    return out


def _timeline(sw: Sweep, case: Case) -> list[dict]:
    """One strict backward's kernels with the fold beside: name, start (us from the first) and duration."""
    from torch.profiler import ProfilerActivity, profile

    b, c = sw.backend, case
    b.fold_beside_dx = True
    b.rms_norm_bwd(c.dy, c.x, c.w, c.rstd, None, c.spec, "strict", True, None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if TIMER == "queued":  # the host enqueues both kernels while this holds the stream
            torch.cuda._sleep(HOLD_CYCLES)
        b.rms_norm_bwd(c.dy, c.x, c.w, c.rstd, None, c.spec, "strict", True, None)
        torch.cuda.synchronize()
    b.fold_beside_dx = False
    events = sorted((e for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name),
                    key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    return [{"kernel": e.name[:60], "start_us": e.time_range.start - t0,
             "us": e.time_range.end - e.time_range.start} for e in events]


def main() -> None:
    sw = Sweep.make("cuda", iters=10)
    rows = []
    for m, n in SHAPES:
        case = Case.make(sw.ref, sw.timer.device, m, n, sw.spec)
        rows.append({"M": m, "N": n, **_parts(sw, case)})
        print(json.dumps(rows[-1]), flush=True)
        if len(rows) == 1:
            timeline = _timeline(sw, case)
        del case
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": sw.ceiling, "timer": TIMER, "rows": rows, "timeline": timeline}, f, indent=1)
    print(f"\ncopy ceiling {sw.ceiling:.0f} GB/s; us, " + ("queued (events, the host ahead)" if TIMER == "queued"
                                                              else "kernel-only"))
    print(f"{'shape':>14} {'dx only':>9} {'fold':>9} {'beside':>9} {'after':>9} {'fast':>9}  bitwise")
    for r in rows:
        print(f"{r['M']:>7d}x{r['N']:<6d} {r['dx_only']:9.1f} {r['fold_only']:9.1f} {r['strict_beside']:9.1f} "
              f"{r['strict_after']:9.1f} {r['fast']:9.1f}  {r['bitwise_beside'] and r['bitwise_after']}")
    for name in OTHER_BACKENDS:
        print(f"\n{name} strict backward (us, bitwise): the fold after its dx pass / beside it / beside it with the SMs"
              " shared out")
        for r in rows:
            cells = [f"{r[name + '_strict' + s]:9.1f} {r[name + '_bitwise' + s]}"
                     for s in ("", "_beside", "_shared")]
            print(f"{r['M']:>7d}x{r['N']:<6d} " + "  ".join(cells))
    print(f"\none strict backward at {rows[0]['M']}x{rows[0]['N']}, fold beside:")
    for e in timeline:
        print(f"  {e['start_us']:8.1f} {e['us']:8.1f}  {e['kernel']}")
    if FOLD_SMS:
        print("\nstrict backward, fold beside with the SMs shared out (fold: r ring columns [x rows a stage] [s\n"
              "shared KB] or c chain rows, r0 the default; us alone; then fold SMs: us of the strict backward, "
              "bitwise)")
        for r in rows:
            for label in dict.fromkeys(v["fold"] for v in r["shared"]):
                runs = [v for v in r["shared"] if v["fold"] == label]
                if "error" in runs[0]:
                    print(f"{r['M']:>7d}x{r['N']:<6d} {label:>12} {runs[0]['error']}")
                    continue
                cells = [f"{v['fold_sms']}: {v['us']:.1f} {v['bitwise']}" for v in runs]
                print(f"{r['M']:>7d}x{r['N']:<6d} {label:>12} {runs[0]['fold_alone_us']:7.1f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
