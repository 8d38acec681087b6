"""Run-time compilation of the packaged CUDA C++ sources with NVRTC (through cuda-core).

Sources are compiled for the running device's architecture, once per configuration (the macros
that select types and tile shapes), and cached on disk under STRICTNORM_CACHE_DIR (default
~/.cache/strictnorm) keyed by a hash of the source, the options, the architecture and the NVRTC
version. Kernels launch on PyTorch's current stream. No compiler flag may change numerics: the
sources use __fadd_rn/__fmul_rn, and FMA contraction, flush-to-zero and approximate division or
square root are switched off explicitly as well.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
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
    src = source(name)
    path = cache_dir() / f"{Path(name).stem}-{arch}-{_key(src, arch, defines)}.cubin"
    if use_cache and path.exists():
        cached = path.read_bytes()
        if whole_elf(cached):
            return cached
    code = compile_source(src, name, arch, defines)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(code)
            tmp.replace(path)
        except OSError:
            pass  # a read-only home still works, just without the disk cache
    return code


def _elf_sections(blob: bytes) -> list[tuple]:
    """A 64-bit ELF file's section headers: (name offset, type, flags, addr, offset, size, link, info, align, entsize)
    each. The caller has checked that the header table lies within the file (whole_elf)."""
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", blob, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]


def _kernel_attribute(cubin: bytes, attribute: int) -> dict[str, int]:
    """One per-kernel attribute of a cubin's .nv.info section (records of (symbol index, value)), by kernel name."""
    sections = _elf_sections(cubin)
    shstrndx, = struct.unpack_from("<H", cubin, 0x3E)

    def cstr(table: int, at: int) -> str:
        start = sections[table][4] + at
        return cubin[start:cubin.index(b"\0", start)].decode()

    symtab = next(i for i, s in enumerate(sections) if s[1] == 2)  # SHT_SYMTAB
    sym_base, sym_size, strtab = sections[symtab][4], sections[symtab][9], sections[symtab][6]
    values = {}
    for sec in sections:
        if cstr(shstrndx, sec[0]) != ".nv.info":
            continue
        data, i = cubin[sec[4]:sec[4] + sec[5]], 0
        while i + 4 <= len(data):  # records: format, attribute, then 2 bytes: a value, or a payload's size (format 4)
            fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
            if fmt == 4 and attr == attribute:
                sym, value = struct.unpack_from("<II", data, i + 4)
                values[cstr(strtab, struct.unpack_from("<I", cubin, sym_base + sym * sym_size)[0])] = value
            i += 4 + (size if fmt == 4 else 0)
    return values


def cubin_registers(cubin: bytes) -> dict[str, int]:
    """Registers a thread of each kernel in a cubin, as ptxas allotted them (EIATTR_REGCOUNT): what decides how many
    blocks of a kernel an SM holds, readable without a GPU."""
    return _kernel_attribute(cubin, 0x2F)


def cubin_stack(cubin: bytes) -> dict[str, int]:
    """Stack bytes a thread of each kernel needs (EIATTR_MAX_STACK_SIZE): where ptxas spilled registers, the spill
    space (local memory, an L1/L2 round trip per access)."""
    return _kernel_attribute(cubin, 0x12)


def compile_for_load(name: str, arch: str, defines: dict[str, int], kernel: str) -> bytes:
    """The cubin to load for `kernel`: compile_cubin's, except that a MIN_BLOCKS bound (the blocks an SM a source's
    __launch_bounds__ asks for) that made ptxas spill is dropped. The bound is a request for occupancy, and the same
    arithmetic compiles either way (the same bits); spilling to meet it would cost more than the blocks gain."""
    cubin = compile_cubin(name, arch, defines)
    stack = cubin_stack(cubin).get(kernel, 0) if "MIN_BLOCKS" in defines else 0
    if stack:
        free = compile_cubin(name, arch, {k: v for k, v in defines.items() if k != "MIN_BLOCKS"})
        if cubin_stack(free).get(kernel, 0) < stack:
            return free
    return cubin


def whole_elf(blob: bytes) -> bool:
    """Whether blob is a 64-bit ELF file whose header tables, segments and sections all lie within it. A cubin cut short
    (a cache copied or unpacked part way) would otherwise reach the driver, which may crash the process loading
    it rather than report an error; the cache compiles such an entry again."""
    if len(blob) < 64 or blob[:5] != b"\x7fELF\x02":
        return False
    phoff, shoff = struct.unpack_from("<QQ", blob, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", blob, 0x36)
    if (phnum and phentsize < 0x38) or shentsize < 0x40:
        return False
    if phoff + phentsize * phnum > len(blob) or shoff + shentsize * shnum > len(blob):
        return False
    for i in range(phnum):  # segments: their bytes in the file
        offset, = struct.unpack_from("<Q", blob, phoff + i * phentsize + 8)
        size, = struct.unpack_from("<Q", blob, phoff + i * phentsize + 0x20)
        if offset + size > len(blob):
            return False
    # sections, but SHT_NOBITS (8): no bytes in the file
    return all(kind == 8 or offset + size <= len(blob) for _, kind, _, _, offset, size, *_ in _elf_sections(blob))


def compile_source(src: str, name: str, arch: str, defines: dict[str, int]) -> bytes:
    """Compile CUDA C++ text (which may include the kernels' headers and sources) for arch; returns the cubin.
    name: the source's name in messages. No disk cache (compile_cubin keeps one for the packaged sources)."""
    from cuda.core import Program, ProgramOptions

    macros = [(k, str(v)) for k, v in sorted(defines.items())] or None
    options = ProgramOptions(arch=arch, name=name, define_macro=macros, include_path=[str(_kernel_dir())],
                             **_BASE_OPTIONS)
    log = _Log()
    try:
        return bytes(Program(src, code_type="c++", options=options).compile("cubin", logs=log).code)
    except Exception as e:  # NVRTC reports errors as exceptions; keep its log in the message
        raise CudaCompileError(f"NVRTC failed on {name} for {arch} with {defines}: {e}\n{log.text}") from e


class _Log:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s


class CudaLaunchError(RuntimeError):
    """The driver refused a kernel launch."""


def _slot_format(value: object) -> str:
    """struct format of one kernel parameter in an 8-byte slot, from the kind of value passed: numpy int32
    and float32 for the kernels' int and float parameters (4 bytes and 4 pad bytes), Python or numpy
    64-bit ints for pointers and long long."""
    import numpy as np

    if isinstance(value, np.int32):
        return "i4x"
    if isinstance(value, np.float32):
        return "f4x"
    if isinstance(value, (int, np.int64)) and not isinstance(value, bool):
        return "q"
    raise CudaLaunchError(f"kernel parameter {value!r} ({type(value).__name__}): pass numpy int32 or float32 "
                          "for 4-byte parameters, ints for pointers and long long")


def _param_sizes(kernel) -> list[int] | None:
    """The kernel's parameter sizes from its image (None where the driver or cuda-core cannot say)."""
    try:
        return [info[1] if isinstance(info, tuple) else info.size for info in kernel.arguments_info]
    except Exception:  # an older driver without cuFuncGetParamInfo: the count goes unchecked
        return None


class LoadedKernel:
    """A loaded kernel and a parameter block built once: a launch packs the values into the block (one
    struct call) and calls cuLaunchKernel with it. cuda.core's launch builds its parameter holder on
    every call, several microseconds of host time per launch on a GPU machine's CPU.

    The struct format is fixed by the first launch: every call site passes one kernel the same kinds of
    values (ints for pointers and long long, numpy int32 and float32 for int and float parameters), and
    is checked against the parameter sizes in the kernel's image."""

    def __init__(self, module, kernel) -> None:
        from cuda.bindings import driver

        self.module = module  # keeps the library loaded
        self.kernel = kernel  # cuda.core Kernel: occupancy queries
        # the context current where the kernel is loaded (KernelCache: the device's primary context)
        self._context = _checked(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._driver = driver
        self.function = _checked(driver.cuKernelGetFunction(kernel.handle), "cuKernelGetFunction")
        self._sizes = _param_sizes(kernel)
        self._struct: struct.Struct | None = None
        self._config = None  # cuLaunchKernelEx's configuration for dependent launches (_dependent_config)
        self._lock = threading.Lock()  # one block per kernel: pack and launch together

    def _build_block(self, args: tuple) -> None:
        formats = [_slot_format(a) for a in args]
        sizes = [4 if f.endswith("4x") else 8 for f in formats]
        if self._sizes is not None and sizes != self._sizes:
            raise CudaLaunchError(f"kernel parameters of {self._sizes} bytes, passed {sizes}")
        self._block = ctypes.create_string_buffer(8 * max(1, len(args)))
        base = ctypes.addressof(self._block)
        self._ptrs = (ctypes.c_void_p * max(1, len(args)))(*[base + 8 * i for i in range(len(args))])
        self._params = ctypes.addressof(self._ptrs)
        self._struct = struct.Struct("<" + "".join(formats))

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Opts the kernel into nbytes of dynamic shared memory (past the 48 KB every launch may use); a
        clear error where the device offers less."""
        driver = self._driver
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (err,) = driver.cuFuncSetAttribute(self.function, attr, nbytes)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise CudaLaunchError(f"{nbytes} bytes of dynamic shared memory refused by the device: {err!r}")

    def launch(self, stream: int, grid: tuple[int, int, int], block: int, shmem: int, *args,
               cooperative: bool = False, dependent: bool = False) -> None:
        """cooperative: every block co-resident (cuLaunchCooperativeKernel; the launch fails where the grid does
        not fit at once), for kernels whose blocks wait for each other. dependent: launched with programmatic
        stream serialization (cuLaunchKernelEx; sm_90 and newer), so that it may start while the grid before it
        on the stream finishes: only for kernels that wait for that grid (common.cuh's wait_prerequisites)
        before they touch memory."""
        driver = self._driver
        with self._lock:
            if self._struct is None:
                self._build_block(args)
            self._struct.pack_into(self._block, 0, *args)
            err = self._launch(grid, block, shmem, stream, cooperative, dependent)
            if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
                self.make_current()
                err = self._launch(grid, block, shmem, stream, cooperative, dependent)
        if err != driver.CUresult.CUDA_SUCCESS:
            what = "cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernelEx" if dependent else "cuLaunchKernel"
            raise CudaLaunchError(f"{what} failed: {err!r} (grid {grid}, block {block}, shared {shmem} B)")

    def make_current(self) -> None:
        """Makes the kernel's context current where none is: torch's autograd engine runs a CUDA backward on
        its own device thread, where torch's runtime makes the context current lazily, so a strictnorm driver
        call can come first there (CUDA_ERROR_INVALID_CONTEXT, seen on an H200 in run 10). The kernel's
        context is the device's primary one, which torch uses."""
        driver = self._driver
        if not int(_checked(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")):
            _checked(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def _launch(self, grid: tuple[int, int, int], block: int, shmem: int, stream: int, cooperative: bool,
                dependent: bool):
        driver = self._driver
        if cooperative:
            (err,) = driver.cuLaunchCooperativeKernel(self.function, grid[0], grid[1], grid[2], block, 1, 1, shmem,
                                                      stream, self._params)
        elif dependent:
            config = self._dependent_config(grid, block, shmem, stream)
            (err,) = driver.cuLaunchKernelEx(config, self.function, self._params, 0)
        else:
            (err,) = driver.cuLaunchKernel(self.function, grid[0], grid[1], grid[2], block, 1, 1, shmem, stream,
                                           self._params, 0)
        return err

    def _dependent_config(self, grid: tuple[int, int, int], block: int, shmem: int, stream: int):
        """The cuLaunchKernelEx configuration with programmatic stream serialization, built once per kernel (a
        fresh one costs several microseconds of host time) and updated per launch."""
        driver = self._driver
        config = self._config
        if config is None:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config = self._config = driver.CUlaunchConfig()
            config.attrs = [attr]
            config.numAttrs = 1
            config.blockDimY = config.blockDimZ = 1
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX = block
        config.sharedMemBytes = shmem
        config.hStream = stream
        return config


def _checked(result: tuple, what: str):
    err, *values = result
    if int(err) != 0:
        raise CudaLaunchError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


def current_stream(device_index: int) -> int:
    """torch's current stream on a device, as a raw handle (the private accessor torch's own compiled
    code uses: a tenth of the host time of torch.cuda.current_stream)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


class KernelCache:
    """Loaded kernels per (device, source, kernel, macros), each a LoadedKernel (which launches itself)."""

    def __init__(self) -> None:
        self._kernels: dict[tuple, LoadedKernel] = {}
        self._lock = threading.Lock()

    def get(self, device_index: int, name: str, kernel: str, defines: dict[str, int]) -> LoadedKernel:
        """The loaded kernel, its context current on the calling thread (the planners' occupancy queries and
        attribute calls that follow need one; they run once per input signature)."""
        key = (device_index, name, kernel, tuple(sorted(defines.items())))
        entry = self._kernels.get(key)
        if entry is None:
            with self._lock:
                entry = self._kernels.get(key)
                if entry is None:
                    entry = self._kernels[key] = self._load(device_index, name, kernel, defines)
        entry.make_current()
        return entry

    @staticmethod
    def _load(device_index: int, name: str, kernel: str, defines: dict[str, int]) -> LoadedKernel:
        from cuda.core import Device, ObjectCode

        dev = Device(device_index)
        dev.set_current()
        major, minor = dev.compute_capability
        cubin = compile_for_load(name, f"sm_{major}{minor}", defines, kernel)
        module = ObjectCode.from_cubin(cubin, name=name)
        return LoadedKernel(module, module.get_kernel(kernel))
