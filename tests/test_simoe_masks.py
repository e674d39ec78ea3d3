"""SIMoE mask variants of the paper's ablations (issue 30): real-valued masks without the sparsity
constraint (Table 4 (c)) and full-granular masks, one gate per weight entry (appendix C.1).

The SIMoE config names them: `simoe.masks: real` and `simoe.mask_granularity: parameter`."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moekit import simoe
from moekit.simoe import hard_concrete as hc
from moekit.simoe.analysis import nonzero_fractions, overlaps
from moekit.simoe.layer import MaskInit, Routing, SILinear, SINorm
from moekit.simoe.objective import constrained, density, dual_step, orthogonality, penalty
from moekit.testing import logits, tiny_inputs, tiny_llama

CFG = simoe.SIMoEConfig(num_experts=4, router_hidden=16)


KEYS = {"kind": "masks", "granularity": "mask_granularity"}


def upcycled(**variant):
    return simoe.simoe_upcycle(tiny_llama(), CFG.model_copy(update={KEYS[k]: v for k, v in variant.items()}))


# --- (c): real-valued masks, no sparsity constraint ---

def test_real_masks_start_at_the_hard_concrete_median_gates():
    """Both start from the same model: the real masks are the median gates of the same log α draws."""
    a = SILinear(nn.Linear(6, 5), 3, MaskInit(0.05, 0.01, torch.Generator().manual_seed(1)), Routing())
    b = SILinear(nn.Linear(6, 5), 3, MaskInit(0.05, 0.01, torch.Generator().manual_seed(1), kind="real"), Routing())
    assert b.real and not a.real
    torch.testing.assert_close(b.log_alpha, hc.median(a.log_alpha), rtol=0, atol=0)
    torch.testing.assert_close(b.gate_values(), a.gate_values(), rtol=0, atol=0)


def test_real_masks_take_any_real_value_and_their_gradient_is_the_masks():
    """Values on the full real axis, not clamped to [0, 1]; y = x W_preᵀ + (m ⊙ x) δᵀ, m = Σ α_i z_i with z
    the parameter itself (no median, no clamp)."""
    torch.manual_seed(0)
    routing = Routing()
    lin = nn.Linear(6, 5)
    si = SILinear(lin, 3, MaskInit(0.05, 0.0, torch.Generator(), kind="real"), routing).train()
    si.delta.data.normal_()
    si.log_alpha.data = torch.randn(3, 6) * 2  # negative and > 1 entries
    routing.weights = torch.softmax(torch.randn(2, 3), -1)
    x = torch.randn(2, 4, 6)
    m = routing.weights @ si.log_alpha.detach()  # (B, d_in)
    for b in range(2):
        torch.testing.assert_close(si(x)[b], F.linear(x[b], lin.weight + si.delta * m[b], lin.bias), rtol=1e-6, atol=1e-6)
    si(x).sum().backward()
    # d/dz_i of Σ_b Σ_t (x_bt ⊙ m_b) δᵀ 1 = Σ_b α_bi Σ_t x_bt ⊙ (δᵀ 1)
    expect = torch.einsum("bi,btk,k->ik", routing.weights, x, si.delta.detach().sum(0))
    torch.testing.assert_close(si.log_alpha.grad, expect, rtol=1e-5, atol=1e-5)


def test_real_masks_have_no_constraint():
    """Ablation (c): the penalty is β·orthogonality only, λ stays 0, nothing is pruned; density logs the
    share of non-zero mask entries."""
    model = upcycled(kind="real").train()
    assert not constrained(model)
    x = tiny_inputs(model)
    model(**x)
    for _ in range(3):
        loss, logs = penalty(model)
        torch.testing.assert_close(loss, CFG.ortho * orthogonality(model))
        dual_step(model.simoe)
        assert float(model.simoe.lam) == 0.0 and logs["simoe/violation"] == 0.0
    assert float(density(model)) == 1.0
    first = simoe.si_modules(model)[0][1]
    first.log_alpha.data[:, :3] = 0.0  # exact zeros are the only sparsity real masks have
    share = 3 * first.log_alpha.shape[0] / sum(m.log_alpha.numel() for _, m in simoe.si_modules(model))
    assert float(density(model)) == pytest.approx(1 - share)


def test_real_masks_stay_one_parameter_after_a_training_forward():
    """The gates kept for the orthogonality penalty (last_z) are not registered as parameters: the state
    dict and the optimizer see each mask once (a saved model loads back)."""
    model = upcycled(kind="real").train()
    n = len(list(model.parameters()))
    model(**tiny_inputs(model))
    assert len(list(model.parameters())) == n
    assert not any(k.endswith("last_z") for k in model.state_dict())


def test_real_mask_model_equals_the_pretrained_model_at_init():
    ref_model = tiny_llama().eval()
    x = tiny_inputs(ref_model)
    ref = logits(ref_model, x)
    assert torch.equal(logits(upcycled(kind="real").eval(), x), ref)  # δ = 0


# --- C.1: full-granular masks ---

def test_full_granular_equals_the_explicit_per_instance_weight():
    """y_b = x_b (W_pre + Σ_i α_bi z_i ⊙ δ)ᵀ + b with z_i (d_out, d_in), by hand per instance."""
    torch.manual_seed(0)
    routing = Routing()
    lin = nn.Linear(6, 5)
    si = SILinear(lin, 3, MaskInit(0.05, 0.0, torch.Generator(), granularity="parameter"), routing).eval()
    assert si.per_param and si.log_alpha.shape == (3, 5, 6)
    si.delta.data.normal_()
    si.log_alpha.data.normal_(std=3)
    routing.weights = torch.softmax(torch.randn(2, 3), -1)
    x = torch.randn(2, 4, 6)
    z = hc.median(si.log_alpha)  # (M, d_out, d_in)
    for b in range(2):
        w = lin.weight + si.delta * torch.einsum("i,iok->ok", routing.weights[b], z)
        torch.testing.assert_close(si(x)[b], F.linear(x[b], w, lin.bias), rtol=1e-6, atol=1e-6)


def test_structured_masks_are_full_granular_masks_constant_over_outputs():
    """The defining relation of C.1's comparison: a structured mask z_i (d_in,) is the full-granular mask
    with z_i[o, k] = z_i[k] for every output o, and both compute the same."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 5)
    r1, r2 = Routing(), Routing()
    s = SILinear(lin, 3, MaskInit(0.05, 0.0, torch.Generator()), r1).eval()
    f = SILinear(lin, 3, MaskInit(0.05, 0.0, torch.Generator(), granularity="parameter"), r2).eval()
    s.delta.data.normal_()
    f.delta.data = s.delta.data.clone()
    s.log_alpha.data.normal_(std=3)
    f.log_alpha.data = s.log_alpha.data[:, None, :].expand(3, 5, 6).clone()
    r1.weights = r2.weights = torch.softmax(torch.randn(2, 3), -1)
    x = torch.randn(2, 4, 6)
    torch.testing.assert_close(f(x), s(x), rtol=1e-6, atol=1e-6)


def test_full_granular_norms_keep_one_gate_per_entry():
    norm = nn.LayerNorm(6)
    si = SINorm(norm, 3, MaskInit(0.05, 0.0, torch.Generator(), granularity="parameter"), Routing())
    assert not si.per_param and si.log_alpha.shape == (3, 6)


def test_full_granular_prune_keeps_outputs_and_drops_unused_columns():
    torch.manual_seed(0)
    routing = Routing()
    si = SILinear(nn.Linear(6, 5), 3, MaskInit(0.05, 0.0, torch.Generator(), granularity="parameter"), routing).eval()
    si.delta.data.normal_()
    si.log_alpha.data.normal_(std=3)
    si.log_alpha.data[:, :, 2] = -20.0  # column 2: gate 0 for every expert and output
    routing.weights = torch.softmax(torch.randn(2, 3), -1)
    x = torch.randn(2, 4, 6)
    before = si(x)
    si.prune()
    assert si.delta.shape == (5, 5) and si.log_alpha.shape == (3, 5, 5) and 2 not in si.keep.tolist()
    torch.testing.assert_close(si(x), before, rtol=1e-6, atol=1e-6)
    assert si.full_gates().shape == (3, 5, 6) and (si.full_gates()[:, :, 2] == 0).all()


def test_full_granular_model_objective_and_analysis():
    """At init the model equals the pretrained one; the orthogonality penalty is ‖Z Zᵀ − I‖₂ over the
    flattened per-entry gates; L0 counts every entry once (each gate switches one parameter); the analysis
    counts non-zero entries."""
    ref_model = tiny_llama().eval()
    x = tiny_inputs(ref_model)
    ref = logits(ref_model, x)
    model = upcycled(granularity="parameter")
    assert torch.equal(logits(model.eval(), x), ref)
    model.train()
    model(**x)
    expect = 0.0
    for _, m in simoe.si_modules(model):
        z = m.last_z.detach().flatten(1)
        expect += float(torch.linalg.matrix_norm(z @ z.T - torch.eye(z.shape[0]), ord=2))
    assert float(orthogonality(model)) == pytest.approx(expect, rel=1e-6)
    probs = torch.cat([hc.prob_nonzero(m.log_alpha).flatten() for _, m in simoe.si_modules(model)])
    assert float(density(model, "params")) == pytest.approx(float(probs.mean()), rel=1e-6)
    assert float(density(model, "masks")) == pytest.approx(float(probs.mean()), rel=1e-6)
    lin = next(m for _, m in simoe.si_modules(model) if isinstance(m, SILinear))
    lin.log_alpha.data[0] = -20.0  # expert 0 of this layer: every gate 0
    frac = nonzero_fractions(model)
    total = sum(m.log_alpha.numel() for _, m in simoe.si_modules(model))
    assert frac["overall"] == pytest.approx(1 - lin.log_alpha[0].numel() / total)
    ov = overlaps(model)
    assert ov.shape == (4, 4) and ov[0, 1] < 1.0 and ov[1, 2] == pytest.approx(1.0)


def test_unknown_mask_variants_are_refused():
    with pytest.raises(ValueError, match="kind"):
        MaskInit(0.05, 0.0, torch.Generator(), kind="binary")
    with pytest.raises(ValueError, match="no hard-concrete draws"):
        MaskInit(0.05, 0.0, torch.Generator(), sampled=True, kind="real")
    with pytest.raises(ValueError, match="masks"):
        simoe.SIMoEConfig(masks="binary")


@pytest.mark.parametrize("variant", [{"kind": "real"}, {"granularity": "parameter"}])
def test_variants_merge_into_the_dense_model_of_fixed_routing(variant):
    """merge folds W_pre + δ ⊙ Σ_i w_i z_i for real-valued and per-entry gates alike (§3.2)."""
    torch.manual_seed(0)
    model = upcycled(**variant).eval()
    for _, m in simoe.si_modules(model):
        m.delta.data.normal_(0, 0.02)
        m.log_alpha.data.normal_(0, 2.0)
    x = tiny_inputs(model)
    w = torch.softmax(torch.randn(4), 0)
    with simoe.fixed_routing(model, w):
        fixed = logits(model, x)
    torch.testing.assert_close(logits(simoe.merge(model, w), x), fixed, rtol=0, atol=1e-5)
