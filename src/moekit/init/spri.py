from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import Field

from moekit.errors import ConfigError
from moekit.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext


@contextmanager
def one_thread() -> Iterator[None]:
    """Run LAPACK single-threaded. Its multithreaded eigh waits on OpenMP barriers and stalls when
    the cores are shared: measured here, a 576² eigh took 0.03 s on 1 thread and 0.2-7 s on 2 threads
    beside two busy processes, and a 2048² one 1.1 s vs 8.6 s on 2 threads of a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


EXACT_LIMIT = 1 << 22  # matrices with more entries use float32 math (SmolLM2's 576 x 1536 stays float64)


class SVDBlocks:
    """The G residuals R_g = U_g U_gᵀ W (= U_g S_g V_gᵀ, SPRI eqs. 10-11) of W (m, n), U_g the g-th contiguous
    block of left singular vectors by descending singular value, so Σ_g R_g = W and ⟨R_g, R_h⟩_F = 0.

    U comes from the eigendecomposition of the smaller Gram matrix (W Wᵀ, or Wᵀ W with V_g when n < m), which
    avoids a full SVD. Small matrices use float64; larger ones float32 with the basis re-orthonormalized once
    (Cholesky QR), which keeps Σ_g R_g = W to ~1e-7 relative and |⟨R_g, R_h⟩| ≲ 1e-8 ‖W‖² (tests/test_spri,
    bench/spri_blocks.py). ‖R_g‖_F comes from the eigenvalues; a block is built only when asked for.
    """

    def __init__(self, w: torch.Tensor, groups: int):
        self.dtype = torch.float64 if w.numel() <= EXACT_LIMIT else torch.float32
        self.w = w.to(self.dtype)
        self.left = w.shape[0] <= w.shape[1]
        gram = self.w @ self.w.T if self.left else self.w.T @ self.w  # (r, r), r = min(m, n)
        with one_thread():
            vals, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
        vecs = vecs.flip(-1)  # (r, r) columns by descending singular value
        if self.dtype == torch.float32:  # one Cholesky-QR pass: orthonormal to float32 precision
            chol = torch.linalg.cholesky(vecs.T @ vecs)  # (r, r)
            vecs = torch.linalg.solve_triangular(chol, vecs.T, upper=False).T
        self.basis = torch.tensor_split(vecs, groups, dim=1)  # (r, r_g) each: one block's singular subspace
        self.sq_norms = [float(v.sum()) for v in torch.tensor_split(vals.flip(-1).clamp_min(0), groups)]

    def __len__(self) -> int:
        return len(self.basis)

    def block(self, g: int) -> torch.Tensor:
        """R_g (m, n): the projection of W onto block g's singular subspace."""
        b = self.basis[g]
        return b @ (b.T @ self.w) if self.left else (self.w @ b) @ b.T


def svd_blocks(w: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """All G residuals of `SVDBlocks`, checked: Σ_g R_g must reconstruct w (1e-6 relative)."""
    parts = SVDBlocks(w, groups)
    blocks = [parts.block(g) for g in range(groups)]
    err = (torch.stack(blocks).sum(0) - parts.w).norm() / parts.w.norm().clamp_min(1e-30)
    if err > 1e-6:
        raise ArithmeticError(f"SVD partition does not reconstruct the matrix (relative error {err:.2e})")
    return blocks


@dataclass
class _SPRIState:
    parts: SVDBlocks
    norm: float  # ‖W‖_F
    group: int = -1  # the group whose scaled block is cached
    scaled: torch.Tensor | None = None  # α_g R_g of that group


@EXPERT_INITS.register("spri")
class SPRIInit(ExpertInitConfig):
    """SVD-Partitioned Residual Initialization (Shan et al. 2026, arXiv:2606.16456, eqs. 8-13).

    The shared expert is the dense FFN (set `shared_expert: true`, §3.2). Routed experts copy the
    dense gate/up; the matrix at `placement` (default down, Table 5) is split by SVD into
    G = E/k residuals R_g from disjoint contiguous blocks of singular triplets (eqs. 10-11), and
    routed expert i in group g = i // k gets α_g R_g + ε_i with α_g = ρ‖W‖_F / (‖R_g‖_F + δ) (eq. 13)
    and ε_i ~ N(0, (eps·rms(α_g R_g))²): the paper says only that ε_i is small; its magnitude (eps) is
    our choice. Routed experts get a zero down bias (the dense bias is the shared expert's), so with
    ρ = 0 the MoE equals the dense model (placement down; gate/up too when the FFN has no biases).
    Different groups are Frobenius-orthogonal, so expert diversity ≈ 1 − same-group pairs / all pairs.
    The experts of a group are built from one cached block: memory holds one R_g at a time.
    """

    method: Literal["spri"] = "spri"
    rho: float = Field(1e-3, ge=0.0)
    delta: float = Field(1e-12, gt=0.0)
    eps: float = Field(1e-2, ge=0.0)
    placement: Literal["down", "gate", "up"] = "down"

    def check(self, spec) -> None:
        if spec.num_experts % spec.top_k:
            raise ValueError(f"spri needs num_experts divisible by top_k to form G = E/k groups; "
                             f"got E={spec.num_experts}, k={spec.top_k}")

    def prepare(self, ctx: InitContext) -> _SPRIState:
        w = getattr(ctx.dense, self.placement)
        if w is None:
            raise ConfigError(f"spri placement={self.placement!r} needs a gated FFN; {ctx.path} has no gate")
        parts = SVDBlocks(w, ctx.spec.num_experts // ctx.spec.top_k)
        return _SPRIState(parts, float(w.double().norm()))

    def expert(self, ctx: InitContext, state: _SPRIState, i: int) -> FFNWeights:
        d = ctx.dense
        w = getattr(d, self.placement)
        g = i // ctx.spec.top_k
        if state.group != g:
            state.scaled = None  # free the previous group's block first
            r = state.parts.block(g)
            alpha = self.rho * state.norm / (math.sqrt(state.parts.sq_norms[g]) + self.delta)
            state.group, state.scaled = g, (alpha * r).to(w.dtype)  # (m, n)
        base = state.scaled
        noise = torch.randn(base.shape, generator=ctx.generator, dtype=base.dtype).to(base.device)
        resid = base + noise * (self.eps * base.pow(2).mean().sqrt())
        # a residual expert has no constant term: the dense down bias lives in the shared expert only
        zero_b = None if d.down_bias is None else torch.zeros_like(d.down_bias)
        return replace(d, **{self.placement: resid, "down_bias": zero_b})
