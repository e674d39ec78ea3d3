"""Granular upcycling (He et al. 2024; MoESpec.granularity): E·G experts that are the G shards of E copies, top-k·G
routing with virtual-group routers, and scaled_copy's factor s = G keeping the MoE equal to the dense model, in
memory, streamed (bit-identical) and exported to native formats."""
import pytest
import torch
import transformers as tf

from moekit.checkpoint.upcycle import upcycle_checkpoint
from moekit.config import validate
from moekit.errors import ConfigError
from moekit.checkpoint.format import load
from moekit.checkpoint.dense import load_dense
from moekit.moe import MoESpec, moe_layers
from moekit.testing import logits, tiny_inputs, tiny_llama, tiny_qwen3, tiny_tokenizer
from moekit.checkpoint.upcycle_model import upcycle

TOL = 1e-5
E, K = 4, 2


def spec_for(G: int, **kw) -> MoESpec:
    return validate(MoESpec, {"num_experts": E, "top_k": K, "granularity": G, "init": "scaled_copy", **kw})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gran")
    for name, build in (("llama", tiny_llama), ("qwen3", tiny_qwen3)):
        build().save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("G", [2, 4])
def test_in_memory_and_streamed_equal_dense_and_each_other(sources, tmp_path, G):
    dense = load_dense(sources / "llama")
    x = tiny_inputs(dense)
    ref = logits(dense, x)
    spec = spec_for(G)
    moe = upcycle(load_dense(sources / "llama"), spec)
    assert max_diff(logits(moe, x), ref) <= TOL
    w = upcycle_checkpoint(sources / "llama", tmp_path / "moe", spec)
    assert w.format == "moekit" and w.layers == 4
    streamed = load(tmp_path / "moe").state_dict()
    want = moe.state_dict()
    assert streamed.keys() == want.keys()
    assert all(torch.equal(streamed[k], want[k]) for k in want)
    assert max_diff(logits(load(tmp_path / "moe"), x), ref) <= TOL


@pytest.mark.parametrize("G", [2, 4])
def test_experts_are_scaled_shards_and_router_rows_repeat_per_copy(G):
    dense = tiny_llama()
    mlp = dense.model.layers[2].mlp
    gate, up, down = (lin.weight.detach().clone() for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    moe = upcycle(dense, spec_for(G)).model.layers[2].mlp
    n = 64 // G
    assert moe.experts.num_experts == E * G and moe.router.top_k == K * G and moe.experts.intermediate_size == n
    assert moe.router.scoring == "topk_softmax"
    for e in range(E):
        for g in range(G):
            rows = slice(g * n, (g + 1) * n)
            i = e * G + g
            assert torch.equal(moe.experts.gate_up[i], torch.cat([gate[rows], up[rows]]))
            assert torch.equal(moe.experts.down[i], down[:, rows] * G)  # s = G, on the down projection
            assert torch.equal(moe.router.weight[i], moe.router.weight[e * G])
        assert not torch.equal(moe.router.weight[e * G], moe.router.weight[((e + 1) % E) * G])


@pytest.mark.parametrize("G", [2, 4])
def test_every_token_gets_all_shards_of_k_copies(G):
    """Even with a large router std (sharp, far from uniform routing) the top-k·G ids are k whole copies."""
    dense = tiny_llama()
    x = tiny_inputs(dense, batch=4, length=16)
    ref = logits(dense, x)
    moe = upcycle(dense, spec_for(G, router={"init_std": 1.0}))
    assert max_diff(logits(moe, x), ref) <= TOL
    for _, m in moe_layers(moe):
        copies = m.last_routing.topk_ids // G  # (T, k·G)
        counts = torch.stack([torch.bincount(row, minlength=E) for row in copies])  # (T, E)
        assert set(counts.unique().tolist()) == {0, G} and bool((counts.sum(-1) == K * G).all())


def test_down_bias_is_whole_in_every_shard():
    """With s = G each shard keeps the down bias b: a copy's G shards, weighted 1/G of the copy's weight, add b."""
    dense = tiny_llama(mlp_bias=True)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    x = tiny_inputs(dense)
    ref = logits(dense, x)
    b = dense.model.layers[0].mlp.down_proj.bias.detach().clone()
    moe = upcycle(dense, spec_for(2))
    assert max_diff(logits(moe, x), ref) <= TOL
    ex = moe_layers(moe)[0][1].experts
    assert all(torch.equal(ex.down_bias[i], b) for i in range(E * 2))


@pytest.mark.parametrize("source, fmt", [("llama", "mixtral"), ("llama", "qwen2_moe"), ("qwen3", "qwen3_moe")])
def test_native_export_has_fine_grained_experts(sources, tmp_path, source, fmt):
    G = 2
    spec = spec_for(G)
    w = upcycle_checkpoint(sources / source, tmp_path / "native", spec, format=fmt)
    assert w.format == fmt
    native = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32)
    cfg = native.config
    if fmt == "mixtral":
        assert (cfg.intermediate_size, cfg.num_local_experts) == (64 // G, E * G)
    else:  # dense I stays for mlp_only_layers
        assert (cfg.moe_intermediate_size, cfg.num_experts, cfg.norm_topk_prob) == (64 // G, E * G, True)
        assert cfg.intermediate_size == 64
    assert cfg.num_experts_per_tok == K * G
    moe = upcycle(load_dense(sources / source), spec)
    x = tiny_inputs(moe)
    assert max_diff(logits(native, x), logits(moe, x)) <= TOL
    assert max_diff(logits(native, x), logits(load_dense(sources / source), x)) <= TOL


def test_auto_format_picks_mixtral(sources, tmp_path):
    assert upcycle_checkpoint(sources / "llama", tmp_path / "out", spec_for(2), format="auto").format == "mixtral"


@pytest.mark.parametrize("spec, match", [
    ({"init": "naive", "granularity": 2}, "granularity 2 .* works with init scaled_copy only, not naive"),
    ({"init": "ume", "granularity": 2}, "works with init scaled_copy only"),
    ({"init": "scaled_copy", "granularity": 2, "router": {"scoring": "softmax_topk"}}, "topk_softmax"),
    ({"init": "scaled_copy", "granularity": 2, "router": {"init": "zeros"}}, "drawn router"),
    ({"init": "scaled_copy", "granularity": 0}, "granularity"),
])
def test_refusals_in_the_spec(spec, match):
    with pytest.raises(ConfigError, match=match):
        validate(MoESpec, {"num_experts": E, "top_k": K, **spec})


def test_granularity_must_divide_the_intermediate_size(sources, tmp_path):
    spec = spec_for(3)
    with pytest.raises(ConfigError, match="granularity 3 must divide the FFN's intermediate size, but "
                                          "model.layers.0.mlp has 64"):
        upcycle(tiny_llama(), spec)
    with pytest.raises(ConfigError, match="granularity 3 must divide"):
        upcycle_checkpoint(sources / "llama", tmp_path / "out", spec)
    assert not (tmp_path / "out").exists()


def test_defaults_at_granularity_one_are_unchanged():
    spec = spec_for(1)
    assert (spec.routed_experts, spec.routed_top_k, spec.scoring, spec.router_init) == (E, K, "softmax_topk", "zeros")
    assert spec.summary == "4 experts, top-2"
    assert spec_for(2).summary == "8 experts (4 copies x 2 shards), top-4"
