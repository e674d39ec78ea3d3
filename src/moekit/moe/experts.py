"""Stacked routed experts with grouped (sort-by-expert) dispatch.

Weights are stored like transformers v5: gated `gate_up` (E, 2I, H) = [gate; up] along dim 1, or
non-gated `up` (E, I, H); `down` (E, H, I); optional biases (E, 2I | I) and (E, H).

Dispatch sorts the T*k (token, slot) pairs by expert (no host sync, no atomics: on a GPU moekit's Triton counting
sort, `triton_experts.sort_by_expert`; elsewhere a stable argsort, moekit.moe.permute), then takes one of three
paths (`Experts.dispatch`):

- "triton": moekit's Triton kernels (moekit.moe.triton_experts), the default on CUDA for gated SiLU experts
  without biases: the token gather, gate_up GEMM, SwiGLU and routing weight fused in one kernel, the down GEMM
  writing rows back to their slots, grouped_mm in the backward (measured on an H200: BENCHMARKS.md). Without
  autograd and with at most E slots (decoding), two matrix-vector kernels instead, with no sort at all.

- "grouped": one grouped matmul per projection (`torch.nn.functional.grouped_mm`), so the backward
  writes every expert's weight gradient into one tensor instead of materializing a full-size zero
  gradient per expert (transformers' `eager` loop). Few kernel launches: the path for GPUs and for
  small groups, where a Python loop's per-expert overhead would dominate.
- "loop": one plain GEMM pair per expert that got tokens (`ExpertLoop`), on CPU once every hit expert
  has enough rows. Each expert's temporaries are small and stay in cache, and no (T*k, H) gather/scatter
  buffers are allocated (fresh buffers over glibc's 32 MB mmap threshold pay page faults on every call);
  the backward writes each expert's gradient straight into its row of one buffer, reusing the memory of
  the weight's dropped last gradient (`_grad_buffer`). With many hit experts they run side by side on one
  thread per core (`_by_expert_threads`). Measured at E=64/top-8 and 4096 tokens (BENCHMARKS.md,
  bench/moe_layer.py): fwd+bwd 1.14x the k x dense limit, grouped 2.21x; slower than grouped below ~2^24
  multiply-adds per hit expert.
"""
from __future__ import annotations

import functools
import itertools
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers.activations import ACT2FN

from moekit.moe.ffn import ExpertWeights
from moekit.moe import triton_experts
from moekit.moe.permute import Combine, Gather, sort_by_expert


def _groupable(x: Tensor, weight: Tensor) -> bool:
    """grouped_mm needs 16-byte aligned rows and pointers (x (S, in), weight (E, out, in))."""
    n = 16 // x.element_size()
    return (x.shape[0] > 0 and x.shape[1] % n == 0 and weight.shape[1] % n == 0
            and x.is_contiguous() and weight.is_contiguous()
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def _contiguous_grad(t: Tensor) -> Tensor:
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())  # grouped_mm's backward rejects stride-0 grads
    return t


@functools.cache
def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm computes forward and backward in `dtype` on `device`: always on the CPU; on CUDA it
    depends on the GPU's architecture and the dtype, so it is tried once on a tiny product (16 x 16, 2 experts).
    Where it fails, grouped_linear runs one matmul per expert instead (same result, more kernel launches). Where
    it runs on CUDA in another dtype than bf16, torch itself runs it by a per-group fallback that reads the offsets
    back to the host, a sync per call (its CUTLASS kernels are bf16 only).
    The probe's upstream gradient is a dense tensor, as a real one is: `.sum().backward()` would hand
    grouped_mm's backward a stride-0 gradient, which it always rejects (so the probe said no on every GPU)."""
    return device.type == "cpu" or _grouped_mm_works(device, dtype)


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """The probe itself, with autograd on whatever the caller's mode: a first call under no_grad (a prefill, an
    evaluation) made its backward fail and cached "no", so every later call took the per-expert fallback."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            y = F.grouped_mm(x, w, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
            y.backward(torch.ones_like(y))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_linear(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """x (S, in) sorted by expert, weight (E, out, in), offs (E,) cumulative counts -> (S, out)."""
    w_t = weight.transpose(1, 2)  # (E, in, out) view
    if _groupable(x, weight) and grouped_mm_runs(x.device, x.dtype):
        return _contiguous_grad(F.grouped_mm(x, w_t, offs=offs))
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    parts = [xi @ w_t[e] for e, xi in enumerate(x.split(counts)) if xi.shape[0] > 0]  # odd shapes, or no grouped_mm
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


class WeightedSwiGLU(torch.autograd.Function):
    """y = silu(g) ⊙ u ⊙ w for h = [g | u] (S, 2I) and routing weights w (S, 1) or None.

    Same math as autograd on `silu(g) * u * w`, but the backward writes dg and du straight into one
    (S, 2I) gradient buffer (no concatenation of the two halves) with fused silu_backward.
    """

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor | None) -> Tensor:
        g, u = h.chunk(2, dim=-1)  # (S, I) each
        a = F.silu(g)  # (S, I)
        au = a * u  # (S, I)
        ctx.save_for_backward(h, a, au, w)
        return au if w is None else au * w

    @staticmethod
    def backward(ctx, dy: Tensor):
        h, a, au, w = ctx.saved_tensors
        g, u = h.chunk(2, dim=-1)
        dyw = dy if w is None else dy * w  # (S, I)
        dh = torch.empty_like(h)  # (S, 2I)
        dg, du = dh.chunk(2, dim=-1)
        torch.mul(dyw, a, out=du)
        torch.ops.aten.silu_backward.grad_input(dyw * u, g, grad_input=dg)
        dw = None if w is None else torch.linalg.vecdot(dy, au).unsqueeze(-1)  # (S, 1)
        return dh, dw


# multiply-adds of one hit expert's first projection (rows * H * I) from which the per-expert loop beats
# grouped_mm on CPU (measured at E=8/H=1024/I=3072 and E=64/H=512/I=384, 1 to 4096 tokens)
LOOP_WORK = 2**24


def _hit_groups(offs: list[int]):
    """(expert, rows slice) of every expert that got rows; offs (E+1,) cumulative counts from 0."""
    return [(e, slice(a, b)) for e, (a, b) in enumerate(zip(offs[:-1], offs[1:])) if b > a]


# hit experts per intra-op thread from which _by_expert_threads runs experts side by side (2 threads, fwd+bwd
# against one expert after another: 8 hit experts 6-19 % slower, 32 a tie to 5 % faster, 64 5-9 % faster)
PARALLEL_EXPERTS = 16


def _by_expert_threads(fn, groups: list, x: Tensor) -> list:
    """[fn(part) for each part of `groups`]: on CPU with n ≥ 2 intra-op threads and ≥ PARALLEL_EXPERTS·n
    groups, the groups are dealt round-robin into n parts, each run on its own Python thread with one
    intra-op thread (one expert's small GEMMs per core, no barrier between the cores). torch's thread count
    is process-wide: it is set back afterwards. The workers record no autograd graph and keep the caller's
    inference mode. Otherwise [fn(groups)] on the calling thread."""
    n = torch.get_num_threads()
    if x.device.type != "cpu" or n < 2 or len(groups) < PARALLEL_EXPERTS * n:
        return [fn(groups)]
    inference = torch.is_inference_mode_enabled()

    def work(part):
        with torch.inference_mode(inference), torch.no_grad():
            return fn(part)

    key = (os.getpid(), n)  # a forked child inherits the pool object but none of its threads
    if key not in _POOLS:  # persistent: a new thread's malloc arena would be unmapped and faulted in again
        _POOLS[key] = ThreadPoolExecutor(n, thread_name_prefix="moekit-experts")
    torch.set_num_threads(1)
    try:
        futures = [_POOLS[key].submit(work, groups[i::n]) for i in range(n)]
        wait(futures)  # every part finished, also when one raised: no worker runs on after this returns
        return [f.result() for f in futures]
    finally:
        torch.set_num_threads(n)


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _sum(parts: list[Tensor]) -> Tensor:
    return functools.reduce(lambda a, b: a.add_(b), parts)


# the memory of each expert weight's last gradient from ExpertLoop, reused once nothing else holds it
_GRAD_MEMORY = WeakIdKeyDictionary()


def _grad_buffer(weight: Tensor, offs: list[int]) -> Tensor:
    """A gradient for weight (E, ...): hit experts' rows are written whole by one GEMM each, so only the
    rows of experts without tokens are zeroed.

    For a leaf weight whose .grad is None (the buffer becomes .grad), the last such buffer's memory is
    reused when no tensor refers to it any more: after zero_grad(set_to_none=True) a fresh buffer over
    glibc's 32 MB mmap threshold would be page-faulted in again on every step. Between steps that memory
    stays allocated, as zero_grad(set_to_none=False) would keep it."""
    reuse = weight.is_leaf and weight.grad is None
    memory = _GRAD_MEMORY.get(weight) if reuse else None
    if (memory is not None and memory.device == weight.device and memory.nbytes() == weight.nbytes
            and torch._C._storage_Use_Count(memory._cdata) == 1):  # only this cache refers to it
        buf = weight.new_empty(0).set_(memory, 0, weight.shape)
    else:
        buf = weight.new_empty(weight.shape)
        if reuse:
            _GRAD_MEMORY[weight] = buf.untyped_storage()
    for e, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        if a == b:
            buf[e].zero_()
    return buf


class ExpertLoop(torch.autograd.Function):
    """Gated-SiLU experts without biases, one GEMM pair per hit expert (see the module docstring).

    x (T, H), w (S, 1) routing weights and token (S,) in expert order, first (E, 2I, H), down (E, H, I),
    offs (E+1,) list -> y (T, H) = Σ_slots scatter(down_e (silu(g) ⊙ u ⊙ w)). Saved per hit expert: the
    pre-activation [g | u] (n, 2I), silu(g) and silu(g) ⊙ u (n, I) each, what autograd keeps for a dense
    FFN; per-expert tensors stay under glibc's mmap threshold (32 MB), so their pages are reused from step
    to step instead of faulted in afresh as one (S, 2I) buffer's are.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, first: Tensor, down: Tensor, token: Tensor, offs: list[int]) -> Tensor:
        groups = _hit_groups(offs)

        def run(part):  # -> partial y (T, H), {expert: saved tensors}
            y, saved = x.new_zeros(x.shape), {}
            for e, rows in part:
                tok = token[rows]  # (n,)
                h = torch.mm(x.index_select(0, tok), first[e].t())  # (n, 2I)
                g, u = h.chunk(2, dim=-1)  # (n, I) each
                sg = F.silu(g)
                a = sg * u  # (n, I) unweighted activation
                y.index_add_(0, tok, torch.mm(a * w[rows], down[e].t()))  # (n, H)
                saved[e] = (h, sg, a)
            return y, saved

        parts = _by_expert_threads(run, groups, x)
        saved = {e: t for _, part in parts for e, t in part.items()}
        ctx.save_for_backward(x, w, first, down, token, *(t for e, _ in groups for t in saved[e]))
        ctx.offs = offs
        return _sum([y for y, _ in parts])

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, first, down, token, *flat = ctx.saved_tensors
        need_x, need_w, need_first, need_down = ctx.needs_input_grad[:4]
        groups = _hit_groups(ctx.offs)
        saved = {e: flat[3 * i: 3 * i + 3] for i, (e, _) in enumerate(groups)}  # (n, 2I), (n, I), (n, I)
        dw = torch.empty_like(w) if need_w else None  # (S, 1)
        dfirst = _grad_buffer(first, ctx.offs) if need_first else None  # (E, 2I, H)
        ddown = _grad_buffer(down, ctx.offs) if need_down else None  # (E, H, I)

        def run(part):  # -> partial dx (T, H); writes the part's rows of dw, dfirst, ddown
            dx = torch.zeros_like(x) if need_x else None
            for e, rows in reversed(part):  # the forward's last experts first: still in cache
                h, sg, a = saved[e]
                tok, we = token[rows], w[rows]  # (n,), (n, 1)
                dye = dy.index_select(0, tok)  # (n, H)
                if need_down:
                    torch.mm(dye.t(), a * we, out=ddown[e])  # (H, I)
                da = torch.mm(dye, down[e])  # (n, I)
                if need_w:
                    torch.linalg.vecdot(da, a, out=dw[rows, 0])
                da.mul_(we)
                g, u = h.chunk(2, dim=-1)  # (n, I) each
                dh = torch.empty_like(h)  # (n, 2I)
                dg, du = dh.chunk(2, dim=-1)
                torch.mul(da, sg, out=du)
                torch.ops.aten.silu_backward.grad_input(da.mul_(u), g, grad_input=dg)
                if need_first:
                    torch.mm(dh.t(), x.index_select(0, tok), out=dfirst[e])  # (2I, H)
                if need_x:
                    dx.index_add_(0, tok, torch.mm(dh, first[e]))  # (n, H)
            return dx

        with torch.autocast(dy.device.type, enabled=False):  # a backward called under autocast: as the forward
            dxs = _by_expert_threads(run, groups, x)
        return _sum(dxs) if need_x else None, dw, dfirst, ddown, None, None


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str,
                 gated: bool = True, bias: bool = False):
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.act, self.gated = act, gated
        self.act_fn = ACT2FN[act]
        # "auto": by device and size (_use_triton, _use_loop); the others force a path
        self.dispatch: Literal["auto", "grouped", "loop", "triton"] = "auto"
        first = 2 * I if gated else I
        self.register_parameter("gate_up" if gated else "up", nn.Parameter(torch.zeros(E, first, H)))
        self.down = nn.Parameter(torch.zeros(E, H, I))
        self.first_bias = nn.Parameter(torch.zeros(E, first)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(E, H)) if bias else None

    @property
    def first(self) -> Tensor:
        """The input projection: gate_up (E, 2I, H) or up (E, I, H)."""
        return self.gate_up if self.gated else self.up

    @classmethod
    def from_weights(cls, w: ExpertWeights) -> Experts:
        """Experts holding a copy of `w`, in w's dtype; each parameter is written once (no zero fill,
        no temporary for the gate/up concatenation)."""
        E, I, H = w.up.shape
        has_bias = w.up_bias is not None or w.down_bias is not None
        with torch.device("meta"):
            m = cls(E, H, I, w.act, gated=w.gate is not None, bias=has_bias).to(w.up.dtype)
        m.to_empty(device=w.up.device)
        with torch.no_grad():
            if m.gated:
                torch.cat([w.gate, w.up], dim=1, out=m.first)
            else:
                m.first.copy_(w.up)
            m.down.copy_(w.down)
            if has_bias:
                zeros = w.up.new_zeros(E, I)
                up_b = w.up_bias if w.up_bias is not None else zeros
                gate_b = w.gate_bias if w.gate_bias is not None else zeros
                m.first_bias.copy_(torch.cat([gate_b, up_b], dim=1) if m.gated else up_b)
                m.down_bias.copy_(w.down_bias if w.down_bias is not None else w.up.new_zeros(E, H))
        return m

    def to_weights(self) -> ExpertWeights:
        I = self.intermediate_size
        first, fb = self.first.detach(), None if self.first_bias is None else self.first_bias.detach()
        return ExpertWeights(
            up=first[:, I:] if self.gated else first, down=self.down.detach(), act=self.act,
            gate=first[:, :I] if self.gated else None,
            up_bias=None if fb is None else (fb[:, I:] if self.gated else fb),
            gate_bias=None if fb is None or not self.gated else fb[:, :I],
            down_bias=None if self.down_bias is None else self.down_bias.detach(),
        )

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                shared: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None) -> Tensor:
        """x (T, H), topk_ids (T, k), topk_weights (T, k) -> (T, H). `shared`: a shared expert's weights that the
        decode kernels add (triton_experts.decode_experts); only where `decoding` is true."""
        if self.decoding(x, topk_ids, topk_weights):
            return triton_experts.decode_experts(x, topk_ids, topk_weights, self.first, self.down, shared)
        if shared is not None:
            raise ValueError("a shared expert is added inside the experts only by the decode kernels (decoding())")
        k = topk_ids.shape[1]
        grad = self._records_grad(x, topk_weights)
        triton = self._use_triton(x)
        order, counts, weight = self._sort(x, topk_ids, topk_weights, grad)  # (S,) slots by expert, S = T*k; (E,)
        if triton:
            return triton_experts.triton_experts(x, weight, self.first, self.down, order, counts, k)
        if self._use_loop(x, counts, grad):
            offs = [0, *itertools.accumulate(counts.tolist())]  # (E+1,)
            with torch.autocast(x.device.type, enabled=False):  # in x's dtype, as grouped_mm (autocast skips it)
                if grad:
                    return ExpertLoop.apply(x, weight, self.first, self.down, order // k, offs)
                return self._loop(x, weight, order // k, offs)
        offs = torch.cumsum(counts, 0).to(torch.int32)  # (E,)
        return self._grouped(x, weight, order, k, topk_ids.reshape(-1)[order], offs)

    def decoding(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> bool:
        """Whether `forward` runs the decode kernels on these inputs (Triton, no autograd, T·k ≤ E)."""
        return (triton_experts.decodes(topk_ids.numel(), self.num_experts) and not self._records_grad(x, topk_weights)
                and self._use_triton(x))

    def _records_grad(self, x: Tensor, topk_weights: Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad
                                            or any(p.requires_grad for p in self.parameters()))

    def _sort(self, x: Tensor, ids: Tensor, weights: Tensor, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        """order (S,) the slots by expert, counts (E,), the routing weights in that order (S, 1) in x's dtype.
        Where moekit's Triton kernels run (a GPU), the sort is their counting sort, which also gathers the
        weights when no gradient is recorded: one kernel launch for the whole routing metadata of a few tokens.
        Where it cannot compile, a stable argsort (moekit.moe.permute) gives the same order."""
        counted = None
        if triton_experts.available(x.device) and (x.device.type == "cuda" or self.dispatch == "triton"):
            counted = triton_experts.sort_by_expert(ids, self.num_experts, None if grad else weights, x.dtype)
        if counted is not None and not grad:
            return counted
        order, counts = counted[:2] if counted is not None else sort_by_expert(ids, self.num_experts)
        return order, counts, weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)  # (S, 1), with its gradient

    def _loop_trainable(self) -> bool:
        """ExpertLoop's hand-written backward covers gated SiLU experts without biases."""
        return self.gated and self.act == "silu" and self.first_bias is None and self.down_bias is None

    def _use_triton(self, x: Tensor) -> bool:
        """moekit's Triton kernels (moe/triton_experts.py): on CUDA where triton imports, for gated SiLU
        experts without biases in x's dtype and grouped_mm for the backward; or forced by `dispatch`."""
        if self.dispatch not in ("auto", "triton") or (self.dispatch == "auto" and x.device.type != "cuda"):
            return False  # first: asked up to 3 times per layer forward (decoding, forward, MoELayer._decode_shared)
        fits = (self._loop_trainable() and x.dtype == self.first.dtype and triton_experts.available(x.device)
                and _groupable(x, self.first) and self.intermediate_size % (16 // x.element_size()) == 0
                and grouped_mm_runs(x.device, x.dtype))
        if self.dispatch == "triton" and not fits:
            raise ValueError("dispatch='triton' needs gated SiLU experts without biases, triton on a CUDA device "
                             "(or TRITON_INTERPRET=1), x in the experts' dtype and 16-byte aligned rows")
        return fits

    def _use_loop(self, x: Tensor, counts: Tensor, grad: bool) -> bool:
        """The per-expert loop: on CPU, when each hit expert has ≥ LOOP_WORK multiply-adds (or forced by
        `dispatch`); with autograd recording, only where ExpertLoop has a backward."""
        if self.dispatch != "auto":
            forced = self.dispatch == "loop"
        elif x.device.type != "cpu":
            forced = False  # grouped_mm, without reading the routing back to the host
        else:
            n = counts.tolist()  # (E,)
            rows = sum(n) / max(sum(map(bool, n)), 1)  # mean rows per hit expert
            forced = rows * self.hidden_size * self.intermediate_size >= LOOP_WORK
        return forced and (self._loop_trainable() or not grad)

    def _loop(self, x: Tensor, weight: Tensor, token: Tensor, offs: list[int]) -> Tensor:
        """Inference loop over the hit experts, any activation and biases; same arithmetic as ExpertLoop
        (routing weight on the intermediate unless there is a down bias)."""
        I, first, down = self.intermediate_size, self.first, self.down

        def run(part):  # -> partial y (T, H)
            y = x.new_zeros(x.shape)
            for e, rows in part:
                tok = token[rows]  # (n,)
                fb = None if self.first_bias is None else self.first_bias[e]
                h = F.linear(x.index_select(0, tok), first[e], fb)  # (n, 2I | I)
                a = self.act_fn(h[:, :I]) * h[:, I:] if self.gated else self.act_fn(h)  # (n, I)
                if self.down_bias is None:
                    y.index_add_(0, tok, F.linear(a * weight[rows], down[e]))  # (n, H)
                else:
                    y.index_add_(0, tok, F.linear(a, down[e], self.down_bias[e]) * weight[rows])
            return y

        return _sum(_by_expert_threads(run, _hit_groups(offs), x))

    def _grouped(self, x: Tensor, weight: Tensor, order: Tensor, k: int, expert: Tensor, offs: Tensor) -> Tensor:
        """grouped_mm dispatch; order (S,) the slots by expert, expert (S,) their expert ids, offs (E,) int32
        cumulative counts. The token gather and the sum over each token's k slots are deterministic (permute)."""
        h = grouped_linear(Gather.apply(x, order, k), self.first, offs)  # (S, 2I | I)
        if self.first_bias is not None:
            h = h + self.first_bias.index_select(0, expert)  # (S, 2I | I)
        # scale by the routing weight on the narrower side: w·(D h) = D (w·h) when there is no down bias
        early = self.down_bias is None and self.intermediate_size <= self.hidden_size
        if self.gated and self.act == "silu" and triton_experts.available(h.device) and h.device.type == "cuda":
            early = self.down_bias is None  # fused into the kernel: the weight costs no pass of its own
            h = triton_experts.SwiGLU.apply(h, weight if early else None)  # (S, I)
        elif self.gated and self.act == "silu":
            h = WeightedSwiGLU.apply(h, weight if early else None)  # (S, I)
        else:
            if self.gated:
                gate, up = h.chunk(2, dim=-1)  # (S, I) each
                h = self.act_fn(gate) * up  # (S, I)
            else:
                h = self.act_fn(h)
            if early:
                h = h * weight  # (S, I)
        y = grouped_linear(h, self.down, offs)  # (S, H)
        if self.down_bias is not None:
            y = y + self.down_bias.index_select(0, expert)  # (S, H)
        if not early:
            y = y * weight  # (S, H)
        return Combine.apply(y, order, k)  # (T, H)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"act={self.act}, gated={self.gated}, bias={self.first_bias is not None}")
