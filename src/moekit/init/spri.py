from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field

from moekit.errors import ConfigError
from moekit.ffn import ExpertWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext, copies


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


def svd_blocks(w: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """Split w (m, n) into `groups` residuals R_g = U_g S_g V_gᵀ, U_g S_g V_gᵀ built from the g-th
    contiguous block of singular triplets (descending singular values); Σ_g R_g = w.

    Computed from the eigendecomposition of the smaller Gram matrix in float64: for m ≤ n,
    w wᵀ = U S² Uᵀ and R_g = U_g U_gᵀ w (= U_g S_g V_gᵀ), which avoids a full SVD of large matrices.
    """
    w64 = w.double()
    left = w64.shape[0] <= w64.shape[1]
    gram = w64 @ w64.T if left else w64.T @ w64  # (r, r), r = min(m, n)
    with one_thread():
        _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
    vecs = vecs.flip(-1)  # (r, r) columns by descending singular value
    blocks = []
    for b in torch.tensor_split(vecs, groups, dim=1):  # (r, r_g) each: this block's singular subspace
        blocks.append(b @ (b.T @ w64) if left else (w64 @ b) @ b.T)  # projection onto it, (m, n)
    err = (torch.stack(blocks).sum(0) - w64).norm() / w64.norm().clamp_min(1e-30)
    if err > 1e-6:
        raise ArithmeticError(f"SVD partition does not reconstruct the matrix (relative error {err:.2e})")
    return blocks


@EXPERT_INITS.register("spri")
class SPRIInit(ExpertInitConfig):
    """SVD-Partitioned Residual Initialization (Shan et al. 2026, arXiv:2606.16456, eqs. 8-13).

    The shared expert is the dense FFN (set `shared_expert: true`, §3.2). Routed experts copy the
    dense gate/up; the matrix at `placement` (default down, Table 5) is split by SVD into
    G = E/k residuals R_g from disjoint contiguous blocks of singular triplets (eqs. 8-10), and
    routed expert i in group g = i // k gets α_g R_g + ε_i with
    α_g = ρ‖W‖_F / (‖R_g‖_F + δ) (eq. 11) and ε_i ~ N(0, (eps·rms(α_g R_g))²) (eq. 12).
    Routed experts get a zero down bias (the dense bias is the shared expert's), so with ρ = 0 the
    MoE equals the dense model (placement down; gate/up too when the FFN has no biases).
    Different groups are Frobenius-orthogonal, so expert diversity ≈ 1 − same-group pairs / all pairs.
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

    def init_experts(self, ctx: InitContext) -> ExpertWeights:
        d, spec = ctx.dense, ctx.spec
        w = getattr(d, self.placement)
        if w is None:
            raise ConfigError(f"spri placement={self.placement!r} needs a gated FFN; {ctx.path} has no gate")
        k, groups = spec.top_k, spec.num_experts // spec.top_k
        norm, dt = w.double().norm(), torch.promote_types(w.dtype, torch.float32)  # residual + noise math in dt
        scaled = [(self.rho * norm / (r.norm() + self.delta) * r).to(dt) for r in svd_blocks(w, groups)]  # (m, n)
        experts = []
        for i in range(spec.num_experts):
            base = scaled[i // k]
            noise = torch.randn(base.shape, generator=ctx.generator, dtype=dt)  # float32 randn: 6x faster than float64
            resid = base + noise * (self.eps * base.pow(2).mean().sqrt())
            # a residual expert has no constant term: the dense down bias lives in the shared expert only
            zero_b = None if d.down_bias is None else torch.zeros_like(d.down_bias)
            experts.append(replace(d, **{self.placement: resid.to(w.dtype), "down_bias": zero_b}))  # stacked later
        return copies(ctx, experts)
