"""What the contract's exactness costs the Triton forward at one tile: the table's tile for rows of P lanes (ROWS rows
a program, held whole, columns in order) with each exact step relaxed in turn, timed beside the backends' forwards and
the anchors in one process.

The exact kernel is the forward's arithmetic (kernels.py's widen, canon_sum, _rstd, normalized_as_used,
effective_weight, store_rounded; llama casting, bf16 x, weight and y) and must give the reference's y and rstd bit for
bit. Each variant drops one step: `no rstd store` (an inference call does not need rstd; Quack's forward does not
store it then), `tl.sum` (Triton's own order instead of the canonical tree), `approximate rstd` (Triton's `/` and
rsqrt instead of div_rn, sqrt_rn and div_rn; `approximate sqrt` and `approximate 1 / s` relax one of the two steps),
`no llama rounding` (x * rstd not rounded to bf16 before the weight),
and `all relaxed` (all four: about what Quack's forward computes). `mean by division` is exact too: the row's
mean as div_rn(ss, N) where the kernels take ss * (1 / N) for N a power of two (the same bits; what that saves), and
so is `rstd by rcp_rn` (the reciprocal as rcp.rn.f32, NVIDIA only: the same bits in a shorter sequence; the backend's
tiles take it where TileChoice.rcp_rn asks). Three
exact variants take the structure of torch.compile's forward (Inductor's, bench/inductor_probe.py) instead:
`x loaded again` (x not held across the sum but read again after it, from L2), `weight after sum` (the weight
loaded only once the sum is taken) and `Inductor's order` (both); `relaxed, Inductor's order` is that with all four
steps relaxed: about Inductor's kernel.
Four variants take a tile of 32 rows at 2 warps to 64 registers a thread or fewer (compiled offline for sm_90 by
Triton 3.6; the exact tile takes 122), so that 2048 programs run in one wave at 65536 x 128 as Inductor's do: x
widened again or loaded again, Inductor's addressing, with rcp_rn (64) or N compiled in (`N constant`: rows addressed
by immediates, as in Inductor's static kernel; 59), and all relaxed with N compiled in (56). At 16 rows of 2 warps
the last two take 40 and 32 (32: 32 programs an SM, one wave of 4096 at 65536 x 128). Run 59 (an H100, the L2
flushed by reading) found the one-wave tiles no faster than 8 x 2's two waves: one wave is not Inductor's lead.
A relaxed variant's largest relative difference from the reference's y (the exact y) is reported, never used.
Kernel-only time as in strictnorm.bench (L2 flushed, profiler).
PROBE_SHAPES=MxN,... (default 262144x128,65536x128; any N, the row held whole), PROBE_TILES=ROWSxWARPS[rREGS],...
(default 8x2,16x2; rREGS: registers a thread bounded), PROBE_VARIANTS="exact;name;..." (default all). Run on the GPU
machine:
    python3 bench/exactness_probe.py [out.json]
(Under TRITON_INTERPRET=1 on a CPU it runs the kernels on CPU tensors: a check of the exact kernel's bits, not a
measurement.)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

import strictnorm as sn
from strictnorm.backends.triton.backend import _store_view
from strictnorm.backends.triton.kernels import (
    BF16,
    LLAMA,
    _rstd,
    canon_sum,
    effective_weight,
    normalized_as_used,
    row_mean,
    store_rounded,
    widen,
    widen_bits,
)
from strictnorm.bench import BYTES_ONLY, COMPILE_ANCHOR, COMPILE_EXACT_ANCHOR, Timer, norm_providers
from strictnorm.reference import exact_mean_scale, next_pow2

EPS = 1e-6
# how rstd is taken from the mean: the contract's div_rn(1, sqrt_rn(.)) (kernels.py's _rstd), the same bits with
# rcp_rn for the reciprocal, or relaxed: rsqrt, the approximate square root with the exact division, the exact square
# root with the approximate division (Triton's `/`)
RSTD_EXACT, RSTD_RCP, RSTD_RSQRT, RSTD_SQRT_APPROX, RSTD_DIV_APPROX = (tl.constexpr(i) for i in range(5))


class Variant(NamedTuple):
    """One tile kernel: the exact steps it keeps and the order of its loads (the defaults: the exact kernel's)."""

    name: str
    exact_sum: bool = True  # canon_sum, else tl.sum
    rstd: tl.constexpr = RSTD_EXACT
    llama_round: bool = True  # x * rstd rounded to bf16 before the weight
    store_rstd: bool = True
    mean_by_multiply: bool = True  # a power of two's mean as ss * 2^-k (kernels.py's row_mean)
    reload_x: bool = False  # x read again after the sum instead of held across it
    late_w: bool = False  # the weight loaded after the sum
    masked: bool = True  # loads and stores masked by rows < M and cols < N (unmasked: M % ROWS == 0 and N == P only)
    offs64: bool = True  # row offsets in 64-bit integers (the backend's); else 32-bit, as Inductor's where they fit
    rewiden: bool = False  # x held across the sum as loaded (16-bit) and widened again for y, not held widened
    n_const: bool = False  # N compiled in as a constant (Inductor's static shape): rows addressed by immediates


RELAXED = dict(exact_sum=False, rstd=RSTD_RSQRT, llama_round=False, store_rstd=False)
INDUCTOR_ORDER = dict(reload_x=True, late_w=True)
# Inductor's addressing at a static shape whose rows fill the tiles: no masks, 32-bit offsets (bench/inductor_probe.py)
INDUCTOR_ADDRESSING = dict(masked=False, offs64=False)
VARIANTS = [Variant("exact"), Variant("mean by division", mean_by_multiply=False),
            Variant("rstd by rcp_rn", rstd=RSTD_RCP), Variant("x loaded again", reload_x=True),
            Variant("weight after sum", late_w=True), Variant("Inductor's order", **INDUCTOR_ORDER),
            Variant("no rstd store", store_rstd=False), Variant("tl.sum", exact_sum=False),
            Variant("approximate rstd", rstd=RSTD_RSQRT), Variant("approximate sqrt", rstd=RSTD_SQRT_APPROX),
            Variant("approximate 1 / s", rstd=RSTD_DIV_APPROX), Variant("no llama rounding", llama_round=False),
            Variant("all relaxed", **RELAXED), Variant("relaxed, Inductor's order", **RELAXED, **INDUCTOR_ORDER),
            Variant("no masks", masked=False), Variant("32-bit offsets", offs64=False),
            Variant("Inductor's addressing", **INDUCTOR_ADDRESSING), Variant("x widened again", rewiden=True),
            Variant("x widened again, Inductor's addressing", rewiden=True, **INDUCTOR_ADDRESSING),
            Variant("relaxed, Inductor's addressing", **RELAXED, **INDUCTOR_ADDRESSING),
            # at or under 64 registers a thread at 32 x 2 (compiled offline for sm_90 by Triton 3.6; the exact 32 x 2
            # tile takes 122): 2048 programs of 32 rows, one wave at 65536 x 128, as Inductor's kernel runs there
            Variant("x widened again, Inductor's addressing, rcp_rn", rewiden=True, rstd=RSTD_RCP,
                    **INDUCTOR_ADDRESSING),
            Variant("x loaded again, Inductor's addressing, rcp_rn", reload_x=True, rstd=RSTD_RCP,
                    **INDUCTOR_ADDRESSING),
            Variant("x loaded again, Inductor's addressing, N constant", reload_x=True, n_const=True,
                    **INDUCTOR_ADDRESSING),
            Variant("relaxed, Inductor's addressing, N constant", **RELAXED, **INDUCTOR_ADDRESSING, n_const=True)]


def is_exact(variant: Variant) -> bool:
    """Whether a variant keeps every step that y's and rstd's bits depend on (rstd by rcp_rn is the same rounding)."""
    return (variant.exact_sum and variant.rstd.value in (RSTD_EXACT.value, RSTD_RCP.value) and variant.llama_round
            and variant.store_rstd)


def applies(variant: Variant, m: int, n: int, rows: int) -> bool:
    """Whether a variant computes every row of (m, n) in tiles of `rows` rows: an unmasked one only where the rows
    fill the tiles and the row its P lanes."""
    return variant.masked or (m % rows == 0 and n == next_pow2(n))


@triton.jit
def tile_kernel(X, W, Y, RSTD, M, N, eps, ROWS: tl.constexpr, P: tl.constexpr, LOG2P: tl.constexpr,
                EXACT_SUM: tl.constexpr, RSTD_MODE: tl.constexpr, LLAMA_ROUND: tl.constexpr,
                STORE_RSTD: tl.constexpr, MEAN_SCALE: tl.constexpr, RELOAD_X: tl.constexpr, LATE_W: tl.constexpr,
                MASKED: tl.constexpr, OFFS64: tl.constexpr, REWIDEN: tl.constexpr, NC: tl.constexpr):
    if NC > 0:  # the row length compiled in (Variant.n_const)
        N = NC
    pid = tl.program_id(0)
    rows = (pid.to(tl.int64) if OFFS64 else pid) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, P)
    # unmasked: every lane's mask is a constant true, which Triton folds away (as Inductor's static kernels have none)
    row_ok = rows < M if MASKED else tl.full((ROWS,), True, tl.int1)
    col_ok = cols < N if MASKED else tl.full((P,), True, tl.int1)
    mask = row_ok[:, None] & col_ok[None, :]
    x_ptrs = X + rows[:, None] * N + cols[None, :]
    x_loaded = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last" if RELOAD_X else "")
    x = widen(x_loaded)
    if not LATE_W:
        wf = effective_weight(W, cols, col_ok, 0.0, LLAMA, BF16, True)[None, :]
    ss = canon_sum(x * x, ROWS, P, LOG2P) if EXACT_SUM else tl.sum(x * x, axis=1)
    if RSTD_MODE == RSTD_EXACT:
        rstd = _rstd(ss, N, eps, ROWS, MEAN_SCALE)
    elif RSTD_MODE == RSTD_RSQRT:
        rstd = tl.math.rsqrt(ss / N + eps)
    else:
        mean = row_mean(ss, N, ROWS, MEAN_SCALE) + eps
        root = tl.sqrt(mean) if RSTD_MODE == RSTD_SQRT_APPROX else tl.sqrt_rn(mean)
        if RSTD_MODE == RSTD_RCP:
            rstd = libdevice.rcp_rn(root)
        elif RSTD_MODE == RSTD_DIV_APPROX:
            rstd = 1.0 / root
        else:
            rstd = tl.div_rn(tl.full((ROWS,), 1.0, tl.float32), root)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    if RELOAD_X:  # as Inductor's forward: x not held across the sum, read again (from L2) for y
        x = widen(tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first"))
    elif REWIDEN:  # the same values by another exact path, which the compiler does not merge with the first widening
        x = widen_bits(x_loaded)
    if LATE_W:
        wf = effective_weight(W, cols, col_ok, 0.0, LLAMA, BF16, True)[None, :]
    xn = normalized_as_used(x, rstd, LLAMA, BF16) if LLAMA_ROUND else x * rstd[:, None]
    store_rounded(Y + rows[:, None] * N + cols[None, :], xn * wf, mask, BF16)


def launcher(x: torch.Tensor, w: torch.Tensor, rows: int, warps: int, variant: Variant, max_registers: int = 0
             ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A call of one variant over x's rows, as the backend's forward makes one: y and rstd allocated per call, bf16 y
    written through its int16 view (kernels.py's store_rounded stores bit patterns; into a bf16 pointer the GPU would
    convert them as integers)."""
    m, n = x.shape
    p = next_pow2(n)
    mean_scale = exact_mean_scale(n) if variant.mean_by_multiply else 0.0

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty_like(x)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        call.compiled = tile_kernel[(triton.cdiv(m, rows),)](x, w, _store_view(y), rstd, m, n, EPS, ROWS=rows, P=p,
                                             LOG2P=p.bit_length() - 1, EXACT_SUM=variant.exact_sum,
                                             RSTD_MODE=variant.rstd.value, LLAMA_ROUND=variant.llama_round,
                                             STORE_RSTD=variant.store_rstd, MEAN_SCALE=mean_scale,
                                             RELOAD_X=variant.reload_x, LATE_W=variant.late_w,
                                             MASKED=variant.masked, OFFS64=variant.offs64, REWIDEN=variant.rewiden,
                                             NC=n if variant.n_const else 0,
                                             num_warps=warps, **({"maxnreg": max_registers} if max_registers else {}),
                                             enable_fp_fusion=False)
        return y, rstd

    return call


def parse_tile(text: str) -> tuple[int, int, int]:
    """"ROWSxWARPS" or "ROWSxWARPSrREGS" (registers a thread bounded, Triton's maxnreg: how many programs an SM holds
    at once) -> (rows, warps, registers or 0)."""
    tile, _, regs = text.partition("r")
    rows, warps = (int(v) for v in tile.split("x"))
    return rows, warps, int(regs or 0)


def anchors(dev: torch.device) -> dict[str, Callable]:
    """strictnorm.bench's providers for rms_norm (llama) that this probe times beside its tiles: each available
    backend's forward (inference calls, fast dW: the forward is the same), the installed anchors with torch.compile,
    and the bytes-only copy, as f(x, w)."""
    providers, _ = norm_providers(dev, compile_anchor=True)
    return {name.removesuffix(" fast"): (lambda x, w, f=f: f(x, w, None)) for name, f in providers.items()
            if name in ("Quack", "Liger", COMPILE_ANCHOR, COMPILE_EXACT_ANCHOR, BYTES_ONLY)
            or (name.startswith("strictnorm ") and name.endswith(" fast"))}


def main() -> None:
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu" if interpreting or not torch.cuda.is_available() else "cuda")
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("PROBE_SHAPES", "262144x128,65536x128").split(",")]
    wanted = os.environ.get("PROBE_VARIANTS")  # names separated by ";" (names hold commas); default every one
    variants = [v for v in VARIANTS if (wanted is None or v.name in wanted.split(";"))
                and not (interpreting and v.rstd == RSTD_RCP)]  # relaxed ones are compared with the reference
    tiles = [parse_tile(s) for s in os.environ.get("PROBE_TILES", "8x2,16x2").split(",")]
    timer = None if dev.type == "cpu" else Timer(dev, iters=15)
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for m, n in shapes:
        x = torch.randn(m, n, device=dev, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).bfloat16()
        want_y, want_rstd = sn.rms_norm_with_rstd(x, w, EPS, backend="torch")
        for rows, warps, max_registers in tiles:
            for variant in variants:
                if not applies(variant, m, n, rows):
                    continue
                call = launcher(x, w, rows, warps, variant, max_registers)
                y, rstd = call()
                row = dict(M=m, N=n, rows=rows, warps=warps, max_registers=max_registers, what=variant.name)
                if dev.type == "cuda":  # registers decide how many programs an SM holds (one wave or more)
                    row["registers"] = getattr(call.compiled, "n_regs", None)
                if is_exact(variant):
                    row["bitwise"] = bool(torch.equal(y, want_y) and torch.equal(rstd, want_rstd))
                else:
                    row["y_max_rel_diff"] = float(((y.float() - want_y.float()).abs()
                                                   / want_y.float().abs().clamp_min(1e-30)).max())
                if timer is not None:
                    row["us"] = timer.kernel_us(call)
                results.append(row)
                print(json.dumps(row), flush=True)
        if timer is not None:
            for name, fn in anchors(dev).items():
                row = dict(M=m, N=n, what=name, us=timer.kernel_us(lambda fn=fn, x=x, w=w: fn(x, w)))
                results.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nexact kernels bitwise with the reference everywhere: "
          f"{all(r['bitwise'] for r in results if 'bitwise' in r)}")
    if timer is not None:
        print(f"{'M x N':>14s} {'tile':>8s} {'what':>30s} {'us':>8s} {'regs':>5s}")
        for r in results:
            tile = f"{r['rows']}x{r['warps']}" + (f"r{r['max_registers']}" if r.get("max_registers") else "") \
                if "rows" in r else ""
            regs = r.get("registers") or ""
            print(f"{r['M']:>7d} x {r['N']:<5d} {tile:>8s} {r['what']:>30s} {r['us']:8.2f} {regs:>5}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
