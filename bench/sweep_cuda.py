"""Tuning sweep for the CUDA norm kernels (kernels/rms_norm.cu): block shapes at the PERF.md shapes.

Every configuration must give the reference's bits (checked here: y, rstd and dx against the torch
backend); only the speed changes. Kernel-only time as in strictnorm.bench (L2 flushed, profiler).
Kernels are compiled first, in parallel, into the disk cache. Rows of N below a power of two also try
each configuration untrimmed (`trim=False`; trimmed is the default). SWEEP_SHAPES=MxN,MxN limits the shapes;
SWEEP_MIN_THREADS=a,b tries each configuration at those block sizes (SWEEP_VALUES=a,b: the lanes a thread holds,
SWEEP_PBS=a,b: the backward's partial blocks per SM); SWEEP_LEAN=1 keeps held rows only (the
forward's weight reloaded: the tables' form). SWEEP_VARIANTS=1 replaces the block-shape grid by the tables' entry
per shape with EVEN off, on with predicated loads and on with unpredicated ones (16-byte aligned rows: only the
16-byte paths), in the backward at each SWEEP_PBS partial blocks an SM where that is set;
SWEEP_DIRECTIONS=fwd,bwd picks the directions (fwd_nr: the inference forward, no rstd stored, the kernel the
bench's forward times; fwd_api: that forward through strictnorm.rms_norm, as the bench calls it; bwd_dx: dx alone);
the tables' own entry is always swept (its rows "table": true, the baseline of the same run); SWEEP_STAGED=1 tries
each backward configuration also with the next row copied ahead into shared memory (`staged`; held rows with EVEN
only);
SWEEP_F32=1 each held backward configuration also with xh and g kept in fp32 between the passes (`hold_f32`);
SWEEP_PREFETCH=1 each held backward configuration also with the next row loaded into registers (`prefetch`);
SWEEP_W_WITH_ROW=1 each held configuration whose weight is reloaded also with the weight's lanes loaded with the
row's, before its sum (`weight_with_row`), in both directions.
Run on the GPU machine:
    python3 bench/sweep_cuda.py [out.json [tuning.json]]
    python3 bench/sweep_cuda.py --merge OUT_DIR NAME...   (the best of several sweeps' results as a tuning file)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

import strictnorm
from strictnorm.backends.cuda import nvrtc
from strictnorm.backends.cuda.backend import (
    BWD_TABLE,
    NormTuning,
    forward_tuning,
    norm_bwd_launch,
    norm_launch,
    tuning_for,
)
from strictnorm.backends.registry import get_backend
from strictnorm.bench import NORM_SHAPES, Timer, copy_ceiling_gbps, norm_bytes
from strictnorm.contract import make_spec
from strictnorm.reference import next_pow2


# The PERF.md shapes, and the longest rows (P = 65536 takes the P = 32768 entry unless it has its own: its
# backward there compiles to 1024 threads capped at 64 registers with a 392-byte stack per thread)
def shapes_from_env(default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """SWEEP_SHAPES=MxN,MxN, else `default` (the sweep scripts' shared shape option)."""
    given = os.environ.get("SWEEP_SHAPES")
    return [tuple(int(v) for v in s.split("x")) for s in given.split(",")] if given else default


SHAPES = shapes_from_env(NORM_SHAPES + [(1024, 65536)])

# Rows held in registers (values per thread, weight held or reloaded) or read twice (threads per row);
# the backward adds where the fast dW partials live and how many blocks per SM produce them.
_VALUES = [int(v) for v in os.environ.get("SWEEP_VALUES", "8,16,32,64").split(",")]
_PBS = [int(v) for v in os.environ.get("SWEEP_PBS", "4,8").split(",")]  # the backward's partial blocks per SM
_HOLD = [NormTuning(values=v, hold_weight=hw, hold_max_p=65536) for v in _VALUES for hw in (True, False)]
_STREAM = [NormTuning(hold_max_p=0, stream_threads=s) for s in (128, 256, 512, 1024)]
FWD_TUNINGS = [dataclasses.replace(t, partial_blocks_per_sm=0, persistent=p) for t in _HOLD + _STREAM
               for p in (True, False)]
BWD_TUNINGS = [dataclasses.replace(t, partial_blocks_per_sm=b, dw_smem=d)
               for t in _HOLD for b in _PBS for d in (False, True)]
BWD_TUNINGS += [dataclasses.replace(t, partial_blocks_per_sm=b) for t in _STREAM[:3] for b in _PBS]
# SWEEP_LEAN=1: rows held only; the forward's weight reloaded per row (the tables' forms up to P = 32768)
if os.environ.get("SWEEP_LEAN") == "1":
    FWD_TUNINGS = [t for t in FWD_TUNINGS if t.hold_max_p and not t.hold_weight]
    BWD_TUNINGS = [t for t in BWD_TUNINGS if t.hold_max_p]
# SWEEP_MIN_THREADS=128,512: each configuration at each of these block sizes (rows per block = min_threads /
# threads per row; short rows put many rows in a block)
if os.environ.get("SWEEP_MIN_THREADS"):
    _sizes = [int(v) for v in os.environ["SWEEP_MIN_THREADS"].split(",")]
    FWD_TUNINGS = [dataclasses.replace(t, min_threads=s) for t in FWD_TUNINGS for s in _sizes]
    BWD_TUNINGS = [dataclasses.replace(t, min_threads=s) for t in BWD_TUNINGS for s in _sizes]


DIRECTIONS = os.environ.get("SWEEP_DIRECTIONS", "fwd,bwd").split(",")
VARIANTS = os.environ.get("SWEEP_VARIANTS") == "1"
STAGED = os.environ.get("SWEEP_STAGED") == "1"
HOLD_F32 = os.environ.get("SWEEP_F32") == "1"
PREFETCH = os.environ.get("SWEEP_PREFETCH") == "1"
W_WITH_ROW = os.environ.get("SWEEP_W_WITH_ROW") == "1"


def tunings_for(n: int, tunings: list[NormTuning]) -> list[NormTuning]:
    """The configurations (padding pieces trimmed, the default), and for N below its power of two each one
    untrimmed too."""
    if n == next_pow2(n):
        return tunings
    return tunings + [dataclasses.replace(t, trim=False) for t in tunings]


def table_tuning(direction: str, m: int, n: int) -> NormTuning:
    """The tables' entry for m rows of n in one direction (fwd_nr and fwd_api, the inference forward: its own
    entry where FWD_INFERENCE_TABLE has one)."""
    if direction.startswith("fwd"):
        return forward_tuning(n, m, need_rstd=direction == "fwd")
    return tuning_for(BWD_TABLE, n, m)


def shape_tunings(direction: str, m: int, n: int) -> list[NormTuning]:
    """The configurations swept at one shape and direction; the tables' own entry always among them (the
    baseline of the same run)."""
    forward = direction.startswith("fwd")
    if VARIANTS:
        base = table_tuning(direction, m, n)
        out = [dataclasses.replace(base, even=even, unpredicated=unpred)
               for even, unpred in ((False, True), (True, False), (True, True))]
        if direction == "bwd" and "SWEEP_PBS" in os.environ:  # each also at every SWEEP_PBS partial blocks an SM
            out = [dataclasses.replace(t, partial_blocks_per_sm=b) for t in out for b in _PBS]
    else:
        out = tunings_for(n, FWD_TUNINGS if forward else BWD_TUNINGS) + [table_tuning(direction, m, n)]
    if STAGED and direction == "bwd":  # staged needs EVEN, held rows, no dw_smem (else it compiles the same kernel)
        out = out + [dataclasses.replace(t, staged=True) for t in out
                     if t.even and t.hold_max_p >= next_pow2(n) and not t.dw_smem]
    if HOLD_F32 and direction == "bwd":  # held rows only
        out = out + [dataclasses.replace(t, hold_f32=True) for t in out if t.hold_max_p >= next_pow2(n)]
    if PREFETCH and direction == "bwd":  # held rows only; it takes a staged configuration's place
        out = out + [dataclasses.replace(t, prefetch=True, staged=False) for t in out if t.hold_max_p >= next_pow2(n)]
    if W_WITH_ROW:  # held rows whose weight is reloaded
        out = out + [dataclasses.replace(t, weight_with_row=True) for t in out
                     if t.hold_max_p >= next_pow2(n) and not t.hold_weight]
    return list(dict.fromkeys(out))


def _compile(defines: dict) -> None:
    nvrtc.compile_cubin("rms_norm.cu", "sm_90", defines)


def precompile() -> None:
    jobs = []
    bf16 = torch.bfloat16
    for m, n in SHAPES:  # the sweep's tensors are fresh allocations: 16-byte aligned
        for direction in ("fwd", "fwd_nr", "fwd_api"):  # fwd_nr, fwd_api: the inference forward (no rstd stored)
            if direction in DIRECTIONS:
                jobs += [norm_launch(n, bf16, None, bf16, bf16, "llama", False, tu, True, direction == "fwd").defines
                         for tu in shape_tunings(direction, m, n)]
        if "bwd" in DIRECTIONS:
            jobs += [norm_bwd_launch(n, bf16, bf16, bf16, "llama", False, False, True, tu, True).defines
                     for tu in shape_tunings("bwd", m, n)]
    unique = {tuple(sorted(d.items())): d for d in jobs}
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        list(ex.map(_compile, unique.values()))
    print(f"compiled {len(unique)} kernels", flush=True)


@dataclasses.dataclass
class Case:
    """One shape's bf16 inputs, the reference's outputs and the bytes each direction moves at least."""

    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    spec: object
    y: torch.Tensor
    rstd: torch.Tensor
    dx: torch.Tensor
    fwd_bytes: int
    bwd_bytes: int

    @classmethod
    def make(cls, ref, dev: torch.device, m: int, n: int, spec) -> Case:
        g = torch.Generator(device=dev).manual_seed(m + n)
        x = torch.randn(m, n, device=dev, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).bfloat16()
        dy = torch.randn(m, n, device=dev, generator=g).bfloat16()
        y, rstd, _ = ref.rms_norm_fwd(x, w, None, spec)
        dx, _ = ref.rms_norm_bwd(dy, x, w, rstd, None, spec, "fast", False, None)
        return cls(x, w, dy, spec, y, rstd, dx, *norm_bytes(m, n))


@dataclasses.dataclass
class Sweep:
    """What every sweep script measures with: the timer (SWEEP_ITERS iterations), the copy ceiling of this run,
    the backend swept, the torch reference and the bf16 llama spec of the cases."""

    timer: Timer
    ceiling: float
    backend: object
    ref: object
    spec: object

    @classmethod
    def make(cls, backend: str, iters: int, device: torch.device | None = None) -> Sweep:
        dev = device or torch.device("cuda")
        return cls(Timer(dev, iters=int(os.environ.get("SWEEP_ITERS", str(iters)))), copy_ceiling_gbps(dev),
                   get_backend(backend), get_backend("torch"), make_spec(torch.bfloat16, 1e-6, 0.0, "llama",
                                                                        torch.bfloat16))


def measure(timer: Timer, backend, case: Case, direction: str, ceiling: float) -> dict:
    """A backend's kernel-only time on one case and direction, and whether it gave the reference's bits (y and
    rstd; dx, and for the fast dW the same bits twice); an error's message instead where it raised. Direction
    "fwd_nr": the forward of an inference call (need_rstd=False: a backend may skip rstd, 4 bytes a row); "fwd_api":
    that call through strictnorm.rms_norm, as the bench times it (the case's spec: bf16 llama, eps 1e-6); "bwd_dx":
    the backward without a weight gradient (dx alone: the dx pass a strict dW's fold runs after)."""
    c, row = case, {}
    try:
        if direction == "fwd":
            fn = lambda: backend.rms_norm_fwd(c.x, c.w, None, c.spec)  # noqa: E731
            y, rstd, _ = fn()
            row["bitwise"] = bool(torch.equal(y, c.y) and torch.equal(rstd, c.rstd))
        elif direction == "fwd_nr":
            fn = lambda: backend.rms_norm_fwd(c.x, c.w, None, c.spec, need_rstd=False)  # noqa: E731
            y, rstd, _ = fn()
            row["bitwise"] = bool(torch.equal(y, c.y) and (rstd is None or torch.equal(rstd, c.rstd)))
        elif direction == "fwd_api":  # the public call, as the bench's forward times it (the same backend object)
            fn = lambda: strictnorm.rms_norm(c.x, c.w, 1e-6, backend=backend.name)  # noqa: E731
            row["bitwise"] = bool(torch.equal(fn(), c.y))
        elif direction == "bwd_dx":
            fn = lambda: backend.rms_norm_bwd(c.dy, c.x, c.w, c.rstd, None, c.spec, "fast", False, None)  # noqa: E731
            row["bitwise"] = bool(torch.equal(fn()[0], c.dx))
        else:
            fn = lambda: backend.rms_norm_bwd(c.dy, c.x, c.w, c.rstd, None, c.spec, "fast", True, None)  # noqa: E731
            dx, dw = fn()
            row["bitwise"] = bool(torch.equal(dx, c.dx) and torch.equal(dw, fn()[1]))
        row["us"] = timer.kernel_us(fn)
        moved = c.bwd_bytes
        if direction.startswith("fwd"):  # the inference forwards (fwd_nr, fwd_api) store no rstd: 4 bytes a row fewer
            moved = c.fwd_bytes - (0 if direction == "fwd" else 4 * c.x.shape[0])
        row["frac_copy"] = moved / row["us"] / 1e3 / ceiling
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _sweep_shape(timer: Timer, cb, ref, spec, m: int, n: int, ceiling: float) -> list[dict]:
    case = Case.make(ref, timer.device, m, n, spec)
    rows = []
    for direction in DIRECTIONS:
        for tu in shape_tunings(direction, m, n):
            cb.fwd_tuning = cb.bwd_tuning = tu
            row = dict(M=m, N=n, direction=direction, table=tu == table_tuning(direction, m, n),
                       **dataclasses.asdict(tu))
            row.update(measure(timer, cb, case, direction, ceiling))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def best_tunings(results: list[dict]) -> dict:
    """Fastest bitwise configuration per padded row length and row count, forward and backward apart, as
    STRICTNORM_CUDA_TUNING reads it: per P, [max rows, knobs] entries, the largest row count unbounded."""
    fields = [f.name for f in dataclasses.fields(NormTuning)]
    out: dict[str, dict] = {"fwd": {}, "fwd_nr": {}, "bwd": {}}
    sources = {"fwd": ("fwd",), "fwd_nr": ("fwd_nr", "fwd_api"), "bwd": ("bwd",)}  # the inference forward: either
    for key in out:
        for n in sorted({r["N"] for r in results}):
            ok = [r for r in results
                  if r["N"] == n and r["direction"] in sources[key] and r.get("bitwise") and "us" in r]
            ms = sorted({r["M"] for r in ok})
            entries = []
            for m in ms:
                top = min((r for r in ok if r["M"] == m), key=lambda r: r["us"])
                entries.append([m if m != ms[-1] else None, {f: top[f] for f in fields if f in top}])
            if entries:
                out[key][str(next_pow2(n))] = entries
    return out


def main() -> None:
    precompile()
    sw = Sweep.make("cuda", iters=7)
    ceiling = sw.ceiling
    results = []
    for m, n in SHAPES:
        results += _sweep_shape(sw.timer, sw.backend, sw.ref, sw.spec, m, n, ceiling)
        torch.cuda.empty_cache()
    best = best_tunings(results)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"copy_GBps": ceiling, "rows": results}, f, indent=1)
    if len(sys.argv) > 2:  # the tuning file strictnorm reads from STRICTNORM_CUDA_TUNING
        with open(sys.argv[2], "w") as f:
            json.dump(best, f, indent=1)
    print("tuning:", json.dumps(best))
    print(f"\ncopy ceiling {ceiling:.0f} GB/s; best per shape (all rows bitwise: "
          f"{all(r.get('bitwise') for r in results)})")
    knobs = ("values", "min_threads", "hold_weight", "hold_max_p", "stream_threads", "partial_blocks_per_sm",
             "dw_smem", "persistent", "trim", "even", "unpredicated", "staged", "hold_f32", "prefetch",
             "weight_with_row")
    for m, n in SHAPES:
        line = f"{m:>7d}x{n:<6d}"
        for key in DIRECTIONS:
            ok = [r for r in results if r["M"] == m and r["N"] == n and r["direction"] == key and "us" in r]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                table = next((f" (table {r['us']:.2f})" for r in ok if r.get("table")), "")
                line += f" {key} {b['us']:7.2f} us{table} {b['frac_copy']:4.0%} {[b[k] for k in knobs]}"
        print(line)
    if VARIANTS:
        print("\nper variant (EVEN off 0 / predicated 1 / unpredicated 2; s: staged, f: hold_f32, p: prefetch; w: "
              "weight_with_row; b: partial blocks an SM): us")
        for m, n in SHAPES:
            for key in DIRECTIONS:
                ok = [r for r in results if r["M"] == m and r["N"] == n and r["direction"] == key and "us" in r]
                print(f"{m:>7d}x{n:<6d} {key} " + " ".join(
                    f"{int(r['even']) + int(r['even'] and r['unpredicated'])}{'s' * r['staged']}"
                    f"{'f' * r.get('hold_f32', False)}{'p' * r.get('prefetch', False)}"
                    f"{'w' * r.get('weight_with_row', False)}"
                    f"b{r['partial_blocks_per_sm']}:{r['us']:.1f}"
                    for r in ok))


def merge(out_dir: str, names: list[str], copies: tuple[str, ...] = ("/tmp/strictnorm-tuning.json",)) -> None:
    """The fastest configuration per entry over several sweeps' results ($OUT/<name>.json, or the rows logged in
    <name>.log where a time limit cut the sweep before it wrote its JSON), as a tuning file: out_dir/tuning.json
    and `copies` (by default /tmp/strictnorm-tuning.json, for a later call on the same machine)."""
    rows = []
    for name in names:
        try:
            with open(f"{out_dir}/{name}.json") as f:
                rows += json.load(f)["rows"]
        except (OSError, ValueError):
            with open(f"{out_dir}/{name}.log") as f:
                logged = [json.loads(line) for line in f if line.startswith('{"M"')]
            print(f"{name}: no JSON, {len(logged)} rows from its log")
            rows += logged
    best = best_tunings(rows)
    for path in (f"{out_dir}/tuning.json", *copies):
        with open(path, "w") as f:
            json.dump(best, f, indent=1)
    shown = ("values", "min_threads", "persistent", "even", "unpredicated", "staged", "hold_f32", "prefetch",
             "partial_blocks_per_sm", "hold_weight", "dw_smem", "weight_with_row")
    for key, table in best.items():
        for p, entries in table.items():
            print(key, p, [(b, {k: v for k, v in t.items() if k in shown}) for b, t in entries])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--merge"]:  # python3 bench/sweep_cuda.py --merge OUT_DIR NAME...
        merge(sys.argv[2], sys.argv[3:])
    else:
        main()
