"""Drop-Upcycling, naive copies and noise: which entries change, and by how much."""
from __future__ import annotations

import pytest
import torch

from moekit.config import validate
from moekit.moe.diversity import diversity
from moekit.moe import MoESpec, moe_layers
from moekit.testing import tiny_gpt2, tiny_llama
from moekit.checkpoint.upcycle_model import upcycle

E = 4


def _upcycle(model, init, E=E, k=2):
    return upcycle(model, validate(MoESpec, {"num_experts": E, "top_k": k, "init": init}))


def _changed_rows(a: torch.Tensor, b: torch.Tensor) -> set[int]:
    return set(torch.nonzero((a != b).any(dim=1)).flatten().tolist())


def _llama_dense():
    dense = tiny_llama()
    return dense, [tuple(lin.weight.detach().clone() for lin in (b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj))
                   for b in dense.model.layers]


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.3, 0.5, 1.0])
def test_drop_gated_same_index_set_everywhere(ratio):
    dense, weights = _llama_dense()
    moe = _upcycle(dense, {"method": "drop", "ratio": ratio})
    I = 64
    n = round(ratio * I)
    for (gate, up, down), (_, m) in zip(weights, moe_layers(moe)):
        ex = m.experts
        sets = []
        for e in range(E):
            g_e, u_e, d_e = ex.gate_up[e, :I], ex.gate_up[e, I:], ex.down[e]
            s_gate, s_up, s_down = _changed_rows(g_e, gate), _changed_rows(u_e, up), _changed_rows(d_e.T, down.T)
            assert len(s_gate) == n
            assert s_gate == s_up == s_down  # rows of gate and up, columns of down
            keep = torch.tensor([i for i in range(I) if i not in s_gate], dtype=torch.long)
            assert torch.equal(g_e[keep], gate[keep]) and torch.equal(u_e[keep], up[keep])
            assert torch.equal(d_e[:, keep], down[:, keep])
            if n:  # re-initialized entries: no dense value survives
                drop = torch.tensor(sorted(s_gate))
                assert (g_e[drop] != gate[drop]).float().mean() > 0.99
                assert (d_e[:, drop] != down[:, drop]).float().mean() > 0.99
            sets.append(frozenset(s_gate))
        if 0 < n < I:
            assert len(set(sets)) > 1  # each expert draws its own index set


def test_drop_resamples_from_the_dense_statistics():
    dense, weights = _llama_dense()
    moe = _upcycle(dense, {"method": "drop", "ratio": 0.5})
    I = 64
    for (gate, up, down), (_, m) in zip(weights, moe_layers(moe)):
        ex = m.experts
        for e in range(E):
            for new, old, rows in ((ex.gate_up[e, :I], gate, True), (ex.gate_up[e, I:], up, True),
                                   (ex.down[e], down, False)):
                a, b = (new, old) if rows else (new.T, old.T)
                drop = torch.tensor(sorted(_changed_rows(a, b)))
                vals = a[drop].detach()
                assert vals.std().item() == pytest.approx(old.std().item(), rel=0.15)
                assert abs(vals.mean().item() - old.mean().item()) < 0.2 * old.std().item()


def test_drop_non_gated_with_biases():
    dense = tiny_gpt2()
    with torch.no_grad():
        for name, p in dense.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    dense_w = [(b.mlp.c_fc.weight.detach().T.clone(), b.mlp.c_fc.bias.detach().clone(),
                b.mlp.c_proj.weight.detach().T.clone(), b.mlp.c_proj.bias.detach().clone())
               for b in dense.transformer.h]
    moe = _upcycle(dense, {"method": "drop", "ratio": 0.25})
    I = 128
    for (up, up_b, down, down_b), (_, m) in zip(dense_w, moe_layers(moe)):
        ex = m.experts
        for e in range(E):
            s_up, s_down = _changed_rows(ex.up[e], up), _changed_rows(ex.down[e].T, down.T)
            assert s_up == s_down and len(s_up) == round(0.25 * I)
            idx = torch.tensor(sorted(s_up))
            keep = torch.tensor([i for i in range(I) if i not in s_up])
            assert torch.count_nonzero(ex.first_bias[e, idx]) == 0  # dropped neurons' biases are zeroed
            assert torch.equal(ex.first_bias[e, keep], up_b[keep])
            assert torch.equal(ex.down_bias[e], down_b)  # the output bias is kept


def test_naive_copies_have_zero_diversity():
    dense, weights = _llama_dense()
    moe = _upcycle(dense, "naive")
    assert abs(diversity(moe)) < 1e-12
    for (gate, up, down), (_, m) in zip(weights, moe_layers(moe)):
        for e in range(E):
            assert torch.equal(m.experts.gate_up[e], torch.cat([gate, up])) and torch.equal(m.experts.down[e], down)


def test_drop_diversity_grows_with_ratio():
    d1 = diversity(_upcycle(tiny_llama(), {"method": "drop", "ratio": 0.1}))
    d5 = diversity(_upcycle(tiny_llama(), {"method": "drop", "ratio": 0.5}))
    assert 0 < d1 < d5


@pytest.mark.parametrize("ratio", [0.2, 0.5])
def test_noise_perturbs_a_ratio_of_entries(ratio):
    dense, weights = _llama_dense()
    moe = _upcycle(dense, {"method": "noise", "ratio": ratio, "std": 0.01})
    assert diversity(moe) > 0
    changed = total = 0
    for (gate, up, down), (_, m) in zip(weights, moe_layers(moe)):
        for e in range(E):
            ref = torch.cat([gate, up])
            diff_first = m.experts.gate_up[e] != ref
            diff_down = m.experts.down[e] != down
            changed += int(diff_first.sum() + diff_down.sum())
            total += diff_first.numel() + diff_down.numel()
            # small: N(0, (0.01·σ_W)²) on the perturbed entries
            delta = (m.experts.down[e] - down)[diff_down]
            assert delta.std().item() == pytest.approx(0.01 * down.std().item(), rel=0.15)
    assert changed / total == pytest.approx(ratio, abs=0.01)


@pytest.mark.parametrize("init", [{"method": "noise", "std": 0.1, "placement": "down"},
                                  {"method": "drop", "ratio": 0.5, "placement": "down"}])
def test_down_placement_changes_only_the_down_projection(init):
    """SPRI Table 3's down-only variants: gate and up stay exact copies, every expert's down differs."""
    dense, weights = _llama_dense()
    moe = _upcycle(dense, init)
    for (gate, up, down), (_, m) in zip(weights, moe_layers(moe)):
        for e in range(E):
            assert torch.equal(m.experts.gate_up[e], torch.cat([gate, up]))
            assert not torch.equal(m.experts.down[e], down)


@pytest.mark.parametrize("method, init, closed_form", [
    ("noise", {"ratio": 0.5, "std": 0.5}, 0.125 / 1.125),  # r·s² / (1 + r·s²)
    ("noise", {"ratio": 1.0, "std": 0.3}, 0.09 / 1.09),
    ("drop", {"ratio": 0.5}, 1 - 0.5 ** 2),  # 1 − (1 − r)²
    ("drop", {"ratio": 0.9}, 1 - 0.1 ** 2),
])
def test_diversity_at_init_follows_the_closed_form(method, init, closed_form):
    """bench/spri_calibration.py's closed forms (SPRI Table 1 calibration), on a wider tiny model (I = 256)."""
    moe = _upcycle(tiny_llama(intermediate_size=256), {"method": method, **init}, E=8)
    from moekit.moe.diversity import init_diversity

    assert init_diversity(moe) == pytest.approx(closed_form, rel=0.08)
