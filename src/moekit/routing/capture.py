"""Record what every MoE layer decided, token by token, into a RoutingTrace; and, for one-shot expert pruning, the
sums that its criteria need, from the routed tokens only.

Saliency sums (`saliency=True`), per language, MoE layer and expert j, over the (token, slot) pairs routed to j
(padding excluded): count, Σ g, Σ ‖f‖₂, Σ g·‖f‖₂, Σ p and Σ p·‖f‖₂, where g is the weight the model applies to expert
j's output (what the layer passes its experts: the router's softmax, renormalized over the top-k where the family
renormalizes), p the plain softmax of the router's logits over all experts (REAP's reference code's default gate,
renormalize_router_weights=False) and f the expert's output before the weight. REAP's saliency (Lasby et al., "REAP
the Experts", arXiv 2510.13999) is Σ g·‖f‖₂ / count (or Σ p·‖f‖₂ / count), EAN's Σ ‖f‖₂, frequency the count
(moekit.selection.oneshot). f is computed by the layer's own
experts module on the tokens routed to each expert, one slot at a time, while the layer runs: one more pass over
the routed experts, never every expert on every token.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from .sites import RouterSite, find_sites
from .trace import SALIENCY, RoutingTrace, TraceError


def _tokens(input_ids: Tensor | None, mask: Tensor) -> np.ndarray:
    """The token ids at the kept positions, or -1 for models without token ids."""
    if input_ids is None:
        return np.full(int(mask.sum()), -1, dtype=np.int32)
    return input_ids.cpu()[mask].numpy().astype(np.int32)


class RoutingCapture:
    """Context manager recording the top-k ids and weights of every MoE layer for non-padding tokens.

        with RoutingCapture(model) as cap:
            cap.run(input_ids, attention_mask, language="sw")   # or: cap.begin(...); model(...); cap.record(...)
        trace = cap.trace()

    The hooks keep references to the decisions the model made (no recomputation, no copy during the
    forward); `record` moves them to CPU and drops padding. Decisions are filed under the batch that `begin` named,
    so layers may also run one at a time over all batches (moekit.routing.streamed) before the batches are recorded.
    """

    def __init__(self, model: nn.Module, layers: str | None = None, saliency: bool = False):
        self.model, self.sites = model, find_sites(model, layers)
        self.saliency = saliency
        self._decisions: dict[int, list[tuple[Tensor, Tensor] | None]] = {}
        self._handles: list = []
        self._parts: list[dict[str, np.ndarray]] = []
        self._languages: list[str] = []
        self._sums: dict[str, np.ndarray] = {}  # language -> (L, E, 6) float64 (SALIENCY order)
        self._logits: dict[int, Tensor] = {}  # layer -> its router's latest logits (T, E)
        # layer -> ‖f‖ (T, k) of its next call, computed elsewhere (a streamed capture's experts loaded in parts)
        self.given_norms: dict[int, Tensor] = {}
        self._next_sample = 0
        self._batch, self._mask, self._language, self._muted = 0, None, None, False

    def __enter__(self) -> RoutingCapture:
        for i, site in enumerate(self.sites):
            self._handles.append(site.on_decision(self._keeper(i)))
            if self.saliency and site.experts_take_routing:
                self._handles.append(site.router.register_forward_hook(self._logit_keeper(i, site)))
                self._handles.append(site.experts.register_forward_pre_hook(self._summer(i, site)))
            elif self.saliency:  # Llama 4: the block's input, with the decision its router just made
                self._handles.append(site.block.register_forward_pre_hook(self._block_summer(i, site)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Record nothing while inside: the experts' own calls in `expert_norms`; a streamed capture's extra runs of
        a layer (moekit.routing.streamed)."""
        muted, self._muted = self._muted, True
        try:
            yield
        finally:
            self._muted = muted

    def begin(self, batch: int, attention_mask: Tensor | None, language: str) -> None:
        """The batch the next forward passes belong to: its number, padding mask (B, S) and language."""
        self._batch, self._language = batch, language
        self._mask = None if attention_mask is None else attention_mask.bool().reshape(-1)  # (B*S,)

    def _keeper(self, i: int):
        def keep(ids: Tensor, weights: Tensor) -> None:
            if self._muted:
                return
            self._decisions.setdefault(self._batch, [None] * len(self.sites))[i] = (ids.detach(), weights.detach())
        return keep

    def _logit_keeper(self, i: int, site: RouterSite):
        def hook(router: nn.Module, args, out) -> None:
            if self._muted:
                return
            self._logits[i] = site.logits_of(out).detach()  # (T, E), read by the experts' pre-hook that follows
        return hook

    def _summer(self, i: int, site: RouterSite):
        def pre_hook(experts: nn.Module, args) -> None:
            if not self._muted:
                self._add_sums(i, site, *args[:3], self._logits.pop(i))
        return pre_hook

    def _block_summer(self, i: int, site: RouterSite):
        def pre_hook(block: nn.Module, args) -> None:
            if self._muted:
                return
            x = args[0].reshape(-1, args[0].shape[-1])  # (T, H)
            logits, ids, w = site.decision(site.router(x))  # the router is deterministic: its decision for x
            self._add_sums(i, site, x, ids, w, logits)
        return pre_hook

    @torch.no_grad()
    def _add_sums(self, i: int, site: RouterSite, x: Tensor, ids: Tensor, w: Tensor, logits: Tensor) -> None:
        """Saliency sums of layer i from its experts' input x (T, H), ids (T, k), weights (T, k) and its router's
        logits (T, E)."""
        norms = self.given_norms.pop(i, None)  # (T, k)
        x = x.reshape(-1, x.shape[-1])  # DBRX's experts are passed (B, S, H)
        if self._mask is not None:
            keep = self._mask.to(x.device)  # (T,)
            x, ids, w, logits = x[keep], ids[keep], w[keep], logits[keep]
            norms = None if norms is None else norms[keep.to(norms.device)]
        if norms is None:
            with self.muted():
                norms = site.expert_norms(x, ids)  # (T', k) ‖f‖ per slot
        norms = norms.to(x.device)
        g = w.float()  # (T', k)
        p = torch.softmax(logits.float(), dim=-1).gather(1, ids)  # (T', k) plain softmax over all experts
        sums = torch.zeros(site.num_experts, len(SALIENCY), dtype=torch.float64, device=x.device)  # (E, 6)
        for column, value in enumerate((torch.ones_like(g), g, norms, g * norms, p, p * norms)):
            sums[:, column].index_add_(0, ids.reshape(-1), value.reshape(-1).double())
        table = self._sums.setdefault(self._language, self._empty_sums())
        table[i, : site.num_experts] += sums.cpu().numpy()

    def _empty_sums(self) -> np.ndarray:
        return np.zeros((len(self.sites), max(s.num_experts for s in self.sites), len(SALIENCY)))  # (L, E, 6)

    def record(self, input_ids: Tensor | None, attention_mask: Tensor | None, language: str,
               sample_ids: Tensor | None = None, batch: int | None = None) -> None:
        """File the decisions of `batch` (default: the current one): input_ids/attention_mask (B, S). Models without
        token ids (speech encoders: one position per frame) pass input_ids=None and the frame mask; their
        trace stores token id -1."""
        pending = self._decisions.pop(self._batch if batch is None else batch, [None])
        if any(p is None for p in pending) or len(pending) != len(self.sites):
            raise TraceError("record() called before a forward pass reached every MoE layer")
        if input_ids is None and attention_mask is None:
            raise TraceError("record() needs input_ids or an attention_mask of shape (batch, positions)")
        b, s = (input_ids if input_ids is not None else attention_mask).shape
        mask = (torch.ones(b, s, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu())
        flat = mask.reshape(-1)  # (B*S,)
        k = max(p[0].shape[-1] for p in pending)
        ids = np.full((len(self.sites), int(flat.sum()), k), -1, dtype=np.int16)  # (L, N, k)
        weights = np.zeros(ids.shape, dtype=np.float32)  # (L, N, k)
        for li, (i, w) in enumerate(pending):
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

    @torch.no_grad()
    def run(self, input_ids: Tensor, attention_mask: Tensor | None, language: str,
            sample_ids: Tensor | None = None) -> None:
        """Forward one batch through the model and record it."""
        self.begin(self._batch + 1, attention_mask, language)
        self.model(input_ids=input_ids, attention_mask=attention_mask)
        self.record(input_ids, attention_mask, language, sample_ids)

    def trace(self, **meta) -> RoutingTrace:
        if not self._parts:
            raise TraceError("nothing recorded")
        cat = lambda key, axis=0: np.concatenate([p[key] for p in self._parts], axis=axis)  # noqa: E731
        sums = None
        if self.saliency:
            sums = np.stack([self._sums.get(lang, self._empty_sums()) for lang in self._languages])  # (Λ, L, E, 6)
        return RoutingTrace([s.name for s in self.sites], np.array([s.num_experts for s in self.sites]),
                            list(self._languages), cat("ids", 1), cat("weights", 1), cat("token"), cat("sample"),
                            cat("position"), cat("lang"), meta, sums)
