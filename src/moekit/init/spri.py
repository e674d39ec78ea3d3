from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import Field

from moekit.errors import ConfigError
from moekit.moe.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext


SMALL_EIGH = 2048  # eigh of matrices up to this size runs single-threaded (see one_thread)


@contextmanager
def one_thread(active: bool = True) -> Iterator[None]:
    """Run LAPACK single-threaded. Its multithreaded eigh waits on OpenMP barriers and stalls when
    the cores are shared: measured here, a 576² eigh took 0.03 s on 1 thread and 0.2-7 s on 2 threads
    beside two busy processes, and a 2048² one 1.1 s vs 8.6 s on 2 threads of a busy 2-core machine. Larger
    ones gain from the threads (4096²: 9.3 s on 1, 5.1 s on 2 idle cores), so callers pass active=False."""
    n = torch.get_num_threads()
    if active:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


EXACT_LIMIT = 1 << 22  # matrices with more entries use float32 math (SmolLM2's 576 x 1536 stays float64)


def eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a symmetric matrix. Large float32 ones on the CPU go to
    SciPy's divide-and-conquer LAPACK (OpenBLAS): 4.5 s for 4096² here against 6.2-8.1 s for torch's (MKL),
    interleaved; small ones run single-threaded (see one_thread); CUDA tensors stay with torch."""
    if gram.device.type == "cpu" and gram.dtype == torch.float32 and gram.shape[0] > SMALL_EIGH:
        import scipy.linalg

        vals, vecs = scipy.linalg.eigh(gram.numpy(), driver="evd", check_finite=False)
        return torch.from_numpy(vals), torch.from_numpy(vecs)
    with one_thread(gram.shape[0] <= SMALL_EIGH):
        return torch.linalg.eigh(gram)


def orthonormal(b: torch.Tensor) -> torch.Tensor:
    """The columns of b (r, c) made orthonormal by one Cholesky-QR pass (same span)."""
    chol = torch.linalg.cholesky(b.T @ b)  # (c, c)
    return torch.linalg.solve_triangular(chol, b.T, upper=False).T


class SVDBlocks:
    """The G residuals R_g = U_g U_gᵀ W (= U_g S_g V_gᵀ, SPRI eqs. 10-11) of W (m, n), U_g the g-th contiguous
    block of left singular vectors by descending singular value, so Σ_g R_g = W and ⟨R_g, R_h⟩_F = 0.

    U comes from the eigendecomposition of the smaller Gram matrix (W Wᵀ, or Wᵀ W with V_g when n < m), which
    avoids a full SVD. Small matrices use float64; larger ones float32, each block's basis re-orthonormalized
    once (Cholesky QR: float32 eigenvectors are orthonormal only to ~4e-6 within a block, ~1e-6 across). Blocks are built when asked for; in float32, asked in order, the last is W minus the others
    (an exact sum, and one projection saved). Measured on a 4096 x 14336 matrix (bench/spri_blocks.py): Σ_g R_g = W to ~5e-7
    relative, |⟨R_g, R_h⟩| ≲ 1e-10 ‖W‖². ‖R_g‖_F comes from the eigenvalues.
    """

    def __init__(self, w: torch.Tensor, groups: int):
        self.dtype = torch.float64 if w.numel() <= EXACT_LIMIT else torch.float32
        self.w = w.to(self.dtype)
        self.left = w.shape[0] <= w.shape[1]
        gram = self.w @ self.w.T if self.left else self.w.T @ self.w  # (r, r), r = min(m, n)
        vals, vecs = eigh(gram)  # ascending eigenvalues
        del gram
        vecs = vecs.flip(-1)  # (r, r) columns by descending singular value
        self.basis = [orthonormal(b) if self.dtype == torch.float32 else b  # (r, r_g): block g's singular subspace
                      for b in torch.tensor_split(vecs, groups, dim=1)]
        self.sq_norms = [float(v.sum()) for v in torch.tensor_split(vals.flip(-1).clamp_min(0), groups)]
        self._sum, self._built = None, set()  # running Σ of the blocks built in order

    def __len__(self) -> int:
        return len(self.basis)

    def block(self, g: int) -> torch.Tensor:
        """R_g (m, n): the projection of W onto block g's singular subspace."""
        last = len(self.basis) - 1
        if g == last and self._built == set(range(last)) and self._sum is not None:
            r = self.w - self._sum
            self._sum = None
            return r
        b = self.basis[g]
        r = b @ (b.T @ self.w) if self.left else (self.w @ b) @ b.T
        if self.dtype == torch.float32 and g == len(self._built) and g < last:  # float64 projections are exact
            self._sum = r.clone() if self._sum is None else self._sum.add_(r)
            self._built.add(g)
        return r


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

    `dense_as: routed` is the paper's "w/o shared expert" ablation (Table 3, A.3): instead of the shared
    expert, the dense FFN is routed expert 0 and experts 1..E-1 are the residual experts (G = (E-1)/k).
    `group_size` sets the experts per group where it should not be top_k (the paper: "we use the routing
    Top-k as the expert group size"), e.g. that ablation at equal active parameters: 9 routed experts, top-3,
    the same 4 groups of 2 as the model with a shared expert.

    `target_diversity` sets ε from the diversity wanted at initialization instead of `eps` (SPRI Table 1
    reports 88.02 %, which the default eps = 0.01 does not give: 0.857 at E = 8, k = 2). A same-group pair
    has cosine 1/(1 + eps²) (‖ε_i‖ = eps·‖α_g R_g‖, independent draws), different groups are orthogonal, so
    diversity = 1 − s/(1 + eps²) with s = same-group pairs / all pairs (4/28 at E = 8, k = 2), and
    eps = √(s/(1 − D) − 1): 0.4387 for D = 0.8802, i.e. ε_i ≈ 0.44 × the residual's rms.
    """

    method: Literal["spri"] = "spri"
    rho: float = Field(1e-3, ge=0.0)
    delta: float = Field(1e-12, gt=0.0)
    eps: float = Field(1e-2, ge=0.0)
    target_diversity: float | None = Field(None, gt=0.0, lt=1.0)  # replaces eps (closed form above); Table 1: 0.8802
    placement: Literal["down", "gate", "up"] = "down"
    dense_as: Literal["shared", "routed"] = "shared"
    group_size: int | None = Field(None, ge=1)  # experts per SVD group; None: top_k (the paper)

    def residual_experts(self, spec) -> int:
        return spec.num_experts - (self.dense_as == "routed")

    def group(self, spec) -> int:
        return self.group_size or spec.top_k

    def same_group_share(self, spec) -> float:
        """s: the share of residual-expert pairs that fall in one group, G·C(g, 2) / C(n, 2)."""
        n, g = self.residual_experts(spec), self.group(spec)
        return (n // g) * g * (g - 1) / (n * (n - 1)) if n > 1 else 0.0

    def noise_scale(self, spec) -> float:
        """eps, or the eps that gives `target_diversity` (see the class docstring)."""
        if self.target_diversity is None:
            return self.eps
        return math.sqrt(self.same_group_share(spec) / (1.0 - self.target_diversity) - 1.0)

    def check(self, spec) -> None:
        if self.dense_as == "shared" and not spec.shared_expert:
            raise ValueError("spri keeps the dense FFN as the shared expert (eq. 8): set shared_expert: true, or "
                             "init.dense_as: routed for the paper's 'w/o shared expert' ablation (A.3)")
        if self.dense_as == "routed" and spec.shared_expert:
            raise ValueError("spri with dense_as: routed puts the dense FFN among the routed experts; set "
                             "shared_expert: false")
        n, g = self.residual_experts(spec), self.group(spec)
        if n < 1 or n % g:
            what = "group_size" if self.group_size else "top_k"
            raise ValueError(f"spri needs its {n} residual experts divisible by {what} to form G = {n}/{g} groups; "
                             f"got E={spec.num_experts}, k={spec.top_k}, group_size={self.group_size}, "
                             f"dense_as={self.dense_as}")
        if self.target_diversity is not None:
            if self.dense_as == "routed":
                raise ValueError("spri: target_diversity has a closed form only with the dense FFN as the shared "
                                 "expert (the routed dense expert's cosines depend on the spectrum); set eps instead")
            lo = 1.0 - self.same_group_share(spec)
            if not lo < self.target_diversity:
                raise ValueError(f"spri: target_diversity must exceed {lo:.6g}, the diversity with eps = 0 at "
                                 f"{n} residual experts in groups of {g}")

    def prepare(self, ctx: InitContext) -> _SPRIState:
        w = getattr(ctx.dense, self.placement)
        if w is None:
            raise ConfigError(f"spri placement={self.placement!r} needs a gated FFN; {ctx.path} has no gate")
        parts = SVDBlocks(w, self.residual_experts(ctx.spec) // self.group(ctx.spec))
        return _SPRIState(parts, float(w.double().norm()))

    def expert(self, ctx: InitContext, state: _SPRIState, i: int) -> FFNWeights:
        d = ctx.dense
        if self.dense_as == "routed":
            if i == 0:
                return d  # the dense FFN as a routed expert
            i -= 1
        w = getattr(d, self.placement)
        g = i // self.group(ctx.spec)
        if state.group != g:
            state.scaled = None  # free the previous group's block first
            alpha = self.rho * state.norm / (math.sqrt(state.parts.sq_norms[g]) + self.delta)
            state.group, state.scaled = g, state.parts.block(g).mul_(alpha).to(w.dtype)  # α_g R_g (m, n)
        base = state.scaled
        noise = torch.randn(base.shape, generator=ctx.generator, dtype=base.dtype).to(base.device)
        rms = torch.linalg.vector_norm(base) / math.sqrt(base.numel())  # no (m, n) temporary
        resid = noise.mul_(self.noise_scale(ctx.spec) * rms).add_(base)  # in place: one (m, n) per expert
        # a residual expert has no constant term: the dense down bias lives in the shared expert only
        zero_b = None if d.down_bias is None else torch.zeros_like(d.down_bias)
        return replace(d, **{self.placement: resid, "down_bias": zero_b})
