"""CuTe DSL kernels (backends/cute/kernels.py): compiled for sm_90a without a GPU, and the exactness
of the generated code checked in its PTX; on a GPU, bitwise against the reference. Skipped where
nvidia-cutlass-dsl is not installed (CI does not install it)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from conftest import HAS_CUDA
from helpers import bits_equal

cutlass = pytest.importorskip("cutlass")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from strictnorm.backends.cute import kernels as K  # noqa: E402


def _ptx(tmp_path, n: int, mode: str, x_dtype, w_dtype) -> str:
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_tensor

    m_sym, n_sym = cute.sym_int(), cute.sym_int()
    fx = make_fake_tensor(x_dtype, (m_sym, n_sym), (cute.sym_int64(), 1))
    fw = make_fake_tensor(w_dtype or x_dtype, (n_sym,), (1,))
    fy = make_fake_tensor(x_dtype, (m_sym, n_sym), (cute.sym_int64(), 1))
    fr = make_fake_tensor(Float32, (m_sym,), (1,))
    op = K.RMSNormForward(K.forward_shape(n), mode, w_dtype is not None, x_dtype)
    cute.compile(op, fx, fw, fy, fr, Int32(1), Int32(n), Float32(1e-6), Float32(0.0), Int32(1),
                 options=f"--keep-ptx --dump-dir {tmp_path}")
    (path,) = list(tmp_path.glob("*.ptx"))
    return path.read_text()


@pytest.mark.parametrize("n", [1, 7, 128, 1000, 4096, 18432])
@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
def test_forward_compiles_with_only_rounded_fp32_ops(n, mode, tmp_path):
    """No fused multiply-add and no unrounded fp32 add/mul/div/sqrt anywhere: ptxas may contract a
    plain add.f32 with a mul, which would change bits."""
    ptx = _ptx(tmp_path, n, mode, cutlass.BFloat16, cutlass.BFloat16)
    assert "fma." not in ptx
    assert not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx), "an fp32 op without .rn"
    assert re.search(r"\bsqrt\.rn\.f32\b", ptx) and re.search(r"\bdiv\.rn\.f32\b", ptx)
    shape = K.forward_shape(n)
    assert shape.piece * shape.tpr * shape.k == 1 << max(0, (n - 1).bit_length())
    assert ("bar.sync" in ptx) == (shape.tpr > 32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 7, 127, 128, 1000, 4096, 5120, 8192, 18432])
@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
def test_forward_bitwise_on_gpu(n, mode, seed):
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    g = torch.Generator(device="cuda").manual_seed(seed)
    for rows in (1, 37, 3000):
        x = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()  # tiny weights: the Gemma case
        offset = 1.0 if mode == "gemma" else 0.0
        spec = make_spec(torch.bfloat16, 1e-6, offset, mode, torch.bfloat16)
        want_y, want_rstd, _ = get_backend("torch").rms_norm_fwd(x, w, None, spec)
        y, rstd = K.forward(x, w, 1e-6, offset, mode, torch.bfloat16)
        assert bits_equal(rstd, want_rstd) and bits_equal(y, want_y), f"{rows}x{n} {mode}"
