"""The CUDA backend's launch plans and packed kernel parameters, on the CPU with recording stand-in kernels
(no GPU, no driver): what each launch receives, call after call. The GPU tests check the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strictnorm.backends import layout
from strictnorm.backends.cuda import backend as cuda_backend
from strictnorm.backends.cuda import nvrtc
from strictnorm.contract import make_spec


class _Occupancy:
    @staticmethod
    def max_active_blocks_per_multiprocessor(threads: int, shmem: int) -> int:
        return 4


class _RecordingKernel:
    def __init__(self, name: str, defines: dict, log: list) -> None:
        self.name, self.defines, self.log = name, dict(defines), log
        self.kernel = self
        self.occupancy = _Occupancy()

    def launch(self, stream, grid, block, shmem, *args, cooperative: bool = False, dependent: bool = False) -> None:
        self.log.append((self.name, grid, block, shmem, args, dependent, stream))
        self.cooperative = cooperative

    def allow_dynamic_shared(self, nbytes: int) -> None:
        self.shared = nbytes


class _RecordingCache:
    def __init__(self, log: list) -> None:
        self.log = log

    def get(self, device_index, name, kernel, defines):
        return _RecordingKernel(kernel, defines, self.log)


@pytest.fixture
def recording(monkeypatch):
    """A CudaBackend whose kernels record their launches; CPU tensors stand in for device memory."""
    props = type("Props", (), {"multi_processor_count": 132, "shared_memory_per_block_optin": 227 * 1024,
                               "major": 9})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_backend, "current_stream", lambda device_index: 0)
    log: list = []
    cb = cuda_backend.CudaBackend()
    cache = _RecordingCache(log)
    monkeypatch.setattr(cb, "_kernels", lambda: cache)
    return cb, log


def _spec(mode: str = "llama"):
    return make_spec(torch.bfloat16, 1e-6, 0.0, mode, torch.bfloat16)


def test_forward_plan_serves_new_tensors_of_the_same_signature(recording):
    """The second call of a signature reuses the plan and passes that call's own tensors and outputs."""
    cb, log = recording
    for _ in range(3):
        x, w = torch.randn(5, 256).bfloat16(), torch.randn(256).bfloat16()
        y, rstd, z = cb.rms_norm_fwd(x, w, None, _spec())
        name, grid, block, shmem, args, *_ = log.pop()
        assert name == "rms_fwd" and z is None
        assert args[0] == x.data_ptr() and args[9] == w.data_ptr()
        assert args[11] == y.data_ptr() and args[12] == rstd.data_ptr()
        assert args[13] == 5 and isinstance(args[14], np.int32) and args[14] == 256
    assert len(cb._fwd_plans) == 1 and not log


def test_forward_without_rstd_allocates_and_stores_none(recording):
    """need_rstd=False (an inference call): a plan of its own whose kernel is compiled without the rstd store
    (NO_RSTD), a null rstd pointer, no rstd tensor; the plan with rstd is untouched by it."""
    cb, log = recording
    x, w = torch.randn(5, 256).bfloat16(), torch.randn(256).bfloat16()
    y, rstd, z = cb.rms_norm_fwd(x, w, None, _spec(), need_rstd=False)
    kernel = log.pop()
    assert rstd is None and z is None and y.shape == x.shape
    assert kernel[4][12] == 0 and kernel[4][11] == y.data_ptr()
    y2, rstd2, _ = cb.rms_norm_fwd(x, w, None, _spec())
    with_rstd = log.pop()
    assert with_rstd[4][12] == rstd2.data_ptr() and rstd2.shape == (5,)
    plans = list(cb._fwd_plans.values())
    assert len(plans) == 2
    assert [p.kernel.defines.get("NO_RSTD", 0) for p in plans] == [1, 0]


def test_strided_rows_are_read_in_place_and_odd_layouts_through_a_copy(recording):
    """Rows with a leading stride are addressed in place (their stride passed); a strided last dimension
    is copied to a contiguous tensor first, every call (a plan records that decision, not the copy)."""
    cb, log = recording
    base = torch.randn(6, 512).bfloat16()
    x = base[:, :256]
    cb.rms_norm_fwd(x, None, None, _spec())
    args = log.pop()[4]
    assert args[0] == x.data_ptr() and args[1] == 512
    for _ in range(2):
        xt = torch.randn(256, 6).bfloat16().t()  # last-dim stride 6
        cb.rms_norm_fwd(xt, None, None, _spec())
        args = log.pop()[4]
        assert args[0] != xt.data_ptr() and args[1] == 256


def test_backward_plans_fold_before_dx_and_sum_partials(recording):
    """dw="strict": the fold launches before the dx kernel (dx may overwrite dy in place); dw="fast": the dx
    kernel writes partial rows that partial_sum.cu then sums (one launch for one segment of rows, a second one
    over the segment sums otherwise): one row a block where its row slots' rows are combined in shared memory
    (DW_COMBINE, RPB * N fp32 of it), one a slot without; zero rows launch nothing and give zeros."""
    cb, log = recording
    x, dy, w = torch.randn(64, 128).bfloat16(), torch.randn(64, 128).bfloat16(), torch.randn(128).bfloat16()
    rstd = torch.rand(64) + 0.5
    cb.rms_norm_bwd(dy, x, w, rstd, None, _spec(), "strict", True, dy)
    assert [e[0] for e in log] == ["fold_stream", "rms_bwd"]
    assert log[0][4][0] == dy.data_ptr() and log[1][4][0] == dy.data_ptr()
    log.clear()
    cb.rms_norm_bwd(dy, x, w, rstd, None, _spec(), "fast", True, None)
    assert [e[0] for e in log] == ["rms_bwd", "partial_sum"]
    assert log[1][4][0] == log[0][4][-7]  # the sum reads the partial rows the dx kernel wrote
    assert log[1][5] and not log[0][5]  # the sum as the dx kernel's dependent grid (sm_90: props.major)
    rpb = cuda_backend.norm_bwd_launch(128, torch.bfloat16, torch.bfloat16, torch.bfloat16, "llama", False, False, True,
                                       cuda_backend.tuning_for(cuda_backend.BWD_TABLE, 128, 64), False).rows_per_block
    assert rpb > 1 and log[0][3] == rpb * 128 * 4 and log[1][4][1] == log[0][1][0]  # a partial row a block
    many = torch.randn(1 << 15, 8).bfloat16()  # few columns, one partial row a row slot: many, two launches
    for combine, sums in ((True, ["partial_sum"]), (False, ["partial_sum", "partial_sum"])):
        log.clear()
        cb.bwd_tuning = cuda_backend.NormTuning(dw_combine=combine)
        cb.rms_norm_bwd(many, many, w[:8], torch.rand(1 << 15) + 0.5, None, _spec(), "fast", True, None)
        assert [e[0] for e in log] == ["rms_bwd", *sums], [e[0] for e in log]
        rpb = 128  # 8 columns: one thread a row, 128-thread blocks
        assert log[1][4][1] == log[0][1][0] * (1 if combine else rpb)
    assert log[1][2] == log[2][2] == 256 and log[1][1][1] > 1 == log[2][1][1]  # segments, then one
    cb.bwd_tuning, cb.dependent_sum = None, False
    log.clear()
    cb.rms_norm_bwd(dy, x, w, rstd, None, _spec(), "fast", True, None)
    assert [(e[0], e[5]) for e in log] == [("rms_bwd", False), ("partial_sum", False)]  # the plain launch
    cb.dependent_sum = True
    log.clear()
    empty = torch.empty(0, 128).bfloat16()
    dx, dw = cb.rms_norm_bwd(empty, empty, w, torch.empty(0), None, _spec(), "strict", True, None)
    assert not log and dx.shape == (0, 128) and torch.equal(dw, torch.zeros_like(w))


class _FakeStream:
    def __init__(self, handle: int, log: list) -> None:
        self.cuda_stream, self.log = handle, log

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait", self.cuda_stream, other.cuda_stream))


def test_strict_fold_forks_beside_the_dx_kernel(recording, monkeypatch):
    """dw="strict" with a dx of its own: the side stream waits for the current one, the fold launches on it,
    the dx kernel on the current stream, then the current stream waits for the side one (join) before the
    call returns. fold_beside_dx=False (the default), or dx over dy: both on the current stream, fold first."""
    cb, log = recording
    cb.fold_beside_dx = True
    here = _FakeStream(0, log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: here)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(7, log))
    x, dy, w = torch.randn(64, 128).bfloat16(), torch.randn(64, 128).bfloat16(), torch.randn(128).bfloat16()
    rstd = torch.rand(64) + 0.5
    cb.rms_norm_bwd(dy, x, w, rstd, None, _spec(), "strict", True, None)
    assert [(e[0], e[-1]) if e[0] != "wait" else e for e in log] == [
        ("wait", 7, 0), ("fold_stream", 7), ("rms_bwd", 0), ("wait", 0, 7)]
    for dx_out, beside in ((None, False), (dy, True)):
        log.clear()
        cb.fold_beside_dx = beside
        cb.rms_norm_bwd(dy, x, w, rstd, None, _spec(), "strict", True, dx_out)
        assert [(e[0], e[-1]) for e in log] == [("fold_stream", 0), ("rms_bwd", 0)]
    assert not cb.fold_beside(dy[1:], x, dy) and cb.fold_beside(torch.empty(1), x[0])
    assert not cb.fold_beside(dy, dy)
    cb.fold_beside_dx = False
    assert not cb.fold_beside(None) and not cb.fold_beside(torch.empty(1), x[0])


def test_onepass_strict_backward_is_one_cooperative_launch(recording):
    """onepass_strict: a strict backward of aligned rows is one cooperative launch of strict_bwd_onepass (grid:
    the column groups with data) reading dy and z and writing dx in place of the dx kernel and the fold;
    arrival counters zeroed. Fast dW, per-head weights and residual gradients keep the two-pass path."""
    cb, log = recording
    cb.onepass_strict = True
    x, dy, w = torch.randn(300, 1000).bfloat16(), torch.randn(300, 1000).bfloat16(), torch.randn(1000).bfloat16()
    rstd = torch.rand(300) + 0.5
    dx, dw = cb.rms_norm_bwd(dy, x, w, rstd, None, _spec(), "strict", True, None)
    ((name, grid, block, shmem, args, *_),) = log
    # 32 groups of 32 columns; warps: one folding (32 columns), four loading and summing, four computing dx,
    # two combining
    assert name == "strict_bwd_onepass" and grid == (32, 1, 1) and block == 32 * (1 + 4 + 4 + 2)
    assert args[0] == dy.data_ptr() and args[2] == x.data_ptr() and args[6] == dx.data_ptr()
    assert args[8] == dw.data_ptr() and args[-3:] == (300, 1000, 0.0) and dw.shape == w.shape
    log.clear()
    cb.rms_norm_bwd(dy, x, w, rstd, None, _spec(), "fast", True, None)
    assert log[0][0] == "rms_bwd"
    log.clear()
    cb.rms_norm_bwd(dy, x, w, rstd, dy.clone(), _spec(), "strict", True, None)  # a residual gradient
    assert [e[0] for e in log] == ["fold_stream", "rms_bwd"]


def test_plan_cache_is_bounded(recording, monkeypatch):
    cb, log = recording
    monkeypatch.setattr(layout, "PLANS_MAX", 4)
    for rows in range(1, 10):
        cb.rms_norm_fwd(torch.randn(rows, 64).bfloat16(), None, None, _spec())
    assert 1 <= len(cb._fwd_plans) <= 4 and len(log) == 9


def test_packed_parameter_formats():
    """Kernel parameters go into 8-byte slots: numpy int32/float32 as 4 bytes plus padding, ints as 8;
    anything else (a Python float, whose width the call does not say) is refused."""
    assert nvrtc._slot_format(np.int32(3)) == "i4x"
    assert nvrtc._slot_format(np.float32(1.5)) == "f4x"
    assert nvrtc._slot_format(2**40) == "q" and nvrtc._slot_format(np.int64(-1)) == "q"
    for bad in (1.5, True, "x"):
        with pytest.raises(nvrtc.CudaLaunchError, match="4-byte parameters"):
            nvrtc._slot_format(bad)
