"""Sparse interpolated modules (SIMoE, Chen et al. 2025, eqs. 2 and 9).

A frozen pretrained module θ_pre gets one shared trainable δ (initialized to 0) and M structured
hard-concrete masks z_i over its input neurons. For routing weights α (per instance or per token) the
effective weight is θ_pre + Σ_i α_i z_i ⊙ δ; because the masks act on input neurons this is computed as
x θ_preᵀ + (m ⊙ x) δᵀ with m = Σ_i α_i z_i, never materializing per-instance weights. With δ = 0 the
module is exactly the pretrained one."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from moekit.simoe import hard_concrete as hc


class Routing:
    """The routing weights every SI module of one model reads: (B, M) per instance, (B, T, M) per token,
    or None (the pretrained model: δ is skipped). Set by the model's router before each forward."""

    def __init__(self):
        self.weights: torch.Tensor | None = None


MASK_KINDS = ("hard_concrete", "real")
GRANULARITIES = ("input", "parameter")


@dataclass
class MaskInit:
    """How masks start (SIMoE B.1): log φ ~ N(μ, std²) with μ giving P(z = 0) = p_zero; and whether training
    samples gates (eqs. 4-5) instead of using their medians (eqs. 6-7, the paper's choice).

    kind "real" is the paper's ablation (c) (Table 4: "we do not impose Sparsity Constraints on the masks z,
    allowing them to be freely optimized as standard trainable parameters with values on the full real axis"):
    the masks are plain parameters, started at the median gates the hard-concrete masks start with (so both
    start from the same model), never clamped, with no sparsity constraint. The parameter keeps the name
    `log_alpha` (the checkpoint format's), but holds the mask values themselves.
    granularity "parameter" is appendix C.1's full-granular masks: one gate per weight entry of a linear
    layer, (M, d_out, d_in), instead of one per input neuron (M, d_in); norms have one gate per entry either
    way."""

    p_zero: float
    std: float
    generator: torch.Generator
    sampled: bool = False
    kind: str = "hard_concrete"
    granularity: str = "input"

    def __post_init__(self):
        if self.kind not in MASK_KINDS or self.granularity not in GRANULARITIES:
            raise ValueError(f"mask kind must be one of {MASK_KINDS} and granularity one of {GRANULARITIES}, "
                             f"got {self.kind!r}, {self.granularity!r}")
        if self.kind == "real" and self.sampled:
            raise ValueError("real-valued masks (ablation (c)) have no hard-concrete draws: use median gates")

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        log_alpha = torch.randn(shape, generator=self.generator) * self.std + hc.init_log_alpha(self.p_zero)
        return hc.median(log_alpha) if self.kind == "real" else log_alpha


class SparseInterpolated(nn.Module):
    """Base of SILinear / SINorm: δ, the masks' log α, and the per-forward mask mixture m."""

    def __init__(self, base: nn.Module, d_in: int, delta_shape: tuple[int, ...], num_experts: int, masks: MaskInit,
                 routing: Routing):
        super().__init__()
        self.base = base.requires_grad_(False)
        w = base.weight
        self.delta = nn.Parameter(torch.zeros(delta_shape, dtype=w.dtype, device=w.device))
        per_param = masks.granularity == "parameter" and len(delta_shape) == 2  # C.1: a gate per weight entry
        self.log_alpha = nn.Parameter(masks.draw((num_experts, *(delta_shape if per_param else (d_in,)))).to(w.device))
        self.sampled = masks.sampled
        self.real = masks.kind == "real"  # ablation (c): log_alpha holds the mask values
        self.per_param = per_param
        self.routing = routing
        self.last_z: torch.Tensor | None = None  # (M, d_in) gates of the last training forward (orthogonality)

    @property
    def num_experts(self) -> int:
        return self.log_alpha.shape[0]

    def __getattr__(self, name: str):
        """What the wrapped module has (its weight, bias, sizes), for code that reads them from it (Mamba reads its
        norm's weight dtype and its projections' biases)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    def gate_values(self) -> torch.Tensor:
        """The deterministic gates: median gates z̄ (eqs. 6-7), or the real-valued masks themselves (c), as a
        view (a plain tensor: kept as last_z it must not become a second registered parameter)."""
        return self.log_alpha.view(self.log_alpha.shape) if self.real else hc.median(self.log_alpha)

    def gates(self) -> torch.Tensor:
        """(M, d_in) (or (M, d_out, d_in) per parameter): median gates z̄ (eqs. 6-7), or in training
        hard-concrete draws when `sampled`; the training gates are kept for the orthogonality penalty."""
        z = hc.sample(self.log_alpha) if self.training and self.sampled else self.gate_values()
        if self.training:
            self.last_z = z
        return z

    def mixture(self, x: torch.Tensor) -> torch.Tensor:
        """m = Σ_i α_i z_i shaped to broadcast against x: (B, 1.., d_in) per instance, (B, T, 1.., d_in)
        per token (inner dims such as Gemma's per-head q/k norms are shared); for an x of rows (N, d_in), each
        instance's (or token's) m repeated over its N / B (or N / BT) consecutive rows."""
        w = self.routing.weights
        m = w.to(self.log_alpha.dtype) @ self.gates()  # (B, d_in) or (B, T, d_in)
        lead = m.shape[:-1]
        if x.dim() == 2 and x.shape[0] != lead[0] and x.shape[0] % lead.numel() == 0:
            # rows flattened from (B, [T,] ..., d_in) in batch-major order (OPT's MLP, Qwen3.5's gated norm)
            m, lead = m.reshape(-1, m.shape[-1]).repeat_interleave(x.shape[0] // lead.numel(), dim=0), x.shape[:1]
        if x.dim() < len(lead) + 1 or tuple(x.shape[:len(lead)]) != tuple(lead):
            raise ValueError(f"SIMoE routing weights {tuple(w.shape)} do not match an input of shape {tuple(x.shape)}")
        return m.reshape(*lead, *[1] * (x.dim() - len(lead) - 1), m.shape[-1]).to(x.dtype)


class SILinear(SparseInterpolated):
    """y = x W_preᵀ + b + (m ⊙ x)[:, keep] δᵀ. After pruning (`prune`), δ and log α keep only the input
    columns some expert uses (`keep`); the dropped ones contributed exact zeros."""

    def __init__(self, base: nn.Linear, num_experts: int, masks: MaskInit, routing: Routing, kept: int | None = None):
        d_in = base.in_features if kept is None else kept
        super().__init__(base, d_in, (base.out_features, d_in), num_experts, masks, routing)
        self.register_buffer("keep", None if kept is None else torch.arange(kept, device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.routing.weights is None:
            return y
        xk = x if self.keep is None else x.index_select(-1, self.keep)
        if self.per_param:
            return y + self._per_param(xk)
        xm = (xk * self.mixture(x)).reshape(-1, xk.shape[-1])  # (N, d_k)
        return y.view(-1, y.shape[-1]).addmm_(xm, self.delta.t()).view(y.shape)  # one GEMM accumulating into y

    def _per_param(self, xk: torch.Tensor) -> torch.Tensor:
        """C.1's full-granular masks: each instance gets its own Σ_i α_i z_i ⊙ δ (d_out, d_k), built here
        (the input-neuron factorization does not apply); per-token routing would need one per token."""
        w = self.routing.weights
        if w.dim() != 2 or xk.shape[0] != w.shape[0]:
            raise ValueError("full-granular SIMoE masks need instance routing: (B, M) weights for inputs (B, ...)")
        m = (w.to(self.log_alpha.dtype) @ self.gates().flatten(1)).view(w.shape[0], *self.delta.shape)  # (B, d_out, d_k)
        eff = (m * self.delta).to(xk.dtype)  # (B, d_out, d_k)
        return torch.einsum("b...k,bok->b...o", xk, eff)  # (B, ..., d_out)

    @torch.no_grad()
    def prune(self) -> None:
        """Drop the input columns whose gate is 0 for every expert (compact export)."""
        z = self.gate_values() != 0  # (M, d_in) or (M, d_out, d_in)
        used = z.flatten(0, -2).any(0)  # (d_in,)
        idx = used.nonzero().squeeze(1)
        self.keep = idx if self.keep is None else self.keep[idx]
        self.delta = nn.Parameter(self.delta[:, idx].contiguous(), requires_grad=self.delta.requires_grad)
        self.log_alpha = nn.Parameter(self.log_alpha[..., idx].contiguous(), requires_grad=self.log_alpha.requires_grad)

    def full_delta(self) -> torch.Tensor:
        """(d_out, in_features) δ with pruned columns as zeros."""
        if self.keep is None:
            return self.delta
        return self.delta.new_zeros(self.base.weight.shape).index_copy(1, self.keep, self.delta)

    def full_gates(self) -> torch.Tensor:
        """(M, in_features) median gates (or real masks; (M, d_out, in_features) per parameter) with pruned
        columns as zeros."""
        z = self.gate_values()
        if self.keep is None:
            return z
        return z.new_zeros(*z.shape[:-1], self.base.in_features).index_copy(z.dim() - 1, self.keep, z)


class SINorm(SparseInterpolated):
    """A norm with weight w_pre + m ⊙ δ (SIMoE applies its experts to norm weights too). Every norm family
    here is affine in its weight, so y(w + d) = y(w) + n(x) ⊙ d with n(x) = y(w=1) − y(w=0), the
    normalized input: works for LayerNorm, RMSNorm and Gemma's (1 + w) RMSNorm alike."""

    def __init__(self, base: nn.Module, num_experts: int, masks: MaskInit, routing: Routing):
        d = base.weight.shape[0]
        super().__init__(base, d, (d,), num_experts, masks, routing)

    def normalized(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        w = self.base.weight
        return functional_call(self.base, {"weight": torch.ones_like(w)}, (x, *args), kwargs) - \
            functional_call(self.base, {"weight": torch.zeros_like(w)}, (x, *args), kwargs)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # args: a gated norm's gate (Qwen3.5)
        y = self.base(x, *args, **kwargs)
        if self.routing.weights is None:
            return y
        # m shaped against the output, where the weight applies: xLSTM's multi-head norm takes (B, T, heads, d_h)
        # and returns (B, T, heads·d_h)
        return y + self.normalized(x, *args, **kwargs) * (self.mixture(y) * self.delta)
