"""SIMoE on every dense family of the installed transformers that the tiny-model harness builds
(tests/test_dense_families.py), each with every weight perturbed and every config multiplier moved off 1.

SIMoE's defining property (Chen et al. 2025, eq. 2): for routing weights α, each wrapped module computes with the
weight θ_pre + Σ_i α_i z_i ⊙ δ. Tested against the plain model of those weights (moekit.simoe.merge), as transformers
computes it after a save and a load: per instance, with two instances of different α in one batch, so that an input
whose rows were flattened by the family (OPT's MLP, Qwen3.5's gated norm) still meets its own instance's mask.
At init (δ = 0) the SIMoE model equals the pretrained one bit for bit, and it wraps every linear layer of the
model's layer stacks (§4: "every linear layer in the pre-trained LLM") except those the family computes with
directly, never calling them (Mamba's dt_proj), which are listed in its state and its checkpoint. (Cross-attention,
which a decoder-only forward never reaches, is wrapped all the same.)"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moekit import simoe
from moekit.checkpoint.upcycle_model import language_model_path
from moekit.simoe.layer import SILinear, SparseInterpolated
from moekit.simoe.model import _stacked
from moekit.testing.families import dense_model_types, tiny_family_model
from test_dense_families import HARNESS_CANNOT_BUILD, NOT_BUILT, _adversarial

FAMILIES = sorted(f for f in dense_model_types() if f not in HARNESS_CANNOT_BUILD and f not in NOT_BUILT)
CFG = simoe.SIMoEConfig(num_experts=4, router_hidden=16)
IDS = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
# families whose code reads a linear layer's weight instead of calling it (the layers moekit leaves unwrapped)
SKIPPED = {"falcon_mamba": {"dt_proj"}, "mamba": {"dt_proj"}}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits


def randomized(model):
    g = torch.Generator().manual_seed(0)
    for _, m in simoe.si_modules(model):
        m.delta.data = torch.randn(m.delta.shape, generator=g) * 0.05
        m.log_alpha.data = torch.randn(m.log_alpha.shape, generator=g) * 3
    return model


def test_families_are_the_dense_sweeps():
    assert len(FAMILIES) >= 95 and set(SKIPPED) <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_simoe_is_the_pretrained_model_at_init_and_interpolates_per_instance(family, tmp_path):
    """At init: the pretrained model bit for bit, every linear layer of the layer stacks wrapped (or skipped:
    SKIPPED; in a multimodal model, those of its language model). Then with random δ and masks, two instances with their own α: each row of the SIMoE logits equals the
    plain model of that row's weights θ_pre + Σ_i α_i z_i ⊙ δ (1e-5 relative), and so does that model saved and
    loaded by transformers; the SIMoE checkpoint saved and loaded again computes the same."""
    model = tiny_family_model(family, edit=_adversarial, perturb=0.05)
    lm = language_model_path(model)  # a multimodal model's: its LLM's linear layers only (GOT-OCR2, MOSS-Transcribe)
    linears = {p for p, m in model.named_modules() if isinstance(m, nn.Linear) and p in _stacked(model)
               and (lm is None or p.startswith(f"{lm}."))}
    model.requires_grad_(False)  # SIMoE freezes it: Mamba's scan takes another path for frozen parameters
    want = logits(model)
    simoe.simoe_upcycle(model, CFG).eval()
    assert torch.equal(logits(model), want)
    # every path: a layer tied to another (Zamba's shared transformer block) is that layer's SI module
    wrapped = {p for p, m in model.named_modules(remove_duplicate=False) if isinstance(m, SILinear)}
    skipped = set(model.simoe.skipped) & linears
    assert wrapped | skipped == linears and not wrapped & skipped
    assert {p.rsplit(".", 1)[-1] for p in skipped} == SKIPPED.get(family, set())

    model = randomized(model)
    alpha = torch.softmax(torch.randn(2, CFG.num_experts, generator=torch.Generator().manual_seed(1)), -1)  # (B, M)
    with simoe.fixed_routing(model, alpha):
        got = logits(model)
    assert not torch.allclose(got[0], got[1])
    simoe.save(model, tmp_path / "simoe")
    loaded = simoe.load(tmp_path / "simoe")
    assert loaded.simoe.skipped == model.simoe.skipped
    with simoe.fixed_routing(loaded, alpha):
        torch.testing.assert_close(logits(loaded), got, rtol=1e-6, atol=1e-6)
    for b in range(2):
        merged = simoe.merge(copy.deepcopy(model), alpha[b])
        assert not any(isinstance(m, SparseInterpolated) for m in merged.modules())
        want = logits(merged)[b]
        assert ((want - got[b]).norm() / want.norm()).item() < 1e-5, family
    merged.save_pretrained(tmp_path / "merged")
    plain = type(merged).from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert ((logits(plain)[1] - got[1]).norm() / got[1].norm()).item() < 1e-5
