"""Router aux losses against hand-computed values."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from moekit.moe.losses import layer_stats, load_balance, z_loss
from moekit.moe.router import RoutingInfo

LN3, LN9 = math.log(3.0), math.log(9.0)

# 3 tokens, 2 experts. softmax rows: [.75, .25], [.25, .75], [.9, .1]
LOGITS = torch.tensor([[LN3, 0.0], [0.0, LN3], [LN9, 0.0]])
# P = mean probs = [1.9/3, 1.1/3]; argmax experts = [0, 1, 0] -> f = [2/3, 1/3]


def _info(logits, ids) -> RoutingInfo:
    ids = torch.as_tensor(ids)
    return RoutingInfo(logits=logits, topk_ids=ids, topk_weights=torch.ones(ids.shape))


def test_load_balance_argmax_by_hand():
    info = _info(LOGITS, [[1], [1], [0]])  # top-k choices ignored by the argmax variant
    # 2 · (2/3 · 1.9/3 + 1/3 · 1.1/3) = 9.8/9
    assert load_balance(info, variant="argmax").item() == pytest.approx(9.8 / 9, abs=1e-6)


def test_load_balance_omni_router_by_hand():
    """Omni-router eqs. 3.3-3.5: f from the argmax, ρ_j = (1/T) Σ over the tokens whose argmax is j of P_ij."""
    info = _info(LOGITS, [[1], [1], [0]])
    # f = [2/3, 1/3]; ρ = [(.75 + .9)/3, .75/3] = [.55, .25]; 2 · (2/3 · .55 + 1/3 · .25) = 0.9
    assert load_balance(info, variant="omni").item() == pytest.approx(0.9, abs=1e-6)
    logits = LOGITS.clone().requires_grad_()
    load_balance(_info(logits, [[0], [1], [0]]), variant="omni").backward()
    # d/dl_tj of E·f_a(t)·p_t,a(t)/T with a(t) the argmax: (E/T) f_a p_ta (δ_ja − p_tj)
    p, f = torch.softmax(LOGITS, -1), torch.tensor([2 / 3, 1 / 3])
    a = p.argmax(-1)
    expected = (2 / 3) * f[a][:, None] * p.gather(1, a[:, None]) * (torch.nn.functional.one_hot(a, 2) - p)
    torch.testing.assert_close(logits.grad, expected)


def test_load_balance_topk_by_hand():
    info = _info(LOGITS, [[1], [1], [0]])  # f = [1/3, 2/3]
    # 2 · (1/3 · 1.9/3 + 2/3 · 1.1/3) = 8.2/9
    assert load_balance(info).item() == pytest.approx(8.2 / 9, abs=1e-6)
    assert load_balance(info, variant="topk").item() == pytest.approx(8.2 / 9, abs=1e-6)


def test_load_balance_topk_counts_every_slot():
    # 2 tokens, 3 experts, k = 2. probs: token0 = [.5, .25, .25], token1 = [.25, .25, .5]
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0], [0.0, 0.0, math.log(2.0)]])
    info = _info(logits, [[0, 1], [2, 1]])  # f = [1/4, 2/4, 1/4], P = [3/8, 2/8, 3/8]
    # 3 · (1/4 · 3/8 + 2/4 · 2/8 + 1/4 · 3/8) = 3 · 10/32
    assert load_balance(info).item() == pytest.approx(30 / 32, abs=1e-6)
    # argmax: [0, 2] -> f = [1/2, 0, 1/2]: 3 · (3/16 + 3/16) = 18/16
    assert load_balance(info, variant="argmax").item() == pytest.approx(18 / 16, abs=1e-6)


def test_z_loss_by_hand():
    info = _info(LOGITS, [[0], [1], [0]])
    # logsumexp rows: ln 4, ln 4, ln 10
    expected = (2 * math.log(4.0) ** 2 + math.log(10.0) ** 2) / 3
    assert z_loss(info).item() == pytest.approx(expected, abs=1e-5)
    assert z_loss(_info(torch.zeros(5, 4), torch.zeros(5, 1, dtype=torch.long))).item() == pytest.approx(
        math.log(4.0) ** 2, abs=1e-6)


def test_uniform_routing_gives_exactly_one():
    # uniform router probabilities: any assignment gives E · Σ f_i / E = 1
    info = _info(torch.zeros(8, 4), torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 0], [1, 1], [2, 2], [3, 0]]))
    assert torch.equal(load_balance(info), torch.tensor(1.0))
    assert torch.equal(load_balance(info, variant="argmax"), torch.tensor(1.0))
    # uniform assignment fractions: E · Σ P_i / E = Σ P_i = 1 whatever the logits
    logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    balanced = _info(logits, torch.tensor([[0, 1], [2, 3]] * 4))
    assert load_balance(balanced).item() == pytest.approx(1.0, abs=1e-6)


def test_load_balance_is_minimal_at_uniform_and_larger_when_collapsed():
    collapsed = _info(torch.tensor([[5.0, 0.0]] * 4), [[0]] * 4)
    assert load_balance(collapsed).item() > 1.9  # -> E = 2 when all mass and all tokens go to one expert


def test_masked_tokens_are_excluded():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 4, generator=g)
    ids = torch.topk(logits, 2, dim=-1).indices
    # padding at positions 2 and 5, given as a (B, L) attention mask
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    keep = torch.tensor([0, 1, 3, 4])
    sub = _info(logits[keep], ids[keep])
    full = _info(logits, ids)
    # equal up to float32 rounding: the mask weights the padding by 0 in the sums (no boolean indexing, which
    # would read the kept count back to the host) rather than leaving it out
    same = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=0)
    for variant in ("topk", "argmax", "omni"):
        same(load_balance(full, mask, variant=variant), load_balance(sub, variant=variant))
        assert load_balance(full, mask, variant=variant) != load_balance(full, variant=variant)
    same(z_loss(full, mask), z_loss(sub))
    assert z_loss(full, mask) != z_loss(full)
    same(z_loss(full, mask.bool().reshape(-1)), z_loss(sub))
    # everything masked: 0, not NaN
    none = torch.zeros(6)
    assert load_balance(full, none).item() == 0.0 and z_loss(full, none).item() == 0.0


def test_masked_padding_values_do_not_matter():
    logits = torch.tensor([[LN3, 0.0], [0.0, LN3], [LN9, 0.0], [100.0, -100.0]])
    info = _info(logits, [[1], [1], [0], [0]])
    mask = torch.tensor([1, 1, 1, 0])
    assert load_balance(info, mask).item() == pytest.approx(8.2 / 9, abs=1e-6)
    assert z_loss(info, mask).item() == pytest.approx((2 * math.log(4.0) ** 2 + math.log(10.0) ** 2) / 3, abs=1e-5)


def test_losses_are_differentiable_in_the_logits():
    logits = LOGITS.clone().requires_grad_()
    z_loss(_info(logits, [[0], [1], [0]])).backward()
    # d/dl (lse(l))² / T = 2·lse·softmax / T
    expected = 2 * torch.logsumexp(LOGITS, -1, keepdim=True) * torch.softmax(LOGITS, -1) / 3
    torch.testing.assert_close(logits.grad, expected)
    logits.grad = None
    load_balance(_info(logits, [[1], [1], [0]])).backward()
    # E · Σ_i f_i ∂P_i/∂l_tj with P = mean softmax: (E/T) · p_tj (f_j − Σ_i f_i p_ti)
    p, f = torch.softmax(LOGITS, -1), torch.tensor([1 / 3, 2 / 3])
    expected = (2 / 3) * p * (f - (p * f).sum(-1, keepdim=True))
    torch.testing.assert_close(logits.grad, expected)


def _random_infos(L, T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    infos = []
    for _ in range(L):
        logits = torch.randn(T, E, generator=g).requires_grad_()
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        infos.append(RoutingInfo(logits=logits, topk_ids=ids, topk_weights=torch.ones(T, k)))
    return infos


@pytest.mark.parametrize("variant", ["topk", "argmax", "omni"])
def test_layer_stats_equals_the_per_layer_losses_and_usage(variant):
    """layer_stats computes same-shaped layers together; each layer's values (and gradients) are the per-layer
    functions': a decoder's 3 layers of T = 10 tokens (masked) and an encoder's 2 layers of 7 frames with another E
    (unmasked: the mask is over 10 tokens), interleaved, come back in layer order."""
    dec, enc = _random_infos(3, 10, 5, 2, 0), _random_infos(2, 7, 6, 3, 1)
    infos = [dec[0], enc[0], dec[1], dec[2], enc[1]]
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0, 0.0])
    stats = layer_stats(infos, mask, variant)
    for i, info in enumerate(infos):
        m = mask if info.logits.shape[0] == 10 else None
        torch.testing.assert_close(stats["lb"][i], load_balance(info, m, variant), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stats["z"][i], z_loss(info, m), rtol=1e-6, atol=1e-7)
        frac = info.tokens_per_expert(m).double() / info.tokens_per_expert(m).sum()
        entropy = -(frac * frac.clamp_min(1e-12).log()).sum()
        assert stats["usage_entropy"][i].item() == pytest.approx(entropy.item(), abs=1e-6)
        assert stats["max_load"][i].item() == pytest.approx(frac.max().item(), abs=1e-7)
    (stats["lb"].sum() + stats["z"].sum()).backward()
    batched = [i.logits.grad.clone() for i in infos]
    for info in infos:
        info.logits.grad = None
    sum(load_balance(i, mask if i.logits.shape[0] == 10 else None, variant)
        + z_loss(i, mask if i.logits.shape[0] == 10 else None) for i in infos).backward()
    for a, info in zip(batched, infos):
        torch.testing.assert_close(a, info.logits.grad, rtol=1e-5, atol=1e-7)


def test_layer_stats_costs_the_same_device_ops_for_any_number_of_layers():
    """What a training step pays for its router statistics does not grow with the MoE layers (it did: 56 aten ops
    per layer in the forward): the same aten ops for 2 layers as for 12."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    counted = []
    for L in (2, 12):
        infos = _random_infos(L, 9, 4, 2, L)
        with Ops() as ops:
            layer_stats(infos, torch.ones(9))
        counted.append(ops.ops)
    assert counted[0] == counted[1] and len(counted[0]) < 80  # views and allocations included
