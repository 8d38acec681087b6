"""Hugging Face transformers integration: swap a model's RMSNorm modules for strictnorm's.

Each supported module class is mapped to the casting mode, weight offset and output dtype that
reproduce its own forward (up to the reduction order, which strictnorm fixes):
- Llama, Mistral, Qwen2, Qwen3 (q_norm/k_norm too), Phi-3: `weight * rd(x * rstd, x.dtype)`,
  output in the promoted dtype of weight and x: casting "llama", offset 0.
- Gemma, Gemma 2, Gemma 3 (q_norm/k_norm too): `rd((x * rstd) * (1 + w.float()), x.dtype)`:
  casting "gemma", offset 1.0 added in fp32.
- OLMo 2: `rd(weight * (x * rstd), x.dtype)` in fp32: casting "gemma", offset 0.

`patch_model(model)` patches an existing instance (the module objects and their parameters stay,
so optimizers and checkpoints are unaffected); `patch_transformers()` patches the classes before
models are built. Both are undone by `unpatch_model` / `unpatch_transformers`; patching twice is
harmless. Modules of other norm classes are left alone and reported.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field

import torch
from torch import nn

from . import api


@dataclass(frozen=True)
class Family:
    casting_mode: str
    offset: float
    eps_attr: str
    promote_out: bool  # output dtype promote(weight, x) instead of x's


_LLAMA = Family("llama", 0.0, "variance_epsilon", True)
_GEMMA = Family("gemma", 1.0, "eps", False)
_OLMO2 = Family("gemma", 0.0, "variance_epsilon", False)

# class name -> (module that defines it, family)
FAMILIES: dict[str, tuple[str, Family]] = {
    "LlamaRMSNorm": ("transformers.models.llama.modeling_llama", _LLAMA),
    "MistralRMSNorm": ("transformers.models.mistral.modeling_mistral", _LLAMA),
    "Qwen2RMSNorm": ("transformers.models.qwen2.modeling_qwen2", _LLAMA),
    "Qwen3RMSNorm": ("transformers.models.qwen3.modeling_qwen3", _LLAMA),
    "Phi3RMSNorm": ("transformers.models.phi3.modeling_phi3", _LLAMA),
    "GemmaRMSNorm": ("transformers.models.gemma.modeling_gemma", _GEMMA),
    "Gemma2RMSNorm": ("transformers.models.gemma2.modeling_gemma2", _GEMMA),
    "Gemma3RMSNorm": ("transformers.models.gemma3.modeling_gemma3", _GEMMA),
    "Olmo2RMSNorm": ("transformers.models.olmo2.modeling_olmo2", _OLMO2),
}
_MARK = "_strictnorm_patched"
_CLASS_ORIGINALS: dict[str, object] = {}


@dataclass
class PatchReport:
    patched: list[str] = field(default_factory=list)  # module names now running strictnorm
    already: list[str] = field(default_factory=list)  # were patched before this call
    unknown: list[str] = field(default_factory=list)  # norm-like modules of classes strictnorm does not map

    def __str__(self) -> str:
        return (f"strictnorm: patched {len(self.patched)} norm modules, {len(self.already)} already patched, "
                f"left alone: {', '.join(self.unknown) or 'none'}")


def _strict_forward(module: nn.Module, hidden_states: torch.Tensor, *, family: Family, dw: str,
                    backend: str | None) -> torch.Tensor:
    w = module.weight
    out = torch.promote_types(w.dtype, hidden_states.dtype) if family.promote_out else hidden_states.dtype
    return api.rms_norm(hidden_states, w, getattr(module, family.eps_attr), offset=family.offset,
                        casting_mode=family.casting_mode, dw=dw, out_dtype=out, backend=backend)


def _looks_like_norm(cls_name: str) -> bool:
    return cls_name.endswith(("RMSNorm", "LayerNorm", "Norm"))


def patch_model(model: nn.Module, *, dw: str = "fast", backend: str | None = None) -> PatchReport:
    """Make every supported RMSNorm module of model run strictnorm (an instance-level forward)."""
    report = PatchReport()
    for name, module in model.named_modules():
        entry = FAMILIES.get(type(module).__name__)
        if entry is None:
            if _looks_like_norm(type(module).__name__):
                report.unknown.append(f"{name} ({type(module).__name__})")
            continue
        if getattr(module, _MARK, False):
            report.already.append(name)
            continue
        module.forward = functools.partial(_strict_forward, module, family=entry[1], dw=dw, backend=backend)
        setattr(module, _MARK, True)
        report.patched.append(name)
    return report


def unpatch_model(model: nn.Module) -> int:
    """Restore the original forward of every module patch_model patched; returns how many."""
    count = 0
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)
            count += 1
    return count


def patch_transformers(*, dw: str = "fast", backend: str | None = None) -> list[str]:
    """Patch the transformers classes themselves (models built afterwards, or already built, use strictnorm).

    Returns the class names patched; classes whose modules this transformers version lacks are skipped.
    """
    done = []
    for cls_name, (module_name, family) in FAMILIES.items():
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            continue
        if cls_name not in _CLASS_ORIGINALS:
            _CLASS_ORIGINALS[cls_name] = cls.forward

        def forward(self, hidden_states, _family=family):
            return _strict_forward(self, hidden_states, family=_family, dw=dw, backend=backend)

        cls.forward = forward
        done.append(cls_name)
    return done


def unpatch_transformers() -> list[str]:
    """Restore the classes patch_transformers changed."""
    restored = []
    for cls_name, original in list(_CLASS_ORIGINALS.items()):
        module_name = FAMILIES[cls_name][0]
        cls = getattr(importlib.import_module(module_name), cls_name)
        cls.forward = original
        del _CLASS_ORIGINALS[cls_name]
        restored.append(cls_name)
    return restored
