"""Run-time compilation of the packaged CUDA C++ sources with NVRTC (through cuda-core).

Sources are compiled for the running device's architecture, once per configuration (the macros
that select types and tile shapes), and cached on disk under STRICTNORM_CACHE_DIR (default
~/.cache/strictnorm) keyed by a hash of the source, the options, the architecture and the NVRTC
version. Kernels launch on PyTorch's current stream. No compiler flag may change numerics: the
sources use __fadd_rn/__fmul_rn, and FMA contraction, flush-to-zero and approximate division or
square root are switched off explicitly as well.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from functools import cache
from importlib import resources
from pathlib import Path

# Options fixed for every strictnorm kernel; numerics-relevant ones are spelled out.
_BASE_OPTIONS = {"std": "c++17", "fma": False, "ftz": False, "prec_div": True, "prec_sqrt": True}


class CudaCompileError(RuntimeError):
    """NVRTC rejected a source; the message carries its log."""


def _kernel_dir():
    return resources.files("strictnorm.backends.cuda").joinpath("kernels")


def source(name: str) -> str:
    return _kernel_dir().joinpath(name).read_text()


def source_names() -> list[str]:
    return sorted(p.name for p in resources.files("strictnorm.backends.cuda").joinpath("kernels").iterdir()
                  if p.name.endswith(".cu"))


@cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaCompileError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


def cache_dir() -> Path:
    return Path(os.environ.get("STRICTNORM_CACHE_DIR") or Path.home() / ".cache" / "strictnorm") / "cubin"


def _key(src: str, arch: str, defines: dict[str, int]) -> str:
    headers = sorted((p.name, p.read_text()) for p in _kernel_dir().iterdir() if p.name.endswith(".cuh"))
    blob = json.dumps([src, headers, arch, sorted(defines.items()), sorted(_BASE_OPTIONS.items()), nvrtc_version()])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def compile_cubin(name: str, arch: str, defines: dict[str, int], use_cache: bool = True) -> bytes:
    """Compile kernels/<name> for arch (e.g. "sm_90") with the given macros; returns the cubin."""
    from cuda.core import Program, ProgramOptions

    src = source(name)
    path = cache_dir() / f"{Path(name).stem}-{arch}-{_key(src, arch, defines)}.cubin"
    if use_cache and path.exists():
        return path.read_bytes()
    options = ProgramOptions(arch=arch, name=name, define_macro=[(k, str(v)) for k, v in sorted(defines.items())],
                             include_path=[str(_kernel_dir())], **_BASE_OPTIONS)
    log = _Log()
    try:
        code = bytes(Program(src, code_type="c++", options=options).compile("cubin", logs=log).code)
    except Exception as e:  # NVRTC reports errors as exceptions; keep its log in the message
        raise CudaCompileError(f"NVRTC failed on {name} for {arch} with {defines}: {e}\n{log.text}") from e
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(code)
            tmp.replace(path)
        except OSError:
            pass  # a read-only home still works, just without the disk cache
    return code


class _Log:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s


class KernelCache:
    """Loaded kernels per (device, source, kernel, macros); launches on torch's current stream."""

    def __init__(self) -> None:
        self._kernels: dict[tuple, object] = {}
        self._streams: dict[int, object] = {}
        self._lock = threading.Lock()

    def get(self, device_index: int, name: str, kernel: str, defines: dict[str, int]):
        key = (device_index, name, kernel, tuple(sorted(defines.items())))
        entry = self._kernels.get(key)
        if entry is None:
            with self._lock:
                entry = self._kernels.get(key)
                if entry is None:
                    entry = self._kernels[key] = self._load(device_index, name, kernel, defines)
        return entry[1]

    @staticmethod
    def _load(device_index: int, name: str, kernel: str, defines: dict[str, int]):
        from cuda.core import Device, ObjectCode

        dev = Device(device_index)
        dev.set_current()
        major, minor = dev.compute_capability
        cubin = compile_cubin(name, f"sm_{major}{minor}", defines)
        module = ObjectCode.from_cubin(cubin, name=name)
        return module, module.get_kernel(kernel)  # the module stays referenced beside its kernel

    def launch(self, device_index: int, kernel, grid: tuple[int, ...], block: int, shmem: int, *args) -> None:
        import torch
        from cuda.core import LaunchConfig, Stream, launch

        handle = torch.cuda.current_stream(device_index).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = Stream.from_handle(handle)
        launch(stream, LaunchConfig(grid=grid, block=block, shmem_size=shmem), kernel, *args)
