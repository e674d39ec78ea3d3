"""Expert diversity (SPRI appendix A.1): 1 − the mean pairwise cosine similarity of the routed experts'
down-projections, per layer, from the weights or accumulated over row chunks of a streamed checkpoint."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from moekit.moe.layer import moe_layers


def expert_diversity(down: Tensor, chunk_bytes: int = 1 << 27) -> float:
    """1 − mean pairwise cosine similarity of the vectorized routed down-projections (E, H, I)."""
    return diversity_by_rows(down.shape, lambda a, b: down[:, a:b].detach(), chunk_bytes)


def diversity_by_rows(shape: tuple[int, int, int], rows: Callable[[int, int], Tensor],
                      chunk_bytes: int = 1 << 27) -> float:
    """`expert_diversity` of down-projections of `shape` (E, H, I) given by `rows(a, b)` → (E, b − a, I): the Gram
    matrix is accumulated in float64 over row chunks of about `chunk_bytes`, never a float64 copy of all E."""
    E, H, I = shape
    step = max(1, chunk_bytes // (8 * E * I))
    gram = torch.zeros(E, E, dtype=torch.float64)
    for a in range(0, H, step):
        v = rows(a, min(H, a + step)).to("cpu", torch.float64).reshape(E, -1)  # (E, rows·I)
        gram += v @ v.T
    return diversity_from_gram(gram)


def diversity_from_gram(gram: Tensor) -> float:
    """`expert_diversity` from the Gram matrix (E, E) of the vectorized down-projections (zero experts count
    as orthogonal to all, as F.normalize treats them)."""
    E = gram.shape[0]
    if E < 2:
        return 0.0
    norm = gram.diagonal().clamp_min(0).sqrt().clamp_min(1e-12)  # (E,)
    sim = gram / torch.outer(norm, norm)  # (E, E) cosines
    off = sim[~torch.eye(E, dtype=torch.bool)]  # (E·(E-1),)
    return float(1.0 - off.mean())


def init_diversity(model: nn.Module) -> float | None:
    """The diversity the model's MoE layers had when upcycled (recorded by moekit.upcycle and
    upcycle_checkpoint; SPRI A.1 "the diversity among initialized routed experts"), averaged over layers;
    None if a layer has no record (e.g. a checkpoint written before moekit recorded it)."""
    values = [m.init_diversity for _, m in moe_layers(model)]
    return None if not values or None in values else sum(values) / len(values)


def diversity(model: nn.Module) -> float:
    """Inter-expert diversity (SPRI appendix A.1), averaged over the model's MoE layers."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers")
    return sum(expert_diversity(m.experts.down) for _, m in layers) / len(layers)
