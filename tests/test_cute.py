"""CuTe DSL kernels (backends/cute/kernels.py): compiled for sm_90a without a GPU, and the exactness
of the generated code checked in its PTX; on a GPU, bitwise against the reference. Skipped where
nvidia-cutlass-dsl is not installed (the test extra installs it)."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import torch
from conftest import HAS_CUDA
from helpers import (
    bits_equal,
    check_fused_add_graph_replay,
    check_special_values,
    extreme_mean_rows,
    slot_partial_rows_model,
    zero_dy_case,
)

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # read when the DSL is imported: compile for the H100/H200
cutlass = pytest.importorskip("cutlass")

from strictnorm.backends.cute import kernels as K  # noqa: E402
from strictnorm.reference import next_pow2  # noqa: E402


def _compiled_ptx(tmp_path, op, args) -> str:
    import cutlass.cute as cute

    cute.compile(op, *args, options=f"--keep-ptx --dump-dir {tmp_path}")
    (path,) = list(tmp_path.glob("*.ptx"))
    assert path.name.endswith(".sm_90a.ptx")
    return path.read_text()


def _ptx(tmp_path, n: int, mode: str, x_dtype, w_dtype, vector: bool = False, res_dtype=None) -> str:
    return _compiled_ptx(tmp_path, *K.forward_args(n, x_dtype, w_dtype, x_dtype, mode, vector, res_dtype))


@pytest.mark.parametrize("n", [1, 7, 128, 1000, 4096, 18432])
@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
@pytest.mark.parametrize("vector", [False, True])
def test_forward_compiles_with_only_rounded_fp32_ops(n, mode, vector, tmp_path):
    """No fused multiply-add and no unrounded fp32 add/mul/div/sqrt anywhere: ptxas may contract a
    plain add.f32 with a mul, which would change bits. Whole aligned pieces load 16 bytes at a time (a staged
    forward's: copied by cp.async)."""
    if vector and (n % 8 or K.forward_shape(n).piece != 8):
        pytest.skip("vector loads need pieces of 8 lanes and N % 8 == 0")
    ptx = _ptx(tmp_path, n, mode, cutlass.BFloat16, cutlass.BFloat16, vector)
    staged = K.stages_rows(K.tuned_shape(n, backward=False), vector, False, 16)  # x copied by cp.async instead
    assert ("ld.global.v4" in ptx) == (vector and not staged)
    assert ("cp.async" in ptx) == staged
    assert "fma." not in ptx
    assert not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx), "an fp32 op without .rn"
    assert re.search(r"\bsqrt\.rn\.f32\b", ptx) and re.search(r"\bdiv\.rn\.f32\b", ptx)
    shape = K.tuned_shape(n, backward=False)
    assert shape.piece * shape.tpr * shape.k == next_pow2(n)
    assert ("bar.sync" in ptx) == (shape.tpr > 32)


@pytest.mark.parametrize("n", [128, 4096, 18432])
def test_forward_divides_out_a_trip_count_only_on_a_persistent_grid(n, tmp_path):
    """A forward whose grid is not persistent has one block a row group: no integer division (the grid-stride trip
    count) ahead of its first load; a persistent one (N = 18432's table entry) keeps it."""
    ptx = _ptx(tmp_path, n, "llama", cutlass.BFloat16, cutlass.BFloat16, vector=True)
    divides = bool(re.search(r"\b(div|rem)\.[su]32\b", ptx))
    assert divides == K.tuned_shape(n, backward=False).persistent
    assert K.tuned_shape(18432, backward=False).persistent and not K.tuned_shape(128, backward=False).persistent


@pytest.mark.parametrize("n, backward", [(128, False), (4096, False), (8192, False), (128, True), (4096, True)])
def test_held_rows_are_read_once(n, backward, tmp_path, held_forward):
    """The tables' shapes keep a row's lanes in registers between the passes: each 16-byte piece of x (forward, not
    staged in shared memory) or of z and dy (backward) is loaded once a row, not again in pass 2 (with the backward's
    prefetch, the first row's before the loop and the next row's in it); the weight's once a pass unless held."""
    bf16 = cutlass.BFloat16
    if backward:
        op, args = K.backward_args(n, bf16, bf16, bf16, "llama", True, False, True)
    else:
        op, args = K.forward_args(n, bf16, bf16, bf16, "llama", True)
    assert op.s.hold
    ptx = _compiled_ptx(tmp_path, op, args)
    weight_loads = 2 if backward and not op.s.hold_weight else 1
    rows = 2 * (2 if op.s.prefetch else 1) if backward else 1
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)) == (rows + weight_loads) * op.s.k


def _clear_shapes() -> None:
    """Forgets the cached shapes and compiled kernels (after a test changes the choices behind them: K.HOLD, K.TRIM,
    ...)."""
    for cached in (K.tuned_shape, K.compile_forward, K.compile_backward):
        cached.cache_clear()


@pytest.fixture
def fresh_shapes():
    """Shapes and kernels computed afresh in the test and forgotten after it; the clearing function, for a test that
    changes the choices midway (request it after monkeypatch, so it clears before the choices are restored)."""
    _clear_shapes()
    yield _clear_shapes
    _clear_shapes()


@pytest.fixture
def held_forward(monkeypatch, fresh_shapes):
    """The held forward's register path (x loaded into registers, not staged in shared memory: HOLD["forward_staged"]
    empty, whatever the default), for the tests that read its loads in the PTX."""
    monkeypatch.setitem(K.HOLD, "forward_staged", {})
    fresh_shapes()


def test_forward_rows_held_where_their_trimmed_lanes_fit(monkeypatch, fresh_shapes, tmp_path):
    """HOLD["forward_trimmed"] = 40 (the default): N = 18432 held by the CUDA table's 512 threads a row, 5 live
    pieces of 8 lanes each, so x is loaded once a row (5 pieces) and the weight once; N = 20481 (6 pieces) still read
    twice, and N = 18432 too with the option off; N = 16384 held by 512 threads, 4 pieces each."""
    assert (lambda s: (s.hold, s.tpr, s.live))(K.tuned_shape(16384, False)) == (True, 512, 4)
    s = K.tuned_shape(18432, False)
    assert (s.hold, s.tpr, s.live, s.persistent) == (True, 512, 5, True)
    assert not K.tuned_shape(20481, False).hold
    bf16 = cutlass.BFloat16
    ptx = _compiled_ptx(tmp_path, *K.forward_args(18432, bf16, bf16, bf16, "llama", True))
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)) == 2 * s.live
    monkeypatch.setitem(K.HOLD, "forward_trimmed", 0)
    fresh_shapes()
    assert not K.tuned_shape(18432, False).hold


def _cuobjdump(tmp_path, op, args, flag: str) -> str:
    """cuobjdump's `flag` output for the sm_90a cubin of op (cuobjdump from Triton's install)."""
    import pathlib
    import subprocess

    import cutlass.cute as cute

    triton = pytest.importorskip("triton")
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump in this Triton install")
    tmp_path.mkdir(parents=True, exist_ok=True)
    cute.compile(op, *args, options=f"--keep-cubin --dump-dir {tmp_path}")
    (cubin,) = list(tmp_path.glob("*.cubin"))
    return subprocess.run([str(cuobjdump), flag, str(cubin)], capture_output=True, text=True, check=True).stdout


def _registers(tmp_path, op, args) -> int:
    """Registers a thread of the sm_90a cubin takes."""
    return int(re.search(r"REG:(\d+)", _cuobjdump(tmp_path, op, args, "--dump-resource-usage")).group(1))


@pytest.mark.parametrize("n, rows, saves, weight_first", [(128, 1 << 18, True, False), (4096, 1 << 15, True, False),
                                                           (4096, 1 << 15, True, True), (18432, 2048, False, False)])
def test_forward_holds_its_lanes_as_loaded(n, rows, saves, weight_first, monkeypatch, held_forward, fresh_shapes,
                                          tmp_path):
    """HOLD["forward_raw"] (the default up to P = 4096): the held forward keeps bf16 lanes as loaded between the
    passes (laundered: an empty asm per 32-bit word), so the compiler cannot keep pass 1's fp32 widening alive
    instead: a thread takes at least a quarter of its held lanes fewer registers than with the lanes held in fp32
    (half, ideally; at N = 18432, 512 threads a row on a persistent grid, both take 64 with the DSL 4.8.1: never
    more). With the weight loaded beside the row (weight_first) its lanes are held the same way. fp32 rows are held
    as they are, with no asm. HOLD["forward_raw"] is raised past N's padded length here (by default P = 8192 and
    past are held in fp32)."""
    bf16 = cutlass.BFloat16
    monkeypatch.setitem(K.HOLD, "forward_raw", 1 << 20)
    fresh_shapes()
    s = K.tuned_shape(n, False, True, K.forward_row_bound(n, rows))
    assert s.hold and s.hold_raw
    for sub in ("ptx", "f32"):
        (tmp_path / sub).mkdir()
    held_lanes = s.live * s.piece * (2 if weight_first else 1)
    raw = _registers(tmp_path / "raw", *K.forward_args(n, bf16, bf16, bf16, "llama", True, weight_first=weight_first))
    ptx = _compiled_ptx(tmp_path / "ptx", *K.forward_args(n, bf16, bf16, bf16, "llama", True,
                                                          weight_first=weight_first))
    assert ptx.count("begin inline asm") == held_lanes // 2
    f32_ptx = _compiled_ptx(tmp_path / "f32", *K.forward_args(n, cutlass.Float32, cutlass.Float32, cutlass.Float32,
                                                               "llama", True, weight_first=weight_first))
    assert "begin inline asm" not in f32_ptx
    monkeypatch.setitem(K.HOLD, "forward_raw", 0)
    fresh_shapes()
    assert not K.tuned_shape(n, False, True, K.forward_row_bound(n, rows)).hold_raw
    held_f32 = _registers(tmp_path / "held-f32", *K.forward_args(n, bf16, bf16, bf16, "llama", True,
                                                                 weight_first=weight_first))
    assert raw <= held_f32 - (held_lanes // 4 if saves else 0), (raw, held_f32)


def test_forward_holds_lanes_as_loaded_up_to_4096():
    """The default holds lanes as loaded up to P = 4096 and in fp32 past it (on an H200 as loaded lost at 8192 x
    8192: HOLD's comment)."""
    assert all(K.tuned_shape(n, False).hold_raw for n in (128, 1000, 4096))
    assert not any(K.tuned_shape(n, False).hold_raw for n in (8192, 16384, 18432))
    assert all(K.tuned_shape(n, False).hold for n in (8192, 16384, 18432))


def test_forward_stages_rows_of_the_lengths_named(monkeypatch, tmp_path):
    """HOLD["forward_staged"]: the held forward of the padded lengths named (4096 and 8192 by default) stages x in
    shared memory from the row count named on (4096 and 2048); fewer rows of those lengths, rows of other lengths and
    the backward do not."""
    assert K.HOLD["forward_staged"] == {4096: 4096, 8192: 2048}
    assert K.tuned_shape(4096, False).staged and K.tuned_shape(5000, False).staged
    assert not any(K.tuned_shape(n, False).staged for n in (128, 1000, 16384, 18432))
    assert not K.tuned_shape(4096, True).staged
    assert [K.forward_stages(4096, rows) for rows in (1, 128, 4095, 4096, 1 << 20)] == [False] * 3 + [True] * 2
    assert not K.forward_stages(5000, 2047) and K.forward_stages(5000, 2048) and not K.forward_stages(8192, 2047)
    assert all(K.forward_stages(n, 1) for n in (128, 1000, 16384))  # lengths never staged: one kernel at any count
    bf16 = cutlass.BFloat16
    for stage in (True, False):
        op, args = K.forward_args(4096, bf16, bf16, bf16, "llama", True, stage=stage)
        (tmp_path / str(stage)).mkdir()
        ptx = _compiled_ptx(tmp_path / str(stage), op, args)
        assert op.s.staged == stage and ("cp.async" in ptx) == stage and ("ld.global.v4" in ptx) != stage
    monkeypatch.setitem(K.HOLD, "forward_staged", {4096: 1})
    assert K.forward_stages(4096, 1)


@pytest.mark.parametrize("n", [128, 1000, 4096, 8192])
@pytest.mark.parametrize("weight_first", [False, True])
def test_staged_forward_copies_rows_into_shared_memory(n, weight_first, monkeypatch, fresh_shapes, tmp_path):
    """HOLD["forward_staged"]: the held forward of 16-byte rows copies each of a thread's live pieces of x into shared
    memory with cp.async (bypassing L1: .cg) and the weight's beside them whether or not the call asks for the weight
    first (through L1: .ca, a line every row slot copies), all before one wait, and reads them there in both passes
    (no global load of x or of the weight); only rounded fp32 arithmetic. Rows that are not 16-byte aligned, the
    fused add and fp32 rows keep the held path (no cp.async, the weight first only where asked: K.stages_rows); an
    fp32 weight is loaded, not staged; P = 16384 (past _STAGED_MAX_P) is not staged."""
    monkeypatch.setitem(K.HOLD, "forward_staged", {next_pow2(n): 1, 16384: 1})
    fresh_shapes()
    s = K.tuned_shape(n, False)
    assert s.staged and s.hold and not s.persistent
    assert not K.tuned_shape(16384, False).staged
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    op, args = K.forward_args(n, bf16, bf16, bf16, "llama", True, weight_first=weight_first)
    assert op.s.hold_weight
    ptx = _compiled_ptx(tmp_path, op, args)
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == s.live
    assert len(re.findall(r"cp\.async\.ca\.shared\.global", ptx)) == s.live
    assert ptx.count("cp.async.wait_group") == 1 and ptx.count("cp.async.commit_group") == 1
    assert ptx.index("cp.async.wait_group") > max(ptx.rfind("cp.async.cg"), ptx.rfind("cp.async.ca"))
    assert not re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)
    for sub, (op, args) in (("scalar", K.forward_args(n, bf16, bf16, bf16, "llama", False, weight_first=weight_first)),
                            ("fused", K.forward_args(n, bf16, bf16, bf16, "llama", True, bf16,
                                                     weight_first=weight_first)),
                            ("fp32", K.forward_args(n, f32, f32, f32, "llama", True, weight_first=weight_first))):
        assert op.s.hold_weight == weight_first, sub
        (tmp_path / sub).mkdir()
        assert "cp.async" not in _compiled_ptx(tmp_path / sub, op, args)
    # pieces of 8 fp32 lanes (32 bytes) are not staged: an fp32 weight is loaded into registers beside staged bf16 x
    (tmp_path / "w32").mkdir()
    ptx = _compiled_ptx(tmp_path / "w32", *K.forward_args(n, bf16, f32, bf16, "llama", True, weight_first=weight_first))
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == s.live
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)) == 2 * s.live


@pytest.mark.parametrize("weight_first", [False, True])
def test_forward_weight_first_loads_the_weight_before_the_row_sum(weight_first, tmp_path, held_forward):
    """With weight_first (K.FORWARD_WEIGHT_FIRST_ROWS: 512 rows at P = 4096) the held forward issues its weight
    loads with the row's, before the row sum's first shuffle; without, after it. Same loads either way."""
    bf16 = cutlass.BFloat16
    op, args = K.forward_args(4096, bf16, bf16, bf16, "llama", True, weight_first=weight_first)
    assert op.s.hold and op.s.hold_weight == weight_first
    ptx = _compiled_ptx(tmp_path, op, args)
    before_sum = ptx[:ptx.index("shfl.sync.bfly")]  # the row sum's first butterfly
    loads = r"ld\.global[.a-z0-9]*\.v4"
    assert len(re.findall(loads, ptx)) == 2 * op.s.k
    assert len(re.findall(loads, before_sum)) == (2 if weight_first else 1) * op.s.k
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)


def test_forward_lanes_a_thread_past_the_table(monkeypatch, held_forward, fresh_shapes, tmp_path):
    """K.FORWARD_VALUES (a sweep variant, empty by default): rows of 4096 held by 64 threads of 64 lanes, two rows a
    block of 128 threads (Quack's shape); x and the weight loaded once a row, rounded fp32 ops only. The GPU test
    checks the bits."""
    assert K.tuned_shape(4096, False).tpr == 128
    monkeypatch.setattr(K, "FORWARD_VALUES", {4096: 64})
    fresh_shapes()
    s = K.tuned_shape(4096, False)
    assert (s.hold, s.tpr, s.k, s.rpb) == (True, 64, 8, 2)
    assert K.tuned_shape(8192, False).tpr == 256  # other lengths keep the rule
    bf16 = cutlass.BFloat16
    op, args = K.forward_args(4096, bf16, bf16, bf16, "llama", True)
    assert op.s == s
    ptx = _compiled_ptx(tmp_path, op, args)
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)) == 2 * s.k


@pytest.mark.parametrize("trim", [True, False])
@pytest.mark.parametrize("backward", [False, True])
def test_pieces_wholly_past_n_are_trimmed(trim, backward, monkeypatch, fresh_shapes, tmp_path):
    """N = 18432 (P = 32768, rows read twice by 256 threads, 16 pieces a thread; the forward's as without
    HOLD["forward_trimmed"]): with TRIM only the 9 pieces that reach into N are loaded (pieces 9-15 are padding in every
    thread: their sums are the +0.0 pads); rounded fp32 ops only. The GPU tests check the bits."""
    monkeypatch.setattr(K, "TRIM", trim)
    monkeypatch.setitem(K.HOLD, "forward_trimmed", 0)
    bf16 = cutlass.BFloat16
    if backward:
        op, args = K.backward_args(18432, bf16, bf16, bf16, "llama", True, False, False)
    else:
        op, args = K.forward_args(18432, bf16, bf16, bf16, "llama", True)
    assert (op.s.tpr, op.s.k, op.s.kr, op.s.live, op.s.hold) == (256, 16, 9 if trim else 0, 9 if trim else 16, False)
    ptx = _compiled_ptx(tmp_path, op, args)
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)
    loads = (4 + 2) if backward else (1 + 1 + 1)  # z, dy twice and w twice; x twice and w once
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)) == loads * op.s.live


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 7, 127, 128, 1000, 4096, 5120, 8192, 18432])
@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
def test_forward_bitwise_on_gpu(n, mode, seed):
    """Element-wise rows (odd N, or a view at an odd offset) and vector rows, against the reference."""
    _check_forward(n, mode, seed)


def test_forward_takes_the_table_entry_for_its_row_count(monkeypatch, fresh_shapes, tmp_path):
    """K.FORWARD_ROW_BOUNDS: up to 4096 rows of P = 128 the CUDA forward table's 16 threads a row of 8 lanes (8 rows a
    block of 128 threads), compiled with the weight loaded with the row (one 16-byte load of x and one of the weight
    a thread, rounded fp32 ops only), and on to K.FORWARD_FEW_ROWS (16384) rows; past that its unbounded entry, 4
    threads a row of 32 lanes; at P = 4096 up to 128 rows one row of 512 threads. An entry whose shape is the
    unbounded one's gives None (one kernel for both); a P not in FORWARD_ROW_BOUNDS gives None."""
    bound = K.forward_row_bound(128, 4096)
    small = K.tuned_shape(128, False, row_bound=bound)
    assert (small.tpr, small.k * small.piece, small.rpb, small.hold) == (16, 8, 8, True)
    few = K.FORWARD_FEW_ROWS[128]
    assert few > bound and K.forward_row_bound(128, bound + 1) == K.forward_row_bound(128, few) == bound
    assert K.forward_row_bound(128, few + 1) is None and K.tuned_shape(128, False).tpr == 4
    monkeypatch.setattr(K, "FORWARD_FEW_ROWS", {})
    assert K.forward_row_bound(128, bound + 1) is None
    monkeypatch.setattr(K, "FORWARD_FEW_ROWS", {128: few})
    assert K.forward_row_bound(127, 1) == bound
    assert K.tuned_shape(4096, False, row_bound=K.forward_row_bound(4096, 128)).tpr == 512
    assert K.forward_row_bound(4096, 2048) is None  # that entry's 64 lanes a thread are held as 32: the same shape
    bf16 = cutlass.BFloat16
    op, args = K.forward_args(128, bf16, bf16, bf16, "gemma", True, weight_first=True, row_bound=bound)
    assert op.s == replace(small, hold_weight=True)
    ptx = _compiled_ptx(tmp_path, op, args)
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)) == 2
    monkeypatch.setattr(K, "FORWARD_ROW_BOUNDS", frozenset({4096}))
    assert K.forward_row_bound(128, 1) is None and K.forward_row_bound(4096, 1) is not None


def test_inference_forward_keeps_the_few_rows_entry_further(monkeypatch, fresh_shapes):
    """K.FORWARD_INFERENCE_FEW_ROWS: an inference call's forward (need_rstd False) of rows of P = 128 keeps the few-rows
    entry, with the weight first, up to 65536 rows, where a training call's takes the unbounded entry past 16384;
    the backend plans the two apart (test_inference_and_training_forwards_bitwise_on_gpu)."""
    few, far = K.FORWARD_FEW_ROWS[128], K.FORWARD_INFERENCE_FEW_ROWS[128]
    bound = K.forward_row_bound(128, 1)
    assert far > few
    for rows in (few + 1, far):
        assert K.forward_row_bound(128, rows) is None
        assert K.forward_row_bound(128, rows, need_rstd=False) == bound
    assert K.forward_row_bound(100, far, need_rstd=False) == bound  # N padded to 128
    assert K.forward_row_bound(128, far + 1, need_rstd=False) is None
    assert K.forward_row_bound(4096, 1 << 20, need_rstd=False) is None  # no entry at P = 4096
    monkeypatch.setattr(K, "FORWARD_INFERENCE_FEW_ROWS", {})
    assert K.forward_row_bound(128, few + 1, need_rstd=False) is None


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [128, 1000, 4096, 16384, 18432, 20000])
@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_forward_options_bitwise_on_gpu(n, mode, seed, monkeypatch, fresh_shapes):
    """The forward's shape choices the other way round from their defaults, against the reference: rows read twice
    where their trimmed lanes would be held (HOLD["forward_trimmed"] = 0) and the weight loaded with the row at every
    row count (the default: up to 512 rows at P = 4096, 128 at 8192), then the weight loaded after the row sum at
    every row count, then rows held with 64 lanes a thread where they are held (FORWARD_VALUES), then held lanes kept
    in fp32 (HOLD["forward_raw"] off), then x staged in shared memory with the weight beside it (HOLD["forward_staged"]
    at N's padded length, at every row count), then nothing staged."""
    monkeypatch.setitem(K.HOLD, "forward_trimmed", 0)
    monkeypatch.setattr(K, "FORWARD_WEIGHT_FIRST_ROWS", {next_pow2(n): 1 << 40})
    fresh_shapes()
    _check_forward(n, mode, seed)
    monkeypatch.setattr(K, "FORWARD_WEIGHT_FIRST_ROWS", {})
    fresh_shapes()
    _check_forward(n, mode, seed)
    monkeypatch.setattr(K, "FORWARD_VALUES", {next_pow2(n): 64})  # rows held by fewer threads (a sweep variant)
    fresh_shapes()
    _check_forward(n, mode, seed)
    monkeypatch.setitem(K.HOLD, "forward_raw", 0)  # held lanes kept in fp32 (the rule before HOLD's forward_raw)
    monkeypatch.setattr(K, "FORWARD_VALUES", {})
    fresh_shapes()
    _check_forward(n, mode, seed)
    monkeypatch.setitem(K.HOLD, "forward_raw", 1 << 20)
    monkeypatch.setitem(K.HOLD, "forward_staged", {next_pow2(n): 1})  # x staged at every row count, the weight beside
    fresh_shapes()
    _check_forward(n, mode, seed)
    monkeypatch.setitem(K.HOLD, "forward_staged", {})  # nothing staged (the default stages P = 4096 and 8192)
    fresh_shapes()
    _check_forward(n, mode, seed)


@pytest.mark.parametrize("n", [128, 4096, 1000])
def test_mean_scale_takes_the_division_out_of_the_ptx(n, tmp_path, monkeypatch, fresh_shapes):
    """HOLD["mean_scale"]: for N = 2^k the forward and the backward take the mean as the sum times 2^-k, so their PTX
    has one div.rn.f32 fewer (the forward keeps rstd's 1 / sqrt) and one mul.rn.f32 by that constant more; N = 1000
    keeps its division. Off by default until timed on a GPU."""
    bf16 = cutlass.BFloat16
    assert K.HOLD["mean_scale"] is False

    def counts(op_args) -> tuple[int, int]:
        where = tmp_path / str(len(list(tmp_path.iterdir())))  # a directory a compile (_compiled_ptx reads its one PTX)
        where.mkdir()
        ptx = _compiled_ptx(where, *op_args)
        return len(re.findall(r"\bdiv\.rn\.f32\b", ptx)), len(re.findall(r"\bmul\.rn\.f32\b", ptx))

    def both():
        return (counts(K.forward_args(n, bf16, bf16, bf16, "llama", True)),
                counts(K.backward_args(n, bf16, bf16, bf16, "llama", True, False, True)))

    before = both()
    monkeypatch.setitem(K.HOLD, "mean_scale", True)
    fresh_shapes()
    after = both()
    for (div0, mul0), (div1, mul1) in zip(before, after, strict=True):
        if n & (n - 1):
            assert (div1, mul1) == (div0, mul0)
        else:
            assert div1 == div0 - 1 and mul1 == mul0 + 1
    assert after[0][0] >= 1  # rstd's reciprocal


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 128, 4096, 1000])
@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_mean_scale_bitwise_on_gpu(n, mode, seed, monkeypatch, fresh_shapes):
    """HOLD["mean_scale"] on: y, rstd and dx the reference's bits with eps = 0 on helpers.extreme_mean_rows
    (subnormal, overflowing and NaN mean squares beside ordinary rows); 1000 rows (the persistent grid's strides)
    and 3."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    monkeypatch.setitem(K.HOLD, "mean_scale", True)
    fresh_shapes()
    tr = get_backend("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    offset = 1.0 if mode == "gemma" else 0.0
    spec = make_spec(torch.bfloat16, 0.0, offset, mode, torch.bfloat16)
    for rows in (3, 1000):
        x = extreme_mean_rows(rows, n, g)
        w = (torch.randn(n, device="cuda", generator=g) * 0.5).bfloat16()
        dy = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        want_y, want_rstd, _ = tr.rms_norm_fwd(x, w, None, spec)
        y, rstd, _ = K.forward(x, w, 0.0, offset, mode, torch.bfloat16)
        assert bits_equal(rstd, want_rstd) and bits_equal(y, want_y), f"{rows}x{n} {mode}"
        want_dx, _ = tr.rms_norm_bwd(dy, x, w, want_rstd, None, spec, "strict", False, None)
        dx, _ = K.backward(dy, x, w, want_rstd, None, offset, mode, partials=True)
        assert bits_equal(dx, want_dx), f"dx {rows}x{n} {mode}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [128, 4096])
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32), (torch.float16, torch.bfloat16)])
def test_staged_forward_mixed_dtypes_bitwise_on_gpu(n, x_dtype, w_dtype, seed, monkeypatch, fresh_shapes):
    """The staged forward (HOLD["forward_staged"]) with the weight staged beside x or loaded (fp32 weights), and fp32
    rows on the held path, against the reference, Gemma offset."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    monkeypatch.setitem(K.HOLD, "forward_staged", {next_pow2(n): 1})  # the weight staged with x (forward_args)
    fresh_shapes()
    g = torch.Generator(device="cuda").manual_seed(seed)
    for rows in (1, 3000):
        x = torch.randn(rows, n, device="cuda", generator=g).to(x_dtype)
        w = (torch.randn(n, device="cuda", generator=g) * 0.01).to(w_dtype)
        spec = make_spec(x_dtype, 1e-6, 1.0, "gemma", x_dtype)
        want_y, want_rstd, _ = get_backend("torch").rms_norm_fwd(x, w, None, spec)
        y, rstd, _ = K.forward(x, w, 1e-6, 1.0, "gemma", x_dtype)
        assert bits_equal(rstd, want_rstd) and bits_equal(y, want_y), f"{rows}x{n} {x_dtype} {w_dtype}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [4096, 5000, 8192])
def test_forward_staged_rows_bound_bitwise_on_gpu(n, seed):
    """Both sides of HOLD["forward_staged"]'s row bound (the register path below it, x staged from it on), by
    default: y and rstd the reference's bits (Gemma offset, tiny bf16 weights)."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    bound = K.HOLD["forward_staged"][next_pow2(n)]
    g = torch.Generator(device="cuda").manual_seed(seed)
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    for rows in (bound - 1, bound):
        assert K.forward_stages(n, rows) == (rows >= bound)
        x = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()
        want_y, want_rstd, _ = get_backend("torch").rms_norm_fwd(x, w, None, spec)
        y, rstd, _ = K.forward(x, w, 1e-6, 1.0, "gemma", torch.bfloat16)
        assert bits_equal(rstd, want_rstd) and bits_equal(y, want_y), f"{rows}x{n}"


def _check_forward(n: int, mode: str, seed: int) -> None:
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    g = torch.Generator(device="cuda").manual_seed(seed)
    for rows, shift in ((1, 0), (37, 1), (3000, 0)):
        x = torch.randn(rows, n + shift, device="cuda", generator=g).bfloat16()[:, shift:]  # shift: misaligned
        w = (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()  # tiny weights: the Gemma case
        offset = 1.0 if mode == "gemma" else 0.0
        spec = make_spec(torch.bfloat16, 1e-6, offset, mode, torch.bfloat16)
        want_y, want_rstd, _ = get_backend("torch").rms_norm_fwd(x, w, None, spec)
        y, rstd, _ = K.forward(x, w, 1e-6, offset, mode, torch.bfloat16)
        assert bits_equal(rstd, want_rstd) and bits_equal(y, want_y), f"{rows}x{n} {mode}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_forward_few_rows_bounds_bitwise_on_gpu(seed):
    """Both sides of the table entry's own bound at P = 128 (4096 rows) and of K.FORWARD_FEW_ROWS (16384): y and rstd
    the reference's bits (Gemma offset, tiny bf16 weights, a fresh row count on each side)."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    few, bound = K.FORWARD_FEW_ROWS[128], K.forward_row_bound(128, 1)
    far = K.FORWARD_INFERENCE_FEW_ROWS[128]
    g = torch.Generator(device="cuda").manual_seed(seed)
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    cases = [(rows, True) for rows in (bound, bound + 1, few, few + 1)] + [(rows, False) for rows in
                                                                            (few + 1, far - 3, far, far + 1)]
    for rows, need_rstd in cases:
        x = torch.randn(rows, 128, device="cuda", generator=g).bfloat16()
        w = (torch.randn(128, device="cuda", generator=g) * 0.01).bfloat16()
        want_y, want_rstd, _ = get_backend("torch").rms_norm_fwd(x, w, None, spec)
        y, rstd, _ = K.forward(x, w, 1e-6, 1.0, "gemma", torch.bfloat16, need_rstd=need_rstd)
        assert bits_equal(rstd, want_rstd) and bits_equal(y, want_y), f"{rows} x 128, need_rstd {need_rstd}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [100, 128])
def test_inference_and_training_forwards_bitwise_on_gpu(n, seed):
    """The backend's inference call (need_rstd False: FORWARD_INFERENCE_FEW_ROWS' shape at these rows) and its
    training call on the same x (the unbounded entry) give the reference's y, the training call its rstd too, in
    either order, from two plans with their own kernels (the same bits would hide one plan serving both)."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    cute, ref = get_backend("cute"), get_backend("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = K.FORWARD_INFERENCE_FEW_ROWS[128] - 5
    x = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    want_y, want_rstd, _ = ref.rms_norm_fwd(x, w, None, spec)
    cute._fwd_plans.clear()
    for need_rstd in (False, True, False):
        y, rstd, _ = cute.rms_norm_fwd(x, w, None, spec, need_rstd=need_rstd)
        assert bits_equal(y, want_y), f"need_rstd {need_rstd}"
        assert (rstd is not None) == need_rstd and (rstd is None or bits_equal(rstd, want_rstd))
    plans = list(cute._fwd_plans.values())
    assert len(plans) == 2 and plans[0].compiled is not plans[1].compiled


@pytest.mark.parametrize("x_name, w_name", [("Float32", "Float32"), ("Float16", "Float32"), ("BFloat16", None)])
def test_forward_compiles_for_other_dtypes(x_name, w_name, tmp_path, held_forward):
    """fp32 rows (two 16-byte vectors per piece), fp16 rows with an fp32 weight, no weight."""
    w_dtype = getattr(cutlass, w_name) if w_name else None
    ptx = _ptx(tmp_path, 4096, "llama", getattr(cutlass, x_name), w_dtype, vector=True)
    assert "fma." not in ptx and "ld.global.v4" in ptx


def _bwd_ptx(tmp_path, n: int, mode: str, vector: bool, has_dres: bool, partials: bool) -> str:
    bf16 = cutlass.BFloat16
    return _compiled_ptx(tmp_path, *K.backward_args(n, bf16, bf16, bf16, mode, vector, has_dres, partials))


@pytest.mark.parametrize("n", [7, 128, 4096, 18432])
@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
@pytest.mark.parametrize("vector, has_dres, partials", [(False, False, True), (True, True, True), (True, False, False)])
def test_backward_compiles_with_only_rounded_fp32_ops(n, mode, vector, has_dres, partials, tmp_path):
    if vector and K.forward_shape(n).piece != 8:
        pytest.skip("vector loads need pieces of 8 lanes")
    ptx = _bwd_ptx(tmp_path, n, mode, vector, has_dres, partials)
    # with partials it lets the dependent partial sum launch early (programmatic dependent launch)
    assert ptx.count("griddepcontrol.launch_dependents") == partials
    assert "fma." not in ptx
    assert not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx), "an fp32 op without .rn"
    assert ("ld.global.v4" in ptx) == vector


@pytest.fixture(params=[False, True], ids=["", "prefetch"])
def backward_prefetch(request, monkeypatch, fresh_shapes):
    """The cute backward with and without the next row prefetched into registers (ForwardShape.prefetch)."""
    monkeypatch.setitem(K.HOLD, "backward_prefetch", request.param)
    return request.param


@pytest.mark.parametrize("n, hold", [(128, True), (4096, True), (8192, "prefetch"), (18432, False), (7, True)])
def test_prefetched_rows_are_loaded_once(n, hold, backward_prefetch, tmp_path):
    """With prefetch (where rows are held: rows read twice lost with it) the backward loads each piece of z and dy
    once a row as without (the first row before the loop, the next one in it: twice the load instructions), and the
    same weight loads; rounded fp32 ops only. Rows of P = 8192 are held (by 512 threads) only with the prefetch."""
    bf16 = cutlass.BFloat16
    hold = backward_prefetch if hold == "prefetch" else hold
    no_partials = K.backward_args(n, bf16, bf16, bf16, "llama", n % 8 == 0, False, False)[0].s
    assert not no_partials.prefetch and no_partials.hold == (n <= 4096)  # the shape measured up to run 15
    op, args = K.backward_args(n, bf16, bf16, bf16, "llama", n % 8 == 0, False, True)
    assert (op.s.prefetch, op.s.hold) == (backward_prefetch and hold, hold)
    ptx = _compiled_ptx(tmp_path, op, args)
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)
    if n % 8:
        return
    z_dy = 2 * (2 if op.s.prefetch else 1) + (0 if hold else 2)  # without hold pass 2 reads z and dy again
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx)) == (z_dy + 2) * op.s.live


def test_rows_of_512_threads_are_held_where_prefetched(fresh_shapes, tmp_path):
    """HOLD["prefetch_threads"] = 512: the backward's rows of P = 8192 held by 512 threads, 16 lanes each, with the
    next row prefetched (rounded fp32 ops only), at 1 block an SM; the backward's without partials still reads them
    twice with 256 threads (HOLD["threads"]); the backward's rows of P = 16384 and 32768 read twice."""
    bwd = K.tuned_shape(8192, True)
    assert (bwd.hold, bwd.prefetch, bwd.tpr, bwd.k * bwd.piece) == (True, True, 512, 16)
    assert K.backward_blocks_per_sm(8192) == 1
    for n in (8192, 16384):
        assert not K.tuned_shape(n, True, partials=False).hold and K.tuned_shape(n, True, False).tpr == 256
    assert not K.tuned_shape(16384, True).hold and not K.tuned_shape(18432, True).hold
    bf16 = cutlass.BFloat16
    ptx = _compiled_ptx(tmp_path, *K.backward_args(8192, bf16, bf16, bf16, "llama", True, False, True))
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 7, 128, 1000, 4096, 8192, 18432])
@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
def test_backward_bitwise_on_gpu(n, mode, seed, backward_prefetch):
    """dx bitwise against the reference, with and without a residual gradient, in vector and
    element-wise rows; the fast dW (sum of the partials) close to the strict one and repeatable. With and without
    prefetch (the last row's prefetch runs past the end)."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    tr = get_backend("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for rows, shift in ((1, 0), (37, 1), (2000, 0)):
        def rand(rows=rows, shift=shift):  # shift: a view at an odd offset, element-wise rows
            return torch.randn(rows, n + shift, device="cuda", generator=g).bfloat16()[:, shift:]

        z, dy, dres = rand(), rand(), (rand() if rows != 37 else None)
        w = (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()
        offset = 1.0 if mode == "gemma" else 0.0
        spec = make_spec(torch.bfloat16, 1e-6, offset, mode, torch.bfloat16)
        _, rstd, _ = tr.rms_norm_fwd(z, w, None, spec)
        want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
        dx, part = K.backward(dy, z, w, rstd, dres, offset, mode, partials=True)
        assert bits_equal(dx, want_dx), f"dx {rows}x{n} {mode}"
        dw = part.sum(0)
        rel = ((dw.double() - want_dw.double()).norm() / want_dw.double().norm().clamp_min(1e-30)).item()
        assert rel < 1e-2
        assert bits_equal(K.backward(dy, z, w, rstd, dres, offset, mode, partials=True)[1], part)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 128, 1000, 4096])
def test_backward_partial_rows_in_their_order_on_gpu(n, seed):
    """The fast dW's partial rows bit for bit as helpers.slot_partial_rows_model orders them: each row slot's left
    fold of its rows over the persistent grid's strides, and where the shape combines its slots (several rows a block:
    N = 7, 128, 1000) one row a block, the slots added in slot order."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec
    from strictnorm.reference import dw_contributions

    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = 5000
    z = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    dy = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    _, rstd, _ = get_backend("torch").rms_norm_fwd(z, w, None, spec)
    _, part = K.backward(dy, z, w, rstd, None, 1.0, "gemma", partials=True)
    s = K.tuned_shape(n, True)
    combine = K.combines_slots(s)
    assert combine == (n != 4096)
    grid = K._grid(s, rows, z.device, K.backward_blocks_per_sm(n))
    assert part.shape == (grid if combine else grid * s.rpb, n)
    want = slot_partial_rows_model(dw_contributions(dy, z, rstd, spec), s.rpb, grid, combine)
    assert bits_equal(part.cpu(), want)


@pytest.mark.parametrize("n", [7, 1000, 4096])
@pytest.mark.parametrize("vector", [False, True])
def test_fused_add_forward_compiles(n, vector, tmp_path):
    """The fused add (bf16 x, fp32 residual stream): rounded ops only; residual_out stored."""
    if vector and K.forward_shape(n).piece != 8:
        pytest.skip("vector loads need pieces of 8 lanes")
    (tmp_path / "fused").mkdir()
    (tmp_path / "plain").mkdir()
    ptx = _ptx(tmp_path / "fused", n, "llama", cutlass.BFloat16, cutlass.Float32, vector, res_dtype=cutlass.Float32)
    assert "fma." not in ptx and not re.search(r"\b(add|sub|mul|div|sqrt)\.f32\b", ptx)
    plain = _ptx(tmp_path / "plain", n, "llama", cutlass.BFloat16, cutlass.Float32, vector)
    assert ptx.count("st.global") > plain.count("st.global")  # residual_out is written too


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 1000, 4096, 18432])
def test_fused_add_forward_bitwise_on_gpu(n, seed):
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    g = torch.Generator(device="cuda").manual_seed(seed)
    for rows in (1, 37, 3000):
        x = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        res = torch.randn(rows, n, device="cuda", generator=g)  # an fp32 residual stream
        w = (torch.randn(n, device="cuda", generator=g) * 0.01).float()
        spec = make_spec(torch.float32, 1e-6, 1.0, "gemma", torch.float32)
        want = get_backend("torch").rms_norm_fwd(x, w, res, spec)
        got = K.forward(x, w, 1e-6, 1.0, "gemma", torch.float32, residual=res)
        for a, b in zip(want, got, strict=True):
            assert bits_equal(a, b), f"{rows}x{n}"


# ---- the registered backend (backends/cute/backend.py) ----------------------------------------------

def test_as_rows_reads_views_in_place_and_copies_the_rest():
    from strictnorm.backends.cute.backend import as_rows

    base = torch.randn(4, 6, 10)
    view = base[:, :, 2:]  # leading dims merge: rows of one stride, read in place
    rows = as_rows(view)
    assert rows.shape == (24, 8) and rows.stride() == (10, 1) and rows.data_ptr() == view.data_ptr()
    crossed = base.transpose(0, 1)[:, :, 2:]  # leading dims that do not merge: a copy
    rows = as_rows(crossed)
    assert rows.is_contiguous() and torch.equal(rows, crossed.reshape(24, 8))
    strided = base[..., ::2]  # a strided last dim: a copy with unit stride
    rows = as_rows(strided)
    assert rows.stride(-1) == 1 and torch.equal(rows, strided.reshape(-1, 5))


def test_row_length_limit_is_a_clear_error():
    from strictnorm.backends.cute.backend import check_row_length

    check_row_length(32768)
    with pytest.raises(ValueError, match="up to 32768 elements.*backend='cuda'"):
        check_row_length(32769)


def test_backend_is_registered_and_says_why_it_cannot_run_here():
    import strictnorm as sn
    from strictnorm.backends import registry

    assert "cute" in registry.names() and "cute" not in registry.PREFERENCE  # by name only
    if not HAS_CUDA:
        assert "NVIDIA GPU" in registry.status("cute", torch.device("cpu")).reason
        with pytest.raises(sn.BackendUnavailable, match="'cute'"):
            sn.rms_norm(torch.randn(2, 8), backend="cute")


def _backend_fwd_cases():
    bf16, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    # x, residual, weight, y dtypes: plain bf16; fp16 rows with an fp32 weight and output; fp32 without a
    # weight; bf16 x added to a bf16 residual stream with an fp32 weight
    return ((bf16, None, bf16, bf16), (f16, None, f32, f32), (f32, None, None, f32), (bf16, bf16, f32, bf16))


@pytest.fixture(params=K.CALLS)
def cute_calls(request, monkeypatch):
    """Both calling conventions of kernels.py (DLPack, TVM FFI): the same kernels, so the same bits."""
    if request.param == "tvm-ffi" and not K._tvm_ffi_importable():
        pytest.skip("apache-tvm-ffi is not installed")
    monkeypatch.setenv("STRICTNORM_CUTE_CALLS", request.param)
    if HAS_CUDA:  # the backend's forward plans hold the convention read when they were made
        from strictnorm.backends.registry import get_backend

        monkeypatch.setattr(get_backend("cute"), "_fwd_plans", {})
    return request.param


@pytest.mark.parametrize("vector", [False, True])
def test_tvm_ffi_calls_compile_the_same_kernel(vector, tmp_path):
    """Compiled for TVM FFI calls (torch tensors in, the stream from TVM FFI's environment), the forward's
    and the backward's device code is the PTX of the DLPack build: only the host side differs."""
    if not K._tvm_ffi_importable():
        pytest.skip("apache-tvm-ffi is not installed")
    import cutlass.cute as cute

    bf16 = cutlass.BFloat16
    for which, make in enumerate((lambda t: K.forward_args(4096, bf16, bf16, bf16, "gemma", vector, tvm_ffi=t),
                                  lambda t: K.backward_args(4096, bf16, bf16, bf16, "gemma", vector, True, True,
                                                            tvm_ffi=t))):
        ptx = []
        for tvm_ffi in (False, True):
            out = tmp_path / f"{which}-{tvm_ffi}"
            out.mkdir()
            op, args = make(tvm_ffi)
            options = f"--keep-ptx --dump-dir {out}" + (" --enable-tvm-ffi" if tvm_ffi else "")
            cute.compile(op, *args, options=options)
            (path,) = list(out.glob("*.ptx"))
            ptx.append(path.read_text())
        kernels = [re.findall(r"\.visible \.entry[\s\S]*?\n}\n", p) for p in ptx]
        assert kernels[0] and len(kernels[0]) == len(kernels[1])
        strip = [[re.sub(r"\.entry \S+?\(", ".entry (", k) for k in ks] for ks in kernels]
        assert strip[0] == strip[1]


def test_calling_convention_setting(monkeypatch):
    monkeypatch.delenv("STRICTNORM_CUTE_CALLS", raising=False)
    assert K.calls() == ("tvm-ffi" if K._tvm_ffi_importable() else "dlpack")
    monkeypatch.setenv("STRICTNORM_CUTE_CALLS", "dlpack")
    assert K.calls() == "dlpack"
    monkeypatch.setenv("STRICTNORM_CUTE_CALLS", "ctypes")
    with pytest.raises(ValueError, match="dlpack"):
        K.calls()
    monkeypatch.setenv("STRICTNORM_CUTE_CALLS", "tvm-ffi")
    if K._tvm_ffi_importable():
        assert K.calls() == "tvm-ffi"
    else:
        with pytest.raises(RuntimeError, match="apache-tvm-ffi"):
            K.calls()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 1000, 4096, 4097, 8192, 16384, 18432])
def test_backend_bitwise_against_reference(n, seed, cute_calls):
    """backend='cute' against the reference: y, rstd, residual_out for every mode and dtype case; dx
    (with and without a residual gradient), strict dW bitwise, fast dW repeatable and close, in place."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cute"), get_backend("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for rows, shift in ((1, 0), (37, 3), (600, 0)):
        def rand(dtype, rows=rows, shift=shift):  # shift: rows read in place from a wider buffer
            return torch.randn(rows, n + shift, device="cuda", generator=g).to(dtype)[:, shift:]

        for mode in ("llama", "gemma", "none"):
            for x_dt, r_dt, w_dt, y_dt in _backend_fwd_cases():
                x, res = rand(x_dt), (rand(r_dt) if r_dt else None)
                w = (torch.randn(n, device="cuda", generator=g) * 0.01).to(w_dt) if w_dt else None  # tiny: Gemma
                offset = 1.0 if mode == "gemma" and w is not None else 0.0
                spec = make_spec(r_dt or x_dt, 1e-6, offset, mode, y_dt)
                for name, a, b in zip(("y", "rstd", "z"), tr.rms_norm_fwd(x, w, res, spec),
                                      cb.rms_norm_fwd(x, w, res, spec), strict=True):
                    assert (a is None) == (b is None) and (a is None or bits_equal(a, b)), \
                        f"{name} {rows}x{n} {mode} {x_dt} {r_dt} {w_dt}"
            bf16 = torch.bfloat16
            z, dy, w = rand(bf16), rand(bf16), (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()
            dres = rand(bf16) if rows != 37 else None
            spec = make_spec(bf16, 1e-6, 1.0 if mode == "gemma" else 0.5, mode, bf16)
            _, rstd, _ = tr.rms_norm_fwd(z, w, None, spec)
            want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
            dx, dw = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
            assert bits_equal(dx, want_dx) and bits_equal(dw, want_dw), f"strict {rows}x{n} {mode}"
            fast1 = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", True, None)
            fast2 = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", True, None)
            assert bits_equal(fast1[0], want_dx) and bits_equal(fast1[1], fast2[1])
            rel = ((fast1[1].double() - want_dw.double()).norm() / want_dw.double().norm().clamp_min(1e-30)).item()
            assert rel < 1e-2
            buf = dy.clone()
            got_dx, _ = cb.rms_norm_bwd(buf, z, w, rstd, dres, spec, "strict", True, buf)
            assert got_dx is buf and bits_equal(buf, want_dx)


def test_forward_rstd_length_is_its_own():
    """The compiled forward's rstd has a length of its own, not x's row count: a caller that drops rstd passes the
    backend's longer sink (layout.rstd_sink), which TVM FFI calls would otherwise reject (run 35 call f). The
    backward's rstd stays tied to the rows."""
    bf16 = cutlass.BFloat16
    _, args = K.forward_args(4096, bf16, bf16, bf16, "llama", True)
    assert args[5].shape[0] is not args[0].shape[0]  # symbolic sizes: the same symbol or not
    _, bargs = K.backward_args(4096, bf16, bf16, bf16, "llama", True, False, True)
    assert bargs[3].shape[0] is bargs[1].shape[0]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [128, 1000, 4096])
def test_backend_forward_plans_shapes_and_dropped_rstd(n, seed, cute_calls, monkeypatch):
    """The backend's planned forward (one plan per input signature) on 3D inputs read in place, 3D views whose rows
    do not merge (copied), a residual, and zero rows, twice each (the second call takes the plan): the reference's
    bits; with need_rstd=False rstd is None and the kernel's rstd lands in layout.rstd_sink (an inference call's own
    plan: its row bounds may differ, K.FORWARD_INFERENCE_FEW_ROWS)."""
    from strictnorm.backends.layout import rstd_sink
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cute"), get_backend("torch")
    monkeypatch.setattr(cb, "_fwd_plans", {})
    g = torch.Generator(device="cuda").manual_seed(seed)
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    w = (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()
    wide = torch.randn(6, 9, n + 8, device="cuda", generator=g).bfloat16()
    for x, res in ((wide[:, :, :n].contiguous(), None), (wide[:, ::2, 8:], None),
                   (wide[:, :, 4:4 + n], torch.randn(6, 9, n, device="cuda", generator=g).bfloat16()),
                   (wide[:0, :, :n], None)):
        want = tr.rms_norm_fwd(x, w, res, spec)
        for _ in range(2):
            got = cb.rms_norm_fwd(x, w, res, spec)
            assert all((a is None) == (b is None) and (a is None or (a.shape == b.shape and bits_equal(a, b)))
                       for a, b in zip(want, got, strict=True))
            y, rstd, z = cb.rms_norm_fwd(x, w, res, spec, need_rstd=False)
            assert rstd is None and bits_equal(want[0], y) and (z is None or bits_equal(want[2], z))
            rows = want[1].numel()
            assert bits_equal(want[1].reshape(-1), rstd_sink(x.device, rows)[:rows])
    assert len(cb._fwd_plans) == 8  # the four signatures, each planned for a training and an inference call


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [128, 1000, 4096])
def test_backend_backward_plans_in_place_and_shapes(n, seed, cute_calls, monkeypatch):
    """The backend's planned backward (one plan per input signature), twice each: 3D rows read in place and rows that
    do not merge (copied), with and without a residual gradient, the fast dW, the strict dW, no dW, zero rows, and
    in place (dx written straight into dy's buffer with the fast dW; through a copy beside the strict fold): dx and
    the strict dW are the reference's bits, the fast dW repeats itself."""
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    cb, tr = get_backend("cute"), get_backend("torch")
    monkeypatch.setattr(cb, "_bwd_plans", {})
    g = torch.Generator(device="cuda").manual_seed(seed)
    spec = make_spec(torch.bfloat16, 1e-6, 1.0, "gemma", torch.bfloat16)
    w = (torch.randn(n, device="cuda", generator=g) * 0.01).bfloat16()

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).bfloat16()

    wide_z, wide_dy = rand(6, 9, n + 8), rand(6, 9, n + 8)
    cases = [(wide_z[:, :, :n].contiguous(), wide_dy[:, :, :n].contiguous(), None),
             (wide_z[:, ::2, 8:], wide_dy[:, ::2, 8:], rand(6, 5, n)),
             (wide_z[:0, :, :n], wide_dy[:0, :, :n], None)]
    for z, dy, dres in cases:
        _, rstd, _ = tr.rms_norm_fwd(z, w, None, spec)
        want_dx, want_dw = tr.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
        for _ in range(2):
            dx, dw = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "strict", True, None)
            assert bits_equal(dx, want_dx) and bits_equal(dw, want_dw)
            dx, dw = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", True, None)
            assert bits_equal(dx, want_dx) and bits_equal(dw, cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast",
                                                                              True, None)[1])
            dx, dw = cb.rms_norm_bwd(dy, z, w, rstd, dres, spec, "fast", False, None)
            assert bits_equal(dx, want_dx) and dw is None
            for dw_mode in ("fast", "strict"):
                buf = dy.contiguous().clone()
                dx, dw = cb.rms_norm_bwd(buf, z, w, rstd, dres, spec, dw_mode, True, buf)
                assert dx is buf and bits_equal(buf, want_dx)
                assert dw_mode == "fast" or bits_equal(dw, want_dw)
    in_place = [p for p in cb._bwd_plans.values() if p.into_out]
    assert in_place and all(not p.fold for p in in_place)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_backend_kernels_keyed_by_mode_and_offset(seed, cute_calls):
    """One shape, the casting mode and the offset changed between calls: each call has the reference's
    bits (a kernel compiled for another mode is never reused; the offset is a runtime argument)."""
    from strictnorm.backends.cute import kernels
    from strictnorm.backends.registry import get_backend
    from strictnorm.contract import make_spec

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(300, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2048, device="cuda", generator=g) * 0.01).bfloat16()
    before = kernels.compile_forward.cache_info().currsize
    for mode, offset in (("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0), ("none", 1.0), ("llama", 1.0)):
        spec = make_spec(torch.bfloat16, 1e-6, offset, mode, torch.bfloat16)
        want = get_backend("torch").rms_norm_fwd(x, w, None, spec)
        got = get_backend("cute").rms_norm_fwd(x, w, None, spec)
        assert bits_equal(want[0], got[0]) and bits_equal(want[1], got[1]), (mode, offset)
    assert kernels.compile_forward.cache_info().currsize - before <= 3  # one kernel per mode at most


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dw", ["fast", "strict"])
def test_backend_autograd_in_place_and_graph_replay(dw, seed, cute_calls):
    """FusedAddRMSNorm through the public API on backend='cute' in a CUDA graph (helpers.py)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def data():
        return (torch.randn(1024, 4096, device="cuda", generator=g).bfloat16(),
                (torch.randn(4096, device="cuda", generator=g) * 0.01).bfloat16(),
                torch.randn(1024, 4096, device="cuda", generator=g).bfloat16())

    check_fused_add_graph_replay("cute", dw, data)


@pytest.mark.parametrize("n", [4096, 8192, 16384, 18432])
def test_backward_partials_stay_in_registers(n, tmp_path):
    """The backend keeps fast-dW partials in the backward kernel where a thread has at most
    K.PARTIALS_MAX_VALUES of them (N = 18432: its 9 trimmed pieces): there the sm_90a cubin has no stack (untrimmed,
    at N = 18432, the partials spilled)."""
    import pathlib
    import subprocess

    triton = pytest.importorskip("triton")
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump in this Triton install")
    import cutlass.cute as cute

    assert K.keeps_partials(n)
    bf16 = cutlass.BFloat16
    op, args = K.backward_args(n, bf16, bf16, bf16, "llama", True, False, True)
    cute.compile(op, *args, options=f"--keep-cubin --dump-dir {tmp_path}")
    (cubin,) = list(tmp_path.glob("*.cubin"))
    usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


def test_longer_rows_leave_the_fast_dw_to_the_fold(monkeypatch, fresh_shapes):
    """Rows whose threads would hold more than K.PARTIALS_MAX_VALUES partials (N past 18432 at P = 32768, P = 65536)
    take the strict fold for dw="fast"; so do all rows of P = 32768 with the trim off."""
    assert K.keeps_partials(128) and K.keeps_partials(16385) and K.keeps_partials(18432)
    assert not any(K.keeps_partials(n) for n in (18433, 20480, 32768, 40000, 65536))
    monkeypatch.setattr(K, "TRIM", False)
    fresh_shapes()
    assert K.keeps_partials(16384) and not K.keeps_partials(16385) and not K.keeps_partials(18432)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 8, 1000, 4096])
def test_signed_zeros_of_a_zero_dy_row(n, seed):
    """helpers.zero_dy_case on the cute backend: padded lanes must add +0.0, (-0) + (-0) must stay -0."""
    from strictnorm.backends.registry import get_backend

    dy, z, w, rstd, spec, want_dx = zero_dy_case(n, "cuda", torch.Generator().manual_seed(seed))
    for dw_mode in ("strict", "fast"):
        got_dx, _ = get_backend("cute").rms_norm_bwd(dy, z, w, rstd, None, spec, dw_mode, True, None)
        assert bits_equal(want_dx, got_dx), f"dw={dw_mode}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [7, 1000, 4096])
@pytest.mark.parametrize("dtype, fused", [(torch.bfloat16, False), (torch.float16, True)])
def test_special_values_bitwise(n, dtype, fused, seed):
    """helpers.check_special_values on the cute backend, every casting mode."""
    from strictnorm.backends.registry import get_backend

    for mode in ("llama", "gemma", "none"):
        check_special_values(get_backend("cute"), n, dtype, fused, mode, "cuda", torch.Generator().manual_seed(seed))


def test_backward_grid_blocks_per_sm(monkeypatch):
    """The persistent grid: every row group up to blocks_per_sm an SM (0: what 2048 threads an SM allow); a
    non-persistent shape takes every group."""
    monkeypatch.setattr(K, "_sm_count", lambda index: 132)
    dev = type("Device", (), {"index": 0})()
    shape = K.ForwardShape(piece=8, tpr=256, k=2, rpb=1, hold=True, persistent=True)
    assert K._grid(shape, 100_000, dev) == 132 * 8
    assert K._grid(shape, 100_000, dev, 2) == 264
    assert K._grid(shape, 100, dev, 2) == 100
    assert K._grid(K.ForwardShape(piece=8, tpr=8, k=2, rpb=16, persistent=True), 100_000, dev) == 132 * 16
    assert K._grid(K.ForwardShape(piece=8, tpr=256, k=2, rpb=1, persistent=False), 100_000, dev, 2) == 100_000
    assert K._grid(shape, 100_000, dev, 2, sms_left=32) == 200  # the rest left to the strict fold beside
    assert K._grid(shape, 100_000, dev, 2, sms_left=500) == 2  # one SM's worth at least
    assert [K.backward_blocks_per_sm(n) for n in (100, 4096, 5000, 8192, 18432, 65536)] == [4, 2, 1, 1, 1, 0]
    assert [K.backward_blocks_per_sm(n, partials=False) for n in (100, 4096, 8192)] == [0, 0, 2]  # without partials


def test_sweep_variants_name_known_choices(monkeypatch):
    """bench/sweep_cute.py's variants: names without a comma (SWEEP_VARIANTS splits on commas), forward-only names
    among them, and every key a choice use() sets or a key of K.HOLD (a misspelt key would add a HOLD entry nothing
    reads, and the variant would time the defaults under its name)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import sweep_cute

    popped = {"trim", "partials_max_values", "weight_first_rows", "forward_values", "forward_row_bounds", "fwd_table",
              "forward_few_rows"}
    assert set(sweep_cute.FORWARD_ONLY) <= set(sweep_cute.VARIANTS)
    for name, variant in sweep_cute.VARIANTS.items():
        assert "," not in name
        assert set(variant) - popped <= set(K.HOLD), name
