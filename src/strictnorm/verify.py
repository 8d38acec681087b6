"""`strictnorm verify`: the contract checked on every available backend, on fresh random inputs.

Each kernel backend is compared bit for bit with the reference computed on the CPU (y, rstd, dx,
dW strict, the fused add's residual_out and gradients, per-head QK-norm on a strided view, the
left fold), also on rows with special values (signed zeros, subnormals, the largest values,
infinities, NaN) and on zero dy rows whose dx zeros carry signs. The reference itself is checked
against the contract's defining properties: the left fold's order, batch invariance, the Gemma
offset in fp32, and accuracy against float64.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from . import api
from .backends import registry

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def _differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """A mask (on the CPU) of the elements whose bits differ, any NaN equal to any NaN (payloads are not part
    of the contract); None when dtype or shape differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return None
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return ~((a.view(_INT_VIEW[a.dtype]) == b.view(_INT_VIEW[b.dtype])) | (torch.isnan(a) & torch.isnan(b)))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits; any NaN equals any NaN (payloads are not part of the contract)."""
    diff = _differing(a, b)
    return diff is not None and not bool(diff.any())


def bits_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where a and b differ, in a line: dtype or shape, else how many elements, the first index and both
    values there (for a failure message)."""
    diff = _differing(a, b)
    if diff is None:
        return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    bad = diff.nonzero()
    if not len(bad):
        return "same bits"
    first = tuple(bad[0].tolist())
    return (f"{len(bad)} of {a.numel()} elements differ; first at {first}: {a.detach().cpu()[first].item()!r} vs "
            f"{b.detach().cpu()[first].item()!r}")


def sprinkle_specials(t: torch.Tensor, gen: torch.Generator, kinds: str = "zeros subnormals max inf nan",
                      fraction: float = 0.1) -> torch.Tensor:
    """t (rows, N) or (N,) with a fraction of each row's elements replaced by special values of its dtype,
    one kind per row in turn (a NaN or an infinity anywhere in a row decides all of its outputs, so kinds
    are not mixed): signed zeros, signed subnormals, plus and minus the largest finite value, signed
    infinities, NaN. Row 0 of a 2-D t is left as it is; a 1-D t takes all the kinds asked for at once."""
    info = torch.finfo(t.dtype)
    tiny, big, inf = info.smallest_normal / 4, info.max, float("inf")
    values = {"zeros": [0.0, -0.0], "subnormals": [tiny, -tiny, tiny / 8], "max": [big, -big],
              "inf": [inf, -inf], "nan": [float("nan")]}
    groups = [torch.tensor(values[k], dtype=torch.float32).to(t.dtype) for k in kinds.split()]
    out = t.detach().clone()
    rows = out.view(1, -1) if out.dim() == 1 else out.reshape(-1, out.shape[-1])
    for r in range(0 if out.dim() == 1 else 1, rows.shape[0]):
        # a 1-D t (a weight) takes every kind at once
        specials = torch.cat(groups) if out.dim() == 1 else groups[(r - 1) % len(groups)]
        count = max(specials.numel(), int(rows.shape[1] * fraction))
        where = torch.randperm(rows.shape[1], generator=gen)[:count]
        pick = torch.cat([torch.arange(specials.numel()), torch.randint(0, specials.numel(), (count,), generator=gen)])
        rows[r, where.to(rows.device)] = specials[pick[:where.numel()]].to(rows.device)
    return out


def with_specials(gen: torch.Generator, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                  res: torch.Tensor | None = None, dres: torch.Tensor | None = None) -> tuple:
    """(x, w, dy, res, dres) as the special-value checks use them: rows, residuals and gradients through
    sprinkle_specials (dy's kinds shifted by three rows against x's), the weight with finite kinds only (an
    infinite or NaN weight lane would decide every row)."""
    return (sprinkle_specials(x, gen), sprinkle_specials(w, gen, "zeros subnormals max"),
            sprinkle_specials(dy.roll(3, 0), gen), None if res is None else sprinkle_specials(res, gen),
            None if dres is None else sprinkle_specials(dres, gen))


ZERO_DY_OFFSET = -1.0


def zero_dy_rows(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, w, dy) in bf16 whose backward hinges on signed zeros, with offset ZERO_DY_OFFSET: x > 0, w + offset
    < 0, dy zero but in row 1 (masked tokens). The zero rows' products xh * (dy * wf) are all -0.0; canon_sum
    adds them exactly ((-0) + (-0) = -0) and pads with +0.0, so their sum is -0.0 when N is a power of two and
    +0.0 otherwise, and dx's zeros take the opposite sign."""
    x = (torch.rand(3, n, generator=gen) + 0.5).to(torch.bfloat16)
    w = (torch.rand(n, generator=gen) * 0.5).to(torch.bfloat16)
    dy = torch.zeros(3, n, dtype=torch.bfloat16)
    dy[1] = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, dy


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ in their bits (see bits_equal); -1 when dtype or shape differ."""
    diff = _differing(a, b)
    return -1 if diff is None else int(diff.sum())


@dataclass
class Check:
    backend: str
    device: str
    check: str
    case: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0


def _leaf(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh leaf (t.to(device) alone is t itself on the CPU: gradients of two runs would share it)."""
    return t.detach().to(device).clone().requires_grad_(True)


def _norm_case(backend: str, device: torch.device, *, rows: int, n: int, dtype: torch.dtype, mode: str,
               offset: float, wdtype: torch.dtype, fused: bool, seed: int, specials: bool = False) -> dict[str, int]:
    """Runs forward + backward (dw strict) on backend/device and on the CPU reference; returns the
    number of differing elements per output. specials: rows, residuals and gradients with special values
    (sprinkle_specials; the weight with finite ones)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).to(dtype)
    w = (torch.randn(n, generator=g) * 0.1).to(wdtype)
    res = torch.randn(rows, n, generator=g).to(dtype) if fused else None
    dy = torch.randn(rows, n, generator=g).to(dtype)
    dz = torch.randn(rows, n, generator=g).to(dtype) if fused else None
    if specials:
        x, w, dy, res, dz = with_specials(g, x, w, dy, res, dz)

    def run(be: str, dev: torch.device):
        xx, ww = _leaf(x, dev), _leaf(w, dev)
        kw = dict(offset=offset, casting_mode=mode, dw="strict", backend=be)
        if fused:
            rr = _leaf(res, dev)
            y, z = api.fused_add_rms_norm(xx, rr, ww, 1e-6, **kw)
            torch.autograd.backward([y, z], [dy.to(dev), dz.to(dev)])
            return {"y": y, "residual_out": z, "dx": xx.grad, "dresidual": rr.grad, "dw": ww.grad}
        y, rstd = api.rms_norm_with_rstd(xx, ww, 1e-6, **kw)
        y.backward(dy.to(dev))
        return {"y": y, "rstd": rstd, "dx": xx.grad, "dw": ww.grad}

    got, want = run(backend, device), run("torch", torch.device("cpu"))
    return {k: mismatches(want[k], got[k]) for k in want}


def _zero_dy_case(backend: str, device: torch.device, n: int, seed: int) -> dict[str, int]:
    """zero_dy_rows through autograd: the signs of dx's zeros."""
    x, w, dy = zero_dy_rows(n, torch.Generator().manual_seed(seed))

    def run(be: str, dev: torch.device):
        xx, ww = _leaf(x, dev), _leaf(w, dev)
        y = api.rms_norm(xx, ww, 1e-6, offset=ZERO_DY_OFFSET, casting_mode="llama", dw="strict", backend=be)
        y.backward(dy.to(dev))
        return {"dx": xx.grad, "dw": ww.grad}

    got, want = run(backend, device), run("torch", torch.device("cpu"))
    return {k: mismatches(want[k], got[k]) for k in want}


def _qk_case(backend: str, device: torch.device, seed: int) -> dict[str, int]:
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = 2, 5, 4, 64
    qkv = torch.randn(b, s, 3 * h * d, generator=g).to(torch.bfloat16)
    w = torch.randn(h, d, generator=g)
    dy = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16)

    def run(be: str, dev: torch.device):
        base, ww = _leaf(qkv, dev), _leaf(w, dev)
        q = base[..., h * d:2 * h * d].view(b, s, h, d)  # a strided view, as from a fused projection
        y = api.qk_norm(q, ww, 1e-6, casting_mode="gemma", offset=1.0, dw="strict", backend=be)
        y.backward(dy.to(dev))
        return {"y": y, "dqkv": base.grad, "dw": ww.grad}

    got, want = run(backend, device), run("torch", torch.device("cpu"))
    return {k: mismatches(want[k], got[k]) for k in want}


def _fold_case(backend: str, device: torch.device, seed: int) -> dict[str, int]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(777, 3, 45, generator=g) * torch.logspace(-8, 8, 45)
    rows = rows.transpose(1, 2)  # non-contiguous
    want = api.reduce_rows_left_fold(rows, backend="torch")
    got = api.reduce_rows_left_fold(rows.to(device), backend=backend)
    return {"fold": mismatches(want, got)}


def _kernel_checks(backend: str, device: torch.device, quick: bool) -> Iterator[tuple[str, str, Callable]]:
    # Each new (N, dtype, mode) compiles kernels on a GPU the first time (cached on disk after).
    shapes = [(33, 128), (4, 1000)] if quick else [(1, 1), (5, 7), (33, 128), (64, 1000), (8, 4096), (2, 18432)]
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    seed = int(time.time_ns() % 2**31)
    for i, (rows, n) in enumerate(shapes):
        for dtype in dtypes:
            for mode in ("llama", "gemma", "none"):
                for fused in (False, True):
                    offset = 1.0 if mode == "gemma" else 0.0
                    wdtype = torch.float32 if mode == "none" else dtype
                    case = f"{rows}x{n} {str(dtype)[6:]} {mode}{' fused' if fused else ''} w={str(wdtype)[6:]}"
                    name = "fused_add_rms_norm" if fused else "rms_norm"
                    yield name, case, (lambda rows=rows, n=n, dtype=dtype, mode=mode, offset=offset,
                                       wdtype=wdtype, fused=fused, s=seed + i: _norm_case(
                        backend, device, rows=rows, n=n, dtype=dtype, mode=mode, offset=offset,
                        wdtype=wdtype, fused=fused, seed=s))
    for n in (7, 64) if quick else (7, 64, 1000):
        yield "rms_norm", f"3x{n} bf16 zero dy rows, offset -1 (signed zeros)", (
            lambda n=n: _zero_dy_case(backend, device, n, seed))
    for dtype, fused in ((torch.bfloat16, False), (torch.float16, True)):
        for mode in ("llama",) if quick else ("llama", "gemma", "none"):
            case = f"11x100 {str(dtype)[6:]} {mode}{' fused' if fused else ''}: zeros, subnormals, max, inf, NaN"
            yield ("fused_add_rms_norm" if fused else "rms_norm"), case, (
                lambda dtype=dtype, fused=fused, mode=mode: _norm_case(
                    backend, device, rows=11, n=100, dtype=dtype, mode=mode, offset=-0.5, wdtype=torch.bfloat16,
                    fused=fused, seed=seed, specials=True))
    if not quick and device.type == "cuda":  # a long strict dW fold (many rows, as a training step's)
        yield "rms_norm", "16384x256 bf16 llama (a long strict fold)", (
            lambda: _norm_case(backend, device, rows=16384, n=256, dtype=torch.bfloat16, mode="llama", offset=0.0,
                               wdtype=torch.bfloat16, fused=False, seed=seed))
    yield "qk_norm", "(2,5,4,64) strided bf16 gemma per-head", lambda: _qk_case(backend, device, seed)
    yield "left_fold", "777x(45,3) strided fp32", lambda: _fold_case(backend, device, seed)


def _reference_checks() -> Iterator[tuple[str, str, Callable]]:
    def fold_order():
        r = torch.tensor([[1e20], [1.0], [-1e20], [1.0]])
        got = api.reduce_rows_left_fold(r, backend="torch")
        return {"fold": int(got.item() != 1.0)}

    def gemma_offset():
        w = torch.full((8,), 0.00390625, dtype=torch.bfloat16)
        x = torch.ones(1, 8)
        y = api.rms_norm(x, w, 0.0, offset=1.0, casting_mode="gemma", backend="torch")
        return {"y": int((y != 1.00390625).sum())}

    def batch_invariance():
        g = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
        x = torch.randn(300, 1000, generator=g).to(torch.bfloat16)
        w = torch.randn(1000, generator=g).to(torch.bfloat16)
        alone = api.rms_norm(x[7:8], w, backend="torch")
        inside = api.rms_norm(x, w, backend="torch")[7:8]
        return {"y": mismatches(alone, inside)}

    def accuracy():
        g = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
        x = torch.randn(64, 4096, generator=g)
        w = torch.randn(4096, generator=g)
        y = api.rms_norm(x, w, backend="torch")
        y64 = api.rms_norm(x.double(), w.double(), backend="torch")
        rel = float((y.double() - y64).norm() / y64.norm())
        return {"rel_err_vs_float64_over_1e-6": int(rel > 1e-6)}

    yield "left_fold", "[1e20, 1, -1e20, 1] -> 1", fold_order
    yield "rms_norm", "gemma offset 1 + bf16 0.00390625 in fp32", gemma_offset
    yield "rms_norm", "row alone == row in batch of 300", batch_invariance
    yield "rms_norm", "fp32 vs float64, 64x4096", accuracy


def iter_checks(backends: list[str] | None = None, quick: bool = False) -> Iterator[Check]:
    """Each check's result as soon as it has run (the kernel backends compile as they go: minutes)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    for name in backends or list(registry.names()):
        st = registry.status(name, device)
        if not st.available:
            yield Check(name, str(device), "available", "-", True, f"skipped: {st.reason}")
            continue
        checks = _reference_checks() if name == "torch" else _kernel_checks(name, device, quick)
        for check, case, fn in checks:
            if ("left_fold" if check == "left_fold" else "rms_norm") not in st.ops:
                continue
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():  # numpy's, when the Triton interpreter meets inf and NaN
                    warnings.filterwarnings("ignore", "(invalid value|overflow) encountered", RuntimeWarning)
                    diffs = fn()
                bad = {k: v for k, v in diffs.items() if v != 0}
                yield Check(name, str(device), check, case, not bad,
                            ", ".join(f"{k}: {v} differ" for k, v in bad.items()), time.perf_counter() - t0)
            except Exception as e:  # a crash is a failed check, reported, not fatal
                yield Check(name, str(device), check, case, False, f"{type(e).__name__}: {e}"[:300],
                            time.perf_counter() - t0)


def as_dicts(results: list[Check]) -> list[dict]:
    return [asdict(r) for r in results]
