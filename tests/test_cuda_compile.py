"""CUDA sources compile through NVRTC without a GPU; the backend reports itself unavailable cleanly."""

from __future__ import annotations

import pytest
import torch

from strictnorm.backends.cuda.backend import fold_launch
from strictnorm.backends.registry import status

nvrtc = pytest.importorskip("strictnorm.backends.cuda.nvrtc")
try:
    nvrtc.nvrtc_version()
except Exception as e:  # pragma: no cover - only where the NVRTC wheel is missing
    pytest.skip(f"NVRTC not usable here: {e}", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _configs():
    for what in (0, 1, 2, 3):
        for a in DTYPES:
            for b in DTYPES if what else [a]:
                for ring in (False, True, "prefetch"):
                    for n in (128, 8192):
                        for simple in (True, False):
                            yield what, a, b, ring, n, simple


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_every_fold_configuration_compiles(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    seen = set()
    for what, a, b, ring, n, simple in _configs():
        fl = fold_launch(n, a, b, what, simple, bool(ring), num_sms=132, prefetch=ring == "prefetch")
        key = (fl.kernel, tuple(sorted(fl.defines.items())))
        if key in seen:
            continue
        seen.add(key)
        cubin = nvrtc.compile_cubin("fold.cu", arch, fl.defines, use_cache=False)
        assert cubin[:4] == b"\x7fELF", f"{fl.kernel} {fl.defines}"
        assert fl.shmem <= 48 * 1024
    assert len(seen) > 50


def test_disk_cache_is_keyed_by_macros(tmp_path, monkeypatch):
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    d1 = {"A_CODE": 0, "B_CODE": 0, "WHAT": 0, "SIMPLE_ROWS": 1}
    d2 = dict(d1, WHAT=2)
    c1 = nvrtc.compile_cubin("fold.cu", "sm_90", d1)
    c2 = nvrtc.compile_cubin("fold.cu", "sm_90", d2)
    assert c1 != c2
    assert len(list((tmp_path / "cubin").glob("*.cubin"))) == 2
    assert nvrtc.compile_cubin("fold.cu", "sm_90", d1) == c1  # served from disk


def test_compile_errors_carry_the_nvrtc_log(tmp_path, monkeypatch):
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    with pytest.raises(nvrtc.CudaCompileError, match="fold.cu"):
        nvrtc.compile_cubin("fold.cu", "sm_90", {"A_CODE": 7, "B_CODE": 0, "WHAT": 0, "SIMPLE_ROWS": 1})


def test_sources_are_packaged():
    assert "fold.cu" in nvrtc.source_names()
    assert "__fadd_rn" in nvrtc.source("fold.cu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")
def test_backend_reports_unavailable_without_gpu():
    st = status("cuda", torch.device("cpu"))
    assert not st.available and "NVIDIA" in st.reason


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_rms_norm_configurations_compile(arch, tmp_path, monkeypatch):
    from strictnorm.backends.cuda.backend import norm_bwd_launch, norm_launch

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    bf16, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    cases = [(n, mode, x, r, w, y, ph) for n in (1, 7, 128, 1000, 4096, 8192, 65536)
             for mode in ("llama", "gemma", "none")
             for x, r, w, y, ph in ((bf16, None, bf16, bf16, False), (f16, f32, f32, f32, False),
                                    (bf16, None, None, bf16, False), (bf16, None, f32, bf16, True))]
    for n, mode, x, r, w, y, ph in cases:
        fl = norm_launch(n, x, r, w, y, mode, ph)
        assert fl.threads % 32 == 0 and fl.threads <= 1024
        d = fl.defines
        assert d["CHUNK"] * d["ROW_THREADS"] >= n and d["ROW_THREADS"] * d["ROWS_PER_BLOCK"] == fl.threads
        assert nvrtc.compile_cubin("rms_norm.cu", arch, d, use_cache=False)[:4] == b"\x7fELF"
        if r is None:  # the backward of the same configuration
            bl = norm_bwd_launch(n, x, y, w, mode, ph, has_dres=ph, dw_partials=not ph)
            assert nvrtc.compile_cubin("rms_norm.cu", arch, bl.defines, use_cache=False)[:4] == b"\x7fELF"


@pytest.mark.parametrize("n", [1, 7, 100, 128, 1000, 4096, 8192, 18432, 65536])
def test_cuda_reduction_mapping_is_canon_sum(n, seed):
    """Emulates rms_norm.cu's reduction (chunk tree per thread, xor shuffles 1..16 within a warp,
    then a tree over the row's warps) with the block shape the backend picks, and checks it gives
    canon_sum's bits: the mapping itself, independent of any GPU."""
    from strictnorm.backends.cuda.backend import norm_launch
    from strictnorm.reference import canon_sum

    d = norm_launch(n, torch.bfloat16, None, torch.bfloat16, torch.bfloat16, "llama", False).defines
    chunk, threads = d["CHUNK"], d["ROW_THREADS"]
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(n, generator=g) * torch.logspace(-5, 5, n)
    lanes = torch.zeros(chunk * threads)
    lanes[:n] = row
    v = lanes.view(threads, chunk)
    while v.shape[1] > 1:  # chunk_tree: (2j, 2j+1) -> j
        v = v[:, 0::2] + v[:, 1::2]
    v = v[:, 0].clone()
    lane = torch.arange(threads)
    off = 1
    while off < min(threads, 32):  # __shfl_xor_sync: v + v[lane ^ off] (commutative: same on both lanes)
        v = v + v[lane ^ off]
        off *= 2
    if threads > 32:
        u = v[::32].clone()  # one value per warp, in warp order
        w = torch.arange(u.numel())
        off = 1
        while off < u.numel():
            u = u + u[w ^ off]
            off *= 2
        total = u[0]
    else:
        total = v[0]
    assert total.item() == canon_sum(row[None])[0].item() or (total.isnan() and canon_sum(row[None])[0].isnan())
