"""Hugging Face patching on tiny randomly initialised models built from configs (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from helpers import bits_equal

transformers = pytest.importorskip("transformers")
from strictnorm import hf  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64, pad_token_id=0)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "phi3": ("Phi3Config", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {}),
    "gemma3": ("Gemma3TextConfig", {}),
    "olmo2": ("Olmo2Config", {}),
}


def _model(family: str, seed: int):
    cfg_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    # eager attention: deterministic backward on GPUs too, so runs can be compared bit for bit
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # non-trivial norm weights (Gemma's start at zero, the others at one)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_model_matches_its_own_norms(family, seed):
    model = _model(family, seed % 1000)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    logits0, grads0 = _loss_and_grads(model, ids)
    report = hf.patch_model(model, dw="strict", backend="torch")
    assert report.patched, report
    n_norm_classes = {type(m).__name__ for m in model.modules() if type(m).__name__ in hf.FAMILIES}
    assert n_norm_classes, "the model's norms are a mapped family"
    if family in ("qwen3", "gemma3"):
        assert any(n.endswith(("q_norm", "k_norm")) for n in report.patched)
    logits1, grads1 = _loss_and_grads(model, ids)
    assert _rel(logits1, logits0) < 1e-5
    for name, g in grads0.items():
        assert _rel(grads1[name], g) < 1e-4, name
    again = hf.patch_model(model)
    assert not again.patched and again.already == report.patched  # patching twice is harmless
    assert hf.unpatch_model(model) == len(report.patched)
    logits2, _ = _loss_and_grads(model, ids)
    assert bits_equal(logits2, logits0)  # unpatch restores the original modules exactly


def test_patched_norm_uses_the_family_numerics(seed):
    """One norm module, bit for bit: the patched module is strictnorm with the family's mode and offset."""
    import strictnorm as sn

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    for family, mode, offset in (("llama", "llama", 0.0), ("gemma3", "gemma", 1.0), ("olmo2", "gemma", 0.0)):
        model = _model(family, 0)
        norm = model.model.norm
        hf.patch_model(model, backend="torch")
        w = norm.weight
        out = torch.promote_types(w.dtype, x.dtype) if family == "llama" else x.dtype
        want = sn.rms_norm(x, w, getattr(norm, "variance_epsilon", getattr(norm, "eps", None)), offset=offset,
                           casting_mode=mode, out_dtype=out, backend="torch")
        got = norm(x)
        assert got.dtype == out and bits_equal(got, want)


def test_unknown_norms_are_left_alone_and_reported():
    class FancyRMSNorm(torch.nn.Module):
        def forward(self, x):
            return x

    m = torch.nn.Sequential(FancyRMSNorm(), torch.nn.Linear(2, 2))
    report = hf.patch_model(m)
    assert not report.patched and "FancyRMSNorm" in report.unknown[0]
    assert "left alone" in str(report)


def test_patch_transformers_classes_and_compile(seed):
    model = _model("qwen3", 1)
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(seed))
    logits0, _ = _loss_and_grads(model, ids)
    patched = hf.patch_transformers(backend="torch")
    try:
        assert "Qwen3RMSNorm" in patched and "LlamaRMSNorm" in patched
        layer = model.model.layers[0]
        x = torch.randn(1, 8, 64, requires_grad=True)
        pos = model.model.rotary_emb(x, torch.arange(8)[None])
        eager = layer(x, position_embeddings=pos)
        eager = eager[0] if isinstance(eager, tuple) else eager
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        out = compiled(x, position_embeddings=pos)
        out = out[0] if isinstance(out, tuple) else out
        assert bits_equal(out, eager)
        logits1, _ = _loss_and_grads(model, ids)
        assert _rel(logits1, logits0) < 1e-5
    finally:
        assert "Qwen3RMSNorm" in hf.unpatch_transformers()
    logits2, _ = _loss_and_grads(model, ids)
    assert bits_equal(logits2, logits0)


def _train(family: str, patched: bool, steps: int = 4, backend: str = "torch", device: str = "cpu"):
    model = _model(family, 3).to(device).train()
    if patched:
        hf.patch_model(model, dw="strict", backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(steps):
        ids = torch.randint(1, 128, (2, 16), generator=gen).to(device)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).cpu(), [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_short_training_loop(family):
    """A few optimizer steps: the patched loss curve follows the unpatched one, and two patched runs
    are identical bit for bit."""
    base, _ = _train(family, patched=False)
    a, params_a = _train(family, patched=True)
    b, params_b = _train(family, patched=True)
    assert ((a - base).abs() / base.abs()).max() < 1e-4
    assert bits_equal(a, b)
    assert all(bits_equal(p, q) for p, q in zip(params_a, params_b, strict=True))


def test_patched_layer_compiles_with_dynamic_shapes_forward_and_backward(seed):
    """A patched Qwen3 decoder layer (RMSNorms and q/k norms, whose incoming gradients are transposed
    views) under torch.compile(fullgraph=True, dynamic=True): no graph break at two sequence lengths, and
    forward and input gradient equal eager. Guards the weight-shape check against symbolic N and the
    custom op's contiguous dx."""
    model = _model("qwen3", seed % 1000)
    hf.patch_model(model, dw="strict", backend="torch")
    layer = model.model.layers[0]
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for s in (8, 13):
        x = torch.randn(1, s, 64, requires_grad=True, generator=torch.Generator().manual_seed(seed + s))
        pos = model.model.rotary_emb(x, torch.arange(s)[None])
        outs = [f(x, position_embeddings=pos) for f in (compiled, layer)]
        outs = [o[0] if isinstance(o, tuple) else o for o in outs]
        grads = [torch.autograd.grad(o.square().sum(), x)[0] for o in outs]
        assert bits_equal(outs[0], outs[1]) and bits_equal(grads[0], grads[1])
