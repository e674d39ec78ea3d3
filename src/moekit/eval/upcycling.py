"""Upcycling metrics: KL(dense ‖ MoE) under teacher forcing (SPRI appendix A.1). Expert diversity is in
moekit.moe.diversity, parameter counts in moekit.routing.sites."""
from __future__ import annotations

import torch
from torch import Tensor, nn


def kl_dense_moe(dense_logits: Tensor, moe_logits: Tensor, labels: Tensor | None = None) -> Tensor:
    """Mean per-token KL(p_dense ‖ p_moe) under teacher forcing (SPRI appendix A.1).

    logits (B, L, V); `labels` (B, L) in HF causal-LM convention (unshifted, -100 = ignore): the
    prediction at position t is scored only if labels[t+1] != -100. Without labels every position counts.
    """
    logp, logq = dense_logits.float().log_softmax(-1), moe_logits.float().log_softmax(-1)  # (B, L, V)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, L)
    if labels is None:
        return kl.mean()
    keep = labels[:, 1:] != -100  # (B, L-1)
    return kl[:, :-1][keep].mean()


@torch.inference_mode()
def kl_on_texts(dense: nn.Module, moe: nn.Module, tokenizer, texts: list[str], batch: int = 16) -> float:
    """Mean per-token KL(dense ‖ MoE) under teacher forcing over `texts` (padding excluded)."""
    total, tokens = 0.0, 0
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        n = int((labels[:, 1:] != -100).sum())
        total += float(kl_dense_moe(dense(**enc).logits, moe(**enc).logits, labels)) * n
        tokens += n
    return total / max(tokens, 1)
