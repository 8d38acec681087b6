"""pytest plugin for the open CUDA backward failure (bench/NOTES.md): records the last CUDA backward call's
arguments (alive in the test's frame anyway, so allocations stay as they are) and, at the first failing
bits_equal of a GPU test, reports the stream, the tensors' addresses and what repeating the call gives.
    python3 -m pytest -p bench.diag_plugin -p no:xdist tests/test_gpu.py -k "cuda_backward_bitwise and tables-5120"
"""

from __future__ import annotations

import torch

from strictnorm.backends.cuda import nvrtc
from strictnorm.backends.cuda.backend import CudaBackend

SENTINEL = 12352.0
SENTINEL_BITS = 0x4641  # bf16 12352.0
_last: dict = {"launches": []}
_names: dict[int, str] = {}
_loaded: set = set()
_real_get = nvrtc.KernelCache.get
_real_launch = nvrtc.LoadedKernel.launch


def _naming_get(self, device_index, name, kernel, defines):
    k = _real_get(self, device_index, name, kernel, defines)
    _loaded.add(k)
    _names[id(k)] = f"{kernel} MODE={defines.get('MODE', defines.get('WHAT'))} DW_PARTIALS={defines.get('DW_PARTIALS')}"
    return k


def _logging_launch(self, stream, grid, block, shmem, *args):
    name = _names.get(id(self), "?")
    if name.startswith("rms_bwd") and args[15] not in (args[0], args[11]):  # not in place: a sentinel in dx
        from cuda.bindings import driver

        rows, n = args[-6], int(args[-5])
        driver.cuMemsetD16Async(args[15], SENTINEL_BITS, rows * n, stream)
    _last["launches"] = (_last["launches"] + [(name, grid, block, shmem, args)])[-6:]
    return _real_launch(self, stream, grid, block, shmem, *args)


nvrtc.KernelCache.get = _naming_get
nvrtc.LoadedKernel.launch = _logging_launch
_real_bwd = CudaBackend.rms_norm_bwd


def _recording_bwd(self, *args):
    _last["call"] = (self, args)
    return _real_bwd(self, *args)


CudaBackend.rms_norm_bwd = _recording_bwd


def _describe(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = got.view(torch.int16) != want.view(torch.int16)
    return f"{int(diff.sum())} of {diff.numel()} differ, NaN {int(got.isnan().sum())}"


def _diagnose(want: torch.Tensor, got: torch.Tensor) -> None:
    self, args = _last["call"]
    dy, z, w, rstd, dres, spec, dw_mode, need_dw, dx_out = args
    print(f"\nDIAG mismatch: {_describe(got, want)} | mode {spec.mode} dw {dw_mode} dx_out {dx_out is not None}")
    print(f"DIAG raw stream {torch._C._cuda_getCurrentRawStream(0)}, torch stream {torch.cuda.current_stream()}")
    for name, t in (("dy", dy), ("z", z), ("w", w), ("rstd", rstd), ("dres", dres), ("got", got), ("want", want)):
        if t is not None:
            print(f"DIAG {name}: ptr {t.data_ptr():#x} ({t.data_ptr() % 512}), {tuple(t.shape)}, {t.dtype}, "
                  f"finite {bool(t.float().isfinite().all())}")
    print("DIAG got after a synchronize:", _describe(got, want), "sentinel", int((got == SENTINEL).sum()))
    for name, grid, block, shmem, a in _last["launches"]:
        print(f"DIAG launch {name} grid {grid} block {block} shmem {shmem} args {a}")
    kernel_launch = [x for x in _last["launches"] if x[0].startswith("rms_bwd")][-1]
    if kernel_launch[4][15] == got.data_ptr() or kernel_launch[4][15] == want.data_ptr():
        k = next(k for k in _loaded if _names.get(id(k)) == kernel_launch[0])
        _real_launch(k, torch._C._cuda_getCurrentRawStream(0), *kernel_launch[1:4], *kernel_launch[4])
        torch.cuda.synchronize()
        print("DIAG the recorded dx launch repeated as is:", _describe(got, want), "/", _describe(want, got))
    torch.cuda.synchronize()
    again = _real_bwd(self, *args)[0]
    torch.cuda.synchronize()
    print("DIAG same call again:", _describe(again, want), "dx ptr", hex(again.data_ptr()))
    for name, grid, block, shmem, a in _last["launches"][-2:]:
        print(f"DIAG launch {name} grid {grid} block {block} shmem {shmem} args {a}")
    out = torch.full_like(dy, SENTINEL)
    again = _real_bwd(self, dy, z, w, rstd, dres, spec, dw_mode, need_dw, out)[0]
    print("DIAG sentinel output:", _describe(again, want), "sentinel", int((again == SENTINEL).sum()))


def _checking(real):
    def bits_equal(a, b):
        ok = real(a, b)
        if not ok and "call" in _last and not _last.get("done"):
            _last["done"] = True
            _diagnose(a, b)
        return ok
    return bits_equal


def pytest_runtest_setup(item):
    module = item.module
    if hasattr(module, "bits_equal") and not getattr(module, "_diag", False):
        module.bits_equal = _checking(module.bits_equal)
        module._diag = True
