"""Hard-concrete gates (Louizos, Welling & Kingma 2018, "Learning Sparse Neural Networks through L0
Regularization", §4), as SIMoE uses them for its expert masks (Chen et al. 2025, appendix A.1: draws eqs. 4-5,
medians eqs. 6-7, expected L0 eq. 8).

A gate with location log α is s = sigmoid((log u − log(1−u) + log α) / β), u ~ U(0, 1), stretched to
(γ, ζ) and clamped to [0, 1]: exact zeros (and ones) have non-zero probability, and the gate is
differentiable in log α through the reparameterization."""
from __future__ import annotations

import math

import torch

GAMMA, ZETA, BETA = -0.1, 1.1, 2.0 / 3.0  # SIMoE appendix A.1


def _stretch(s: torch.Tensor) -> torch.Tensor:
    return (s * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def sample(log_alpha: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stochastic training gates (eqs. 4-5: s from the concrete distribution, z = min(1, max(0, s)) after the
    stretch to (γ, ζ)): one draw per entry of `log_alpha`."""
    u = torch.rand(log_alpha.shape, generator=generator, device=log_alpha.device, dtype=log_alpha.dtype)
    u = u.clamp(1e-6, 1.0 - 1e-6)
    return _stretch(torch.sigmoid((u.log() - (-u).log1p() + log_alpha) / BETA))


def median(log_alpha: torch.Tensor) -> torch.Tensor:
    """Deterministic evaluation gates (eq. 7): the median of the gate distribution, i.e. the u = 1/2
    draw, clamp(sigmoid(log α / β)(ζ − γ) + γ, 0, 1); exactly 0 when log α ≤ β·logit(−γ/(ζ−γ))."""
    return _stretch(torch.sigmoid(log_alpha / BETA))


def prob_nonzero(log_alpha: torch.Tensor) -> torch.Tensor:
    """P(z ≠ 0) = sigmoid(log α − β log(−γ/ζ)), the closed-form expected L0 of each gate (eq. 8)."""
    return torch.sigmoid(log_alpha - BETA * math.log(-GAMMA / ZETA))


def init_log_alpha(p_zero: float) -> float:
    """log α with P(z = 0) = p_zero (SIMoE appendix B.1 uses 0.05): the inverse of `prob_nonzero`."""
    if not 0.0 < p_zero < 1.0:
        raise ValueError(f"p_zero must be in (0, 1), got {p_zero}")
    return math.log((1.0 - p_zero) / p_zero) + BETA * math.log(-GAMMA / ZETA)
