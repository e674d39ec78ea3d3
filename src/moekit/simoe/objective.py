"""SIMoE training objective (Chen et al. 2025, eqs. 3 and 10-13):

    min_θ max_{λ ≥ 0}  NLL(θ) + β Σ_l ‖Z_l Z_lᵀ − I‖_2 + λ (τ − (1 − L0(Z)))

L0(Z) is the expected fraction of non-zero mask entries (eq. 8 per gate, averaged over every mask entry:
the constraint is on mask sparsity, eq. 3 / A.2); `sparsity: params` weights each gate by the δ parameters
it switches instead. The orthogonality penalty is the spectral norm (§3.1); `ortho_norm: frobenius` is
the alternative. Model parameters take gradient descent steps (the Trainer's optimizer); λ takes projected
gradient ascent steps λ ← max(0, λ + η g) on the constraint violation g = τ − (1 − L0) (eq. 13), and is
reset to 0 as soon as the constraint holds (Gallego-Posada et al. 2022).

This is the whole dual: one scalar updated after each optimizer step. cooper-optim would own the primal
optimizer as well, which transformers' Trainer already owns, so the update is implemented here."""
from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from moekit.simoe import hard_concrete as hc
from moekit.simoe.layer import SILinear
from moekit.simoe.model import SIMoE, si_modules


def constrained(model: nn.Module) -> bool:
    """Whether the sparsity constraint applies: not to ablation (c)'s real-valued masks (Table 4: "we do not
    impose Sparsity Constraints on the masks"), where λ stays 0."""
    return not any(m.real for _, m in si_modules(model))


def density(model: nn.Module, weighting: str | None = None) -> torch.Tensor:
    """L0(Z) (differentiable): the expected fraction of non-zero mask entries over all SI modules (eq. 8 per
    gate); with weighting "params", of non-zero expert parameters (each gate counts the δ rows it switches;
    a full-granular gate switches one). Default: the model's `simoe.sparsity`. Real-valued masks (ablation
    (c)): the fraction of entries that are not exactly 0 (not differentiable; there is no constraint)."""
    weighting = weighting or model.simoe.cfg.sparsity
    nonzero, total = 0.0, 0
    for _, m in si_modules(model):
        per_gate = isinstance(m, SILinear) and weighting == "params" and not m.per_param
        rows = m.delta.shape[0] if per_gate else 1  # weight per gate
        p = (m.log_alpha.detach() != 0).to(m.log_alpha.dtype) if m.real else hc.prob_nonzero(m.log_alpha)
        nonzero = nonzero + rows * p.sum()
        total += rows * m.log_alpha.numel()
    return nonzero / total


def orthogonality(model: nn.Module) -> torch.Tensor:
    """Σ_l ‖Z_l Z_lᵀ − I‖ over the gates of the last training forward (§3.1, eq. 10): the spectral norm, or
    the Frobenius norm with `ortho_norm: frobenius`."""
    ord = 2 if model.simoe.cfg.ortho_norm == "spectral" else "fro"
    terms = []
    for _, m in si_modules(model):
        if m.last_z is not None:
            z = m.last_z.flatten(1)  # (M, d_in), or (M, d_out·d_in) per parameter
            terms.append(torch.linalg.matrix_norm(z @ z.T - torch.eye(z.shape[0], device=z.device), ord=ord))
    return torch.stack(terms).sum() if terms else torch.zeros(())


def penalty(model: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
    """β·orthogonality + λ·g for the current training step; g is kept for the dual update."""
    s: SIMoE = model.simoe
    l0 = density(model)
    g = s.cfg.tau - (1.0 - l0) if constrained(model) else torch.zeros(())  # (c): no constraint, λ stays 0
    ortho = orthogonality(model)
    s.violation.fill_(g.item())
    logs = {"simoe/sparsity": 1.0 - l0.item(), "simoe/lambda": s.lam.item(), "simoe/ortho": ortho.item(),
            "simoe/violation": g.item()}
    return s.cfg.ortho * ortho + s.lam * g, logs


def dual_step(s: SIMoE) -> None:
    """Projected gradient ascent on λ (eqs. 12-13), reset to 0 once the constraint holds."""
    g = float(s.violation)
    s.lam.fill_(0.0 if g <= 0 else max(0.0, float(s.lam) + s.cfg.dual_lr * g))


class DualCallback(TrainerCallback):
    """λ's ascent step after every optimizer step."""

    def __init__(self, model: nn.Module):
        self.simoe = model.simoe

    def on_step_end(self, args, state, control, **kwargs):
        dual_step(self.simoe)


def param_groups(model: nn.Module, lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups: the masks' log α without weight decay (at `mask_lr` if set, else `lr`: Table 6 has one
    learning rate), δ and the router at `lr`."""
    s: SIMoE = model.simoe
    masks = [m.log_alpha for _, m in si_modules(model)]
    ids = {id(p) for p in masks}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    return [{"params": rest, "lr": lr, "weight_decay": weight_decay},
            {"params": masks, "lr": s.cfg.mask_lr or lr, "weight_decay": 0.0}]
