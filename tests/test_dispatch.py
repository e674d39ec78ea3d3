"""The per-expert loop dispatch (ExpertLoop, Experts._loop) equals the grouped one: outputs and gradients."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
import warnings

import pytest
import torch

from moekit.moe import Experts
from moekit.moe import experts as experts_mod

E = 5


def _experts(H, I, gated=True, act="silu", bias=False, dtype=torch.float32, seed=0, num_experts=E):
    g = torch.Generator().manual_seed(seed)
    m = Experts(num_experts, H, I, act, gated=gated, bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.to(dtype)


def _run(m, dispatch, x, ids, w, proj, backward=True):
    """Output and (x, w, parameter) gradients of one forward/backward with the given dispatch."""
    m.dispatch = dispatch
    m.zero_grad(set_to_none=True)
    x, w = x.detach().clone().requires_grad_(backward), w.detach().clone().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        y = m(x, ids, w)
    if not backward:
        return [y]
    (y.float() * proj).sum().backward()
    return [y, x.grad, w.grad, *(p.grad for p in m.parameters())]


# expert 4 never routed; token 2 routed to expert 1 twice; expert 0 gets most
IDS = torch.tensor([[0, 1], [1, 0], [1, 1], [2, 0], [0, 3], [3, 2], [0, 1]])


def _inputs(T, H, dtype=torch.float32, ids=IDS, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = ids[:T]
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.rand(ids.shape, generator=g).to(dtype)
    proj = torch.randn(T, H, generator=g)
    return x, ids, w, proj


@pytest.mark.parametrize("T", [1, 3, 7])
@pytest.mark.parametrize("H,I", [(32, 64), (64, 32), (30, 50)])
def test_loop_equals_grouped_fp32(T, H, I):
    m = _experts(H, I)
    args = _inputs(T, H)
    loop, grouped = _run(m, "loop", *args), _run(m, "grouped", *args)
    for i, (a, b) in enumerate(zip(loop, grouped)):
        # w's gradient: a dot product over I in the loop, over H in grouped where I > H (its narrower side); the
        # weights' gradients (i >= 3) sum over tokens, which 2 intra-op threads split differently in the two paths
        tol = 1e-5 if (i == 2 and I > H) or i >= 3 else 1e-6
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert torch.count_nonzero(loop[3][4]) == 0 and torch.count_nonzero(loop[4][4]) == 0  # unrouted expert: 0


def test_loop_equals_grouped_bf16():
    m = _experts(32, 64, dtype=torch.bfloat16)
    args = _inputs(7, 32, torch.bfloat16)
    loop, grouped = _run(m, "loop", *args), _run(m, "grouped", *args)
    for a, b in zip(loop, grouped):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("gated,act,bias", [(True, "silu", False), (True, "silu", True), (False, "gelu_new", True),
                                            (True, "gelu", False)])
def test_inference_loop_equals_grouped(gated, act, bias):
    m = _experts(32, 48, gated, act, bias)
    args = _inputs(7, 32)
    loop, grouped = _run(m, "loop", *args, backward=False), _run(m, "grouped", *args, backward=False)
    torch.testing.assert_close(loop[0], grouped[0], atol=1e-6, rtol=1e-6)


def test_loop_inference_equals_loop_training_output():
    m = _experts(32, 64)
    args = _inputs(7, 32)
    assert torch.equal(_run(m, "loop", *args, backward=False)[0], _run(m, "loop", *args)[0])


def test_training_without_a_loop_backward_uses_grouped(monkeypatch):
    calls = []
    monkeypatch.setattr(experts_mod.ExpertLoop, "apply", lambda *a: calls.append(a))
    m = _experts(32, 64, gated=False, act="gelu_new")
    y = _run(m, "loop", *_inputs(7, 32))[0]
    assert not calls and y.shape == (7, 32)


def test_frozen_experts_get_no_weight_gradient_and_x_still_does():
    m = _experts(32, 64).requires_grad_(False)
    args = _inputs(7, 32)
    loop, grouped = _run(m, "loop", *args), _run(m, "grouped", *args)
    assert loop[3] is None and loop[4] is None
    torch.testing.assert_close(loop[1], grouped[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T,expect_loop", [(1, False), (64, False), (4096, True)])
def test_auto_dispatch_by_work_per_hit_expert(T, expect_loop, monkeypatch):
    """H*I = 2^18: the loop needs ≥ 64 rows per hit expert (LOOP_WORK = 2^24)."""
    calls = []
    monkeypatch.setattr(experts_mod.ExpertLoop, "apply", lambda *a: calls.append(a) or a[0])
    m = Experts(8, 512, 512, "silu")
    ids = torch.arange(T * 2).reshape(T, 2) % 8
    m(torch.zeros(T, 512, requires_grad=True), ids, torch.ones(T, 2))
    assert bool(calls) is expect_loop


def _loop_grads(m, seed):
    """The expert weight gradients of one loop forward/backward on inputs drawn from `seed`."""
    _run(m, "loop", *_inputs(7, 32, seed=seed))
    return m.gate_up.grad, m.down.grad


def test_loop_reuses_a_dropped_gradient_memory_and_its_values_are_exact():
    m, fresh = _experts(32, 64), _experts(32, 64)
    first = _loop_grads(m, seed=1)
    storages = [g.untyped_storage() for g in first]
    refs, cdata = [s._weak_ref() for s in storages], [s._cdata for s in storages]
    del first, storages
    second = _loop_grads(m, seed=2)  # zero_grad(set_to_none=True) in _run dropped the first gradients
    expired = [torch.UntypedStorage._expired(r) for r in refs]
    for r in refs:
        torch.UntypedStorage._free_weak_ref(r)
    assert not any(expired)  # kept alive only by the gradient memory cache ...
    assert [g.untyped_storage()._cdata for g in second] == cdata  # ... and reused, not faulted in afresh
    for a, b in zip(second, _loop_grads(fresh, seed=2)):
        assert torch.equal(a, b)
    assert torch.count_nonzero(second[0][4]) == 0  # the unrouted expert's rows were zeroed, not left over


def test_loop_never_writes_into_a_gradient_someone_still_holds():
    m = _experts(32, 64)
    kept = _loop_grads(m, seed=1)
    copies = [g.clone() for g in kept]
    kept_view = kept[1][2]  # a view holds the memory as well
    second = _loop_grads(m, seed=2)
    for g, c in zip(kept, copies):
        assert torch.equal(g, c)
    assert torch.equal(kept_view, copies[1][2])
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(second, kept))


@pytest.mark.parametrize("set_to_none", [False, True])
def test_loop_gradients_accumulate_across_backwards(set_to_none):
    m = _experts(32, 64)
    proj = _inputs(7, 32, seed=1)[3]
    single = [g.clone() for g in _loop_grads(m, seed=1)]
    m.zero_grad(set_to_none=set_to_none)
    for _ in range(2):
        (m(*_inputs(7, 32, seed=1)[:3]) * proj).sum().backward()
    for p, g in zip((m.gate_up, m.down), single):
        torch.testing.assert_close(p.grad, 2 * g, atol=1e-6, rtol=1e-6)
        kept = experts_mod._GRAD_MEMORY.get(p)  # no second gradient's worth of memory kept alive
        assert kept is None or kept._cdata == p.grad.untyped_storage()._cdata


def test_loop_backward_through_a_parametrized_weight_warns_nothing():
    """Selective training parametrizes the expert weights (non-leaf in the forward): no .grad access."""
    from torch.nn.utils import parametrize

    class Scale(torch.nn.Module):
        def forward(self, t):
            return 2 * t

    m, ref = _experts(32, 64), _experts(32, 64)
    parametrize.register_parametrization(m, "gate_up", Scale())
    with torch.no_grad():
        ref.gate_up.mul_(2)
    x, ids, w, proj = _inputs(7, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the second step would find cached memory if a non-leaf were cached
            got = _run(m, "loop", x, ids, w, proj)
    want = _run(ref, "loop", x, ids, w, proj)
    torch.testing.assert_close(m.parametrizations.gate_up.original.grad, 2 * want[3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- experts side by side on CPU threads

def _many_experts(E=40, T=64, H=32, I=64, seed=0):
    """E experts, every one hit (≥ PARALLEL_EXPERTS · 2), and inputs for _run."""
    m = _experts(H, I, seed=seed, num_experts=E)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.arange(T) % E, (torch.arange(T) * 7 + 3) % E], dim=1)  # (T, 2)
    x, w, proj = torch.randn(T, H, generator=g), torch.rand(T, 2, generator=g), torch.randn(T, H, generator=g)
    return m, (x, ids, w, proj)


@contextlib.contextmanager
def _num_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def two_threads():
    with _num_threads(2):
        yield


def test_expert_threads_equal_one_expert_after_another(two_threads, monkeypatch):
    m, args = _many_experts()
    side_by_side = _run(m, "loop", *args), _run(m, "loop", *args, backward=False)
    monkeypatch.setattr(experts_mod, "PARALLEL_EXPERTS", 10**6)
    one_by_one = _run(m, "loop", *args), _run(m, "loop", *args, backward=False)
    for a, b in zip([*side_by_side[0], *side_by_side[1]], [*one_by_one[0], *one_by_one[1]]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # only the order of the partial sums differs
    grouped = _run(m, "grouped", *args)
    for a, b in zip(side_by_side[0], grouped):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _record_silu(monkeypatch, fail=False):
    seen, silu = [], torch.nn.functional.silu

    def recording(t, *a, **k):
        seen.append((threading.get_ident(), torch.get_num_threads(), torch.is_grad_enabled()))
        if fail:
            raise RuntimeError("boom")
        return silu(t, *a, **k)

    monkeypatch.setattr(experts_mod.F, "silu", recording)
    return seen


def test_expert_threads_are_single_threaded_without_grad_and_the_count_comes_back(two_threads, monkeypatch):
    m, args = _many_experts()
    seen = _record_silu(monkeypatch)
    _run(m, "loop", *args)
    assert seen and threading.get_ident() not in {t for t, _, _ in seen}  # on worker threads only
    assert {(n, grad) for _, n, grad in seen} == {(1, False)}
    assert torch.get_num_threads() == 2


def test_expert_threads_give_the_thread_count_back_when_a_worker_raises(two_threads, monkeypatch):
    m, args = _many_experts()
    _record_silu(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="boom"):
        _run(m, "loop", *args)
    assert torch.get_num_threads() == 2


def test_expert_threads_finish_every_part_before_an_error_comes_out(two_threads):
    """No worker may still write into the gradient buffers once the call has raised."""
    finished = []

    def part(groups):
        if 0 in groups:  # the first part fails at once
            raise RuntimeError("boom")
        time.sleep(0.2)
        finished.append(groups)

    groups = list(range(2 * experts_mod.PARALLEL_EXPERTS))
    with pytest.raises(RuntimeError, match="boom"):
        experts_mod._by_expert_threads(part, groups, torch.zeros(1))
    assert finished == [groups[1::2]]


@pytest.mark.parametrize("threads,E", [(1, 40), (2, 8)])
def test_experts_stay_on_the_calling_thread_with_one_thread_or_few_experts(threads, E, monkeypatch):
    m, args = _many_experts(E=E)
    seen = _record_silu(monkeypatch)
    with _num_threads(threads):
        _run(m, "loop", *args)
    assert {t for t, _, _ in seen} == {threading.get_ident()}


@pytest.mark.parametrize("E", [5, 40])  # on the calling thread, and side by side on two
def test_loop_under_autocast_computes_in_the_weights_dtype_like_grouped(E, two_threads):
    """CPU bf16 autocast (train.precision=bf16) around an fp32 model: the loop ran bf16 GEMMs into fp32
    buffers and failed; now it computes in fp32, as grouped_mm does (autocast does not cover it)."""
    m, args = _many_experts(E=E)
    plain = _run(m, "loop", *args)
    for backward in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loop, grouped = _run(m, "loop", *args, backward=backward), _run(m, "grouped", *args, backward=backward)
        for a, b, c in zip(loop, grouped, plain):
            assert a.dtype == torch.float32 and torch.equal(a, c)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_expert_threads_work_in_a_forked_child(two_threads):
    """The pool's threads do not survive fork(): a child gets its own pool instead of waiting forever."""
    m, args = _many_experts()
    want = _run(m, "loop", *args, backward=False)[0]  # the parent's pool exists now

    def child():
        os._exit(0 if torch.equal(_run(m, "loop", *args, backward=False)[0], want) else 1)

    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
    assert p.exitcode == 0
