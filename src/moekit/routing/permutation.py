"""Expert-permutation test (Omni-router, Gu et al. 2025, arXiv 2507.05724, Fig. 6): how much does the loss
depend on *which* experts a token is sent to? With probability p, a token's experts at an MoE layer are
replaced by k random distinct experts (its combine weights kept); the loss is compared with the model's own
routing. Specialized experts make the loss rise quickly with p.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .sites import RerouteFn, find_sites


@dataclass(frozen=True)
class PermutationResult:
    base: float  # mean loss with the model's own routing
    losses: dict[float, float]  # p -> mean loss with experts replaced at rate p

    @property
    def deltas(self) -> dict[float, float]:
        return {p: loss - self.base for p, loss in self.losses.items()}


def random_experts(p: float, gen: torch.Generator) -> RerouteFn:
    """A reroute that, independently per token and layer, swaps the ids for k random distinct experts
    with probability p."""

    def fn(logits: Tensor, ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        T, E = logits.shape  # (T, E)
        hit = torch.rand(T, generator=gen, device=gen.device) < p  # (T,)
        fresh = torch.rand(T, E, generator=gen, device=gen.device).argsort(-1)[:, : ids.shape[-1]]  # (T, k)
        return torch.where(hit[:, None], fresh.to(ids.device, ids.dtype), ids), weights  # (T, k)

    return fn


@torch.no_grad()
def mean_loss(model: nn.Module, batches: Iterable[dict]) -> float:
    """Mean of model(**batch).loss over the batches (each a dict of model inputs including labels)."""
    device = next(model.parameters()).device
    losses = [float(model(**{k: v.to(device) for k, v in batch.items()}).loss) for batch in batches]
    if not losses:
        raise ConfigError("no batches to evaluate")
    return sum(losses) / len(losses)


def permutation_test(model: nn.Module, batches: list[dict], ps: list[float], seed: int = 0,
                     layers: str | None = None) -> PermutationResult:
    """Mean loss without and with random expert replacement at each rate in `ps` (Omni-router Fig. 6).

    Every MoE layer (or those whose path matches `layers`) is rerouted; each p starts from `seed`, so a
    result is reproducible. The reroute hooks are removed afterwards, also on error."""
    result = {}
    for p in ps:
        with permuted(model, p, seed, layers):
            result[p] = mean_loss(model, batches)
    return PermutationResult(mean_loss(model, batches), result)


@contextlib.contextmanager
def permuted(model: nn.Module, p: float, seed: int = 0, layers: str | None = None) -> Iterator[None]:
    """Inside the block, every MoE layer (or those matching `layers`) replaces a token's experts by random
    ones with probability p, from a generator seeded with `seed`; the hooks are removed afterwards, also on
    error."""
    if not 0 <= p <= 1:
        raise ConfigError(f"permutation rates must lie in [0, 1], got {p}")
    sites = find_sites(model, layers)
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    handles = [site.reroute(random_experts(p, gen)) for site in sites]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
