"""The contract every registered expert-init method must honour (driven by the registry)."""
from __future__ import annotations

from moekit.moe.state import spec_of
import pytest
import torch

from moekit.checkpoint import format as io
from moekit.config import validate
from moekit.init import EXPERT_INITS
from moekit.moe.losses import layer_stats
from moekit.moe import MoESpec, moe_layers
from moekit.testing import TINY_MODELS, logits, tiny_inputs
from moekit.checkpoint.upcycle_model import layer_generator, upcycle

E, K = 4, 2
METHODS = EXPERT_INITS.names()
# methods whose routed experts depend on the seed (the others copy or scale the dense FFN)
RANDOM_EXPERTS = {"drop", "noise", "scratch", "spri"}
FAMILIES = ["llama", "gpt2"]  # gated without biases, non-gated with biases (Conv1D)


def test_registry_lists_the_methods():
    assert set(METHODS) >= {"btx", "drop", "naive", "noise", "scaled_copy", "spri", "ume"}
    assert METHODS == sorted(METHODS)


def spec_for(method: str, seed: int = 0, **kw) -> MoESpec:
    cls = EXPERT_INITS.get(method)
    init: dict = {"method": method}
    if cls.needs_branches:  # one model per expert, btx's seed model (the last expert) aside
        with_seed = cls.model_fields["include_seed"].default if "include_seed" in cls.model_fields else False
        init["branches"] = [f"branch-{i}" for i in range(E - with_seed)]
    # ume/scaled_copy keep the model dense-equal only without a shared expert; spri wants one
    shared = method == "spri"
    return validate(MoESpec, {"num_experts": E, "top_k": K, "init": init, "seed": seed,
                              "shared_expert": shared, **kw})


def build(method: str, family: str = "llama", seed: int = 0, **kw):
    fn = TINY_MODELS[family]
    spec = spec_for(method, seed, **kw)
    branches = [fn(seed=100 + i) for i in range(len(spec.init.branches))] if spec.init.needs_branches else None
    return upcycle(fn(seed=0), spec, branches=branches), spec


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_shapes(method, family):
    model, spec = build(method, family)
    H, I = 32, {"llama": 64, "gpt2": 4 * 32}[family]
    layers = moe_layers(model)
    assert len(layers) == 4
    gated = family == "llama"
    for _, moe in layers:
        ex, r = moe.experts, moe.router
        assert ex.num_experts == E and r.top_k == K and r.scoring == spec.scoring
        assert ex.first.shape == (E, 2 * I if gated else I, H)
        assert ex.down.shape == (E, H, I)
        assert r.weight.shape == (E, H)
        if gated:
            assert ex.first_bias is None and ex.down_bias is None
        else:
            assert ex.first_bias.shape == (E, I) and ex.down_bias.shape == (E, H)
        if spec.shared_expert:
            sh = moe.shared
            assert sh.up_proj.weight.shape == (I, H) and sh.down_proj.weight.shape == (H, I)
            assert (sh.gate_proj is not None) == gated
        else:
            assert moe.shared is None
        for p in moe.parameters():
            assert p.dtype == torch.float32 and torch.isfinite(p).all()


@pytest.mark.parametrize("method", METHODS)
def test_determinism(method):
    a, spec = build(method, seed=0)
    b, _ = build(method, seed=0)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)

    c, _ = build(method, seed=1)
    sc = c.state_dict()
    router_random = spec.router_init == "normal"
    for path, moe in moe_layers(a):
        key = f"{path}.router.weight"
        assert torch.equal(sa[key], sc[key]) != router_random, key
        experts_equal = all(torch.equal(sa[k], sc[k]) for k in sa if k.startswith(f"{path}.experts."))
        assert experts_equal != (method in RANDOM_EXPERTS), path
    # the per-layer generator: different layers get different random routers
    (_, m0), (_, m1) = moe_layers(a)[:2]
    if router_random:
        assert not torch.equal(m0.router.weight, m1.router.weight)


def test_layer_generator_depends_on_seed_and_path():
    def draw(seed, path):
        return torch.randn(8, generator=layer_generator(seed, path))

    assert torch.equal(draw(0, "model.layers.0.mlp"), draw(0, "model.layers.0.mlp"))
    assert not torch.equal(draw(0, "model.layers.0.mlp"), draw(0, "model.layers.1.mlp"))
    assert not torch.equal(draw(0, "model.layers.0.mlp"), draw(1, "model.layers.0.mlp"))
    # any int seed the spec accepts works, huge or negative
    assert not torch.equal(draw(2**70, "model.layers.0.mlp"), draw(2**70 + 1, "model.layers.0.mlp"))
    assert not torch.equal(draw(-1, "model.layers.0.mlp"), draw(-2, "model.layers.0.mlp"))


def test_huge_seed_upcycles():
    a, _ = build("noise", seed=2**70)
    b, _ = build("noise", seed=2**70)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_save_load_bit_identical(method, family, tmp_path):
    model, spec = build(method, family)
    inputs = tiny_inputs(model)
    before = logits(model, inputs)
    io.save(model, tmp_path / "moe")
    loaded = io.load(tmp_path / "moe")
    assert torch.equal(logits(loaded, inputs), before)
    assert spec_of(loaded) == spec
    sd, sl = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sl.keys() and all(torch.equal(sd[k], sl[k]) for k in sd)


@pytest.mark.parametrize("method", METHODS)
def test_forward_backward_reaches_router_and_experts(method):
    model, _ = build(method)
    model.train()
    inputs = tiny_inputs(model)
    out = model(**inputs, labels=inputs["input_ids"])
    layers = moe_layers(model)
    infos = [m.last_routing for _, m in layers]
    loss = out.loss + 0.01 * layer_stats(infos, inputs["attention_mask"])["lb"].sum()  # what MoETrainer adds
    loss.backward()
    for path, moe in layers:
        assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0, path
        used = moe.last_routing.tokens_per_expert() > 0
        assert used.any()
        for p in (moe.experts.first, moe.experts.down):
            per_expert = p.grad.flatten(1).abs().sum(1)  # (E,)
            # an expert's weights get gradient exactly when tokens were routed to it
            assert torch.equal(per_expert > 0, used), path


@pytest.mark.parametrize("include_seed", [True, False])
def test_btx_experts_are_branch_ffns_and_the_rest_is_averaged(include_seed):
    """BTX §2.2: expert i = branch i's FFN, the rest averaged; with the seed model as one more expert (the
    last), as Sukhbaatar et al. and SIMoE's baseline do, the seed joins the average too."""
    branches = [TINY_MODELS["llama"](seed=100 + i) for i in range(E - include_seed)]
    seed = TINY_MODELS["llama"](seed=0)
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in [*branches, *([seed] * include_seed)]]
    spec = validate(MoESpec, {"num_experts": E, "top_k": K, "init": {"method": "btx", "include_seed": include_seed,
                                                                      "branches": ["b"] * len(branches)}})
    model = upcycle(seed, spec, branches=branches)
    for i, (path, moe) in enumerate(moe_layers(model)):
        for e, st in enumerate(states):
            gate, up, down = (st[f"{path}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            assert torch.equal(moe.experts.gate_up[e], torch.cat([gate, up]))
            assert torch.equal(moe.experts.down[e], down)
    for k, v in model.state_dict().items():
        if ".mlp." not in k:
            mean = torch.stack([st[k] for st in states]).mean(0)
            torch.testing.assert_close(v, mean, atol=1e-7, rtol=0)


def test_btx_needs_matching_branches():
    from moekit.errors import ConfigError

    with pytest.raises(ConfigError, match="one branch per expert"):
        validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": {"method": "btx", "branches": ["a", "b"]}})
    with pytest.raises(ConfigError, match=f"needs {E - 1} branch models, got 2"):
        upcycle(TINY_MODELS["llama"](), spec_for("btx"), branches=[TINY_MODELS["llama"](seed=i) for i in range(2)])
    other = [TINY_MODELS["llama"](seed=i, intermediate_size=48) for i in range(E - 1)]
    with pytest.raises(ConfigError, match="architecture"):
        upcycle(TINY_MODELS["llama"](), spec_for("btx"), branches=other)
