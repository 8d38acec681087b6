"""rms_norm.cu, and fold.cu's dW ring, run on the CPU (bench/emulate: threads, barriers and shuffles emulated,
cp.async as an immediate copy, AddressSanitizer on the launch's buffers and the shared-memory ring) against the
reference, bit for bit. This checks the CUDA sources' logic in CI, without a GPU: the launch shapes the host
code picks, trimmed padding pieces, signed zeros, the fold ring's knobs. It does not check what NVRTC makes
of the source, nor the ring's waits (the GPU tests do). Skipped without g++ 12 or newer."""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    EXTREME_MEAN_SCALES,
    bits_equal,
    extreme_mean_rows,
    partial_sum_model,
    slot_partial_rows_model,
    sprinkle_specials,
    zero_dy_case,
)

from strictnorm.backends.cuda.backend import (
    FoldTuning,
    NormTuning,
    OnepassTuning,
    fold_launch,
    norm_bwd_launch,
    norm_launch,
    onepass_launch,
)
from strictnorm.backends.torch_ref import TorchBackend
from strictnorm.contract import make_spec
from strictnorm.reference import dw_contributions

ROOT = Path(__file__).resolve().parent.parent


def _gxx_ok() -> bool:
    if shutil.which("g++") is None:
        return False
    out = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True).stdout.strip()
    return bool(re.match(r"\d+", out)) and int(out.split(".")[0]) >= 12


pytestmark = pytest.mark.skipif(not _gxx_ok(), reason="needs g++ 12 or newer")


def _emulate(defines: dict, rows: int, n: int, offset: float, tensors: dict, tmp: Path, eps: float = 1e-6) -> dict:
    for name in ("x", "res", "w", "dy"):
        tensors[name].contiguous().view(torch.int16).numpy().tofile(tmp / f"{name}.bin")
    tensors["rstd"].contiguous().numpy().tofile(tmp / "rstd.bin")
    macros = " ".join(f"-D{k}={v}" for k, v in sorted(defines.items())
                      if k not in ("XC", "RC", "NC", "WC", "YC", "DYC", "HAS_W", "PER_HEAD"))
    cmd = ["bash", str(ROOT / "bench/emulate/run.sh"), str(rows), str(n), macros, str(tmp), repr(offset), repr(eps)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0 and "ERROR" not in run.stderr, run.stdout + run.stderr[-3000:]

    def read(name, dtype, count):
        raw = torch.from_file(str(tmp / name), size=count, dtype=torch.int16 if dtype != torch.float32 else torch.int32)
        return raw.view(dtype)

    got = {"out": read("out.bin", torch.bfloat16, rows * n).view(rows, n),
           "rstd": read("rstd_out.bin", torch.float32, rows),
           "z": read("z.bin", torch.bfloat16, rows * n).view(rows, n)}
    if (tmp / "dw_part.bin").exists():  # the backward's fast-dW partial rows
        part = (tmp / "dw_part.bin").stat().st_size // 4
        got["dw_part"] = read("dw_part.bin", torch.float32, part).view(-1, n)
    return got


def _inputs(rows: int, n: int, seed: int) -> dict:
    """Random rows, every other one with special values (zeros, subnormals, largest values, inf, NaN)."""
    g = torch.Generator().manual_seed(seed)
    x, res = torch.randn(rows, n, generator=g).bfloat16(), torch.randn(rows, n, generator=g).bfloat16()
    x[1::2] = sprinkle_specials(x[1::2], g)
    w = sprinkle_specials((torch.randn(n, generator=g) * 0.5).bfloat16(), g, "zeros subnormals max", 0.05)
    return {"x": x, "res": res, "w": w, "dy": torch.randn(rows, n, generator=g).bfloat16()}


# (N, tuning, aligned): the tables' shapes at N below its power of two, with and without trimmed padding
# pieces, and rows read twice instead of held; aligned: compiled as for 16-byte aligned rows (EVEN: only the
# 16-byte paths, pieces whole or wholly padding; N = 1000 leaves pieces wholly in the padding; untrimmed, pieces
# before the last one lie wholly in the padding; unpredicated=False: EVEN's loads through load_raw; weight_with_row:
# the weight's lanes loaded with each row's, W_WITH_ROW; mean_scale=False: the IEEE division by N = 2^k, not
# MEAN_SHIFT's multiply)
CASES = [(5120, None, False), (5120, NormTuning(values=32, trim=True), False),
         (18432, NormTuning(values=64, trim=True), False), (7, None, False), (1000, NormTuning(values=8), False),
         (1000, NormTuning(hold_max_p=0, stream_threads=128, trim=True), False),
         (4096, NormTuning(hold_max_p=0, stream_threads=256), False),
         (5120, NormTuning(values=32, trim=True), True), (1000, NormTuning(values=8), True),
         (1000, NormTuning(hold_max_p=0, stream_threads=128, trim=True), True),
         (5120, NormTuning(values=64, trim=False), True),
         (5120, NormTuning(hold_max_p=0, stream_threads=256, trim=False), True),
         (5120, NormTuning(values=64, unpredicated=False), True),
         (5120, NormTuning(values=32, hold_weight=False, weight_with_row=True), False),
         (1000, NormTuning(values=8, hold_weight=False, weight_with_row=True), True),
         (128, NormTuning(values=8, mean_scale=False), True), (4096, NormTuning(values=32, mean_scale=False), False)]


def test_even_cases_compile_even():
    """The aligned cases above take the EVEN kernels (else they would test nothing new)."""
    bf16 = torch.bfloat16
    for n, tuning, aligned in CASES:
        fl = norm_launch(n, bf16, bf16, bf16, bf16, "llama", False, tuning, aligned)
        bl = norm_bwd_launch(n, bf16, bf16, bf16, "llama", False, True, False, tuning, aligned)
        assert fl.defines.get("EVEN", 0) == bl.defines.get("EVEN", 0) == int(aligned)


def test_weight_with_row_only_where_rows_are_held_and_the_weight_is_not():
    """W_WITH_ROW is compiled for held rows whose weight is reloaded (hold_weight=False), in both directions; a held
    weight or rows read twice leave it out (the same cubin as without the knob)."""
    bf16 = torch.bfloat16
    with_row = NormTuning(values=32, hold_weight=False, weight_with_row=True)
    fl = norm_launch(5120, bf16, None, bf16, bf16, "llama", False, with_row, True)
    bl = norm_bwd_launch(5120, bf16, bf16, bf16, "llama", False, False, True, with_row, True)
    assert fl.defines["W_WITH_ROW"] == bl.defines["W_WITH_ROW"] == 1 and fl.defines["HOLD_W"] == 0
    for other in (NormTuning(values=32, weight_with_row=True), NormTuning(hold_max_p=0, weight_with_row=True)):
        assert "W_WITH_ROW" not in norm_launch(5120, bf16, None, bf16, bf16, "llama", False, other, True).defines
        plain = dataclasses.replace(other, weight_with_row=False)
        assert norm_launch(5120, bf16, None, bf16, bf16, "llama", False, other, True).defines == norm_launch(
            5120, bf16, None, bf16, bf16, "llama", False, plain, True).defines


@pytest.mark.parametrize("n, tuning, aligned", CASES)
def test_emulated_forward_bitwise(n, tuning, aligned, seed, tmp_path):
    bf16 = torch.bfloat16
    mode = random.Random(seed).choice(["llama", "gemma", "none"])
    fused = n != 7
    fl = norm_launch(n, bf16, bf16 if fused else None, bf16, bf16, mode, False, tuning, aligned)
    rows = max(5, 2 * fl.rows_per_block + 1)  # a partial row group too
    t = _inputs(rows, n, seed)
    t["rstd"] = torch.zeros(rows)
    spec = make_spec(bf16, 1e-6, 0.5, mode, bf16)
    y, rstd, z = TorchBackend().rms_norm_fwd(t["x"], t["w"], t["res"] if fused else None, spec)
    got = _emulate(fl.defines, rows, n, 0.5, t, tmp_path)
    assert bits_equal(y, got["out"]) and bits_equal(rstd, got["rstd"])
    assert not fused or bits_equal(z, got["z"])


@pytest.mark.parametrize("n, tuning", [(128, NormTuning(values=8, mean_scale=True)), (1, NormTuning(mean_scale=True)),
                                       (4096, NormTuning(values=32, mean_scale=True, hold_max_p=0))])
def test_emulated_mean_scale_bitwise(n, tuning, seed, tmp_path):
    """MEAN_SHIFT (NormTuning.mean_scale, compiled only where N = 2^k): a row's mean as its sum times 2^-k in both
    directions gives the reference's bits, with eps = 0 so that the mean's own bits reach rstd, on
    helpers.extreme_mean_rows (subnormal, overflowing and NaN mean squares beside ordinary rows); dx from those rstd."""
    bf16 = torch.bfloat16
    fl = norm_launch(n, bf16, None, bf16, bf16, "gemma", False, tuning, True)
    assert fl.defines["MEAN_SHIFT"] == n.bit_length() - 1
    plain = dataclasses.replace(tuning, mean_scale=False)
    assert "MEAN_SHIFT" not in norm_launch(n, bf16, None, bf16, bf16, "gemma", False, plain, True).defines
    assert "MEAN_SHIFT" not in norm_launch(3 * n, bf16, None, bf16, bf16, "gemma", False, tuning, True).defines
    g = torch.Generator().manual_seed(seed)
    rows = 2 * len(EXTREME_MEAN_SCALES) + 1
    t = {"x": extreme_mean_rows(rows, n, g), "res": torch.zeros(rows, n).bfloat16(),
         "dy": torch.randn(rows, n, generator=g).bfloat16(), "w": (torch.randn(n, generator=g) * 0.5).bfloat16(),
         "rstd": torch.zeros(rows)}
    spec = make_spec(bf16, 0.0, 1.0, "gemma", bf16)
    ref = TorchBackend()
    y, rstd, _ = ref.rms_norm_fwd(t["x"], t["w"], None, spec)
    ms = t["x"][1].float().square().sum() / n
    assert 0 < ms < torch.finfo(torch.float32).tiny or n == 1  # a subnormal mean square (or N = 1's one square)
    got = _emulate(fl.defines, rows, n, spec.offset, t, tmp_path, eps=0.0)
    assert bits_equal(y, got["out"]) and bits_equal(rstd, got["rstd"])
    t["rstd"] = rstd
    bl = norm_bwd_launch(n, bf16, bf16, bf16, "gemma", False, False, False, tuning, True)
    assert bl.defines["MEAN_SHIFT"] == fl.defines["MEAN_SHIFT"]
    want, _ = ref.rms_norm_bwd(t["dy"], t["x"], t["w"], rstd, None, spec, "strict", False, None)
    assert bits_equal(want, _emulate(bl.defines, rows, n, spec.offset, t, tmp_path)["out"])


@pytest.mark.parametrize("n, tuning", [(5120, NormTuning(values=32, trim=True)), (1000, None), (7, None)])
def test_emulated_forward_without_rstd(n, tuning, seed, tmp_path):
    """NO_RSTD (an inference call): y and residual_out the reference's bits, and the rstd buffer never written
    (its NaN sentinels stay)."""
    bf16 = torch.bfloat16
    fl = norm_launch(n, bf16, bf16, bf16, bf16, "llama", False, tuning, False, store_rstd=False)
    assert fl.defines["NO_RSTD"] == 1
    rows = max(5, 2 * fl.rows_per_block + 1)
    t = _inputs(rows, n, seed)
    t["rstd"] = torch.full((rows,), float("nan"))
    spec = make_spec(bf16, 1e-6, 0.0, "llama", bf16)
    y, _, z = TorchBackend().rms_norm_fwd(t["x"], t["w"], t["res"], spec)
    got = _emulate(fl.defines, rows, n, 0.0, t, tmp_path)
    assert bits_equal(y, got["out"]) and bits_equal(z, got["z"]) and bits_equal(t["rstd"], got["rstd"])


@pytest.mark.parametrize("n, tuning, aligned", CASES)
def test_emulated_backward_bitwise(n, tuning, aligned, seed, tmp_path):
    """dx with a residual gradient, and the signed zeros of zero dy rows with a negative offset."""
    bf16 = torch.bfloat16
    bl = norm_bwd_launch(n, bf16, bf16, bf16, "llama", False, True, False, tuning, aligned)
    dy, z, w, rstd, spec, want = zero_dy_case(n, "cpu", torch.Generator().manual_seed(seed))
    rows = dy.shape[0]
    t = {"x": z, "res": torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)).bfloat16(), "w": w,
         "dy": dy, "rstd": rstd}
    want, _ = TorchBackend().rms_norm_bwd(dy, z, w, rstd, t["res"], spec, "strict", False, None)
    got = _emulate(bl.defines, rows, n, spec.offset, t, tmp_path)
    assert bits_equal(want, got["out"])
    # without a residual gradient the zeros' signs show (adding one turns -0.0 into +0.0)
    bl = norm_bwd_launch(n, bf16, bf16, bf16, "llama", False, False, False, tuning, aligned)
    want, _ = TorchBackend().rms_norm_bwd(dy, z, w, rstd, None, spec, "strict", False, None)
    assert bits_equal(want, _emulate(bl.defines, rows, n, spec.offset, t, tmp_path)["out"])


@pytest.mark.parametrize("n, tuning", [(5120, NormTuning(values=32, staged=True)),
                                       (1000, NormTuning(values=8, staged=True)),
                                       (4096, NormTuning(values=32, min_threads=256, staged=True)),
                                       (5120, NormTuning(values=32, staged=True, hold_f32=True)),
                                       (1000, NormTuning(values=16, staged=True, hold_f32=True)),
                                       (5120, NormTuning(values=32, prefetch=True)),
                                       (1000, NormTuning(values=8, prefetch=True, staged=True)),
                                       (4096, NormTuning(values=32, min_threads=256, prefetch=True, hold_f32=True)),
                                       (1000, NormTuning(values=16, prefetch=True, unpredicated=False))])
def test_emulated_staged_backward_bitwise(n, tuning, seed, tmp_path):
    """STAGED: each row's z and dy copied ahead into shared memory, one block walking every row group (the
    stages alternate from row to row; rows past the end and padding pieces are zero-filled copies), with special
    values, a zero dy row and a residual gradient; HOLD_F32 (xh and g kept in fp32 between the passes) too. PREFETCH
    (the next row into registers; it takes STAGED's place) the same way, with predicated loads too."""
    bf16 = torch.bfloat16
    bl = norm_bwd_launch(n, bf16, bf16, bf16, "llama", False, True, False, tuning, True)
    assert (bl.defines.get("STAGED"), bl.defines.get("PREFETCH")) == ((None, 1) if tuning.prefetch else (1, None))
    rows = 3 * bl.rows_per_block + 2  # several groups, the last one partial
    t = _inputs(rows, n, seed)
    # an ordinary weight (the largest values there make every row's dx NaN, which would hide any error)
    t["w"] = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.5).bfloat16()
    t["dy"][2] = 0.0
    spec = make_spec(bf16, 1e-6, -0.5, "gemma", bf16)
    ref = TorchBackend()
    _, t["rstd"], _ = ref.rms_norm_fwd(t["x"], t["w"], None, spec)
    want, _ = ref.rms_norm_bwd(t["dy"], t["x"], t["w"], t["rstd"], t["res"], spec, "strict", False, None)
    assert bool(want[0::2].isfinite().all())  # the rows without special values
    bl = norm_bwd_launch(n, bf16, bf16, bf16, "gemma", False, True, False, tuning, True)
    assert bl.defines.get("HOLD_F32", 0) == int(tuning.hold_f32)
    assert bits_equal(want, _emulate(dict(bl.defines, EMU_WALK=1), rows, n, spec.offset, t, tmp_path)["out"])


# The fast dW's partial rows: (N, tuning, one block walking every row group): the P = 128 table's entries (8 and 16
# row slots, partials in registers, xh and g in fp32), a prefetched 2-slot block, slots in shared memory (DW_SMEM),
# rows read twice (4 slots), and the slots' rows written one a slot (dw_combine off)
PARTIAL_CASES = [(128, NormTuning(values=8, hold_weight=False, hold_f32=True), False),
                 (128, NormTuning(values=16, hold_weight=False, hold_f32=True), True),
                 (1000, NormTuning(values=16, prefetch=True), True),
                 (1024, NormTuning(values=32, min_threads=256, dw_smem=True), True),
                 (1000, NormTuning(hold_max_p=0, stream_threads=128, min_threads=512), False),
                 (128, NormTuning(values=8, dw_combine=False), True)]


@pytest.mark.parametrize("n, tuning, walk", PARTIAL_CASES)
def test_emulated_fast_dw_partial_rows(n, tuning, walk, seed, tmp_path):
    """The backward's fast-dW partial rows (DW_PARTIALS) equal the model of their order bit for bit: each row slot's
    left fold of its rows, and with DW_COMBINE (several slots a block) the slots' rows added in slot order into one
    row a block; a row with special values; a last group with fewer rows than slots. dx as the reference's."""
    bf16 = torch.bfloat16
    bl = norm_bwd_launch(n, bf16, bf16, bf16, "gemma", False, False, True, tuning, True)
    rpb, combine = bl.rows_per_block, bool(bl.defines.get("DW_COMBINE"))
    assert rpb > 1 and combine == tuning.dw_combine
    assert bl.defines["DW_SMEM"] == int(tuning.dw_smem) and bl.defines["HOLD"] == int(tuning.hold_max_p > 0)
    rows = 3 * rpb + rpb // 2 + 1  # several groups, the last one partial
    t = _inputs(rows, n, seed)
    g = torch.Generator().manual_seed(seed)
    t["w"] = (torch.randn(n, generator=g) * 0.5).bfloat16()
    t["x"][3::2] = torch.randn(t["x"][3::2].shape, generator=g).bfloat16()  # special values in row 1 only
    spec = make_spec(bf16, 1e-6, -0.5, "gemma", bf16)
    ref = TorchBackend()
    _, t["rstd"], _ = ref.rms_norm_fwd(t["x"], t["w"], None, spec)
    want_dx, _ = ref.rms_norm_bwd(t["dy"], t["x"], t["w"], t["rstd"], None, spec, "strict", False, None)
    defines = dict(bl.defines, EMU_WALK=1) if walk else bl.defines
    got = _emulate(defines, rows, n, spec.offset, t, tmp_path)
    assert bits_equal(want_dx, got["out"])
    contrib = dw_contributions(t["dy"], t["x"], t["rstd"], spec)
    grid = 1 if walk else -(-rows // rpb)  # one block walking every row group, or one launch a group
    want = slot_partial_rows_model(contrib, rpb, grid, combine)
    assert got["dw_part"].shape == want.shape and bits_equal(want, got["dw_part"])
    # the order is the model's: the rows folded the other way round differ somewhere
    assert not bits_equal(want, slot_partial_rows_model(contrib.flip(0), rpb, grid, combine))


def _emulate_fold(defines: dict, shmem: int, dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                  tmp: Path) -> torch.Tensor:
    rows, n = dy.shape
    dy.contiguous().view(torch.uint8).numpy().tofile(tmp / "a.bin")
    x.contiguous().view(torch.uint8).numpy().tofile(tmp / "b.bin")
    rstd.contiguous().numpy().tofile(tmp / "rstd.bin")
    macros = " ".join(f"-D{k}={v}" for k, v in sorted(defines.items()))
    cmd = ["bash", str(ROOT / "bench/emulate/fold_run.sh"), str(rows), str(n), str(shmem), str(tmp), macros]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0 and "ERROR" not in run.stderr, run.stdout + run.stderr[-3000:]
    return torch.from_file(str(tmp / "out.bin"), size=n, dtype=torch.int32).view(torch.float32)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# fold ring shapes: the default dW ring, rings past 48 KB (more stages; converted stages of 256 and 512
# rows), the contributions column-major, a warp-wide stripe of 32 columns (the fold beside a dx pass that
# shares the SMs out) converted in stages of 32 rows (row- or column-major), or of 64 in 100 KB
FOLD_TUNINGS = [FoldTuning(), FoldTuning(rows_per_stage=256, smem_bytes=200 * 1024), FoldTuning(column_major=True),
                FoldTuning(rows_per_stage=512, smem_bytes=200 * 1024, column_major=True),
                FoldTuning(cols=32, rows_per_stage=32), FoldTuning(cols=32, rows_per_stage=64, smem_bytes=100 * 1024),
                FoldTuning(cols=32, rows_per_stage=32, column_major=True)]


@pytest.mark.parametrize("tuning", FOLD_TUNINGS)
def test_emulated_strict_dw_fold_bitwise(tuning, seed, tmp_path):
    """fold.cu's dW ring (producers convert each stage to fp32 contributions, the consumer folds) equals the
    reference's ascending left fold of the contributions; rows with special values, a partial last stage,
    columns not a multiple of the CTA's. (Adding two rows of a stage in the other order fails it.)"""
    from strictnorm.reference import dw_contributions, left_fold_rows

    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    rows, n = 1300 + seed % 97, 20
    dy, x = torch.randn(rows, n, generator=g).bfloat16(), torch.randn(rows, n, generator=g).bfloat16()
    # finite specials in many rows; an infinity and a NaN in two columns only (either decides its column's
    # result whatever the order: the other columns must stay order-sensitive)
    x[3::7] = sprinkle_specials(x[3::7], g, "zeros subnormals")
    x[5, 0], x[9, 1] = float("inf"), float("nan")
    rstd = torch.rand(rows, generator=g) + 0.5
    fl = fold_launch(n, bf16, bf16, 1, True, True, num_sms=132, tuning=tuning)
    assert fl.defines["CONVERT"] == 1 and fl.defines.get("COLUMN_MAJOR", 0) == int(tuning.column_major)
    want = left_fold_rows(dw_contributions(dy, x, rstd, make_spec(bf16, 1e-6, 0.0, "llama", bf16)))
    assert bits_equal(want, _emulate_fold(fl.defines, fl.shmem, dy, x, rstd, tmp_path))


# the ring's consumer, its whole stages unrolled (FULL_STAGE) or by 16: plain folds of fp32 rows (16 columns a CTA; 20
# columns, so a partial column group) and bf16 rows (32 columns); the dW fold's converted, row-major contributions, and
# a dW ring of 256-row stages that does not convert (its consumer widens and multiplies as it adds), of bf16 dy and fp32
# x (contributions with full fp32 mantissas)
RING_CASES = [(FP32, FP32, 0, 20, FoldTuning()), (FP32, FP32, 0, 20, FoldTuning(full_stage=False)),
              (BF16, BF16, 0, 40, FoldTuning(cols=32, rows_per_stage=64)),
              (BF16, FP32, 1, 24, FoldTuning()),
              (BF16, FP32, 1, 24, FoldTuning(cols=8, rows_per_stage=256))]


@pytest.mark.parametrize("dy_dtype, x_dtype, what, n, tuning", RING_CASES)
def test_emulated_ring_consumer_bitwise(dy_dtype, x_dtype, what, n, tuning, seed, tmp_path):
    """fold_ring's consumer loops equal the reference's ascending left fold of the rows (plain) or of the dW
    contributions: a partial last stage, special values, rows scaled by powers of two from 2^-12 to 2^11 (so that
    bf16 rows' sums round and the order shows)."""
    from strictnorm.reference import dw_contributions, left_fold_rows

    g = torch.Generator().manual_seed(seed)
    rows = 1300 + seed % 97
    scale = torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    dy = (torch.randn(rows, n, generator=g) * scale).to(dy_dtype)
    x = torch.randn(rows, n, generator=g).to(x_dtype)
    x[3::7] = sprinkle_specials(x[3::7], g, "zeros subnormals")
    dy[5, 0], x[9, 1] = float("inf"), float("nan")
    rstd = torch.rand(rows, generator=g) + 0.5
    fl = fold_launch(n, dy_dtype, x_dtype, what, True, True, num_sms=132, tuning=tuning)
    assert fl.kernel == "fold_ring" and fl.defines.get("FULL_STAGE", 0) == int(tuning.full_stage)
    assert fl.defines["CONVERT"] == int(what == 1 and tuning.rows_per_stage != 256)
    spec = make_spec(x_dtype, 1e-6, 0.0, "llama", x_dtype)
    want = left_fold_rows(dw_contributions(dy, x, rstd, spec) if what else dy)
    assert bits_equal(want, _emulate_fold(fl.defines, fl.shmem, dy, x, rstd, tmp_path))


@pytest.mark.parametrize("dy_dtype, x_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32)])
def test_emulated_strict_dw_fold_other_dtypes(dy_dtype, x_dtype, seed, tmp_path):
    """The default dW ring for fp16 rows and for fp32 ones (x's rows two 16-byte chunks to dy's one: the stage
    copies of unequal chunk counts; the 8-column conversion through one or two 16-byte loads a tensor),
    against the reference's ascending left fold of the contributions, in x's casting."""
    from strictnorm.reference import dw_contributions, left_fold_rows

    g = torch.Generator().manual_seed(seed)
    rows, n = 700 + seed % 61, 20
    dy, x = torch.randn(rows, n, generator=g).to(dy_dtype), torch.randn(rows, n, generator=g).to(x_dtype)
    x[3::7] = sprinkle_specials(x[3::7], g, "zeros subnormals")
    rstd = torch.rand(rows, generator=g) + 0.5
    fl = fold_launch(n, dy_dtype, x_dtype, 1, True, True, num_sms=132, tuning=FoldTuning())  # the ring
    assert fl.defines["CONVERT"] == 1
    want = left_fold_rows(dw_contributions(dy, x, rstd, make_spec(x_dtype, 1e-6, 0.0, "llama", x_dtype)))
    assert bits_equal(want, _emulate_fold(fl.defines, fl.shmem, dy, x, rstd, tmp_path))


@pytest.mark.parametrize("chain_rows, cols, n, items", [(256, 8, 20, 3), (512, 8, 24, 3), (1024, 16, 40, 3),
                                                      (64, 4, 9, 3), (256, 8, 5, 1)])
@pytest.mark.parametrize("what", [0, 1])
def test_emulated_fold_chain_bitwise(chain_rows, cols, n, items, what, seed, tmp_path):
    """fold.cu's fold_chain (items of chain_rows rows x cols columns, each continuing its predecessor's sums)
    equals the reference's ascending left fold: of the rows themselves (plain fold) and of the dW
    contributions; a partial last item, a partial last column group (or one narrower than an item), a
    single item (nothing handed over), 16-byte and element loads, every tail of fold_column's loop. Three
    CTAs run at once (bench/emulate/fold_main.cpp), so an item's predecessor is often still running: without
    the wait for its hand-over, 4 of these 10 cases fail."""
    from strictnorm.reference import dw_contributions, left_fold_rows

    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    # the last item partial (a 32-row block of fold_column's pipelined loop, then 4-row loads, then single rows);
    # items == 1: no hand-over at all
    rows = (items - 1) * chain_rows + 49 + seed % 7
    dy, x = torch.randn(rows, n, generator=g).bfloat16(), torch.randn(rows, n, generator=g).bfloat16()
    x[3::7] = sprinkle_specials(x[3::7], g, "zeros subnormals")
    dy[5, 0], x[9, 1] = float("inf"), float("nan")  # two columns decided whatever the order
    rstd = torch.rand(rows, generator=g) + 0.5
    fl = fold_launch(n, bf16, bf16, what, True, True, num_sms=132, rows=rows,
                     tuning=FoldTuning(cols=cols, chain_rows=chain_rows, smem_bytes=200 * 1024))
    items = -(-rows // chain_rows) * -(-n // cols)
    assert fl.kernel == "fold_chain" and fl.state_ints == 2 + items * cols * 2
    spec = make_spec(bf16, 1e-6, 0.0, "llama", bf16)
    want = left_fold_rows(dw_contributions(dy, x, rstd, spec) if what else dy)
    assert bits_equal(want, _emulate_fold(fl.defines, fl.shmem, dy, x, rstd, tmp_path))


# fold_stream: (columns a CTA, rows a stage, converting warps, addend buffers, dy's dtype, x's dtype, what, N, the
# buffers padded after each group of 8 columns, the consumers isolated on their sub-partitions): the default's 256-row
# stages at 8 columns; one
# consumer lane a column up to two consumer warps, one buffer a converting warp (each waits for the consumer every
# stage) or more, a partial last column group (of whole 16-byte chunks, or fp32 rows of 20 columns: element loads),
# fp16 and fp32 rows (two 16-byte loads a segment), the plain fold (what 0) of bf16 and fp32 rows; rows 16-byte aligned
# (the backend takes fold_simple otherwise). Stages of whole 32-row blocks with two buffers or more take the seamless
# consumer (the next stage's first loads before this stage's last adds); one buffer (8, 32, 1, 1) or 16-row stages
# (64, 16) the consumer's loop a stage
STREAM_CASES = [(8, 32, 2, 2, BF16, BF16, 1, 24, False, False), (16, 32, 4, 8, BF16, BF16, 1, 40, False, False),
                (32, 64, 0, 0, FP16, FP16, 1, 40, False, False), (64, 32, 2, 4, BF16, FP32, 1, 72, False, False),
                (32, 32, 3, 3, BF16, BF16, 0, 40, False, False), (8, 32, 1, 1, FP32, FP32, 0, 20, False, False),
                (32, 32, 2, 4, BF16, BF16, 1, 40, True, False), (64, 32, 1, 2, BF16, BF16, 0, 72, True, False),
                (8, 256, 2, 0, BF16, BF16, 1, 24, False, False), (8, 256, 1, 0, FP32, FP32, 0, 16, False, False),
                (8, 256, 4, 0, BF16, BF16, 1, 24, False, True), (64, 32, 3, 0, FP32, FP32, 0, 72, False, True),
                (8, 32, 1, 2, FP32, FP32, 0, 20, False, False), (16, 64, 4, 8, FP32, FP32, 0, 40, False, True),
                (64, 16, 2, 4, BF16, BF16, 1, 72, False, False)]
# PREFETCH (the converters' next whole stage loaded before the current one is stored): partial column groups and
# last stages through the loads without it, one buffer a converting warp, fp32 x, the plain fold of fp32 rows
STREAM_CASES = [case + (False,) for case in STREAM_CASES] + [
    (32, 64, 8, 0, BF16, BF16, 1, 72, False, False, True), (8, 256, 4, 0, BF16, BF16, 1, 24, False, True, True),
    (8, 128, 4, 0, FP32, FP32, 0, 16, False, True, True), (16, 32, 2, 2, BF16, FP32, 1, 40, False, False, True),
    (32, 32, 3, 3, FP16, FP16, 1, 40, True, False, True)]


@pytest.mark.parametrize("cols, rows_per_stage, warps, buffers, dy_dtype, x_dtype, what, n, pad, isolate, prefetch",
                         STREAM_CASES)
def test_emulated_fold_stream_bitwise(cols, rows_per_stage, warps, buffers, dy_dtype, x_dtype, what, n, pad, isolate,
                                      prefetch, seed, tmp_path):
    """fold.cu's fold_stream (converter warps loading rows into registers and handing fp32 addends to the consumer
    warps through mbarrier-guarded buffers) equals the reference's ascending left fold of the dW contributions (in
    x's casting) or of the rows themselves; rows with special values, a partial last stage. The emulation runs
    each thread as a thread of its own with random delays, so a wait left out lets a warp overtake the one it
    waits for."""
    from strictnorm.reference import dw_contributions, left_fold_rows

    g = torch.Generator().manual_seed(seed)
    rows = 300 + seed % 61
    dy, x = torch.randn(rows, n, generator=g).to(dy_dtype), torch.randn(rows, n, generator=g).to(x_dtype)
    x[3::7] = sprinkle_specials(x[3::7], g, "zeros subnormals")
    dy[5, 0], x[9, 1] = float("inf"), float("nan")  # two columns decided whatever the order
    rstd = torch.rand(rows, generator=g) + 0.5
    tuning = FoldTuning(stream=True, cols=cols, rows_per_stage=rows_per_stage, convert_warps=warps, buffers=buffers,
                        pad_groups=pad, isolate=isolate, prefetch=prefetch)
    fl = fold_launch(n, dy_dtype, x_dtype, what, True, True, num_sms=132, tuning=tuning, smem_optin=227 * 1024)
    assert fl.kernel == "fold_stream" and fl.defines["COLS"] == cols and fl.grid_x == -(-n // cols)
    assert fl.defines["CSTAGES"] == (buffers or 2 * (warps or 8)) and fl.defines.get("GROUP_PAD", 0) == 8 * pad
    assert fl.defines.get("ISOLATE", 0) == isolate and fl.defines.get("PREFETCH", 0) == prefetch
    spec = make_spec(x_dtype, 1e-6, 0.0, "llama", x_dtype)
    want = left_fold_rows(dw_contributions(dy, x, rstd, spec) if what else dy)
    assert bits_equal(want, _emulate_fold(fl.defines, fl.shmem, dy, x, rstd, tmp_path))


def _emulate_onepass(defines: dict, dy: torch.Tensor, z: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                     offset: float, tmp: Path) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = dy.shape
    for name, t in (("dy", dy), ("z", z), ("w", w)):
        t.contiguous().view(torch.uint8).numpy().tofile(tmp / f"{name}.bin")
    rstd.contiguous().numpy().tofile(tmp / "rstd.bin")
    macros = " ".join(f"-D{k}={v}" for k, v in sorted(defines.items()))
    cmd = ["bash", str(ROOT / "bench/emulate/onepass_run.sh"), str(rows), str(n), str(tmp), repr(offset), macros]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # waits abort after 60 s (shim.h)
    assert run.returncode == 0 and "ERROR" not in run.stderr, run.stdout + run.stderr[-3000:]

    def read(name, dtype, count):
        bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
        return torch.from_file(str(tmp / name), size=count, dtype=bits).view(dtype)

    return read("dx.bin", z.dtype, rows * n).view(rows, n), read("dw.bin", w.dtype, n)


# (rows, N, dtypes of dy / z / w, mode, tuning): GROUPS below 32 (lanes hold one subtree sum each) and above
# (several), groups without data (N well below P), partial last blocks, fp16 and fp32 rows, an fp32 weight
ONEPASS_CASES = [
    (300, 100, (torch.bfloat16,) * 3, "llama", OnepassTuning(rows=32, depth=1, tiles=2, b_warps=1, dx_warps=1,
                                                              dx_groups=1, c_warps=1)),
    (517, 1000, (torch.bfloat16,) * 3, "gemma", OnepassTuning(rows=64, depth=3, tiles=6, b_warps=2, dx_warps=2,
                                                               c_warps=3)),
    (203, 2048, (torch.float16, torch.float16, torch.float32), "none", OnepassTuning(w_cols=64, rows=32, b_warps=1,
                                                                                   dx_warps=1, dx_groups=1)),
    (150, 320, (torch.bfloat16, torch.float32, torch.bfloat16), "llama", OnepassTuning(w_cols=64, rows=16, b_warps=1,
                                                                                      dx_warps=1, dx_groups=1)),
    (5, 1100, (torch.bfloat16,) * 3, "gemma", OnepassTuning(rows=32, b_warps=1, dx_warps=1, dx_groups=1)),  # 35 of 64
    # 256 columns a CTA (eight fold warps, rows in eight slices), 9 of 16 groups holding columns
    (70, 2100, (torch.bfloat16,) * 3, "none", OnepassTuning(w_cols=256, rows=16, b_warps=1, dx_warps=2, c_warps=1)),
    (1, 100, (torch.bfloat16,) * 3, "llama", OnepassTuning()),  # a single row
]


@pytest.mark.parametrize("rows, n, dtypes, mode, tuning", ONEPASS_CASES)
def test_emulated_onepass_strict_backward_bitwise(rows, n, dtypes, mode, tuning, seed, tmp_path):
    """onepass.cu (every CTA at once, exchanging row sums through global memory) equals the reference's strict
    backward: dx and dW bit for bit, special values in some rows, a negative offset (gemma: + 1)."""
    g = torch.Generator().manual_seed(seed)
    dy_t, z_t, w_t = dtypes
    dy, z = torch.randn(rows, n, generator=g).to(dy_t), torch.randn(rows, n, generator=g).to(z_t)
    z[3::11] = sprinkle_specials(z[3::11], g, "zeros subnormals")
    w = (torch.randn(n, generator=g) * 0.5).to(w_t)
    offset = 1.0 if mode == "gemma" else -0.25
    spec = make_spec(z_t, 1e-6, offset, mode, z_t)
    rstd = torch.rand(rows, generator=g) + 0.5
    fl = onepass_launch(n, dy_t, z_t, w_t, mode, num_sms=132, smem_optin=227 * 1024, tuning=tuning)
    want_dx, want_dw = TorchBackend().rms_norm_bwd(dy, z, w, rstd, None, spec, "strict", True, None)
    got_dx, got_dw = _emulate_onepass(fl.defines, dy, z, w, rstd, spec.offset, tmp_path)
    assert bits_equal(want_dx, got_dx) and bits_equal(want_dw, got_dw)


@pytest.mark.parametrize("rows, n, seg_rows, out_dtype", [(300, 40, 300, torch.float32), (50, 37, 20, torch.float32),
                                                          (130, 24, 64, torch.bfloat16), (3, 5, 3, torch.float32)])
def test_emulated_partial_sum_in_its_fixed_order(rows, n, seg_rows, out_dtype, seed, tmp_path):
    """partial_sum.cu (the fast dW's sum of partial rows) equals the model of its order bit for bit: 16-byte loads
    where N % 4 == 0, column blocks past N, segments (the last one shorter), rows fewer than the groups, signed
    zeros and cancelling magnitudes (adding two rows in another order changes the sums)."""
    from strictnorm.backends.cuda.backend import _SUM_COLS, _SUM_THREADS, partial_sum_shape

    g = torch.Generator().manual_seed(seed)
    part = torch.randn(rows, n, generator=g) * torch.logspace(-6, 6, rows)[:, None]
    part[rows // 2] = -0.0
    vec = partial_sum_shape(rows, n, 132).vec
    assert vec == (4 if n % 4 == 0 else 1)
    part.numpy().tofile(tmp_path / "part.bin")
    macros = f"-DSUM_COLS={_SUM_COLS} -DSUM_THREADS={_SUM_THREADS} -DVEC={vec}"
    if out_dtype != torch.float32:
        macros += " -DOUT_CODE=1"
    cmd = ["bash", str(ROOT / "bench/emulate/partial_sum_run.sh"), str(rows), str(n), str(seg_rows), str(tmp_path),
           macros]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0 and "ERROR" not in run.stderr, run.stdout + run.stderr[-3000:]
    segments = -(-rows // seg_rows)
    want = partial_sum_model(part, seg_rows, _SUM_THREADS // (_SUM_COLS // vec)).to(out_dtype)
    raw_dtype = torch.int32 if out_dtype == torch.float32 else torch.int16
    got = torch.from_file(str(tmp_path / "out.bin"), size=segments * n, dtype=raw_dtype).view(out_dtype)
    assert bits_equal(want, got.view(segments, n))
    assert not bits_equal(want, partial_sum_model(part.flip(0), seg_rows, 1).to(out_dtype)) or rows < 4


def test_partial_sum_shape_segments_cover_the_rows():
    """Segments only where the column blocks leave SMs idle, at least 16 rows a thread, and they cover the rows."""
    from strictnorm.backends.cuda.backend import _SUM_COLS, partial_sum_shape

    assert partial_sum_shape(264, 4096, 132).segments == 1  # 256 column blocks
    assert partial_sum_shape(16896, 128, 132).segments == 16  # 8 column blocks, 64 groups of threads
    assert partial_sum_shape(1056, 128, 132).segments == 1  # 16.5 rows a thread in one launch
    assert partial_sum_shape(2048, 128, 132).segments == 2
    for rows, n in ((1, 4096), (5, 7), (1000, 128), (16896, 128), (100_000, 3), (528, 8192)):
        s = partial_sum_shape(rows, n, 132)
        assert s.col_blocks * _SUM_COLS >= n > (s.col_blocks - 1) * _SUM_COLS
        assert (s.segments - 1) * s.seg_rows < rows <= s.segments * s.seg_rows
        assert s.vec == (4 if n % 4 == 0 else 1)
