"""Routing statistics on hand-built traces with known closed-form values (RISE eqs. 1–4, 12; Omni-router
Cramér's V and entropies), and the expert-permutation test (Omni-router Fig. 6) on tiny MoE models."""
import numpy as np
import pytest
import torch

from moekit.errors import ConfigError
from moekit.moe.spec import MoESpec
from moekit.routing.permutation import mean_loss, permutation_test, random_experts
from moekit.routing.stats import (activation_frequency, adjacent_association, align_experts, contingency,
                                  cramers_v, expert_usage, global_expert_sets, jaccard, layer_regions,
                                  layerwise_jaccard, overlap_mass, overlap_share, region_means, token_routing_entropy, top1,
                                  usage_entropy)
from moekit.routing.trace import RoutingTrace
from moekit.testing import TINY_HF_MOE, tiny_llama
from moekit.checkpoint.upcycle_model import upcycle


def moekit_model():
    return upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=1, init={"method": "noise"})).eval()


def make_trace(ids, lang=None, languages=("en",), token=None, num_experts=8, weights=None):
    """A trace from ids (L, N, k); weights default to decreasing over the k slots."""
    ids = np.asarray(ids, dtype=np.int16)
    L, N, k = ids.shape
    if weights is None:
        weights = np.broadcast_to(np.linspace(1, 0.5, k, dtype=np.float32), ids.shape).copy()
    lang = np.zeros(N, np.int16) if lang is None else np.asarray(lang, np.int16)
    token = np.arange(N, dtype=np.int32) if token is None else np.asarray(token, np.int32)
    return RoutingTrace([f"model.layers.{i}.mlp" for i in range(L)], np.full(L, num_experts), list(languages),
                        ids, np.asarray(weights, np.float32), token, np.zeros(N, np.int32), np.arange(N, dtype=np.int32),
                        lang)


def three_languages(L=4):
    """en and fr route every token to experts {0, 1}, sw to {4, 5}, at every layer."""
    en = np.tile([0, 1], (L, 6, 1))
    sw = np.tile([4, 5], (L, 6, 1))
    ids = np.concatenate([en, en, sw], axis=1)  # (L, 18, 2)
    return make_trace(ids, lang=np.repeat([0, 1, 2], 6), languages=("en", "fr", "sw"))


def test_global_sets_and_jaccard_identical_and_disjoint():
    trace = three_languages()
    a = activation_frequency(trace)  # (3, L, E)
    sets = global_expert_sets(a, k=8)
    assert sets.sum((1, 2)).tolist() == [8, 8, 8]  # 2 experts x 4 layers each, all in the top 8
    J = jaccard(sets)
    np.testing.assert_array_equal(J, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])
    # K smaller than what a language activates: ties broken by (layer, expert) order, identical for en/fr
    small = global_expert_sets(a, k=3)
    assert small.sum((1, 2)).tolist() == [3, 3, 3] and jaccard(small)[0, 1] == 1


def test_jaccard_partial_overlap():
    # en uses experts {0, 1}, sw {1, 2} at one layer: |∩| = 1, |∪| = 3
    ids = np.concatenate([np.tile([0, 1], (1, 5, 1)), np.tile([1, 2], (1, 5, 1))], axis=1)
    trace = make_trace(ids, lang=np.repeat([0, 1], 5), languages=("en", "sw"))
    J = jaccard(global_expert_sets(activation_frequency(trace), k=4))
    assert J[0, 1] == pytest.approx(1 / 3) and J[1, 0] == J[0, 1]


def test_layerwise_jaccard_and_region_means():
    # sw shares en's experts in the middle layers only: layer-wise J = 0 0 0 1 1 0 0 0 (L = 8)
    L = 8
    en = np.tile([0, 1], (L, 4, 1))
    sw = np.tile([4, 5], (L, 4, 1))
    sw[3:5] = [0, 1]
    trace = make_trace(np.concatenate([en, sw], axis=1), lang=np.repeat([0, 1], 4), languages=("en", "sw"))
    J = layerwise_jaccard(activation_frequency(trace), reference=0, k=2)  # (2, L)
    np.testing.assert_array_equal(J[0], np.ones(L))
    np.testing.assert_array_equal(J[1], [0, 0, 0, 1, 1, 0, 0, 0])
    regions = layer_regions(L)  # 3 shallow, 2 middle, 3 deep
    means = region_means(J, regions)
    assert {r: m[1] for r, m in means.items()} == {"shallow": 0, "middle": 1, "deep": 0}
    # configurable boundaries: a 50/25/25 split moves layer 3 into shallow
    means = region_means(J, layer_regions(L, (0.5, 0.25, 0.25)))
    assert means["shallow"][1] == pytest.approx(1 / 4) and means["middle"][1] == pytest.approx(1 / 2)


def test_overlap_mass():
    """RISE eq. 12 is a raw sum of activation frequencies (L·k for every expert); the share normalizes it."""
    trace = three_languages(L=2)
    a = activation_frequency(trace)
    full = {name: list(range(8)) for name in trace.layers}
    np.testing.assert_allclose(overlap_mass(a, trace.layers, full), [4, 4, 4])  # 2 layers x top-2
    np.testing.assert_allclose(overlap_share(a, trace.layers, full), [1, 1, 1])
    # expert 0 at layer 0 is activated by every en and fr token (a = 1), never by sw
    np.testing.assert_allclose(overlap_mass(a, trace.layers, {trace.layers[0]: [0]}), [1, 1, 0])
    np.testing.assert_allclose(overlap_share(a, trace.layers, {trace.layers[0]: [0]}), [0.25, 0.25, 0])
    np.testing.assert_allclose(overlap_mass(a, trace.layers, {}), [0, 0, 0])
    with pytest.raises(ConfigError, match="not an MoE layer"):
        overlap_mass(a, trace.layers, {"model.layers.9.mlp": [0]})
    with pytest.raises(ConfigError, match="out of range"):
        overlap_mass(a, trace.layers, {trace.layers[0]: [8]})


def test_cramers_v_permutation_gives_one_and_a_diagonal_aligned_table():
    rng = np.random.default_rng(0)
    perm = rng.permutation(8)
    first = rng.integers(0, 8, 400)
    ids = np.stack([first, perm[first], first])[..., None]  # (3, 400, 1): layer 1 = perm(layer 0)
    V, tables = adjacent_association(make_trace(ids))
    np.testing.assert_allclose(V, [1, 1])
    for t in tables:
        assert np.count_nonzero(t - np.diag(np.diag(t))) == 0  # diagonal after alignment
        np.testing.assert_array_equal(np.sort(np.diag(t)), np.sort(np.bincount(first, minlength=8)))
    table = contingency(first, perm[first], 8, 8)
    aligned, order = align_experts(table)
    np.testing.assert_array_equal(order, perm)
    np.testing.assert_array_equal(aligned, table[:, order])


def test_cramers_v_independent_choices_near_zero():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 8, (2, 20000, 1))
    V, _ = adjacent_association(make_trace(ids))
    assert V[0] < 0.03  # E[V] ≈ sqrt((E-1)/N) ≈ 0.019 under independence


def test_cramers_v_closed_form_and_degenerate():
    # 2x2 table [[a, b], [c, d]]: V = |ad - bc| / sqrt((a+b)(c+d)(a+c)(b+d))
    t = np.array([[30, 10], [5, 15]])
    assert cramers_v(t) == pytest.approx(abs(30 * 15 - 10 * 5) / np.sqrt(40 * 20 * 35 * 25))
    assert np.isnan(cramers_v(np.array([[5, 3], [0, 0]])))  # one row used: no variation


def test_top1_follows_the_largest_weight_not_the_slot():
    ids = np.array([[[2, 5], [1, 4]], [[3, 6], [0, 7]]])  # (2, 2, 2)
    weights = np.array([[[0.3, 0.7], [0.6, 0.4]], [[0.9, 0.1], [0.2, 0.8]]])
    np.testing.assert_array_equal(top1(make_trace(ids, weights=weights)), [[5, 1], [3, 7]])


def test_usage_entropy_uniform_and_single_expert():
    uniform = np.tile(np.arange(8), 10)[None, :, None]  # every expert equally often
    single = np.zeros((1, 80, 1))
    trace = make_trace(np.concatenate([uniform, single]))
    np.testing.assert_allclose(usage_entropy(trace), [np.log(8), 0], atol=1e-12)
    np.testing.assert_allclose(expert_usage(trace).sum(1), [1, 1])
    # k = 2: slots count separately; the padding (-1) of a smaller-k layer is ignored
    ids = np.stack([np.tile([[0, 1]], (4, 1)), np.tile([[2, -1]], (4, 1))])  # (2, 4, 2)
    np.testing.assert_allclose(usage_entropy(make_trace(ids)), [np.log(2), 0], atol=1e-12)


def test_token_routing_entropy_most_frequent_tokens():
    # token 7 (6 occurrences) always goes to expert 3; token 9 (4) alternates 0/1; token 2 (1) is dropped
    token = np.array([7] * 6 + [9] * 4 + [2])
    choice = np.array([3] * 6 + [0, 1, 0, 1] + [5])
    trace = make_trace(np.stack([choice, choice])[..., None], token=token)
    tokens, H = token_routing_entropy(trace, num_tokens=2)
    assert tokens.tolist() == [7, 9] and H.shape == (2, 2)
    np.testing.assert_allclose(H, [[0, np.log(2)], [0, np.log(2)]], atol=1e-12)


def lm_batches(seed=0, n=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 128, (2, 12), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "moekit"])
def test_permutation_test(family):
    model = {**TINY_HF_MOE, "moekit": moekit_model}[family]()
    batches = lm_batches()
    before = model(**batches[0]).logits
    res = permutation_test(model, batches, [0.0, 0.5, 1.0], seed=3)
    assert res.losses[0.0] == res.base == mean_loss(model, batches)  # p = 0 is the model's own routing
    assert res.losses[1.0] != res.base and res.deltas[1.0] == res.losses[1.0] - res.base
    assert torch.equal(model(**batches[0]).logits, before)  # every reroute hook removed
    assert permutation_test(model, batches, [0.5], seed=3).losses[0.5] == res.losses[0.5]  # seeded


def test_random_experts_are_distinct_and_keep_weights():
    gen = torch.Generator().manual_seed(0)
    logits, ids, weights = torch.randn(500, 8), torch.zeros(500, 3, dtype=torch.long), torch.rand(500, 3)
    new_ids, new_weights = random_experts(0.5, gen)(logits, ids, weights)
    assert new_weights is weights
    changed = (new_ids != ids).any(-1)  # (T,)
    assert 0.4 < changed.float().mean() < 0.6
    assert all(len(set(row.tolist())) == 3 for row in new_ids[changed])
    assert new_ids.max() < 8 and new_ids.dtype == ids.dtype


def test_permutation_rate_out_of_range():
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        permutation_test(moekit_model(), lm_batches(), [1.5])
