"""Expert usage: of a model on batches (teacher-forced, padding excluded), and per training batch (usage
entropy, max load; logged by the moe training method). Usage of a recorded trace: moekit.routing.stats."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from moekit.errors import ConfigError
from moekit.moe.layer import moe_layers


@contextmanager
def inference(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout, no router jitter) and no autograd; restores the training flag."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def usage_counts(model: nn.Module, batches: Iterable[dict[str, Tensor]]) -> dict[str, Tensor]:
    """{MoE layer path: (E,) routed (token, slot) assignments per expert} over non-padding tokens. A batch holds
    the model's inputs (input_ids, attention_mask, and e.g. a speech-LLM's audio features); labels are ignored."""
    layers = moe_layers(model)
    counts = {path: torch.zeros(m.router.num_experts, dtype=torch.long) for path, m in layers}
    with inference(model):
        for b in batches:
            inputs = {k: v.to(model.device) for k, v in b.items() if k != "labels"}
            mask = inputs.setdefault("attention_mask", torch.ones_like(inputs["input_ids"]))  # (B, L)
            model(**inputs)
            for path, m in layers:
                counts[path] += m.last_routing.tokens_per_expert(mask).cpu()  # routing rows are (B·L, k)
    return counts


def fractions(counts: dict[str, Tensor]) -> dict[str, list[float]]:
    if any(int(c.sum()) == 0 for c in counts.values()):
        raise ConfigError("no non-padding tokens to measure expert usage on")
    return {path: (c.double() / c.sum()).tolist() for path, c in counts.items()}


def model_usage(model: nn.Module, batches: Iterable[dict[str, Tensor]]) -> dict[str, list[float]]:
    """{MoE layer path: fraction of routed (token, slot) assignments per expert}, teacher-forced,
    over the non-padding tokens (attention_mask) of `batches`; {} for a dense model."""
    return fractions(usage_counts(model, batches))
