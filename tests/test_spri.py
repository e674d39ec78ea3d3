"""SPRI: SVD-partitioned residual experts."""
from __future__ import annotations

import itertools

import pytest
import torch

from moekit.config import validate
from moekit.errors import ConfigError
from moekit.init.spri import svd_blocks
from moekit.moe.diversity import diversity, expert_diversity
from moekit.moe import MoESpec, moe_layers
from moekit.testing import TINY_MODELS, logits, tiny_inputs, tiny_llama
from moekit.checkpoint.upcycle_model import upcycle


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


# ------------------------------------------------------------------ svd_blocks


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16)])  # wide, tall, square
@pytest.mark.parametrize("groups", [1, 3, 4])
def test_svd_blocks(shape, groups):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    blocks = svd_blocks(w, groups)
    assert len(blocks) == groups
    assert all(b.dtype == torch.float64 and b.shape == shape for b in blocks)
    w64 = w.double()
    assert (torch.stack(blocks).sum(0) - w64).abs().max() <= 1e-10
    for a, b in itertools.combinations(blocks, 2):
        assert abs((a * b).sum()) / (a.norm() * b.norm()) < 1e-10  # Frobenius-orthogonal
    r = min(shape)
    sizes = [len(c) for c in torch.tensor_split(torch.arange(r), groups)]
    sv = torch.linalg.svdvals(w64)  # descending
    start = 0
    for b, size in zip(blocks, sizes):
        assert torch.linalg.matrix_rank(b).item() == size
        # block g holds the g-th contiguous run of singular values (largest first)
        torch.testing.assert_close(torch.linalg.svdvals(b)[:size], sv[start:start + size], atol=1e-10, rtol=1e-10)
        start += size


# ------------------------------------------------------------------ the SPRI layer


def _spri(model=None, E=8, k=2, **init):
    model = model if model is not None else tiny_llama()
    spec = validate(MoESpec, {"num_experts": E, "top_k": k, "shared_expert": True,
                              "init": {"method": "spri", **init}})
    return upcycle(model, spec)


@pytest.mark.parametrize("E,k", [(8, 2), (8, 4), (6, 3)])
def test_groups_are_orthogonal_and_members_nearly_identical(E, k):
    moe = _spri(E=E, k=k)
    for _, m in moe_layers(moe):
        down = m.experts.down
        for i, j in itertools.combinations(range(E), 2):
            c = _cos(down[i], down[j])
            if i // k == j // k:
                assert c > 1 - 1e-3, (i, j, c)
            else:
                assert abs(c) < 1e-3, (i, j, c)
        # same-group pairs / all pairs
        same = (E // k) * k * (k - 1) // 2
        assert expert_diversity(down) == pytest.approx(1 - same / (E * (E - 1) / 2), abs=1e-3)


def test_diversity_e8_k2():
    assert diversity(_spri(E=8, k=2)) == pytest.approx(1 - 4 / 28, abs=1e-3)


def test_residual_closed_form_and_copies():
    dense = tiny_llama()
    mlps = [b.mlp for b in dense.model.layers]
    W = [(m.gate_proj.weight.detach().clone(), m.up_proj.weight.detach().clone(),
          m.down_proj.weight.detach().clone()) for m in mlps]
    rho, E, k = 1e-2, 8, 2
    moe = _spri(dense, E=E, k=k, rho=rho, eps=0.0)
    for (gate, up, down), (_, m) in zip(W, moe_layers(moe)):
        ex = m.experts
        blocks = svd_blocks(down, E // k)
        for i in range(E):
            r = blocks[i // k]
            expected = rho * down.double().norm() / (r.norm() + 1e-12) * r
            torch.testing.assert_close(ex.down[i], expected.float(), atol=1e-9, rtol=1e-5)
            assert ex.down[i].double().norm().item() == pytest.approx(rho * down.double().norm().item(), rel=1e-5)
            assert torch.equal(ex.gate_up[i], torch.cat([gate, up]))  # gate/up copied
        sh = m.shared  # the shared expert is the dense FFN
        assert torch.equal(sh.gate_proj.weight, gate) and torch.equal(sh.up_proj.weight, up)
        assert torch.equal(sh.down_proj.weight, down)


@pytest.mark.parametrize("placement", ["gate", "up"])
def test_placement_gate_up(placement):
    dense = tiny_llama()
    mlp = dense.model.layers[0].mlp
    gate, up, down = (lin.weight.detach().clone() for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    target = {"gate": gate, "up": up}[placement]
    moe = _spri(dense, E=4, k=2, rho=0.1, eps=0.0, placement=placement)
    ex = moe_layers(moe)[0][1].experts
    I = ex.intermediate_size
    blocks = svd_blocks(target, 2)
    for i in range(4):
        g_i, u_i = ex.gate_up[i, :I], ex.gate_up[i, I:]
        resid, copied = (g_i, u_i) if placement == "gate" else (u_i, g_i)
        r = blocks[i // 2]
        torch.testing.assert_close(resid, (0.1 * target.double().norm() / (r.norm() + 1e-12) * r).float(),
                                   atol=1e-8, rtol=1e-5)
        assert torch.equal(copied, gate if placement == "up" else up)
        assert torch.equal(ex.down[i], down)
    # experts of different groups are orthogonal in the placement matrix
    part = slice(0, I) if placement == "gate" else slice(I, 2 * I)
    assert abs(_cos(ex.gate_up[0, part], ex.gate_up[2, part])) < 1e-6


def test_placement_gate_needs_a_gated_ffn():
    with pytest.raises(ConfigError, match="gated"):
        _spri(TINY_MODELS["gpt2"](), E=4, k=2, placement="gate")


@pytest.mark.parametrize("family", ["llama", "gpt2", "whisper"])
def test_rho_zero_equals_dense(family):
    dense = TINY_MODELS[family]()
    with torch.no_grad():  # non-zero biases: the dense down bias must not be added twice
        for name, p in dense.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    inputs = tiny_inputs(dense)
    ref = logits(dense, inputs)
    moe = _spri(dense, E=4, k=2, rho=0.0, eps=0.0)
    assert (logits(moe, inputs) - ref).abs().max() <= 1e-5


def test_small_rho_is_close_to_dense_and_differs():
    dense = tiny_llama()
    inputs = tiny_inputs(dense)
    ref = logits(dense, inputs)
    out = logits(_spri(dense, E=4, k=2), inputs)  # default rho = 1e-3
    diff = (out - ref).abs().max().item()
    assert 0 < diff < 1e-2


@pytest.mark.parametrize("E,k", [(6, 4), (5, 2)])
def test_num_experts_must_be_divisible_by_top_k(E, k):
    with pytest.raises(ConfigError, match="divisible"):
        validate(MoESpec, {"num_experts": E, "top_k": k, "shared_expert": True, "init": "spri"})


def test_dense_as_routed_expert_zero_is_dense_and_the_rest_form_groups():
    """Table 3 / A.3 'w/o shared expert': expert 0 is the dense FFN, experts 1..E-1 the residual experts in
    G = (E-1)/k orthogonal groups."""
    dense = tiny_llama()
    down0 = [b.mlp.down_proj.weight.detach().clone() for b in dense.model.layers]
    E, k = 5, 2
    moe = upcycle(dense, validate(MoESpec, {"num_experts": E, "top_k": k, "init": {"method": "spri", "dense_as": "routed"}}))
    for down, (_, m) in zip(down0, moe_layers(moe)):
        assert m.shared is None and torch.equal(m.experts.down[0], down)
        res = m.experts.down[1:]
        for i, j in itertools.combinations(range(E - 1), 2):
            c = _cos(res[i], res[j])
            assert (c > 1 - 1e-3) if i // k == j // k else (abs(c) < 1e-3), (i, j, c)


# ------------------------------------------------------------------ target_diversity, group_size (issue 30)


def test_target_diversity_eps_by_hand():
    """SPRI Table 1's 88.02 % at E = 8, k = 2: s = 4/28 same-group pairs, eps = √(s/(1 − D) − 1), by hand
    √(0.142857/0.1198 − 1) = √0.192465 = 0.43871; the default eps = 0.01 gives 1 − (4/28)/1.0001 = 0.857157."""
    from moekit.init.spri import SPRIInit

    spec = validate(MoESpec, {"num_experts": 8, "top_k": 2, "shared_expert": True, "init": "spri"})
    assert SPRIInit(target_diversity=0.8802).noise_scale(spec) == pytest.approx(0.43871, abs=1e-5)
    assert SPRIInit().noise_scale(spec) == 0.01
    assert 1 - SPRIInit().same_group_share(spec) / (1 + 0.01 ** 2) == pytest.approx(0.857157, abs=1e-6)


def test_target_diversity_is_measured():
    """The upcycled experts' diversity (SPRI A.1, mean over layers) is the one asked for: 0.8802 (Table 1)
    where the default eps gives 0.857."""
    model = tiny_llama(hidden_size=64, intermediate_size=256)
    moe = _spri(model, E=8, k=2, target_diversity=0.8802)
    assert diversity(moe) == pytest.approx(0.8802, abs=4e-3)
    assert diversity(_spri(tiny_llama(hidden_size=64, intermediate_size=256), E=8, k=2)) == pytest.approx(
        0.857157, abs=1e-3)


@pytest.mark.parametrize("bad", [0.85, 1 - 4 / 28])
def test_target_diversity_below_the_eps_zero_floor_is_refused(bad):
    with pytest.raises(ConfigError, match="must exceed"):
        validate(MoESpec, {"num_experts": 8, "top_k": 2, "shared_expert": True,
                           "init": {"method": "spri", "target_diversity": bad}})


def test_target_diversity_needs_the_shared_dense_expert():
    with pytest.raises(ConfigError, match="closed form"):
        validate(MoESpec, {"num_experts": 9, "top_k": 2, "init": {"method": "spri", "dense_as": "routed",
                                                                  "target_diversity": 0.9}})


def test_no_shared_at_equal_active_parameters():
    """'w/o shared expert' at equal active parameters (A.3, our second reading): 9 routed experts, top-3,
    group_size 2 keeps the 4 groups of 2 of the model with a shared expert; the residual experts equal that
    model's routed experts, and 3 FFNs run per token in both."""
    from moekit.routing.sites import param_counts

    shared = _spri(tiny_llama(), E=8, k=2, eps=0.0)
    spec = validate(MoESpec, {"num_experts": 9, "top_k": 3, "init": {"method": "spri", "dense_as": "routed",
                                                                     "group_size": 2, "eps": 0.0}})
    routed = upcycle(tiny_llama(), spec)
    for (_, a), (_, b) in zip(moe_layers(shared), moe_layers(routed)):
        assert torch.equal(b.experts.down[0], a.shared.down_proj.weight)  # the dense FFN, now routed
        assert torch.equal(b.experts.down[1:], a.experts.down)
    (tot_a, act_a), (tot_b, act_b) = param_counts(shared), param_counts(routed)
    router_row = 32 * len(moe_layers(shared))  # one more router row of hidden size per MoE layer
    assert act_b - act_a == router_row and tot_b - tot_a == router_row


def test_group_size_must_divide_the_residual_experts():
    with pytest.raises(ConfigError, match="divisible by group_size"):
        validate(MoESpec, {"num_experts": 9, "top_k": 3, "init": {"method": "spri", "dense_as": "routed",
                                                                  "group_size": 3}})
