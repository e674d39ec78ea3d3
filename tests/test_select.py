"""Expert selection on hand-built routing traces whose right answers are known exactly."""
import numpy as np
import pytest

from moekit.errors import ConfigError
from moekit.routing.stats import activation_frequency
from moekit.routing.trace import RoutingTrace
from moekit.selection import SELECTORS, Selection, select
from moekit.selection.esft import entry_threshold, relevance
from moekit.selection.rise import composite_scores, overlap, region_budgets, specificity

BIG = {"shallow": 10**6, "middle": 10**6, "deep": 10**6}


def make_trace(ids, lang, languages=("en", "sw"), weights=None, sample=None, num_experts=None):
    """ids (L, N, k), lang (N,) indices into languages; weights default 1/k, one sample per token."""
    ids = np.asarray(ids, dtype=np.int16)
    L, N, k = ids.shape
    weights = np.full((L, N, k), 1 / k) if weights is None else np.asarray(weights)
    sample = np.arange(N) if sample is None else np.asarray(sample)
    num_experts = np.full(L, ids.max() + 1) if num_experts is None else np.asarray(num_experts)
    return RoutingTrace([f"model.layers.{i}.mlp" for i in range(L)], num_experts, list(languages), ids,
                        weights.astype(np.float32), np.zeros(N, np.int32), sample.astype(np.int32),
                        np.zeros(N, np.int32), np.asarray(lang, dtype=np.int16))


def isolated_trace(num_layers=8):
    """sw tokens route to experts (0, 1) in every layer, en tokens to (1, 2); expert 3 is never used."""
    per_token = [(1, 2), (1, 2), (0, 1), (0, 1)]  # en, en, sw, sw
    ids = np.array([per_token] * num_layers)
    return make_trace(ids, [0, 0, 1, 1], num_experts=np.full(num_layers, 4))


def random_trace(seed=0, L=8, N=300, k=2, E=16, languages=("en", "sw", "fr")):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(N)]) for _ in range(L)])  # (L, N, k)
    w = rng.random((L, N, k))
    return make_trace(ids, rng.integers(0, len(languages), N), languages, w / w.sum(-1, keepdims=True),
                      sample=np.arange(N) // 7, num_experts=np.full(L, E))


def chosen(selection: Selection) -> set[tuple[int, int]]:
    return {(int(layer.split(".")[2]), e) for layer, ids in selection.experts.items() for e in ids}


# ---- RISE -------------------------------------------------------------------------------------------


def test_rise_scores_match_hand_computation():
    a = np.array([[[0.5, 0.5, 0.0, 0.0]], [[0.0, 0.5, 1.0, 0.0]]])  # (Λ=2, L=1, E=4), row 0 is the target
    # mean (0.25, 0.5, 0.5, 0), population std (0.25, 0, 0.5, 0) -> CV (1, 0, 1, undefined)
    np.testing.assert_allclose(specificity(a, 0), [[2.0, 1.0, 0.0, 0.0]])
    np.testing.assert_allclose(overlap(a), [[0.5, 1.0, 0.5, 0.0]])  # unused expert: O = 0
    spec, ovlp = composite_scores(a, 0, alpha=10)
    np.testing.assert_allclose(spec, [[2 * (1 + 5), 1 * (1 + 5), 0, 0]])
    np.testing.assert_allclose(ovlp, [[0.5 * (1 + 2.5), 1 * (1 + 5), 0.5 * (1 + 5), 0]])


def test_rise_selects_exactly_the_expected_experts():
    # Spec = S(1 + 10 a_sw): expert 0 (sw only) 2·11 = 22, expert 1 (shared) 1·11 = 11, others 0.
    # Ovlp = O(1 + 10 ā): expert 1 1·11 = 11, experts 0 and 2 0.5·6 = 3, expert 3 0.
    # K = 8 -> 2 shallow (layers 0-2), 2 middle (3-4), 4 deep (5-7); ties go to the lower layer.
    sel = select(isolated_trace(), "rise", "sw", 8)
    assert chosen(sel) == {(0, 0), (1, 0), (3, 1), (4, 1), (5, 0), (6, 0), (7, 0), (5, 1)}
    assert sel.budget == sel.count == 8
    assert sel.params["region_budgets"] == {"shallow": 2, "middle": 2, "deep": 4}
    assert sel.params["layer_regions"] == ["shallow"] * 3 + ["middle"] * 2 + ["deep"] * 3
    assert sel.scores["model.layers.0.mlp"] == pytest.approx([22, 11, 0, 0])
    assert sel.scores["model.layers.3.mlp"] == pytest.approx([3, 11, 3, 0])


def test_expert_used_only_by_the_target_has_the_top_specificity():
    trace = random_trace()
    sw = trace.language_mask("sw")
    rng = np.random.default_rng(1)
    trace.ids[2] = [rng.choice(15, 2, replace=False) for _ in range(trace.num_tokens)]  # experts 0-14
    trace.ids[2][sw, 0] = 15  # expert 15 of layer 2: every sw token, no other language
    a = activation_frequency(trace)
    S = specificity(a, trace.languages.index("sw"))
    assert S[2].argmax() == 15 and S[2, 15] == pytest.approx(3.0)  # a_sw / (a_sw / 3 languages)
    assert (2, 15) in chosen(select(trace, "rise", "sw", 3, ratios=(1, 0, 0)))


@pytest.mark.parametrize("budget, ratios, expected", [
    (128, (0.35, 0.25, 0.40), (44, 32, 52)),  # floor, floor, remainder (the authors' rounding)
    (100, (0.29, 0.31, 0.40), (29, 31, 40)),  # 100 · 0.29 = 28.999... in floating point is still 29
    (7, (1 / 3, 1 / 3, 1 / 3), (2, 2, 3)),
    (10, (0.0, 0.0, 1.0), (0, 0, 10)),
])
def test_budget_is_split_exactly_by_the_ratios(budget, ratios, expected):
    assert tuple(region_budgets(budget, ratios, BIG).values()) == expected


def test_a_region_too_small_for_its_share_spills_into_the_roomiest():
    assert region_budgets(10, (0.3, 0.3, 0.4), {"shallow": 4, "middle": 0, "deep": 100}) == \
        {"shallow": 3, "middle": 0, "deep": 7}
    assert region_budgets(10, (0.8, 0.1, 0.1), {"shallow": 2, "middle": 5, "deep": 5}) == \
        {"shallow": 2, "middle": 5, "deep": 3}


def test_rise_fills_each_region_with_its_budget_and_never_repeats_an_expert():
    trace = random_trace(L=8, E=16)
    sel = select(trace, "rise", "sw", 40)
    regions = sel.params["layer_regions"]
    per_region = {r: sum(len(ids) for ids, reg in zip(sel.experts.values(), regions) if reg == r)
                  for r in ("shallow", "middle", "deep")}
    assert per_region == {"shallow": 14, "middle": 10, "deep": 16} == sel.params["region_budgets"]
    assert all(len(ids) == len(set(ids)) for ids in sel.experts.values())
    assert sel.count == 40
    # a budget of every expert takes every expert once
    assert sel.count == len(chosen(sel))
    assert len(chosen(select(trace, "rise", "sw", 8 * 16))) == 8 * 16


def test_rise_is_deterministic_and_two_layer_models_have_no_middle():
    trace = random_trace(L=2, E=8)
    first = select(trace, "rise", "sw", 6)
    assert first == select(trace, "rise", "sw", 6)
    assert first.params["layer_regions"] == ["shallow", "deep"]
    assert first.params["region_budgets"]["middle"] == 0 and first.count == 6


def test_rise_needs_another_language():
    trace = isolated_trace()
    only_sw = trace.select(trace.language_mask("sw"))
    with pytest.raises(ConfigError, match="other languages"):
        select(only_sw, "rise", "sw", 4)


@pytest.mark.parametrize("params", [{"ratios": (0.5, 0.5, 0.5)}, {"regions": (1.0, 0.0, -0.0001)},
                                    {"alpha": -1.0}, {"beta": 1.0}])
def test_rise_rejects_bad_settings(params):
    with pytest.raises(ConfigError, match="invalid rise settings"):
        select(isolated_trace(), "rise", "sw", 4, **params)


# ---- ESFT -------------------------------------------------------------------------------------------


def esft_trace():
    """One layer, top-2. sw: sample 0 = one token, sample 1 = three tokens; en tokens must not count."""
    ids = [[(0, 1), (0, 2), (1, 2), (0, 1), (3, 2)]]
    w = [[(0.75, 0.25), (0.5, 0.5), (0.6, 0.4), (0.9, 0.1), (0.7, 0.3)]]
    return make_trace(ids, [1, 1, 1, 1, 0], weights=w, sample=[0, 1, 1, 1, 2])


def test_esft_relevance_is_the_per_sample_mean_of_eqs_6_and_7():
    trace = esft_trace()
    sw = trace.language_mask("sw")
    gate = [(0.75 + (0.5 + 0.9) / 3) / 2, (0.25 + (0.6 + 0.1) / 3) / 2, ((0.5 + 0.4) / 3) / 2, 0.0]
    np.testing.assert_allclose(relevance(trace, sw, "gate"), [gate], rtol=1e-6)
    # token: 1(selected) / K, K = 2: sample 0 gives (1/2, 1/2, 0, 0), sample 1 (1/3, 1/3, 1/3, 0)
    token = relevance(trace, sw, "token")
    np.testing.assert_allclose(token, [[5 / 12, 5 / 12, 1 / 6, 0.0]])
    assert token.sum() == pytest.approx(1.0)


def test_entry_threshold_is_the_running_sum_before_each_expert():
    scores = np.array([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.5, 0.0]])
    np.testing.assert_allclose(entry_threshold(scores), [[0.95, 0.0, 0.8, 0.5], [0.5, 0.75, 0.0, 1.0]])


def token_trace(counts):
    """One layer, top-1, one sample: expert i gets counts[i] of the sw tokens (token ratio = count / total)."""
    ids = np.repeat(np.arange(len(counts)), counts)[None, :, None]
    return make_trace(ids, np.ones(ids.shape[1], int), sample=np.zeros(ids.shape[1], int))


@pytest.mark.parametrize("top_p, expected", [
    (0.2, [0]),  # 0.5 ≥ 0.2 after the first expert
    (0.5, [0]),  # reaching top_p exactly stops
    (0.6, [0, 1]),  # 0.5 < 0.6: the expert crossing the threshold (0.5 -> 0.8) is included
    (0.8, [0, 1]),  # 0.5 + 0.3 reaches 0.8 despite floating-point sums
    (0.81, [0, 1, 2]),
    (1.0, [0, 1, 2, 3]),
])
def test_esft_threshold_includes_the_expert_that_crosses_it(top_p, expected):
    sel = select(token_trace([10, 6, 3, 1]), "esft", "sw", top_p=top_p)  # ratios 0.5, 0.3, 0.15, 0.05
    assert sel.experts["model.layers.0.mlp"] == expected
    assert sel.budget == len(expected) and sel.params["top_p"] == top_p


def test_esft_default_thresholds_are_the_papers():
    trace = token_trace([10, 6, 3, 1])
    assert select(trace, "esft", "sw").params["top_p"] == 0.2
    assert select(trace, "esft", "sw", score="gate").params["top_p"] == 0.1


def test_esft_never_adds_experts_with_zero_relevance():
    # gate scores of a router whose top-k weights sum to 0.3: no set reaches top_p = 0.5
    ids = [[(0, 1), (0, 2), (0, 1)]]
    trace = make_trace(ids, [1, 1, 1], weights=np.full((1, 3, 2), 0.15), num_experts=[6])
    assert select(trace, "esft", "sw", score="gate", top_p=0.5).experts["model.layers.0.mlp"] == [0, 1, 2]


def test_esft_with_a_budget_matches_its_threshold_selection():
    trace = random_trace(seed=3, L=4, E=16)
    for top_p in (0.1, 0.2, 0.35, 0.5, 0.8):
        by_threshold = select(trace, "esft", "sw", top_p=top_p)
        by_budget = select(trace, "esft", "sw", by_threshold.count)
        assert by_budget.experts == by_threshold.experts
        assert by_budget.params["mode"] == "budget" and by_budget.budget == by_threshold.count


def test_esft_budget_and_top_p_together_is_an_error():
    with pytest.raises(ConfigError, match="not both"):
        select(esft_trace(), "esft", "sw", 2, top_p=0.3)


# ---- baselines --------------------------------------------------------------------------------------


def test_random_is_reproducible_by_seed_and_differs_across_seeds():
    trace = random_trace(L=4, E=16)
    a, b = select(trace, "random", "sw", 20, seed=7), select(trace, "random", "sw", 20, seed=7)
    assert a == b
    assert chosen(a) != chosen(select(trace, "random", "sw", 20, seed=8))
    assert a.count == len(chosen(a)) == 20


def test_random_spreads_the_budget_uniformly_and_respects_each_layers_experts():
    trace = random_trace(L=3, E=8)
    trace.num_experts = np.array([8, 4, 4])  # layers 1 and 2 have experts 0-3 only
    counts = np.array([[len(ids) for ids in select(trace, "random", "sw", 4, seed=s).experts.values()]
                       for s in range(400)])  # (seeds, L)
    assert (counts.sum(1) == 4).all()
    np.testing.assert_allclose(counts.mean(0), [4 * 8 / 16, 4 * 4 / 16, 4 * 4 / 16], atol=0.15)
    for s in range(20):
        sel = select(trace, "random", "sw", 16, seed=s)  # every expert
        assert [len(ids) for ids in sel.experts.values()] == [8, 4, 4]


def test_topk_takes_the_targets_most_activated_experts_over_all_layers():
    # sw activation frequencies: layer 0 (1, 1, 0, 0), layer 1 (0.5, 0.5, 0.5, 0.5), en ignored
    ids = [[(0, 1), (0, 1), (2, 3)], [(0, 1), (2, 3), (0, 1)]]
    trace = make_trace(ids, [1, 1, 0], num_experts=[4, 4])
    sel = select(trace, "topk", "sw", 3)
    assert chosen(sel) == {(0, 0), (0, 1), (1, 0)}  # the 0.5 tie goes to the lowest expert id
    assert sel.scores["model.layers.1.mlp"] == [0.5, 0.5, 0.5, 0.5]


# ---- shared contract --------------------------------------------------------------------------------

NEEDS_BUDGET = [m for m in SELECTORS.names() if SELECTORS.get(m).needs_budget]
BUDGETED = [m for m in SELECTORS.names() if not SELECTORS.get(m).per_layer]  # per-layer ones: moekit.selection.oneshot


@pytest.mark.parametrize("method", BUDGETED)
def test_unknown_target_is_one_config_error(method):
    with pytest.raises(ConfigError, match="'xx' is not in the trace"):
        select(random_trace(), method, "xx", 4)


@pytest.mark.parametrize("method", BUDGETED)
@pytest.mark.parametrize("budget", [0, 8 * 16 + 1])
def test_budget_outside_the_expert_count_is_one_config_error(method, budget):
    with pytest.raises(ConfigError, match="between 1 and the 128 experts"):
        select(random_trace(), method, "sw", budget)


@pytest.mark.parametrize("method", NEEDS_BUDGET)
def test_methods_with_a_budget_need_one(method):
    with pytest.raises(ConfigError, match="needs a budget"):
        select(random_trace(), method, "sw")


def test_unknown_method_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="ean, esft, random, reap, rise, topk, usage"):
        select(random_trace(), "magic", "sw", 4)


@pytest.mark.parametrize("method", BUDGETED)
def test_selection_has_every_layer_scores_per_expert_and_round_trips(method, tmp_path):
    trace = random_trace(L=4, E=16)
    sel = select(trace, method, "sw", 12)
    assert list(sel.experts) == list(sel.scores) == trace.layers
    assert all(len(s) == 16 for s in sel.scores.values())
    assert all(ids == sorted(set(ids)) and all(0 <= e < 16 for e in ids) for ids in sel.experts.values())
    assert sel.count == sel.budget == 12 and sel.target == "sw" and sel.method == method
    assert Selection.load(sel.save(tmp_path / "s.json")) == sel
