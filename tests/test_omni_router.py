"""Omni-router (Gu et al. 2025, eq. 4.1): one router module shared by MoE layers, each feeding its own hidden
state; named groups; save/load keeps the tie; native export refuses it. Plus the `scratch` expert init."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

import moekit.checkpoint.format as mio
from moekit.config import validate
from moekit.errors import ConfigError, ExportError
from moekit.checkpoint.export import EXPORTERS
from moekit.moe import MoESpec, moe_layers
from moekit.testing import logits, tiny_inputs, tiny_llama, tiny_whisper
from moekit.checkpoint.upcycle_model import upcycle


def spec(**kw) -> MoESpec:
    return validate(MoESpec, {"num_experts": 4, "top_k": 1, "init": "scratch", **kw})


def routers(model) -> dict[str, int]:
    return {path: id(m.router) for path, m in moe_layers(model)}


def test_all_layers_share_one_router_object():
    model = upcycle(tiny_llama(), spec(router_sharing="all"))
    assert len(moe_layers(model)) == 4 and len(set(routers(model).values())) == 1


def test_named_groups_share_within_and_not_across():
    model = upcycle(tiny_whisper(), spec(router_sharing={"enc": "encoder", "dec": "decoder"}))
    r = routers(model)
    enc = {v for k, v in r.items() if "encoder" in k}
    dec = {v for k, v in r.items() if "decoder" in k}
    assert len(r) == 4 and len(enc) == 1 and len(dec) == 1 and enc != dec


def test_layers_outside_every_group_keep_their_own_router():
    model = upcycle(tiny_llama(), spec(router_sharing={"odd": r"layers\.[13]\."}))
    r = routers(model)
    assert r["model.layers.1.mlp"] == r["model.layers.3.mlp"]
    assert len({r["model.layers.0.mlp"], r["model.layers.2.mlp"], r["model.layers.1.mlp"]}) == 3


def test_layer_in_two_groups_is_refused_before_any_change():
    model = tiny_llama()
    with pytest.raises(ConfigError, match="several router_sharing groups"):
        upcycle(model, spec(router_sharing={"a": "layers", "b": r"layers\.2"}))
    assert not moe_layers(model)


def test_group_spanning_hidden_sizes_is_refused():
    two = torch.nn.Module()  # two stacks of blocks with different hidden sizes (e.g. a speech-LLM)
    two.a, two.b = tiny_llama().model.layers, tiny_llama(hidden_size=48).model.layers
    with pytest.raises(ConfigError, match=r"spans hidden sizes \[32, 48\]"):
        upcycle(two, spec(router_sharing="all"))
    assert not moe_layers(two)
    assert len(moe_layers(upcycle(two, spec(router_sharing={"a": r"^a\.", "b": r"^b\."})))) == 8


@pytest.mark.parametrize("bad", [{}, {"a": "("}])
def test_bad_groups_are_config_errors(bad):
    with pytest.raises(ConfigError, match="router_sharing"):
        validate(MoESpec, {"router_sharing": bad})


def test_shared_router_gradient_is_the_sum_over_layers():
    """Tying the router = summing each layer's gradient w.r.t. its own copy of the same weights."""
    tied = upcycle(tiny_llama(), spec(router_sharing="all", seed=1)).train()
    untied = upcycle(tiny_llama(), spec(seed=1)).train()
    w = next(iter(moe_layers(tied)))[1].router.weight
    with torch.no_grad():
        for _, m in moe_layers(untied):
            m.router.weight.copy_(w)
    inputs = tiny_inputs(tied)
    for model in (tied, untied):
        model(**inputs).logits.square().mean().backward()
    per_layer = sum(m.router.weight.grad for _, m in moe_layers(untied))
    torch.testing.assert_close(w.grad, per_layer, rtol=1e-5, atol=1e-7)
    assert w.grad.abs().sum() > 0


def test_groups_survive_save_and_load(tmp_path):
    model = upcycle(tiny_whisper(), spec(router_sharing={"enc": "encoder", "dec": "decoder"}))
    inputs = {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": torch.tensor([[1, 5, 6], [1, 7, 8]])}
    before = model(**inputs).logits
    out = mio.save(model, tmp_path / "ckpt")
    keys = []
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            keys += list(st.keys())
    assert sum("router.weight" in k for k in keys) == 2  # one tensor per group on disk
    loaded = mio.load(out)
    r = routers(loaded)
    assert len(set(r.values())) == 2
    assert torch.equal(loaded(**inputs).logits, before)


def test_native_export_refuses_a_shared_router():
    model = upcycle(tiny_llama(), spec(router_sharing="all", init="naive"))
    with pytest.raises(ExportError, match="shared between layers"):
        EXPORTERS.get("mixtral")(model)


def test_scratch_experts_are_fresh_linear_inits():
    dense = tiny_llama(intermediate_size=256)
    w_dense = dense.model.layers[0].mlp.up_proj.weight.clone()
    model = upcycle(dense, spec(num_experts=8))
    ex = moe_layers(model)[0][1].experts
    gate, up = ex.gate_up.detach().chunk(2, dim=1)  # (E, I, H) each
    H, I = up.shape[2], up.shape[1]
    bound = 1 / math.sqrt(H)
    assert up.abs().max() <= bound and ex.down.abs().max() <= 1 / math.sqrt(I)
    assert abs(float(up.std()) - bound / math.sqrt(3)) < 0.02 * bound  # std of U(-b, b) = b/√3
    assert not torch.equal(up[0], up[1]) and not torch.equal(up[0], gate[0])
    assert not any(torch.equal(up[e], w_dense) for e in range(8))
    assert moe_layers(model)[0][1].router.scoring == "softmax_topk"  # Switch routing
