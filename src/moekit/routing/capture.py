"""Record what every MoE layer decided, token by token, into a RoutingTrace."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from .sites import find_sites
from .trace import RoutingTrace, TraceError


def _tokens(input_ids: Tensor | None, mask: Tensor) -> np.ndarray:
    """The token ids at the kept positions, or -1 for models without token ids."""
    if input_ids is None:
        return np.full(int(mask.sum()), -1, dtype=np.int32)
    return input_ids.cpu()[mask].numpy().astype(np.int32)


class RoutingCapture:
    """Context manager recording the top-k ids and weights of every MoE layer for non-padding tokens.

        with RoutingCapture(model) as cap:
            cap.run(input_ids, attention_mask, language="sw")   # or: model(...); cap.record(...)
        trace = cap.trace()

    The hooks keep references to the decisions the model made (no recomputation, no copy during the
    forward); `record` moves them to CPU and drops padding.
    """

    def __init__(self, model: nn.Module, layers: str | None = None):
        self.model, self.sites = model, find_sites(model, layers)
        self._pending: list[tuple[Tensor, Tensor] | None] = [None] * len(self.sites)
        self._handles: list = []
        self._parts: list[dict[str, np.ndarray]] = []
        self._languages: list[str] = []
        self._next_sample = 0

    def __enter__(self) -> RoutingCapture:
        for i, site in enumerate(self.sites):
            self._handles.append(site.on_decision(self._keeper(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _keeper(self, i: int):
        def keep(ids: Tensor, weights: Tensor) -> None:
            self._pending[i] = (ids.detach(), weights.detach())
        return keep

    def record(self, input_ids: Tensor | None, attention_mask: Tensor | None, language: str,
               sample_ids: Tensor | None = None) -> None:
        """File the decisions of the forward that just ran: input_ids/attention_mask (B, S). Models without
        token ids (speech encoders: one position per frame) pass input_ids=None and the frame mask; their
        trace stores token id -1."""
        if any(p is None for p in self._pending):
            raise TraceError("record() called before a forward pass reached every MoE layer")
        if input_ids is None and attention_mask is None:
            raise TraceError("record() needs input_ids or an attention_mask of shape (batch, positions)")
        b, s = (input_ids if input_ids is not None else attention_mask).shape
        mask = (torch.ones(b, s, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu())
        flat = mask.reshape(-1)  # (B*S,)
        k = max(p[0].shape[-1] for p in self._pending)
        ids = np.full((len(self.sites), int(flat.sum()), k), -1, dtype=np.int16)  # (L, N, k)
        weights = np.zeros(ids.shape, dtype=np.float32)  # (L, N, k)
        for li, (i, w) in enumerate(self._pending):
            if i.shape[0] != flat.shape[0]:
                raise TraceError(f"layer {self.sites[li].name} routed {i.shape[0]} tokens, the batch has "
                                 f"{flat.shape[0]}: pass layers= to capture one stack at a time")
            ids[li, :, : i.shape[-1]] = i.cpu()[flat].numpy()
            weights[li, :, : w.shape[-1]] = w.float().cpu()[flat].numpy()
        if sample_ids is None:
            sample_ids = torch.arange(self._next_sample, self._next_sample + b)
        self._next_sample = max(self._next_sample, int(sample_ids.max()) + 1)
        if language not in self._languages:
            self._languages.append(language)
        pos = torch.arange(s).expand(b, s)
        self._parts.append(dict(ids=ids, weights=weights, token=_tokens(input_ids, mask),
                                sample=sample_ids[:, None].expand(b, s)[mask].numpy().astype(np.int32),
                                position=pos[mask].numpy().astype(np.int32),
                                lang=np.full(int(flat.sum()), self._languages.index(language), dtype=np.int16)))
        self._pending = [None] * len(self.sites)

    @torch.no_grad()
    def run(self, input_ids: Tensor, attention_mask: Tensor | None, language: str,
            sample_ids: Tensor | None = None) -> None:
        """Forward one batch through the model and record it."""
        self.model(input_ids=input_ids, attention_mask=attention_mask)
        self.record(input_ids, attention_mask, language, sample_ids)

    def trace(self, **meta) -> RoutingTrace:
        if not self._parts:
            raise TraceError("nothing recorded")
        cat = lambda key, axis=0: np.concatenate([p[key] for p in self._parts], axis=axis)  # noqa: E731
        return RoutingTrace([s.name for s in self.sites], np.array([s.num_experts for s in self.sites]),
                            list(self._languages), cat("ids", 1), cat("weights", 1), cat("token"), cat("sample"),
                            cat("position"), cat("lang"), meta)

