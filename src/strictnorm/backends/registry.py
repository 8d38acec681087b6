"""Backend registry: which backends exist, which can run here, and which one a call uses.

Selection: an explicit `backend=` argument, else the STRICTNORM_BACKEND environment variable,
else automatic: the first available backend in PREFERENCE that provides the op. A backend asked
for explicitly (argument or environment) that cannot run raises BackendUnavailable with the
reason; there is no silent fallback, since every backend gives the same bits anyway and a user
who names one wants to know when it is not the one running.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import cache

import torch

from .base import Backend

ENV_VAR = "STRICTNORM_BACKEND"
# Module and class of each backend; imported lazily so that a missing extra never breaks import.
_SPECS = {
    "cuda": ("strictnorm.backends.cuda.backend", "CudaBackend"),
    "triton": ("strictnorm.backends.triton.backend", "TritonBackend"),
    "torch": ("strictnorm.backends.torch_ref", "TorchBackend"),
    "cute": ("strictnorm.backends.cute.backend", "CuteBackend"),
}
# Automatic choice, in order: `cuda` first for its lower host time a call (README.md, Backends, says where `triton`'s
# kernels are faster). `cute` is offered by name only while its forward is slower than `cuda`'s.
PREFERENCE = ("cuda", "triton", "torch")



class BackendUnavailable(RuntimeError):
    """A backend was asked for that cannot run the op here; the message says why."""


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str  # why not, or "" when available
    ops: tuple[str, ...]


@cache
def get_backend(name: str) -> Backend:
    if name not in _SPECS:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(_SPECS)}")
    module, cls = _SPECS[name]
    return getattr(importlib.import_module(module), cls)()


def names() -> tuple[str, ...]:
    return tuple(_SPECS)


@cache
def _reason(name: str, device: torch.device) -> str | None:
    return get_backend(name).unavailable_reason(device)


def status(name: str, device: torch.device) -> BackendStatus:
    backend = get_backend(name)
    reason = _reason(name, device)
    return BackendStatus(name, reason is None, reason or "", tuple(sorted(backend.ops)))


# Evaluated once at trace time under torch.compile: a compiled graph keeps the backend it traced.
@torch.compiler.assume_constant_result
def resolve(requested: str | None, device: torch.device, op: str) -> str:
    """The name of the backend that runs `op` on `device` for this call."""
    source = "argument"
    if requested is None:
        requested = os.environ.get(ENV_VAR) or None
        source = f"environment variable {ENV_VAR}"
    if requested is not None:
        backend = get_backend(requested)
        if op not in backend.ops:
            raise BackendUnavailable(f"backend {requested!r} (from the {source}) does not implement {op}")
        reason = _reason(requested, device)
        if reason is not None:
            raise BackendUnavailable(f"backend {requested!r} (from the {source}) cannot run on {device}: {reason}")
        return requested
    return automatic_choice(device, op)[0]


@cache  # each backend's availability on a device is cached (_reason): so is the choice it leads to
def automatic_choice(device: torch.device, op: str) -> tuple[str, tuple[str, ...]]:
    """The automatic choice for op on device, and why each preferred backend before it was passed over.

    CPU tensors always get the reference: a Triton kernel on the CPU is the interpreter, a debugging tool.
    """
    if device.type == "cpu":
        return "torch", ("on the CPU the reference backend serves",)
    skipped = []
    for name in PREFERENCE:
        backend = get_backend(name)
        if op not in backend.ops:
            skipped.append(f"{name}: does not implement {op}")
            continue
        reason = _reason(name, device)
        if reason is None:
            return name, tuple(skipped)
        skipped.append(f"{name}: {reason}")
    raise BackendUnavailable(f"no backend can run {op} on {device}")
