"""CUDA sources compile through NVRTC without a GPU; the backend reports itself unavailable cleanly."""

from __future__ import annotations

import re

import pytest
import torch

from strictnorm.backends.cuda.backend import fold_launch
from strictnorm.backends.registry import status
from strictnorm.reference import next_pow2

nvrtc = pytest.importorskip("strictnorm.backends.cuda.nvrtc")
try:
    nvrtc.nvrtc_version()
except Exception as e:  # pragma: no cover - only where the NVRTC wheel is missing
    pytest.skip(f"NVRTC not usable here: {e}", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _configs():
    """(what, a, b, ring, n, simple, out): every input dtype pairing; results in the weight dtypes where
    the backends ask for them (the partial sums of fp32 rows, the strict dW of same-dtype dy and x)."""
    for what in (0, 1, 2, 3):
        for a in DTYPES:
            for b in DTYPES if what else [a]:
                outs = DTYPES if (what == 0 and a == torch.float32) or (what and a == b) else [torch.float32]
                for ring in (False, True):
                    for n in (128, 4096, 8192):
                        for simple in (True, False):
                            for out in outs:
                                yield what, a, b, ring, n, simple, out


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_every_fold_configuration_compiles(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    seen = set()
    for what, a, b, ring, n, simple, out in _configs():
        fl = fold_launch(n, a, b, what, simple, ring, num_sms=132, out_dtype=out)
        key = (fl.kernel, tuple(sorted(fl.defines.items())))
        if key in seen:
            continue
        seen.add(key)
        cubin = nvrtc.compile_cubin("fold.cu", arch, fl.defines, use_cache=False)
        assert cubin[:4] == b"\x7fELF", f"{fl.kernel} {fl.defines}"
        assert fl.shmem <= 48 * 1024
    assert len(seen) > 50


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_onepass_configurations_compile(arch, tmp_path, monkeypatch):
    """onepass.cu at the lengths whose column groups differ (32, 64 and 256 columns a CTA, GROUPS below and
    above 32), every mode and row dtype, without a weight; within the opt-in shared memory of an H200."""
    from strictnorm.backends.cuda.backend import onepass_launch

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    cases = [(n, dt, mode, w) for n in (100, 4096, 8192, 18432) for dt in DTYPES for mode in ("llama", "gemma", "none")
             for w in (dt, None) if (mode == "llama" or dt == torch.bfloat16) and (w is not None or n == 4096)]
    for n, dt, mode, w in cases:
        fl = onepass_launch(n, dt, dt, w, mode, num_sms=132, smem_optin=227 * 1024)
        assert fl is not None and fl.grid <= 132 and fl.shmem <= 227 * 1024, (n, dt)
        cubin = nvrtc.compile_cubin("onepass.cu", arch, fl.defines, use_cache=False)
        assert cubin[:4] == b"\x7fELF", fl.defines
    assert onepass_launch(65536, torch.bfloat16, torch.bfloat16, None, "llama", 132, 227 * 1024) is None


def test_disk_cache_is_keyed_by_macros(tmp_path, monkeypatch):
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    d1 = {"A_CODE": 0, "B_CODE": 0, "WHAT": 0, "SIMPLE_ROWS": 1}
    d2 = dict(d1, WHAT=2)
    c1 = nvrtc.compile_cubin("fold.cu", "sm_90", d1)
    c2 = nvrtc.compile_cubin("fold.cu", "sm_90", d2)
    assert c1 != c2
    assert len(list((tmp_path / "cubin").glob("*.cubin"))) == 2
    assert nvrtc.compile_cubin("fold.cu", "sm_90", d1) == c1  # served from disk


def test_disk_cache_compiles_a_cut_entry_again(tmp_path, monkeypatch):
    """A cached cubin cut short (a cache copied or unpacked part way: one such file crashed a GPU test worker in the
    driver) is never returned: it is compiled again and the entry rewritten whole. whole_elf tells the two apart at
    every cut, and tells a file that is not an ELF file."""
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    defines = {"A_CODE": 0, "B_CODE": 0, "WHAT": 0, "SIMPLE_ROWS": 1}
    whole = nvrtc.compile_cubin("fold.cu", "sm_90", defines)
    assert nvrtc.whole_elf(whole)
    for cut in (0, 10, 64, len(whole) // 3, len(whole) // 2, len(whole) - 1):
        assert not nvrtc.whole_elf(whole[:cut]), cut
    assert not nvrtc.whole_elf(b"\x00" * len(whole))
    (entry,) = (tmp_path / "cubin").glob("*.cubin")
    entry.write_bytes(whole[:24576])
    assert nvrtc.compile_cubin("fold.cu", "sm_90", defines) == whole
    assert entry.read_bytes() == whole


def test_compile_errors_carry_the_nvrtc_log(tmp_path, monkeypatch):
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    with pytest.raises(nvrtc.CudaCompileError, match="fold.cu"):
        nvrtc.compile_cubin("fold.cu", "sm_90", {"A_CODE": 7, "B_CODE": 0, "WHAT": 0, "SIMPLE_ROWS": 1})



def test_source_without_macros_compiles(tmp_path, monkeypatch):
    # no macros at all is a valid NVRTC call (an empty list is not, to cuda-core): a source that needs none compiles
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    cubin = nvrtc.compile_source("extern \"C\" __global__ void k(float* p) { p[0] = 1.0f; }", "plain.cu", "sm_90", {})
    assert nvrtc.whole_elf(cubin)

def test_sources_are_packaged():
    assert "fold.cu" in nvrtc.source_names()
    assert "__fadd_rn" in nvrtc.source("fold.cu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")
def test_backend_reports_unavailable_without_gpu():
    st = status("cuda", torch.device("cpu"))
    assert not st.available and "NVIDIA" in st.reason


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_rms_norm_configurations_compile(arch, tmp_path, monkeypatch):
    from dataclasses import replace

    from strictnorm.backends.cuda.backend import (
        BWD_TABLE,
        FWD_TABLE,
        NormTuning,
        norm_bwd_launch,
        norm_launch,
        tuning_for,
    )

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    bf16, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    cases = [(n, mode, x, r, w, y, ph) for n in (7, 1000, 18432)
             for mode in ("llama", "gemma", "none")
             for x, r, w, y, ph in ((bf16, None, bf16, bf16, False), (f16, f32, f32, f32, False),
                                    (bf16, None, None, bf16, False), (bf16, None, f32, bf16, True))]
    for n, mode, x, r, w, y, ph in cases:  # rows 16-byte aligned but at N = 7: the EVEN kernels there
        fl = norm_launch(n, x, r, w, y, mode, ph, replace(tuning_for(FWD_TABLE, n), even=True), n != 7)
        assert fl.defines.get("EVEN", 0) == int(n != 7)
        assert fl.threads % 32 == 0 and fl.threads <= 1024
        d = fl.defines
        assert d["PIECE"] * d["TPR"] * d["K"] == next_pow2(n) and d["TPR"] * d["RPB"] == fl.threads
        assert nvrtc.compile_cubin("rms_norm.cu", arch, d, use_cache=False)[:4] == b"\x7fELF"
        if mode == "gemma" and not ph:  # an inference call's forward: no rstd store
            dn = norm_launch(n, x, r, w, y, mode, ph, replace(tuning_for(FWD_TABLE, n), even=True), n != 7,
                             store_rstd=False).defines
            assert dn == dict(d, NO_RSTD=1)
            assert nvrtc.compile_cubin("rms_norm.cu", arch, dn, use_cache=False)[:4] == b"\x7fELF"
        if r is None:  # the backward of the same configuration
            bl = norm_bwd_launch(n, x, y, w, mode, ph, has_dres=ph, dw_partials=not ph,
                                 tuning=replace(tuning_for(BWD_TABLE, n), even=True), aligned=n != 7)
            assert bl.defines.get("EVEN", 0) == int(n != 7)
            assert nvrtc.compile_cubin("rms_norm.cu", arch, bl.defines, use_cache=False)[:4] == b"\x7fELF"
    # padding pieces trimmed (KR < K): forward and backward, held rows and rows read twice
    for n, tuning in ((640, NormTuning(values=32, trim=True)), (18432, NormTuning(values=64, trim=True)),
                      (5120, NormTuning(values=32, hold_max_p=0, trim=True))):
        fl = norm_launch(n, bf16, None, bf16, bf16, "gemma", False, tuning)
        bl = norm_bwd_launch(n, bf16, bf16, bf16, "gemma", False, True, True, tuning)
        for d in (fl.defines, bl.defines):
            span = d["PIECE"] * d["TPR"]  # lanes of one piece index k over the row's threads
            assert 1 <= d["KR"] < d["K"] and (d["KR"] - 1) * span < n <= d["KR"] * span
            assert nvrtc.compile_cubin("rms_norm.cu", arch, d, use_cache=False)[:4] == b"\x7fELF"
    # the backward with each row's z and dy staged ahead in shared memory (held rows, EVEN): mixed dtypes (two 16-byte
    # chunks a piece of fp32), per-head weights, a residual gradient
    for n, values, z, dy, w, ph in ((1000, 32, bf16, bf16, bf16, False), (18432, 64, bf16, bf16, f32, False),
                                    (4096, 32, f32, f16, f32, True)):
        bl = norm_bwd_launch(n, z, dy, w, "gemma", ph, has_dres=True, dw_partials=not ph, aligned=True,
                             tuning=NormTuning(values=values, hold_max_p=65536, staged=True))
        assert bl.defines.get("STAGED") == 1
        assert nvrtc.compile_cubin("rms_norm.cu", arch, bl.defines, use_cache=False)[:4] == b"\x7fELF"
        # the same with the next row prefetched into registers instead (it takes STAGED's place), and unaligned
        for aligned in (True, False):
            bl = norm_bwd_launch(n, z, dy, w, "gemma", ph, has_dres=True, dw_partials=not ph, aligned=aligned,
                                 tuning=NormTuning(values=values, hold_max_p=65536, staged=True, prefetch=True))
            assert (bl.defines.get("PREFETCH"), bl.defines.get("STAGED")) == (1, None)
            assert nvrtc.compile_cubin("rms_norm.cu", arch, bl.defines, use_cache=False)[:4] == b"\x7fELF"
    # the weight's lanes loaded with each row's (W_WITH_ROW), forward and backward, fused add, mixed weight dtype
    for n, values, w in ((4096, 32, bf16), (18432, 64, f32), (1000, 8, f16)):
        tuning = NormTuning(values=values, hold_weight=False, hold_max_p=65536, weight_with_row=True)
        fl = norm_launch(n, bf16, bf16, w, bf16, "gemma", False, tuning, aligned=True)
        bl = norm_bwd_launch(n, bf16, bf16, w, "gemma", False, has_dres=True, dw_partials=True, aligned=True,
                             tuning=replace(tuning, prefetch=True))
        for d in (fl.defines, bl.defines):
            assert d["W_WITH_ROW"] == 1
            assert nvrtc.compile_cubin("rms_norm.cu", arch, d, use_cache=False)[:4] == b"\x7fELF"


def _emulate_row_sum(row: torch.Tensor, piece: int, tpr: int, k: int) -> torch.Tensor:
    """rms_norm.cu's reduction, step by step on the CPU: piece trees, xor shuffles within a warp,
    then the subtrees k * warps + warp (in-thread, or through shared memory by runs and shuffles)."""
    p = piece * tpr * k
    lanes = torch.zeros(p)
    lanes[: row.numel()] = row
    # thread t, slot k holds piece k * tpr + t
    v = lanes.view(k, tpr, piece)
    while v.shape[2] > 1:  # pair_tree over the piece: (2j, 2j+1) -> j
        v = v[:, :, 0::2] + v[:, :, 1::2]
    part = v[:, :, 0].clone()  # (k, tpr)
    t = torch.arange(tpr)
    off = 1
    while off < min(tpr, 32):  # __shfl_xor_sync within the warp: both lanes get the same sum
        part = part + part[:, t ^ off]
        off *= 2
    if tpr <= 32:
        u = part[:, 0]  # subtree k
        while u.numel() > 1:
            u = u[0::2] + u[1::2]
        return u[0]
    s = part[:, ::32].reshape(-1)  # shared memory: index k * (tpr // 32) + warp
    if s.numel() >= 32:
        u = s.view(32, -1)
        while u.shape[1] > 1:
            u = u[:, 0::2] + u[:, 1::2]
        u = u[:, 0].clone()
        lane = torch.arange(32)
        off = 1
        while off < 32:
            u = u + u[lane ^ off]
            off *= 2
    else:
        u = torch.cat([s, torch.zeros(32 - s.numel())])
        lane = torch.arange(32)
        off = 1
        while off < s.numel():
            u = u + u[lane ^ off]
            off *= 2
    return u[0]


@pytest.mark.parametrize("n", [1, 7, 100, 128, 1000, 4096, 8192, 18432, 65536])
def test_cuda_reduction_mapping_is_canon_sum(n, seed):
    """The reduction of rms_norm.cu, emulated with every block shape the tuning knobs can give,
    gives canon_sum's bits: the mapping itself, independent of any GPU."""
    from strictnorm.backends.cuda.backend import NormTuning, norm_launch
    from strictnorm.reference import canon_sum

    g = torch.Generator().manual_seed(seed)
    row = torch.randn(n, generator=g) * torch.logspace(-5, 5, n)
    want = canon_sum(row[None])[0]
    shapes = set()
    for values in (8, 16, 32):
        for hold_max_p in (0, 1 << 16):
            for stream_threads in (128, 256, 1024):
                tu = NormTuning(values=values, hold_max_p=hold_max_p, stream_threads=stream_threads)
                for dt in (torch.bfloat16, torch.float32):
                    d = norm_launch(n, dt, None, dt, dt, "llama", False, tu).defines
                    shapes.add((d["PIECE"], d["TPR"], d["K"]))
    for piece, tpr, k in sorted(shapes):
        got = _emulate_row_sum(row, piece, tpr, k)
        assert torch.equal(got, want), f"piece {piece} tpr {tpr} k {k}"
    if n >= 1000:  # the check can fail: the same values one lane over give other bits
        piece, tpr, k = max(shapes)
        plain = torch.zeros(n)
        plain[:4] = torch.tensor([2.0**24, 1.0, 1.0, -(2.0**24)])  # (2^24 + 1) + (1 - 2^24) = 1
        assert _emulate_row_sum(plain, piece, tpr, k).item() == canon_sum(plain[None])[0].item() == 1.0
        assert _emulate_row_sum(plain.roll(1), piece, tpr, k).item() == 2.0


def test_tuning_tables_cover_every_row_length():
    from strictnorm.backends.cuda.backend import BWD_TABLE, FWD_TABLE, tuning_for

    for table in (FWD_TABLE, BWD_TABLE):
        for entries in table.values():
            assert entries[-1][0] is None  # every length has an unbounded entry
        big = table[4096][-1][1]
        assert tuning_for(table, 4096) is big and tuning_for(table, 4096, 1 << 20) is big
        assert tuning_for(table, 4000) is big  # padded to 4096
        assert tuning_for(table, 1) is table[min(table)][-1][1]
        assert tuning_for(table, 65536) is table[max(table)][-1][1]


def test_inference_forward_takes_its_own_entries():
    """forward_tuning: an inference call (need_rstd False) takes FWD_INFERENCE_TABLE's entry for its padded length and
    row count; a training call, and an inference call at a length the table lacks, FWD_TABLE's."""
    from strictnorm.backends.cuda.backend import FWD_INFERENCE_TABLE, FWD_TABLE, forward_tuning, tuning_for

    assert FWD_INFERENCE_TABLE and all(entries[-1][0] is None for entries in FWD_INFERENCE_TABLE.values())
    for p, entries in FWD_INFERENCE_TABLE.items():
        for n in (p // 2 + 1, p):
            for rows in [b for b, _ in entries[:-1]] + [1 << 20]:
                assert forward_tuning(n, rows, need_rstd=False) is tuning_for(FWD_INFERENCE_TABLE, n, rows)
                assert forward_tuning(n, rows) is tuning_for(FWD_TABLE, n, rows)
    # 262144 x 128 differs between the two (the run-42 sweep's entry); rows of 4096 columns have no inference entry
    assert forward_tuning(128, 262144, need_rstd=False) != forward_tuning(128, 262144)
    assert 4096 not in FWD_INFERENCE_TABLE
    assert forward_tuning(4096, 8192, need_rstd=False) is tuning_for(FWD_TABLE, 4096, 8192)


def test_row_bounded_entries_apply_within_their_bound():
    from strictnorm.backends.cuda.backend import BWD_TABLE, tuning_for

    entries = BWD_TABLE[4096]
    assert len(entries) > 1 and entries[-1][0] is None
    low = 1
    for bound, tuning in entries[:-1]:
        assert tuning_for(BWD_TABLE, 4096, low) is tuning and tuning_for(BWD_TABLE, 4096, bound) is tuning
        low = bound + 1
    assert tuning_for(BWD_TABLE, 4096, low) is entries[-1][1] and tuning_for(BWD_TABLE, 4096) is entries[-1][1]


def _blocks_an_sm_by_registers(registers: int, threads: int) -> int:
    """Blocks of `threads` an sm_90 SM holds as far as registers and threads go: 65536 registers, allotted a warp at
    a time in multiples of 8 a thread; at most 2048 threads and 32 blocks."""
    warps, allotted = -(-threads // 32), -(-registers // 8) * 8
    return min(32, 2048 // threads, 65536 // (warps * allotted * 32))


# (rows, N): the blocks an SM of the inference forward's and the backward's (dw="fast") tiles at bf16 as the tables
# were measured with (NVRTC 13.0.88, sm_90); 262144 x 128: FWD_INFERENCE_TABLE's 128-thread blocks, 12 an SM.
# Some sit on an edge: the backward at 2048 x 4096 (512 threads, 64 registers, two blocks an SM as its tuning caps
# it) took 68 registers with the row mean by multiplication, one block an SM, and 21.1-21.5 -> 25.4 us
# (bench/results/2026-12-03-h200-run34, call b); so did the forward at 2048 x 18432 (64).
_BLOCKS_AN_SM = {(128, 4096): (2, 1), (2048, 4096): (8, 2), (8192, 4096): (10, 3), (32768, 4096): (10, 3),
                 (8192, 8192): (6, 2), (2048, 18432): (2, 1), (262144, 128): (12, 6)}


def test_tiles_keep_the_blocks_an_sm_they_were_measured_with(tmp_path, monkeypatch):
    """A source or table change that costs a tile registers enough to hold fewer blocks an SM fails here, before a
    GPU run would find it slower (the registers ptxas allots, read from the cubin)."""
    from strictnorm.backends.cuda.backend import BWD_TABLE, forward_tuning, norm_bwd_launch, norm_launch, tuning_for

    if nvrtc.nvrtc_version() != "13.0":  # another ptxas allots other counts; CI pins the GPU's NVRTC
        pytest.skip(f"the blocks an SM were measured with NVRTC 13.0, not {nvrtc.nvrtc_version()}")
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    bf16, seen = torch.bfloat16, {}
    for (rows, n), (fwd_blocks, bwd_blocks) in _BLOCKS_AN_SM.items():
        fwd = norm_launch(n, bf16, None, bf16, bf16, "llama", False, forward_tuning(n, rows, need_rstd=False), True,
                          False)  # the inference forward, as the bench times it
        bwd = norm_bwd_launch(n, bf16, bf16, bf16, "llama", False, False, True, tuning_for(BWD_TABLE, n, rows), True)
        for launch, kernel, want in ((fwd, "rms_fwd", fwd_blocks), (bwd, "rms_bwd", bwd_blocks)):
            key = tuple(sorted(launch.defines.items()))
            if key not in seen:
                seen[key] = nvrtc.cubin_registers(nvrtc.compile_cubin("rms_norm.cu", "sm_90", launch.defines))[kernel]
            got = _blocks_an_sm_by_registers(seen[key], launch.threads)
            assert got >= want, f"{kernel} {rows} x {n}: {seen[key]} registers, {got} blocks an SM (measured: {want})"


def test_min_blocks_bounds_the_registers_and_is_off_by_default(tmp_path, monkeypatch):
    """NormTuning.min_blocks compiles the kernel for that many blocks an SM (MIN_BLOCKS): the forward's and the
    backward's registers then fit 65536 / (threads x blocks), where without it they do not; 0 (every table entry's
    default) adds no macro, so those kernels' cubins and cache keys stay as they were."""
    from dataclasses import replace

    from strictnorm.backends.cuda.backend import BWD_TABLE, forward_tuning, norm_bwd_launch, norm_launch, tuning_for

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    bf16 = torch.bfloat16
    fwd_tuning, bwd_tuning = forward_tuning(128, 65536, need_rstd=False), tuning_for(BWD_TABLE, 128, 65536)
    assert fwd_tuning.min_blocks == bwd_tuning.min_blocks == 0
    for blocks in (0, 16):
        fwd = norm_launch(128, bf16, None, bf16, bf16, "llama", False, replace(fwd_tuning, min_blocks=blocks), True,
                          False)
        bwd = norm_bwd_launch(128, bf16, bf16, bf16, "llama", False, False, True,
                              replace(bwd_tuning, min_blocks=blocks), True)
        for launch, kernel in ((fwd, "rms_fwd"), (bwd, "rms_bwd")):
            assert launch.defines.get("MIN_BLOCKS", 0) == blocks
            registers = nvrtc.cubin_registers(nvrtc.compile_cubin("rms_norm.cu", "sm_90", launch.defines))[kernel]
            bound = 65536 // (launch.threads * 16)
            if blocks:
                assert registers <= bound, (kernel, registers, bound)
            elif nvrtc.nvrtc_version() == "13.0":  # the counts without the bound were read with that ptxas
                assert registers > bound, (kernel, registers, bound)


def test_a_min_blocks_bound_that_spills_is_dropped_when_loaded(tmp_path, monkeypatch):
    """compile_for_load keeps a MIN_BLOCKS bound ptxas meets in registers (bf16 rows of 128, 16 blocks of 128
    threads: 32 registers, no stack) and drops one that makes it spill (fp32 rows of 8192 at 8 blocks of 256):
    the kernel loaded then is the unbounded one, with no stack."""
    from dataclasses import replace

    from strictnorm.backends.cuda.backend import forward_tuning, norm_launch

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    bf16, f32 = torch.bfloat16, torch.float32
    cases = ((128, bf16, 16), (8192, f32, 8))
    for n, dtype, blocks in cases:
        tuning = replace(forward_tuning(n, 1 << 20, need_rstd=False), min_blocks=blocks)
        defines = norm_launch(n, dtype, None, dtype, dtype, "llama", False, tuning, True, False).defines
        bounded = nvrtc.compile_cubin("rms_norm.cu", "sm_90", defines)
        free = nvrtc.compile_cubin("rms_norm.cu", "sm_90", {k: v for k, v in defines.items() if k != "MIN_BLOCKS"})
        loaded = nvrtc.compile_for_load("rms_norm.cu", "sm_90", defines, "rms_fwd")
        spills = nvrtc.cubin_stack(bounded)["rms_fwd"] > nvrtc.cubin_stack(free)["rms_fwd"]
        assert loaded == (free if spills else bounded), (n, dtype)
        assert nvrtc.cubin_stack(loaded)["rms_fwd"] == 0
        if nvrtc.nvrtc_version() == "13.0":  # which of the two spills was read with that ptxas
            assert spills == (dtype == f32), (n, dtype)
    plain = norm_launch(128, bf16, None, bf16, bf16, "llama", False, forward_tuning(128, 1 << 20), True).defines
    assert nvrtc.compile_for_load("rms_norm.cu", "sm_90", plain, "rms_fwd") == nvrtc.compile_cubin(
        "rms_norm.cu", "sm_90", plain)


def test_cubin_registers_reads_each_kernel(tmp_path, monkeypatch):
    """cubin_registers names every kernel of a cubin with a plausible count; a source whose kernel needs more
    registers reports more."""
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    small = nvrtc.compile_cubin("rms_norm.cu", "sm_90", dict(norm_launch_defines(128)))
    big = nvrtc.compile_cubin("rms_norm.cu", "sm_90", dict(norm_launch_defines(4096, values=64)))
    assert set(nvrtc.cubin_registers(small)) == {"rms_fwd"} and set(nvrtc.cubin_registers(big)) == {"rms_fwd"}
    assert 16 <= nvrtc.cubin_registers(small)["rms_fwd"] < nvrtc.cubin_registers(big)["rms_fwd"] <= 255


def norm_launch_defines(n: int, values: int = 0) -> dict[str, int]:
    """rms_norm.cu's forward macros at N columns of bf16 (values: fp32 lanes a thread holds, more registers)."""
    from dataclasses import replace

    from strictnorm.backends.cuda.backend import FWD_TABLE, norm_launch, tuning_for

    tuning = tuning_for(FWD_TABLE, n)
    tuning = replace(tuning, values=values) if values else tuning
    return norm_launch(n, torch.bfloat16, None, torch.bfloat16, torch.bfloat16, "llama", False, tuning, True).defines


@pytest.mark.parametrize("what, dtype", [(0, torch.float32), (1, torch.bfloat16)])
def test_fold_ring_knobs_compile(what, dtype, tmp_path, monkeypatch):
    """fold.cu's sweep knobs (bench/sweep_fold.py): the default ring unrolls whole stages (FULL_STAGE);
    other ring shapes and the 16-row unroll compile; a ring whose two stages exceed the shared memory
    limit is refused with a clear error instead of failing at launch."""
    from strictnorm.backends.cuda.backend import FoldTuning

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    ring = fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=FoldTuning())
    assert ring.kernel == "fold_ring" and ring.defines["FULL_STAGE"] == 1
    for tuning in (FoldTuning(full_stage=False), FoldTuning(cols=16, rows_per_stage=64, full_stage=False)):
        fl = fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=tuning)
        assert "FULL_STAGE" not in fl.defines and fl.shmem <= 48 * 1024
        assert nvrtc.compile_cubin("fold.cu", "sm_90", fl.defines, use_cache=False)[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="shared memory"):
        fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=FoldTuning(cols=32, rows_per_stage=512))
    # a bigger ring opted into (smem_bytes): more stages, and the dW fold converts stages of 256 rows
    small = fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=FoldTuning(rows_per_stage=256))
    big = fold_launch(128, dtype, dtype, what, True, True, num_sms=132,
                      tuning=FoldTuning(rows_per_stage=256, smem_bytes=200 * 1024))
    assert 48 * 1024 < big.shmem <= 200 * 1024 and big.defines["STAGES"] > small.defines["STAGES"]
    assert big.defines["CONVERT"] == int(what != 0) and small.defines["CONVERT"] == 0
    assert nvrtc.compile_cubin("fold.cu", "sm_90", big.defines, use_cache=False)[:4] == b"\x7fELF"
    # the dW fold's contributions column-major (four rows a consumer load); nothing to convert in a plain fold
    # fold_chain: items of chain_rows rows spread over the SMs (one group only: per-head folds keep the ring)
    chain = FoldTuning(chain_rows=1024, smem_bytes=100 * 1024)
    fl = fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=chain, rows=262144)
    assert fl.kernel == "fold_chain" and fl.state_ints == 2 + 256 * 16 * 8 * 2 and fl.grid_x == 264
    assert nvrtc.compile_cubin("fold.cu", "sm_90", fl.defines, use_cache=False)[:4] == b"\x7fELF"
    assert fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=chain, rows=262144,
                       groups=4).kernel == "fold_ring"
    with pytest.raises(ValueError, match="shared memory"):
        fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=FoldTuning(chain_rows=8192), rows=9)
    cm = fold_launch(128, dtype, dtype, what, True, True, num_sms=132, tuning=FoldTuning(column_major=True))
    assert cm.defines.get("COLUMN_MAJOR", 0) == int(what != 0)
    assert nvrtc.compile_cubin("fold.cu", "sm_90", cm.defines, use_cache=False)[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_fold_stream_compiles_and_plans(arch, tmp_path, monkeypatch):
    """fold_stream (FoldTuning.stream): the widest columns that still give most SMs a CTA, up to 8 row segments a
    converting lane, addend buffers cut where the CTAs an SM holds would not fit, every dtype and both folds
    compiling through NVRTC; shapes it cannot take refused clearly."""
    from strictnorm.backends.cuda.backend import FoldTuning

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    h200, bf16 = 227 * 1024, torch.bfloat16
    stream = FoldTuning(stream=True)
    for n, cols, rows in ((4096, 32, 64), (8192, 64, 32), (18432, 64, 32), (2048, 16, 64), (1024, 8, 64),
                          (128, 8, 64)):
        fl = fold_launch(n, bf16, bf16, 1, True, True, num_sms=132, tuning=stream, rows=32768, smem_optin=h200)
        assert fl.kernel == "fold_stream" and fl.grid_x == -(-n // cols)
        assert (fl.defines["COLS"], fl.defines["STREAM_ROWS"]) == (cols, rows) and fl.shmem <= h200
        assert fl.block == (max(1, cols // 32) + 8) * 32 and fl.defines["CSTAGES"] % 8 == 0
    # 288 CTAs of 64 columns at 18432: three an SM, each within a third of its shared memory (8 buffers, not 16)
    wide = fold_launch(18432, bf16, bf16, 1, True, True, num_sms=132, tuning=stream, smem_optin=h200)
    assert wide.shmem <= 228 * 1024 // 3 - 1024 and wide.defines["CSTAGES"] == 8
    for a_dtype, b_dtype, what in ((bf16, bf16, 1), (torch.float16, torch.float16, 1), (bf16, torch.float32, 1),
                                   (torch.float32, torch.float32, 0), (bf16, bf16, 0)):
        for cols in (8, 32, 64):
            fl = fold_launch(4096, a_dtype, b_dtype, what, True, True, num_sms=132, smem_optin=h200,
                             tuning=FoldTuning(stream=True, cols=cols))
            assert nvrtc.compile_cubin("fold.cu", arch, fl.defines, use_cache=False)[:4] == b"\x7fELF"
    # the buffers padded after each group of 8 columns: 8 floats more a group, the default's macros untouched
    padded = fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, smem_optin=h200,
                         tuning=FoldTuning(stream=True, pad_groups=True))
    plain = fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, smem_optin=h200, tuning=stream)
    assert padded.defines["GROUP_PAD"] == 8 and "GROUP_PAD" not in plain.defines
    assert padded.shmem - plain.shmem == plain.defines["CSTAGES"] * 4 * 8 * 4
    assert nvrtc.compile_cubin("fold.cu", arch, padded.defines, use_cache=False)[:4] == b"\x7fELF"
    # the consumers alone on their sub-partitions: converters on warps 1-3, 5-7, ... (one consumer), 2-3, 6-7, ... (two)
    for cols, warps, threads in ((8, 4, 6 * 32), (32, 8, 11 * 32), (64, 3, 7 * 32)):
        fl = fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, smem_optin=h200,
                         tuning=FoldTuning(stream=True, cols=cols, convert_warps=warps, isolate=True))
        assert fl.defines["ISOLATE"] == 1 and fl.block == threads
        assert nvrtc.compile_cubin("fold.cu", arch, fl.defines, use_cache=False)[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="isolate"):
        fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, smem_optin=h200,
                    tuning=FoldTuning(stream=True, cols=128, isolate=True))
    for bad in (FoldTuning(stream=True, cols=24), FoldTuning(stream=True, cols=48), FoldTuning(stream=True, cols=256),
                FoldTuning(stream=True, rows_per_stage=30), FoldTuning(stream=True, cols=8, rows_per_stage=16)):
        with pytest.raises(ValueError, match="fold_stream takes"):
            fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, tuning=bad, smem_optin=h200)
    with pytest.raises(ValueError, match="buffers"):
        fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, smem_optin=h200,
                    tuning=FoldTuning(stream=True, convert_warps=4, buffers=6))
    with pytest.raises(ValueError, match="shared memory"):
        fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, smem_optin=h200,
                    tuning=FoldTuning(stream=True, cols=128, rows_per_stage=128))


def test_default_folds_below_4096_columns():
    """Without a FoldTuning, below 4096 columns: fold_chain for one group of many rows (the dW fold from 65536 rows up
    to 256 columns, the plain fold from 32768 rows up to 512) with items as long as the device's shared memory allows;
    else the dW fold takes fold_stream (8 columns a CTA in stages of 256 rows with 4 converting warps and the consumer
    isolated where the columns are few, wider stripes where they still give most SMs a CTA) where its buffers fit, the
    plain fold too from 4096 rows up to 512 columns (in stages of 128 rows below 16384 rows, of 512 from there), and
    the ring elsewhere (H200, session 22; run 23)."""
    from strictnorm.backends.cuda.backend import default_chain, default_stream

    h200, bf16, f32 = 227 * 1024, torch.bfloat16, torch.float32
    for n, rows, groups, cols, stage, warps in ((128, 4096, 1, 8, 256, 4), (128, 65535, 1, 8, 256, 4),
                                                (1000, 8192, 1, 8, 256, 4), (2048, 8192, 1, 16, 64, 8),
                                                (128, 4099, 8, 8, 256, 4), (128, 262144, 32, 32, 64, 8),
                                                (1000, 4099, 16, 64, 32, 4), (257, 262144, 1, 8, 256, 4),
                                                (1024, 32768, 1, 8, 256, 4)):
        fl = fold_launch(n, bf16, bf16, 1, True, True, num_sms=132, rows=rows, groups=groups, smem_optin=h200)
        assert fl.kernel == "fold_stream" and fl.grid_x == -(-n // cols) and fl.shmem <= h200, (n, rows, groups)
        assert (fl.defines["COLS"], fl.defines["STREAM_ROWS"], fl.defines["CONVERT_WARPS"]) == (cols, stage, warps)
        assert fl.defines.get("ISOLATE", 0) == (cols == 8) and fl.block == (6 * 32 if cols == 8 else fl.block)
    # the plain fold's fold_stream: 8 isolated columns, 4 converting warps, 128- or 512-row stages
    for n, rows, stage in ((128, 4096, 128), (512, 16383, 128), (128, 16384, 512), (300, 32767, 512)):
        fl = fold_launch(n, f32, f32, 0, True, True, num_sms=132, rows=rows, smem_optin=h200)
        assert fl.kernel == "fold_stream" and fl.grid_x == -(-n // 8) and fl.shmem <= h200, (n, rows)
        assert (fl.defines["COLS"], fl.defines["STREAM_ROWS"], fl.defines["CONVERT_WARPS"]) == (8, stage, 4)
        assert fl.defines["ISOLATE"] == 1
    for n, rows, groups in ((128, 4095, 1), (513, 8192, 1), (128, 32768, 1), (128, 8192, 2)):
        assert default_stream(n, groups, 132, 0, rows) is None, (n, rows, groups)
    for n, rows, what, chain_rows in ((128, 65536, 1, 4096), (128, 262144, 1, 4096), (256, 65536, 1, 4096),
                                      (128, 32768, 0, 4096), (512, 32768, 0, 4096)):
        dt = bf16 if what else f32
        fl = fold_launch(n, dt, dt, what, True, True, num_sms=132, rows=rows, smem_optin=h200)
        assert fl.kernel == "fold_chain" and fl.defines["CHAIN_ROWS"] == chain_rows and fl.defines["COLS"] == 8
        assert fl.shmem <= h200 and default_chain(n, rows, 1, h200, what).chain_rows == chain_rows
    for n, rows in ((128, 32767), (512, 32767), (513, 262144), (2048, 1024)):
        assert default_chain(n, rows, 1, h200, 0) is None
    for n, rows in ((128, 4095), (513, 262144), (2048, 1024)):
        assert fold_launch(n, f32, f32, 0, True, True, num_sms=132, rows=rows, smem_optin=h200).kernel == "fold_ring"
    for n, rows, groups in ((257, 262144, 1), (128, 65535, 1), (128, 262144, 8)):
        assert default_chain(n, rows, groups, h200) is None
    assert default_chain(128, 262144, 1, 99 * 1024).chain_rows == 2048  # e.g. sm_89: 99 KB a block
    assert default_chain(128, 262144, 1, 48 * 1024).chain_rows == 1024
    assert default_chain(128, 262144, 1, 16 * 1024) is None
    # 8 buffers of 256 rows x 8 columns (67 KB) past the 48 KB any launch may use: one a converting warp (33 KB);
    # past what the device offers (16 KB): the ring
    for optin in (0, 48 * 1024):
        fl = fold_launch(128, bf16, bf16, 1, True, True, num_sms=132, rows=4096, smem_optin=optin)
        assert fl.kernel == "fold_stream" and fl.defines["CSTAGES"] == 4 and fl.shmem <= 48 * 1024
    fl = fold_launch(128, bf16, bf16, 1, True, True, num_sms=132, rows=4096, smem_optin=16 * 1024)
    assert fl.kernel == "fold_ring"


def test_default_plain_ring(tmp_path, monkeypatch):
    """The plain fold's ring without a FoldTuning (backend.default_ring, H200 run 22): 32 columns x 128 rows a stage
    in 96 KB where 32-column CTAs fill 90% of the SMs but not all, below 16384 rows; 16 columns x 512 rows in 96 KB
    from 4096 rows where 16-column CTAs are at most one an SM (and fold_stream does not take the fold: up to 512
    columns, since run 23); else, and on devices of less than 96 KB a block, for per-head groups and for the dW fold,
    the 48 KB ring of _ring_shape. The new shapes compile."""
    from strictnorm.backends.cuda.backend import default_ring

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    h200, f32 = 227 * 1024, torch.float32
    for n, rows, shape in ((4096, 1024, (32, 128, 6)), (4096, 16383, (32, 128, 6)), (3800, 4096, (32, 128, 6)),
                           (4096, 16384, (16, 256, 3)), (2048, 4096, (16, 512, 3)), (1024, 4096, (16, 512, 3)),
                           (513, 32767, (16, 512, 3)), (128, 4095, (16, 256, 3)), (2113, 4096, (16, 256, 3)),
                           (8192, 4096, (32, 64, 6)), (1024, 1024, (16, 256, 3))):
        fl = fold_launch(n, f32, f32, 0, True, True, num_sms=132, rows=rows, smem_optin=h200)
        assert fl.kernel == "fold_ring", (n, rows)
        assert (fl.defines["COLS"], fl.defines["ROWS_PER_STAGE"], fl.defines["STAGES"]) == shape, (n, rows)
        assert fl.shmem == shape[0] * shape[1] * shape[2] * 4 and fl.defines["FULL_STAGE"] == 1
        if shape[2] * shape[0] * shape[1] * 4 > 48 * 1024:
            assert nvrtc.compile_cubin("fold.cu", "sm_90", fl.defines, use_cache=False)[:4] == b"\x7fELF"
    # fewer SMs: the same rule by the device's count (4096 columns on 140 SMs: 128 CTAs are 91%)
    assert default_ring(4096, 4096, 1, 140, h200, 0).cols == 32 and default_ring(4096, 4096, 1, 150, h200, 0) is None
    for n, rows, groups, optin, what in ((4096, 4096, 1, 64 * 1024, 0), (4096, 4096, 1, 0, 0), (128, 8192, 4, h200, 0),
                                         (4096, 4096, 1, h200, 1), (128, 8192, 1, h200, 1)):
        assert default_ring(n, rows, groups, 132, optin, what) is None, (n, rows, groups, optin, what)
    fl = fold_launch(4096, f32, f32, 0, True, True, num_sms=132, rows=4096, smem_optin=64 * 1024)
    assert (fl.defines["COLS"], fl.defines["ROWS_PER_STAGE"], fl.shmem) == (16, 256, 48 * 1024)


def test_default_dw_fold_is_the_stream_from_4096_columns():
    """Without a FoldTuning the dW fold from 4096 columns (where fold_chain and default_dw_ring do not apply) is
    fold_stream, 32 columns a CTA up to 8192 columns and 16 beyond, 8 converting warps where the CTAs are one an SM,
    else 4 (H200, run 20); the plain fold keeps the ring, and so does a device whose shared memory is not known or
    too small."""
    h200, bf16 = 227 * 1024, torch.bfloat16
    for n, groups, cols, warps in ((4096, 1, 32, 8), (8192, 2, 32, 4), (18432, 1, 16, 4), (4096, 2, 32, 4)):
        fl = fold_launch(n, bf16, bf16, 1, True, True, num_sms=132, rows=32768, groups=groups, smem_optin=h200)
        assert fl.kernel == "fold_stream" and (fl.defines["COLS"], fl.defines["CONVERT_WARPS"]) == (cols, warps)
    for n, what, optin in ((4096, 0, h200), (8192, 0, h200), (4096, 1, 0)):
        dt = bf16 if what else torch.float32
        assert fold_launch(n, dt, dt, what, True, True, num_sms=132, rows=32768, smem_optin=optin).kernel == "fold_ring"


def test_sms_shared_out_between_the_fold_and_the_dx_pass():
    """CudaBackend.fold_sms's arithmetic (no GPU: the residency query's cached answer stands in): fold_chain's grid
    sized for the fold's SMs, the dx pass's persistent grid for the rest; a non-persistent grid untouched."""
    from strictnorm.backends.cuda.backend import CudaBackend, FoldTuning

    bf16 = torch.bfloat16
    chain = FoldTuning(cols=32, chain_rows=1024, smem_bytes=227 * 1024)
    whole = fold_launch(4096, bf16, bf16, 1, True, True, num_sms=132, tuning=chain, rows=32768)
    shared = fold_launch(4096, bf16, bf16, 1, True, True, num_sms=24, tuning=chain, rows=32768)
    assert (whole.grid_x, shared.grid_x) == (132, 24)  # one 131 KB item a CTA, one CTA an SM
    b = CudaBackend()
    kernel = object()
    b._resident[(0, id(kernel), 256, 0)] = (4, 132)  # 4 blocks an SM, 132 SMs
    assert b._grid(0, kernel, 256, 10**6) == 528
    assert b._grid(0, kernel, 256, 10**6, sms_left=24) == 4 * 108
    assert b._grid(0, kernel, 256, 100, sms_left=24) == 100
    assert b._grid(0, kernel, 256, 10**6, sms_left=500) == 4  # at least one SM's worth
    assert b._grid(0, kernel, 256, 10**6, persistent=False, sms_left=24) == 10**6


def test_tuning_file_replaces_entries_with_row_bounds(tmp_path, monkeypatch):
    """STRICTNORM_CUDA_TUNING as bench/sweep_cuda.py writes it: [max rows, knobs] entries per P (or one
    bare knobs object); the last entry must be unbounded."""
    import json

    from strictnorm.backends.cuda import backend as cb

    monkeypatch.setattr(cb, "FWD_TABLE", dict(cb.FWD_TABLE))
    monkeypatch.setattr(cb, "BWD_TABLE", dict(cb.BWD_TABLE))
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"fwd": {"4096": [[64, {"values": 8}], [None, {"values": 32, "persistent": False}]]},
                                "bwd": {"128": {"values": 16, "partial_blocks_per_sm": 4}}}))
    monkeypatch.setenv("STRICTNORM_CUDA_TUNING", str(path))
    cb._load_tuning_file()
    assert cb.tuning_for(cb.FWD_TABLE, 4096, 64).values == 8
    assert cb.tuning_for(cb.FWD_TABLE, 4096, 65) == cb.NormTuning(values=32, persistent=False)
    assert cb.tuning_for(cb.BWD_TABLE, 100) == cb.NormTuning(values=16, partial_blocks_per_sm=4)
    path.write_text(json.dumps({"fwd": {"4096": [[64, {"values": 8}]]}}))
    with pytest.raises(ValueError, match="must be unbounded"):
        cb._load_tuning_file()


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_partial_sum_compiles(arch, tmp_path, monkeypatch):
    """partial_sum.cu (the fast dW's sum of partial rows): 16-byte and scalar loads, fp32 and 16-bit outputs."""
    from strictnorm.backends.cuda.backend import _SUM_COLS, _SUM_THREADS

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    for vec, out in ((4, None), (1, None), (4, 1), (1, 2)):
        defines = {"SUM_COLS": _SUM_COLS, "SUM_THREADS": _SUM_THREADS, "VEC": vec, **({"OUT_CODE": out} if out else {})}
        assert nvrtc.compile_cubin("partial_sum.cu", arch, defines, use_cache=False)[:4] == b"\x7fELF"


def _nvdisasm():
    import pathlib

    triton = pytest.importorskip("triton")
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        pytest.skip("no nvdisasm in this Triton install")
    return tool


# An integer min/max whose predicate output a branch uses. ptxas (NVRTC 13.0.88, sm_90) compiled the held
# weight's `aligned && max(0, min(PIECE, left)) == PIECE` to VIMNMX.RELU with a predicate output, and on an
# H200 the branch on it took the 16-byte load for pieces wholly in the padding (left == 0): a read past the
# weight's end (compute-sanitizer memcheck), garbage in padded lanes and, before the padded products were
# selected to +0.0, an all-NaN dx at N = 5120 (bench/NOTES.md). rms_norm.cu keeps `left` unclamped.
_PREDICATED_MIN_MAX = re.compile(r"VIMNMX[.\w]* R\w+, P\d")


@pytest.mark.parametrize("n, tuning", [(5120, None), (1000, None), (7, {"values": 8}), (4096, {"values": 8})])
def test_no_predicated_min_max_in_the_sass(n, tuning, tmp_path, monkeypatch):
    """The configurations whose sm_90 code had the pattern above (forward, backward with and without dW
    partials, llama and gemma), disassembled: none of it left."""
    import subprocess

    from strictnorm.backends.cuda.backend import NormTuning, norm_bwd_launch, norm_launch

    tool = _nvdisasm()
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    bf16, tun = torch.bfloat16, NormTuning(**tuning) if tuning else None
    for mode in ("llama", "gemma"):
        for defines in (norm_launch(n, bf16, None, bf16, bf16, mode, False, tun).defines,
                        *(norm_bwd_launch(n, bf16, bf16, bf16, mode, False, True, partials, tun).defines
                          for partials in (False, True))):
            cubin = tmp_path / "k.cubin"
            cubin.write_bytes(nvrtc.compile_cubin("rms_norm.cu", "sm_90", defines, use_cache=False))
            sass = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            assert "LDG" in sass, "disassembly without loads"
            hits = _PREDICATED_MIN_MAX.findall(sass)
            assert not hits, f"{mode} {defines}: {hits}"


def test_staged_only_where_it_applies_and_fits():
    """STAGED takes held rows with EVEN and no dw_smem, and at most 160 KB of stages a block (sm_80 allows 164)."""
    from strictnorm.backends.cuda.backend import NormTuning, norm_bwd_launch, staged_smem

    bf16, f32 = torch.bfloat16, torch.float32
    held = NormTuning(values=64, hold_max_p=65536, staged=True)

    def launch(z=bf16, dy=bf16, tuning=held, aligned=True, n=18432):
        return norm_bwd_launch(n, z, dy, bf16, "llama", False, False, True, tuning, aligned).defines

    d = launch()
    assert d.get("STAGED") == 1 and staged_smem(d, bf16, bf16) == 2 * 512 * 5 * 8 * 4 == 160 * 1024
    assert "STAGED" not in launch(z=f32, dy=f32)  # 320 KB of stages
    assert "STAGED" not in launch(aligned=False)  # no EVEN
    assert "STAGED" not in launch(tuning=NormTuning(values=64, hold_max_p=0, staged=True))  # rows read twice
    assert "STAGED" not in launch(tuning=NormTuning(values=32, dw_smem=True, staged=True), n=4096)
    assert staged_smem(launch(tuning=NormTuning(values=64, hold_max_p=65536)), bf16, bf16) == 0


def test_default_dw_fold_of_4096_to_8192_columns(tmp_path, monkeypatch):
    """Without a FoldTuning, the dW fold of 4096 to 8192 columns (one group) takes the ring of 32-column CTAs with its
    stages converted where its CTAs outnumber the SMs (128 rows a stage in 96 KB) or its rows are fewer than 8192
    (256 rows in 200 KB), fold_stream elsewhere, per-head groups and other widths unchanged (H200, run 27); where
    the 32-column CTAs outnumber the SMs, fold_stream from 2048 rows in 16-column CTAs where those are at most three
    an SM, else from 4096 rows in 64-column CTAs of 8 converting warps and padded buffers (run 30); each compiles for
    sm_90."""
    from strictnorm.backends.cuda.backend import FoldTuning, default_dw_ring, default_stream

    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    h200, bf16 = 227 * 1024, torch.bfloat16
    for n, rows, cols, stage, warps, pad in ((5120, 2048, 16, 64, 4, 0), (6144, 65536, 16, 64, 4, 0),
                                             (6336, 4096, 16, 64, 4, 0), (6352, 4096, 64, 32, 8, 8),
                                             (7168, 4096, 64, 32, 8, 8), (8192, 32768, 64, 32, 8, 8)):
        assert default_dw_ring(n, rows, 1, 132, h200) is None, (n, rows)
        assert default_stream(n, 1, 132, 1, rows) == FoldTuning(stream=True, cols=cols, rows_per_stage=stage,
                                                                convert_warps=warps, pad_groups=bool(pad))
        fl = fold_launch(n, bf16, bf16, 1, True, True, num_sms=132, rows=rows, smem_optin=h200)
        assert fl.kernel == "fold_stream" and fl.grid_x == -(-n // cols), (n, rows)
        assert (fl.defines["COLS"], fl.defines["STREAM_ROWS"], fl.defines["CONVERT_WARPS"]) == (cols, stage, warps)
        assert fl.defines.get("GROUP_PAD", 0) == pad
        assert nvrtc.compile_cubin("fold.cu", "sm_90", fl.defines, use_cache=False)[:4] == b"\x7fELF"
    for n, rows, stage, smem in ((4096, 2048, 256, 200 * 1024), (4096, 1, 256, 200 * 1024),
                                 (4096, 8191, 256, 200 * 1024), (8192, 4095, 128, 96 * 1024),
                                 (8192, 1024, 128, 96 * 1024), (5120, 2047, 128, 96 * 1024)):
        assert default_dw_ring(n, rows, 1, 132, h200) == FoldTuning(cols=32, rows_per_stage=stage, smem_bytes=smem)
        fl = fold_launch(n, bf16, bf16, 1, True, True, num_sms=132, rows=rows, smem_optin=h200)
        assert fl.kernel == "fold_ring" and fl.grid_x == -(-n // 32) and fl.shmem <= smem, (n, rows)
        assert (fl.defines["COLS"], fl.defines["ROWS_PER_STAGE"]) == (32, stage)
        assert nvrtc.compile_cubin("fold.cu", "sm_90", fl.defines, use_cache=False)[:4] == b"\x7fELF"
    for n, rows, groups in ((4096, 8192, 1), (4096, 32768, 1), (4096, 2048, 2), (2048, 2048, 1), (18432, 2048, 1),
                            (8192, 8192, 2)):
        assert default_dw_ring(n, rows, groups, 132, h200) is None, (n, rows, groups)
        fl = fold_launch(n, bf16, bf16, 1, True, True, num_sms=132, rows=rows, groups=groups, smem_optin=h200)
        assert fl.kernel == "fold_stream" and fl.defines["COLS"] in (16, 32), (n, rows, groups)
    assert default_dw_ring(4096, 2048, 1, 132, 99 * 1024) is None  # e.g. sm_89: no 200 KB a block


@pytest.mark.parametrize("n, values", [(128, 8), (4096, 32)])
def test_mean_scale_takes_the_division_out_of_the_sass(n, values, tmp_path, monkeypatch):
    """NormTuning.mean_scale (MEAN_SHIFT where N = 2^k): the sm_90 code of the forward and of the backward has fewer
    reciprocals (the IEEE division by N, MUFU.RCP and its refinement, gone; the forward keeps rstd's 1 / sqrt), and
    still compiles for sm_80."""
    import subprocess

    from strictnorm.backends.cuda.backend import NormTuning, norm_bwd_launch, norm_launch

    tool = _nvdisasm()
    monkeypatch.setenv("STRICTNORM_CACHE_DIR", str(tmp_path))
    bf16 = torch.bfloat16

    def reciprocals(defines: dict) -> int:
        cubin = tmp_path / "k.cubin"
        cubin.write_bytes(nvrtc.compile_cubin("rms_norm.cu", "sm_90", defines, use_cache=False))
        sass = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        assert "LDG" in sass, "disassembly without loads"
        return sass.count("MUFU.RCP")

    counts = {}
    for scale in (False, True):
        tuning = NormTuning(values=values, mean_scale=scale)
        fwd = norm_launch(n, bf16, None, bf16, bf16, "llama", False, tuning).defines
        bwd = norm_bwd_launch(n, bf16, bf16, bf16, "llama", False, False, True, tuning).defines
        assert fwd.get("MEAN_SHIFT") == bwd.get("MEAN_SHIFT") == (n.bit_length() - 1 if scale else None)
        counts[scale] = (reciprocals(fwd), reciprocals(bwd))
        assert nvrtc.compile_cubin("rms_norm.cu", "sm_80", bwd, use_cache=False)[:4] == b"\x7fELF"
    # fewer in both (the backward's row loop may carry the division in more than one copy), rstd's kept
    assert counts[True][0] < counts[False][0] and counts[True][1] < counts[False][1] and counts[True][0] >= 1, counts
