"""Router rows from prompts: mergekit-moe's gate modes `hidden` and `cheap_embed` (mergekit 0.1.5, moe/router.py),
implemented from their definition.

For expert e with positive prompts P_e and negative prompts N_e (RouterSpec.prompts; the shared expert's gate from
RouterSpec.shared_prompts is one more row, after the experts'), and the MoE layer of block l:

  hidden       r_e = n(mean_{p∈P_e} h_l(p) − mean_{p∈N_e} h_l(p)), h_l(p) the hidden state entering block l
               (transformers' output_hidden_states[l]) at the prompt's last token (pool="last", mergekit's hidden)
               or averaged over its tokens (pool="mean");
  cheap_embed  r_e = n(n(Σ_{p∈P_e} Σ_t emb(p_t)) − n(Σ_{p∈N_e} Σ_t emb(p_t))), the same row for every layer;

n(v) = v / max(‖v‖, 1e-8), and without negative prompts the negative term is absent. A prompt is its tokenizer's
BOS text followed by the prompt, tokenized without other special tokens (as mergekit does).

Computed in float32 (mergekit runs the model in bfloat16), CHUNK prompts per forward, each forward stopped at the
last MoE block. The streaming upcycle never holds the model: it runs these on weights read block by block from the
checkpoint (moekit.checkpoint.layerwise).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moekit.errors import ConfigError
from moekit.moe.spec import MoESpec
from moekit.surgery import Slot

CHUNK = 16  # prompts per forward


def normalize(v: Tensor) -> Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp(min=1e-8)


def encode(tokenizer, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """Token ids and attention mask (P, T), left-padded so that every prompt ends in the last column."""
    bos = tokenizer.bos_token or ""
    seqs = [tokenizer(bos + p, add_special_tokens=False)["input_ids"] for p in prompts]
    empty = next((p for p, s in zip(prompts, seqs) if not s), None)
    if empty is not None:
        raise ConfigError(f"router prompt {empty!r} has no tokens")
    pad = next(i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, 0) if i is not None)
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)  # (P, T)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)  # (P, T)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.tensor(s)
        mask[i, T - len(s):] = 1
    return ids, mask


def pool(h: Tensor, mask: Tensor, how: str) -> Tensor:
    """(P, T, H) -> (P, H) in float32: the last column (each prompt's last token) or the mean over real tokens."""
    if how == "last":
        return h[:, -1].float()
    m = mask.unsqueeze(-1).to(h.dtype)  # (P, T, 1)
    return ((h * m).sum(1) / m.sum(1)).float()


class _Stop(Exception):
    """Raised once the last MoE block's input is captured: the rest of the forward is not needed."""


def block_inputs(model: nn.Module, blocks: list[nn.Module], ids: Tensor, mask: Tensor, how: str) -> list[Tensor]:
    """The pooled hidden state (P, H) entering each of `blocks` (in forward order) in one forward of the base
    model, stopped at the last of them."""
    out: list[Tensor | None] = [None] * len(blocks)

    def capture(i: int):
        def hook(module, args, kwargs):
            out[i] = pool(args[0] if args else kwargs["hidden_states"], mask, how)
            if i == len(blocks) - 1:
                raise _Stop
        return hook

    handles = [b.register_forward_pre_hook(capture(i), with_kwargs=True, prepend=True)  # before any weight loading
               for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            model.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return out


def _texts(spec: MoESpec) -> tuple[list[str], list[tuple[slice, slice]]]:
    """All prompts in one list, and per expert (then for the shared expert's gate, if it has prompts) the slices
    of its positive and negative ones."""
    texts, spans = [], []
    shared = [] if spec.router.shared_prompts is None else [spec.router.shared_prompts]
    for p in [*spec.router.prompts, *shared]:
        start = len(texts)
        texts += p.positive + p.negative
        spans.append((slice(start, start + len(p.positive)), slice(start + len(p.positive), len(texts))))
    return texts, spans


def hidden_rows(model: nn.Module, slots: list[Slot], spec: MoESpec, tokenizer) -> dict[str, Tensor]:
    """{MoE layer path: (E [+ 1], H) rows} of the `hidden` mode (module docstring), `model` holding weights."""
    texts, spans = _texts(spec)
    order = sorted(slots, key=lambda s: s.index)
    states: list[list[Tensor]] = [[] for _ in order]  # per layer, per chunk: (chunk, H)
    for start in range(0, len(texts), CHUNK):
        ids, mask = encode(tokenizer, texts[start:start + CHUNK])
        for layer, h in zip(states, block_inputs(model, [s.block for s in order], ids, mask, spec.router.pool)):
            layer.append(h)
    rows = {}
    for slot, chunks in zip(order, states):
        h = torch.cat(chunks)  # (P, H)
        rows[slot.path] = normalize(torch.stack([h[pos].mean(0) - (h[neg].mean(0) if neg.stop > neg.start else 0)
                                                 for pos, neg in spans]))  # (E, H)
    return rows


def cheap_rows(embed: Tensor, spec: MoESpec, tokenizer) -> Tensor:
    """(E [+ 1], H) rows of the `cheap_embed` mode (module docstring) from the embedding matrix (V, H)."""
    texts, spans = _texts(spec)
    ids, mask = encode(tokenizer, texts)
    sums = (embed.float()[ids] * mask.unsqueeze(-1)).sum(1)  # (P, H): each prompt's summed token embeddings
    return normalize(torch.stack([normalize(sums[pos].sum(0)) - (normalize(sums[neg].sum(0)) if neg.stop > neg.start
                                                                 else 0) for pos, neg in spans]))  # (E, H)


def prompt_rows(model: nn.Module, slots: list[Slot], spec: MoESpec, tokenizer) -> dict[str, Tensor]:
    """{MoE layer path: (E [+ 1 for the shared gate], H) float32 router rows} for the prompt inits, `model` holding
    its weights (in its dtype), put in eval mode for the forward."""
    check_model(model, slots, tokenizer, spec)
    if spec.router_init == "cheap_embed":
        row = cheap_rows(model.get_input_embeddings().weight.detach(), spec, tokenizer)
        return {s.path: row for s in slots}
    training = model.training
    try:
        return hidden_rows(model.eval(), slots, spec, tokenizer)
    finally:
        model.train(training)


def check_model(model: nn.Module, slots: list[Slot], tokenizer, spec: MoESpec) -> None:
    if tokenizer is None:
        raise ConfigError(f"router.init {spec.router_init} tokenizes the router prompts: the model needs a tokenizer")
    if getattr(model.config, "is_encoder_decoder", False) or len({s.stack for s in slots}) > 1:
        raise ConfigError(f"router.init {spec.router_init} needs a decoder-only model (one stack of blocks fed "
                          "token ids)")
