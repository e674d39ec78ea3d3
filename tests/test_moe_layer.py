"""Experts (grouped dispatch), Router and MoELayer against naive per-token references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

import moekit.moe.experts as experts_mod
from moekit.moe.ffn import FFNWeights
from moekit.moe import Experts, MoELayer, Router, RoutingInfo, SharedExpert

E, K = 4, 2


def _random_experts(H: int, I: int, gated: bool, bias: bool, act: str, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    m = Experts(E, H, I, act, gated=gated, bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


def _reference(m: Experts, x, ids, w, first, down, first_bias, down_bias):
    """y_t = Σ_j w_tj · FFN_{ids_tj}(x_t), one token and one slot at a time."""
    I = m.intermediate_size
    act = ACT2FN[m.act]
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(x.shape[1])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = first[e] @ x[t]
            if first_bias is not None:
                h = h + first_bias[e]
            h = act(h[:I]) * h[I:] if m.gated else act(h)
            out = down[e] @ h
            if down_bias is not None:
                out = out + down_bias[e]
            y = y + w[t, j] * out
        rows.append(y)
    return torch.stack(rows)


# expert 3 gets no token; expert 0 gets most
IDS = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 1], [1, 0], [0, 2], [2, 0]])


@pytest.fixture
def spy_grouped_mm(monkeypatch):
    calls = []
    orig = experts_mod.F.grouped_mm

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return orig(*a, **kw)

    monkeypatch.setattr(experts_mod.F, "grouped_mm", spy)
    return calls


# I > H and I <= H: the routing weight is applied before the down projection when I <= H (no down bias)
@pytest.mark.parametrize("H,I,grouped", [(32, 64, True), (30, 50, False), (64, 32, True), (50, 30, False)])
@pytest.mark.parametrize("gated,act", [(True, "silu"), (False, "gelu_new")])
@pytest.mark.parametrize("bias", [False, True])
def test_experts_forward_and_grads_equal_reference(H, I, grouped, gated, act, bias, spy_grouped_mm):
    m = _random_experts(H, I, gated, bias, act)
    g = torch.Generator().manual_seed(1)
    T = IDS.shape[0]
    x = torch.randn(T, H, generator=g).requires_grad_()
    w = torch.rand(T, K, generator=g).requires_grad_()
    proj = torch.randn(T, H, generator=g)  # random cotangent so every output entry matters

    y = m(x, IDS, w)
    assert (len(spy_grouped_mm) == 2) is grouped  # aligned dims use grouped_mm, odd dims the loop
    (y * proj).sum().backward()

    ref_params = [p.detach().clone().requires_grad_() for p in (m.first, m.down)]
    ref_bias = [None if b is None else b.detach().clone().requires_grad_() for b in (m.first_bias, m.down_bias)]
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = _reference(m, x_ref, IDS, w_ref, *ref_params, *ref_bias)
    (y_ref * proj).sum().backward()

    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.first.grad, ref_params[0].grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.down.grad, ref_params[1].grad, atol=1e-5, rtol=1e-5)
    if bias:
        torch.testing.assert_close(m.first_bias.grad, ref_bias[0].grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m.down_bias.grad, ref_bias[1].grad, atol=1e-5, rtol=1e-5)
    # the expert that got no token has exactly zero gradient, the others do not
    unused = 3
    assert torch.count_nonzero(m.first.grad[unused]) == 0 and torch.count_nonzero(m.down.grad[unused]) == 0
    for e in range(3):
        assert torch.count_nonzero(m.first.grad[e]) > 0 and torch.count_nonzero(m.down.grad[e]) > 0
    if bias:
        assert torch.count_nonzero(m.first_bias.grad[unused]) == 0 and torch.count_nonzero(m.down_bias.grad[unused]) == 0


@pytest.mark.parametrize("H,I", [(32, 64), (30, 50), (64, 32)])
def test_experts_all_tokens_on_one_expert_and_empty_batch(H, I):
    m = _random_experts(H, I, True, True, "silu")
    x = torch.randn(5, H)
    ids = torch.full((5, 1), 2)
    w = torch.ones(5, 1)
    one = m.to_weights().expert(2)
    torch.testing.assert_close(m(x, ids, w), one(x), atol=1e-5, rtol=1e-5)
    empty = m(x[:0], ids[:0], w[:0])
    assert empty.shape == (0, H)


def test_experts_weights_roundtrip():
    for gated in (True, False):
        m = _random_experts(32, 64, gated, True, "silu")
        m2 = Experts.from_weights(m.to_weights())
        for (n, p), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
            assert n == n2 and torch.equal(p, p2)


# ---------------------------------------------------------------- router


def _router(scoring, jitter=0.0, H=16, seed=0):
    r = Router(H, 6, 3, scoring, jitter)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return r.eval()


def test_router_softmax_topk_is_topk_of_softmax():
    r = _router("softmax_topk")
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    info = r(x)
    probs = torch.softmax(x @ r.weight.T, dim=-1)
    vals, ids = torch.topk(probs, 3, dim=-1)
    assert torch.equal(info.topk_ids, ids)
    torch.testing.assert_close(info.topk_weights, vals, atol=1e-6, rtol=0)
    torch.testing.assert_close(info.logits, x @ r.weight.T)
    assert (info.topk_weights.sum(-1) < 1).all()


def test_router_topk_softmax_renormalizes():
    r = _router("topk_softmax")
    x = torch.randn(10, 16)
    info = r(x)
    logits = x @ r.weight.T
    probs = torch.softmax(logits, dim=-1)
    vals, ids = torch.topk(probs, 3, dim=-1)
    assert torch.equal(info.topk_ids, ids)
    torch.testing.assert_close(info.topk_weights.sum(-1), torch.ones(10), atol=1e-6, rtol=0)
    torch.testing.assert_close(info.topk_weights, vals / vals.sum(-1, keepdim=True), atol=1e-6, rtol=0)
    # = softmax over the k selected logits
    torch.testing.assert_close(info.topk_weights, torch.softmax(logits.gather(1, ids), -1), atol=1e-6, rtol=0)


def test_router_jitter_only_in_training():
    r = _router("topk_softmax", jitter=0.3)
    plain = _router("topk_softmax", jitter=0.0)
    x = torch.randn(10, 16)
    ev1, ev2 = r.eval()(x), r(x)
    assert torch.equal(ev1.logits, ev2.logits) and torch.equal(ev1.logits, plain(x).logits)
    r.train()
    t1, t2 = r(x), r(x)
    assert not torch.equal(t1.logits, ev1.logits) and not torch.equal(t1.logits, t2.logits)
    # jitter multiplies each input entry by U(0.7, 1.3): logits stay within the corresponding bounds
    bound = (x.abs() * 0.3) @ r.weight.abs().T
    assert ((t1.logits - ev1.logits).abs() <= bound + 1e-5).all()
    plain.train()
    assert torch.equal(plain(x).logits, ev1.logits)  # jitter=0: training mode changes nothing


def test_router_rejects_bad_top_k():
    with pytest.raises(ValueError):
        Router(8, 4, 5, "topk_softmax")
    with pytest.raises(ValueError):
        Router(8, 4, 0, "topk_softmax")


def test_tokens_per_expert_with_mask():
    ids = torch.tensor([[0, 1], [1, 2], [3, 1], [0, 3]])  # (T=4, k=2), E=5
    info = RoutingInfo(logits=torch.zeros(4, 5), topk_ids=ids, topk_weights=torch.full((4, 2), 0.5))
    assert info.num_experts == 5
    assert info.tokens_per_expert().tolist() == [2, 3, 1, 2, 0]
    mask = torch.tensor([[1, 1], [0, 1]])  # (B, L) attention mask: token 2 is padding
    assert info.tokens_per_expert(mask).tolist() == [2, 2, 1, 1, 0]
    assert info.tokens_per_expert(torch.tensor([True, False, False, True])).tolist() == [2, 1, 0, 1, 0]
    assert info.tokens_per_expert(torch.zeros(4)).tolist() == [0] * 5


# ---------------------------------------------------------------- MoE layer


def _layer(router, H=32, I=64, shared: FFNWeights | None = None, seed=0):
    return MoELayer(router, _random_experts(H, I, True, False, "silu", seed),
                    None if shared is None else SharedExpert(shared))


def test_shared_router_is_one_object_and_gets_both_gradients():
    r = Router(32, 4, 2, "topk_softmax")
    with torch.no_grad():
        r.weight.normal_(generator=torch.Generator().manual_seed(3))
    a, b = _layer(r, seed=1), _layer(r, seed=2)
    model = torch.nn.Sequential(a, b)
    assert a.router is b.router
    assert sum(p is r.weight for p in model.parameters()) == 1  # parameters() yields it once
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))

    def grad_of(fn):
        r.weight.grad = None
        fn().backward()
        return r.weight.grad.clone()

    g_a = grad_of(lambda: a(x).pow(2).sum())
    hb = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    g_b = grad_of(lambda: b(hb).pow(2).sum())
    g_both = grad_of(lambda: a(x).pow(2).sum() + b(hb).pow(2).sum())
    assert g_a.abs().sum() > 0 and g_b.abs().sum() > 0
    torch.testing.assert_close(g_both, g_a + g_b)


def test_last_routing_is_set_per_layer():
    r = Router(32, 4, 2, "topk_softmax")
    with torch.no_grad():
        r.weight.normal_(generator=torch.Generator().manual_seed(0))
    a, b = _layer(r, seed=1), _layer(r, seed=2)
    assert a.last_routing is None
    x = torch.randn(2, 5, 32)
    y = a(x)
    assert y.shape == x.shape
    info = a.last_routing
    assert info.logits.shape == (10, 4) and info.topk_ids.shape == (10, 2)
    torch.testing.assert_close(info.logits, x.reshape(10, 32) @ r.weight.T)
    assert b.last_routing is None  # not a global list: only the layer that ran records
    x2 = torch.randn(3, 32)
    b(x2)
    torch.testing.assert_close(b.last_routing.logits, x2 @ r.weight.T)
    torch.testing.assert_close(a.last_routing.logits, info.logits)


def test_layer_equals_routed_sum_plus_ungated_shared_expert():
    g = torch.Generator().manual_seed(7)
    shared = FFNWeights(up=torch.randn(48, 32, generator=g) * 0.2, down=torch.randn(32, 48, generator=g) * 0.2,
                        gate=torch.randn(48, 32, generator=g) * 0.2, down_bias=torch.randn(32, generator=g),
                        act="silu")
    r = Router(32, 4, 2, "topk_softmax")
    with torch.no_grad():
        r.weight.normal_(generator=g)
    with_shared, without = _layer(r, shared=shared, seed=1), _layer(r, seed=1)
    x = torch.randn(2, 6, 32, generator=g)
    y, y0 = with_shared(x), without(x)
    torch.testing.assert_close(y - y0, shared(x), atol=1e-5, rtol=1e-5)  # added as is, no gate
    # and the routed part is the reference sum
    info = without.last_routing
    flat = x.reshape(-1, 32)
    ex = without.experts
    ref = _reference(ex, flat, info.topk_ids, info.topk_weights, ex.first, ex.down, None, None)
    torch.testing.assert_close(y0.reshape(-1, 32), ref, atol=1e-5, rtol=1e-5)
    # SharedExpert keeps the weights it was built from
    back = with_shared.shared.to_weights()
    for name in ("up", "down", "gate", "down_bias"):
        assert torch.equal(getattr(back, name), getattr(shared, name))
    assert back.up_bias is None and back.gate_bias is None
    assert F.mse_loss(y, y0) > 0
