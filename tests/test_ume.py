"""Methods that keep the upcycled MoE equal to the dense model at init (UME, scaled_copy)."""
from __future__ import annotations

import pydantic
import pytest
import torch

from moekit.config import validate
from moekit.errors import ConfigError
from moekit.moe import MoESpec, moe_layers
from moekit.testing import TINY_MODELS, logits, tiny_inputs, tiny_llama
from moekit.checkpoint.upcycle_model import upcycle

FAMILIES = ["llama", "qwen3", "gpt2", "whisper"]
TOL = 1e-5


def _dense_and_moe(family: str, spec: dict, **model_kw):
    dense = TINY_MODELS[family](**model_kw)
    with torch.no_grad():  # non-zero biases, so that scaling or duplicating them would show
        for name, p in dense.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    inputs = tiny_inputs(dense)
    ref = logits(dense, inputs)
    moe = upcycle(dense, validate(MoESpec, spec))
    return ref, logits(moe, inputs), moe


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_ume_equals_dense(family):
    # the router is random (normal, here with a large std): renormalized copies do not depend on it
    ref, out, moe = _dense_and_moe(family, {"num_experts": 4, "top_k": 2, "init": "ume",
                                            "router": {"init_std": 1.0}})
    assert len(moe_layers(moe)) == 4
    assert _max_diff(ref, out) <= TOL
    for _, m in moe_layers(moe):
        assert m.router.weight.abs().sum() > 0 and m.router.scoring == "topk_softmax"


@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (4, 4), (6, 3)])
def test_ume_equals_dense_for_any_e_k(num_experts, top_k):
    ref, out, _ = _dense_and_moe("llama", {"num_experts": num_experts, "top_k": top_k, "init": "ume"})
    assert _max_diff(ref, out) <= TOL


@pytest.mark.parametrize("target,expected", [(None, {"encoder": 2, "decoder": 2}),
                                             ("encoder", {"encoder": 2, "decoder": 0}),
                                             ("decoder", {"encoder": 0, "decoder": 2})])
def test_ume_whisper_stacks(target, expected):
    ref, out, moe = _dense_and_moe("whisper", {"num_experts": 4, "top_k": 2, "init": "ume", "target": target})
    paths = [p for p, _ in moe_layers(moe)]
    assert {s: sum(f".{s}." in p for p in paths) for s in ("encoder", "decoder")} == expected
    assert _max_diff(ref, out) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_copy_equals_dense(family):
    ref, out, moe = _dense_and_moe(family, {"num_experts": 4, "top_k": 2, "init": "scaled_copy"})
    for _, m in moe_layers(moe):
        assert m.router.scoring == "softmax_topk" and torch.count_nonzero(m.router.weight) == 0
    assert _max_diff(ref, out) <= TOL


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (8, 1), (3, 2)])
def test_scaled_copy_equals_dense_for_any_e_k(num_experts, top_k):
    ref, out, moe = _dense_and_moe("llama", {"num_experts": num_experts, "top_k": top_k, "init": "scaled_copy"})
    assert _max_diff(ref, out) <= TOL
    # the scale s = E/k sits on the down projection only (distribute="down")
    mlp = tiny_llama().model.layers[0].mlp  # same seed: the dense weights
    ex = moe_layers(moe)[0][1].experts
    for e in range(num_experts):
        assert torch.equal(ex.down[e], mlp.down_proj.weight * (num_experts / top_k))
        assert torch.equal(ex.gate_up[e], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_scaled_copy_megatron_is_approximate_for_silu_and_gelu(family):
    """Megatron's s^(1/3) (gated) / s^(1/2) split is exact only for homogeneous activations."""
    spec = {"num_experts": 8, "top_k": 2, "init": {"method": "scaled_copy", "distribute": "megatron"}}
    ref, out, _ = _dense_and_moe(family, spec)
    assert _max_diff(ref, out) > 1e-3


@pytest.mark.parametrize("act", ["relu"])
def test_scaled_copy_megatron_is_exact_for_relu(act):
    spec = {"num_experts": 8, "top_k": 2, "init": {"method": "scaled_copy", "distribute": "megatron"}}
    ref, out, _ = _dense_and_moe("llama", spec, hidden_act=act)
    assert _max_diff(ref, out) <= TOL


def test_ume_experts_are_dense_copies():
    dense = tiny_llama()
    mlp = dense.model.layers[1].mlp
    gate, up, down = (lin.weight.detach().clone() for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    moe = upcycle(dense, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    ex = moe.model.layers[1].mlp.experts
    for e in range(4):
        assert torch.equal(ex.gate_up[e], torch.cat([gate, up]))
        assert torch.equal(ex.down[e], down)


@pytest.mark.parametrize("bad,match", [
    ({"init": "ume", "shared_expert": True}, "shared_expert=false"),
    ({"init": "ume", "router": {"scoring": "softmax_topk"}}, "topk_softmax"),
    ({"init": "scaled_copy", "shared_expert": True}, "shared_expert=false"),
    ({"init": "scaled_copy", "router": {"scoring": "topk_softmax"}}, "softmax_topk"),
])
def test_dense_equal_methods_reject_incompatible_specs(bad, match):
    with pytest.raises(ConfigError, match=match) as info:
        validate(MoESpec, {"num_experts": 4, "top_k": 2, **bad})
    assert "invalid config" in str(info.value)
    assert not isinstance(info.value, pydantic.ValidationError)
    # direct construction raises pydantic's error (a ValueError); validate() is the user-facing path
    with pytest.raises(pydantic.ValidationError):
        MoESpec(num_experts=4, top_k=2, **bad)


@pytest.mark.parametrize("init", ["ume", "scaled_copy"])
def test_gated_ffn_with_biases_equals_dense(init):
    # Llama with mlp_bias: gate, up and down biases all land in the experts (and are scaled for scaled_copy)
    ref, out, moe = _dense_and_moe("llama", {"num_experts": 4, "top_k": 2, "init": init}, mlp_bias=True)
    ex = moe_layers(moe)[0][1].experts
    assert ex.first_bias.shape == (4, 128) and ex.down_bias.shape == (4, 32)
    assert torch.count_nonzero(ex.first_bias[:, :64]) > 0  # the gate bias is kept
    assert _max_diff(ref, out) <= TOL
