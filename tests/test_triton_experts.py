"""moekit's Triton kernels (moe/triton_experts.py) against eager references, forward and backward.

Without a GPU they run on CPU tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before moekit is imported). The interpreter multiplies bf16 `tl.dot` operands as raw bits, so the GEMM kernels
are checked in float32 and float16 here, bf16 on the GPU (tests/test_gpu.py); the element-wise kernels in all
three. Shapes stay tiny: each program instance costs ~17 ms under the interpreter.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekit.moe import Experts
from moekit.moe import triton_experts as tx
from moekit.moe.permute import Combine, Gather, combine, sort_by_expert
from moekit.moe.router import route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not tx.available(DEVICE), reason="needs triton (and TRITON_INTERPRET=1 on CPU)")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _swiglu_ref(h, w):
    g, u = h.float().chunk(2, dim=-1)
    a = F.silu(g) * u
    return a if w is None else a * w.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("S, I, weighted", [(37, 24, True), (1, 5, True), (16, 16, False), (0, 8, True)])
def test_swiglu_forward_and_backward_equal_autograd(dtype, S, I, weighted):
    g = torch.Generator().manual_seed(S * 100 + I)
    h = torch.randn(S, 2 * I, generator=g).to(DEVICE, dtype).requires_grad_()
    w = torch.rand(S, 1, generator=g).to(DEVICE, dtype).requires_grad_() if weighted else None
    dy = torch.randn(S, I, generator=g).to(DEVICE, dtype)
    a = tx.SwiGLU.apply(h, w)
    a.backward(dy)
    hr = h.detach().float().requires_grad_()
    wr = None if w is None else w.detach().float().requires_grad_()
    ar = _swiglu_ref(hr, wr)
    ar.backward(dy.float())
    assert a.dtype == dtype and a.shape == (S, I)
    if S == 0:
        return
    assert _rel(a, ar) <= TOL[dtype]
    assert _rel(h.grad, hr.grad) <= TOL[dtype]
    if weighted:
        assert _rel(w.grad, wr.grad) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, k, H", [(5, 2, 24), (1, 1, 7), (9, 3, 16)])
def test_combine_sums_each_tokens_rows_in_float32(dtype, T, k, H):
    g = torch.Generator().manual_seed(T + k + H)
    src = torch.randn(T * k, H, generator=g).to(DEVICE, dtype)
    idx = torch.randperm(T * k, generator=g).to(DEVICE)
    want = src.float()[idx].view(T, k, H).sum(1)
    got = tx.combine(src, k, idx)
    assert got.dtype == dtype
    # one rounding, at the end: exact in float32; bf16 within one unit in the last place (the interpreter's
    # float32 -> bf16 cast truncates where the GPU rounds to nearest)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tol)
    torch.testing.assert_close(tx.combine(src, k).float(), src.float().view(T, k, H).sum(1).to(dtype).float(), **tol)


def test_inverse_permutation():
    order = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    inv = tx.inverse(order)
    assert torch.equal(order[inv], torch.arange(11)) and torch.equal(inv[order], torch.arange(11))


def _eager(first, down, x, ids, w):
    """y_t = Σ_j w_tj · down_e (silu(g) ⊙ u), e = ids_tj, one (token, slot) at a time, in float32."""
    I = down.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            h = first[ids[t, j]].float() @ x[t].float()  # (2I,)
            y[t] += w[t, j].float() * (down[ids[t, j]].float() @ (F.silu(h[:I]) * h[I:]))
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("E, k, H, I, T", [
    (5, 2, 32, 48, 7),   # E not a power of two, one expert never chosen
    (3, 1, 16, 16, 1),   # one token, k = 1
    (4, 4, 24, 40, 3),   # every expert for every token
])
def test_triton_experts_forward_and_backward_equal_eager(dtype, E, k, H, I, T):
    g = torch.Generator().manual_seed(E * 1000 + T)
    first = (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(DEVICE, dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=g) * 0.3).to(DEVICE, dtype).requires_grad_()
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E - 1 if E > k else E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    order, counts = sort_by_expert(ids, E)
    ws = w.reshape(-1)[order].unsqueeze(-1)
    y = tx.triton_experts(x, ws, first, down, order, counts, k)
    y.backward(dy)
    leaves = [x, w, first, down]
    refs = [t.detach().float().requires_grad_() for t in leaves]
    yr = _eager(refs[2], refs[3], refs[0], ids, refs[1])
    yr.backward(dy.float())
    assert y.dtype == dtype and _rel(y, yr) <= TOL[dtype]
    for got, want in zip(leaves, refs):
        assert _rel(got.grad, want.grad) <= TOL[dtype]
    if E > k:  # the expert no token chose gets exact zero gradients
        assert torch.count_nonzero(first.grad[E - 1]) == 0 and torch.count_nonzero(down.grad[E - 1]) == 0


@pytest.mark.parametrize("H, I", [(17, 9), (8, 3)])
def test_triton_experts_forward_with_odd_sizes(H, I):
    """The forward kernels mask every tile edge: odd H and I compute the eager result (the backward's grouped_mm
    needs 16-byte rows, so Experts trains such shapes on its grouped path)."""
    g = torch.Generator().manual_seed(H)
    E, k, T = 6, 2, 5
    first, down = torch.randn(E, 2 * I, H, generator=g).to(DEVICE), torch.randn(E, H, I, generator=g).to(DEVICE)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, k, generator=g).to(DEVICE)
    order, counts = sort_by_expert(ids, E)
    with torch.no_grad():
        y = tx.triton_experts(x, w.reshape(-1)[order].unsqueeze(-1), first, down, order, counts, k)
    assert _rel(y, _eager(first, down, x, ids, w)) <= 1e-5


def _random_experts(E, k, H, I, T, seed):
    """Experts with random weights, and inputs x (T, H), ids (T, k), weights (T, k) for them."""
    g = torch.Generator().manual_seed(seed)
    m = Experts(E, H, I, "silu")
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    return m.to(DEVICE), x, ids, torch.rand(T, k, generator=g).to(DEVICE)


@pytest.mark.parametrize("T", [2, 6])  # 4 slots for 4 experts: the decode kernels; 12: the sorted path
def test_triton_experts_without_grad_matches_grouped(T):
    m, x, ids, w = _random_experts(4, 2, 16, 32, T, seed=3)
    with torch.no_grad():
        m.dispatch = "triton"
        got = m(x, ids, w)
        m.dispatch = "grouped"
        want = m(x, ids, w)
    assert _rel(got, want) <= 1e-5


def test_dispatch_triton_refuses_what_it_cannot_run():
    m = Experts(4, 16, 32, "gelu", gated=False).to(DEVICE)
    m.dispatch = "triton"
    x = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="gated SiLU"):
        m(x, torch.zeros(3, 1, dtype=torch.long, device=DEVICE), torch.ones(3, 1, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_combine_are_adjoint_and_deterministic(dtype):
    """The torch permutation ops (moe/permute.py, every device): Combine(Gather(x)) = k·x, and their gradients
    are each other's (gather ↔ sum over the k slots), computed without atomics: two runs agree bit for bit."""
    g = torch.Generator().manual_seed(0)
    T, k, E, H = 7, 3, 5, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    order, counts = sort_by_expert(ids, E)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=E))
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    rows = Gather.apply(x, order, k)  # (S, H)
    assert torch.equal(rows, x.detach()[order // k])
    out = Combine.apply(rows, order, k)
    torch.testing.assert_close(out.float(), (k * x.detach()).float(), rtol=1e-2 if dtype == torch.bfloat16 else 0,
                               atol=0)
    dy = torch.randn(T, H, generator=g).to(dtype)
    out.backward(dy)
    first = x.grad.clone()
    x.grad = None
    Combine.apply(Gather.apply(x, order, k), order, k).backward(dy)
    assert torch.equal(first, x.grad)
    assert torch.equal(combine(dy.index_select(0, order // k), order, k), (dy.float() * k).to(dtype))


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_grouped_mm_probe_answers_the_same_in_every_autograd_mode(mode):
    """The probe that decides grouped_mm on a GPU, run here on the CPU: its answer must not depend on the caller's
    autograd mode (under no_grad its backward failed, and "no" was cached for the process)."""
    from contextlib import nullcontext

    from moekit.moe.experts import _grouped_mm_works

    ctx = {"grad": nullcontext(), "no_grad": torch.no_grad(), "inference_mode": torch.inference_mode()}[mode]
    with ctx:
        assert _grouped_mm_works(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("T, k, E, tile", [
    (1, 1, 3, None),       # one slot
    (8, 8, 64, None),      # decode: one block, one kernel
    (37, 3, 5, 64),        # several blocks (E not a power of two): histogram, running sum, scatter
    (50, 2, 8, 16),        # 16-slot blocks: 7 of them
    (0, 2, 4, None),       # no tokens
])
def test_counting_sort_equals_stable_argsort(T, k, E, tile, monkeypatch):
    """The Triton counting sort gives exactly the stable argsort's order, bincount's counts and the weights in
    that order, converted to the asked dtype; one block or many."""
    if tile is not None:
        monkeypatch.setattr(tx, "SORT_TILE", tile)
    g = torch.Generator().manual_seed(T * 10 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)] or [torch.zeros(0, k).long()])
    ids, w = ids.reshape(T, k).to(DEVICE), torch.rand(T, k, generator=g).to(DEVICE)
    order, counts, ws = tx.sort_by_expert(ids, E, w, torch.float16)
    assert order.dtype == torch.int64 and counts.dtype == torch.int32 and ws.shape == (T * k, 1)
    assert torch.equal(order, torch.argsort(ids.reshape(-1), stable=True))
    assert torch.equal(counts.long(), torch.bincount(ids.reshape(-1).cpu(), minlength=E).to(DEVICE))
    assert torch.equal(ws, w.reshape(-1)[order].unsqueeze(-1).half())
    assert torch.equal(tx.sort_by_expert(ids, E)[0], order)


def test_counting_sort_leaves_ids_outside_the_experts_unplaced():
    ids = torch.tensor([[2, 5], [0, 2], [-1, 1]], device=DEVICE)  # 5 and -1: no such expert
    order, counts, _ = tx.sort_by_expert(ids, 3)
    assert counts.tolist() == [1, 1, 2]
    assert order[:4].tolist() == [2, 5, 0, 3]


def test_triton_dispatch_trains_the_routing_weights_like_grouped():
    """Experts with dispatch="triton" (the counting sort, and the weights gathered by torch when a gradient is
    recorded) against the grouped path: output and every gradient, routing weights included."""
    m, x0, ids, w0 = _random_experts(5, 2, 16, 32, 9, seed=5)
    dy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out = {}
    for dispatch in ("triton", "grouped"):
        m.dispatch = dispatch
        m.zero_grad(set_to_none=True)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = m(x, ids, w)
        y.backward(dy)
        out[dispatch] = [y, x.grad, w.grad, m.gate_up.grad, m.down.grad]
    for a, b in zip(out["triton"], out["grouped"]):
        assert _rel(a, b) <= 1e-5


class _DeviceOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the device work of what runs inside it: every aten op that would launch a kernel (allocations and
    views do not) and every launch of moekit's Triton kernels (whose interpreter's own torch ops are not counted)."""

    FREE = {"empty", "new_empty", "empty_like", "empty_strided", "view", "_unsafe_view", "reshape", "_reshape_alias",
            "as_strided", "alias", "detach", "t", "transpose", "slice", "select", "unsqueeze", "squeeze", "expand",
            "split", "chunk"}
    KERNELS = ("counting_sort_kernel", "expert_hist_kernel", "gate_up_kernel", "down_kernel", "combine_k",
               "decode_gate_up_kernel", "decode_down_kernel", "route_kernel")

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops, self.paused = [], False
        for name in self.KERNELS:
            monkeypatch.setattr(tx, name, self._counted(name, getattr(tx, name)))

    def _counted(self, name, kernel):
        mode = self

        class Counted:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    mode.ops.append(name)
                    mode.paused = True
                    try:
                        return kernel[grid](*args, **kw)
                    finally:
                        mode.paused = False
                return launch
        return Counted()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ not in self.FREE:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("T, launches", [
    (3, ["decode_gate_up_kernel", "decode_down_kernel"]),  # 6 slots <= 8 experts: no sort at all
    (5, ["counting_sort_kernel", "gate_up_kernel", "down_kernel", "combine_k"]),  # 10 slots: sorted, one block
])
def test_a_no_grad_forward_of_few_tokens_is_two_or_four_kernel_launches(T, launches, monkeypatch):
    """Without autograd, few tokens cost two kernel launches (T·k ≤ E: the decode kernels) or four (counting sort
    with the weight gather, fused gate_up, down, k-sum) and no other device op: no argsort, histogram, index or
    cast kernels."""
    m, x, ids, w = _random_experts(8, 2, 16, 32, T, seed=2)
    m.dispatch = "triton"
    with torch.no_grad(), _DeviceOps(monkeypatch) as dev:
        m(x, ids, w)
    assert dev.ops == launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("E, k, H, I, T", [
    (5, 2, 32, 48, 2),   # E not a power of two
    (3, 1, 16, 16, 1),   # one token, k = 1
    (9, 3, 17, 9, 3),    # odd H and I
    (4, 1, 24, 40, 4),   # every token the same expert (ids below)
])
def test_decode_experts_equal_eager(dtype, E, k, H, I, T):
    """The decode kernels (matrix-vector products, no tl.dot: exact under the interpreter in every dtype) against
    one (token, slot) at a time in float32."""
    g = torch.Generator().manual_seed(E * 100 + H)
    first = (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(DEVICE, dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.3).to(DEVICE, dtype)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    ids = (torch.full((T, k), 2) if E == 4 else torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]))
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(DEVICE, dtype)
    y = tx.decode_experts(x, ids.to(DEVICE), w, first, down)
    assert y.dtype == dtype and _rel(y, _eager(first, down, x, ids.to(DEVICE), w)) <= TOL[dtype]


def test_decode_layer_launches_a_seventh_of_what_transformers_block_does(monkeypatch):
    """A whole MoE layer's decode step (one token): moekit's fused router kernel (linear, top-k, weights) and its two
    decode kernels, 3 launches and no other device op, against transformers' own Mixtral block with `grouped_mm`
    experts (22 device ops in transformers 5.23: its router, sort, histogram, casts, index ops, two grouped GEMMs
    and the element-wise ops between them). On a GPU each is a launch, and at decode sizes launches are the cost
    (BENCHMARKS.md, MoE layer speed on a GPU)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    E, k, H, I = 8, 2, 16, 32
    ours = _layer(E, k, H, I, seed=0)
    cfg = MixtralConfig(num_local_experts=E, num_experts_per_tok=k, hidden_size=H, intermediate_size=I,
                        experts_implementation="grouped_mm")
    theirs = MixtralSparseMoeBlock(cfg).to(DEVICE)
    x = torch.randn(1, 1, H, device=DEVICE)
    ops = []
    for block in (ours, theirs):
        with torch.no_grad():
            block(x)  # warm-up
            with _DeviceOps(monkeypatch) as dev:
                block(x)
        ops.append(dev.ops)
    assert ops[0] == ["route_kernel", "decode_gate_up_kernel", "decode_down_kernel"]
    assert 7 * len(ops[0]) <= len(ops[1]), ops[1]


def _layer(E, k, H, I, seed, dispatch="triton", shared=None, gate=False):
    """A MoE layer with random router and experts, both on `dispatch` ("triton" or eager router + grouped experts);
    `shared`: a shared expert's (intermediate size, act, gated, bias), with `gate` its sigmoid gate."""
    from moekit.moe.ffn import FFNWeights
    from moekit.moe.layer import MoELayer, SharedExpert
    from moekit.moe.router import Router

    g = torch.Generator().manual_seed(seed)
    router = Router(H, E, k, "topk_softmax")
    torch.nn.init.normal_(router.weight, generator=g)
    if shared is not None:
        IS, act, gated, bias = shared
        r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
        shared = SharedExpert(FFNWeights(up=r(IS, H), down=r(H, IS), act=act, gate=r(IS, H) if gated else None,
                                         up_bias=r(IS) if bias else None))
    shared_gate = torch.nn.Linear(H, 1, bias=False) if gate else None
    if shared_gate is not None:
        torch.nn.init.normal_(shared_gate.weight, generator=g)
    layer = MoELayer(router, _random_experts(E, k, H, I, 1, seed=seed)[0], shared, shared_gate=shared_gate).to(DEVICE)
    triton = dispatch == "triton"
    layer.router.dispatch, layer.experts.dispatch = ("triton", "triton") if triton else ("eager", "grouped")
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["topk_softmax", "softmax_topk"])
@pytest.mark.parametrize("E, k, H, T", [
    (8, 2, 32, 4),   # T·k = E
    (5, 1, 17, 3),   # E not a power of two, k = 1, odd H
    (6, 6, 24, 1),   # k = E: every expert
    (60, 4, 40, 15),  # 15 tokens, 60 experts in a 64-wide block
])
def test_route_tokens_computes_what_the_router_computes(dtype, scoring, E, k, H, T):
    """The fused router kernel: logits as F.linear's (float32 sums, then rounded), and from those logits the same
    top-k experts in the same order and the same weights as `router.route`. Exact ids in float32; in 16-bit,
    where rounded logits can tie, the chosen logits are the same values (ties may pick either expert)."""
    g = torch.Generator().manual_seed(E * 7 + T)
    x, weight = torch.randn(T, H, generator=g).to(DEVICE, dtype), torch.randn(E, H, generator=g).to(DEVICE, dtype)
    logits, weights, ids = tx.route_tokens(x, weight, k, scoring == "softmax_topk")
    want = F.linear(x.float(), weight.float())
    assert logits.dtype == weights.dtype == dtype and ids.dtype == torch.int64
    assert _rel(logits, want) <= TOL[dtype]
    want_w, want_ids = route(logits, k, scoring)  # from the kernel's own logits
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    torch.testing.assert_close(weights.float(), want_w, rtol=TOL[dtype], atol=TOL[dtype] * 1e-2)


@pytest.mark.parametrize("scoring, weight", [("topk_softmax", 1 / 3), ("softmax_topk", 1 / 7)])
def test_route_tokens_ties_go_to_the_lower_expert_and_nan_comes_first(scoring, weight):
    """A zero router: every logit 0, so the top 3 of 7 are experts 0, 1, 2 with weight 1/3 each (renormalized)
    or 1/7 (softmax over all 7). A NaN in expert 4's row: every weight NaN, as eager's; its NaN logit is chosen
    first where the top-k is taken over the logits, as torch.topk does (and an expert id is always in range)."""
    x = torch.ones(2, 9, device=DEVICE)
    w = torch.zeros(7, 9, device=DEVICE)
    logits, weights, ids = tx.route_tokens(x, w, 3, scoring == "softmax_topk")
    assert torch.equal(logits, torch.zeros(2, 7, device=DEVICE))
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights, torch.full((2, 3), weight, device=DEVICE))
    w[4, 0] = float("nan")
    logits, weights, ids = tx.route_tokens(x, w, 3, scoring == "softmax_topk")
    assert weights.isnan().all() and ((ids >= 0) & (ids < 7)).all()
    if scoring == "topk_softmax":
        assert ids[:, 0].tolist() == [4, 4] and route(F.linear(x, w), 3, scoring)[1][:, 0].tolist() == [4, 4]


@pytest.mark.parametrize("T", [1, 3])
def test_a_decoding_layer_equals_the_eager_layer(T):
    """The whole layer's decode step (fused router, decode kernels) against the eager router and grouped experts."""
    fast, slow = _layer(8, 2, 16, 32, seed=4), _layer(8, 2, 16, 32, seed=4, dispatch="eager")
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    with torch.no_grad():
        got, want = fast(x), slow(x)
    assert torch.equal(fast.last_routing.topk_ids, slow.last_routing.topk_ids)
    assert _rel(got, want) <= 1e-5 and _rel(fast.last_routing.logits, slow.last_routing.logits) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("E, k, H, I, IS, T, gate", [
    (8, 2, 16, 32, 48, 3, False),  # SPRI: a shared expert wider than the routed ones
    (5, 1, 17, 24, 9, 4, True),    # Qwen2-MoE: a sigmoid-gated shared expert; odd H and IS, E not a power of 2
])
def test_decode_experts_add_the_shared_expert(dtype, E, k, H, I, IS, T, gate):
    """The decode kernels with a shared expert (its own width IS) added to every token, scaled by sigmoid(g·x) with
    a gate row: against the routed eager sum plus the shared FFN in float32."""
    g = torch.Generator().manual_seed(IS)
    r = lambda *shape: (torch.randn(*shape, generator=g) * 0.3).to(DEVICE, dtype)  # noqa: E731
    first, down, x = r(E, 2 * I, H), r(E, H, I), r(T, H)
    sg, su, sd, row = r(IS, H), r(IS, H), r(H, IS), r(H) if gate else None
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(DEVICE, dtype)
    y = tx.decode_experts(x, ids, w, first, down, (sg, su, sd, row))
    xf = x.float()
    s = (F.silu(xf @ sg.float().T) * (xf @ su.float().T)) @ sd.float().T  # (T, H)
    want = _eager(first, down, x, ids, w) + (s if row is None else torch.sigmoid(xf @ row.float())[:, None] * s)
    assert y.dtype == dtype and _rel(y, want) <= TOL[dtype]


@pytest.mark.parametrize("gate", [False, True])
def test_a_decoding_layer_with_a_shared_expert_is_three_launches(gate, monkeypatch):
    """A SPRI layer (routed experts + shared expert) or a Qwen2-MoE one (+ the shared expert's sigmoid gate) decodes
    in the same 3 launches as one without (its own modules are 6 more device ops: three linears, SiLU, the product,
    the sum; 9 with the gate's linear, sigmoid and product) and computes what the eager layer computes."""
    fast = _layer(8, 2, 16, 32, seed=7, shared=(24, "silu", True, False), gate=gate)
    slow = _layer(8, 2, 16, 32, seed=7, dispatch="eager", shared=(24, "silu", True, False), gate=gate)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad(), _DeviceOps(monkeypatch) as dev:
        got = fast(x)
    assert dev.ops == ["route_kernel", "decode_gate_up_kernel", "decode_down_kernel"]
    with torch.no_grad():
        assert _rel(got, slow(x)) <= 1e-5


@pytest.mark.parametrize("shared", [(24, "gelu", True, False), (24, "silu", False, False), (24, "silu", True, True)])
def test_a_shared_expert_the_kernels_cannot_compute_runs_on_its_own(shared, monkeypatch):
    """Another activation, an ungated shared expert or one with biases: the routed experts still decode in their two
    kernels and the shared expert runs its own modules, for the eager layer's output."""
    fast = _layer(8, 2, 16, 32, seed=8, shared=shared)
    slow = _layer(8, 2, 16, 32, seed=8, dispatch="eager", shared=shared)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad(), _DeviceOps(monkeypatch) as dev:
        got = fast(x)
    assert dev.ops[:3] == ["route_kernel", "decode_gate_up_kernel", "decode_down_kernel"] and len(dev.ops) > 3
    with torch.no_grad():
        assert _rel(got, slow(x)) <= 1e-5


def test_a_router_above_the_fused_size_runs_eagerly(monkeypatch):
    """A router weight of more than ROUTER_FUSED_MAX elements decodes with torch's ops (cuBLAS spreads its GEMV over
    the GPU; one program per token would read it alone); at the bound, with the fused kernel."""
    layer = _layer(8, 2, 16, 32, seed=6)
    x = torch.randn(1, 16, device=DEVICE)
    for bound, fused in ((8 * 16, True), (8 * 16 - 1, False)):
        monkeypatch.setattr(tx, "ROUTER_FUSED_MAX", bound)
        with torch.no_grad(), _DeviceOps(monkeypatch) as dev:
            layer(x)
        assert ("route_kernel" in dev.ops) == fused and ("topk" in dev.ops) != fused, dev.ops


def test_the_router_runs_eagerly_where_a_gradient_is_recorded():
    layer = _layer(8, 2, 16, 32, seed=5)
    x = torch.randn(2, 16, device=DEVICE)
    layer(x)  # weights require grad, grad mode on: the eager ops, with their autograd graph
    assert layer.last_routing.logits.grad_fn is not None and layer.last_routing.topk_weights.grad_fn is not None
    with torch.no_grad():
        layer(x)
    assert layer.last_routing.logits.grad_fn is None


def test_a_counting_sort_that_does_not_fit_the_device_falls_back_to_argsort(monkeypatch):
    """A block configuration whose kernel does not compile or fit (OutOfResources on some GPU) is tried once: the
    experts sort with argsort instead and compute the same output; later calls do not launch it again."""
    from triton.runtime.errors import OutOfResources

    tried = []

    class TooBig:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append(grid)
                raise OutOfResources(300_000, 232_448, "shared memory")
            return launch

    m, x, ids, w = _random_experts(5, 2, 16, 32, 4, seed=7)
    with torch.no_grad():
        m.dispatch = "grouped"
        want = m(x, ids, w)
        monkeypatch.setattr(tx, "counting_sort_kernel", TooBig())
        monkeypatch.setattr(tx, "_SORT_FAILED", set())
        m.dispatch = "triton"
        got = [m(x, ids, w) for _ in range(2)]
    assert len(tried) == 1 and tx.sort_by_expert(ids, 5) is None
    assert all(_rel(y, want) <= 1e-5 for y in got)
