"""Turn a dense HF model into an MoE model in place, one FFN at a time."""
from __future__ import annotations

import ctypes
import re
import zlib
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from moekit.checkpoint.format import adopt
from moekit.errors import ConfigError, NumericsError
from moekit.moe.ffn import ExpertWeights
from moekit.init.base import InitContext
from moekit.moe.diversity import expert_diversity
from moekit.moe.build import build_moe, init_router, shared_gate_weight
from moekit.moe.prompts import prompt_rows
from moekit.moe.router import Router
from moekit.moe.spec import PROMPT_INITS, MoESpec
from moekit.progress import report
from moekit.surgery import Slot, find_slots
from moekit.moe.state import model_state


def layer_generator(seed: int, path: str) -> torch.Generator:
    """Per-layer RNG: the same spec seed and module path always give the same init."""
    # mod 2**64: any int seed (torch takes [-2**63, 2**64) and reads negatives as two's complement)
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(path.encode())) % 2**64)


def language_model_path(model: nn.Module) -> str | None:
    """The path of the language model of a multimodal model (transformers' `language_model` submodule beside its
    audio or vision encoder: Qwen2-Audio, Qwen3-ASR, LLaVA, ...; else its `text_model`: Idefics3, SmolVLM), None for
    any other model."""
    names = [name for name, _ in model.named_modules()]
    return next((n for lm in ("language_model", "text_model") for n in names if n.rsplit(".", 1)[-1] == lm), None)


def in_audio_codec(path: str) -> bool:
    """Whether an FFN belongs to a speech model's audio codec (Kyutai's Mimi, `codec_model`): it turns audio into the
    tokens the model reads, and is not the model being adapted."""
    return path.startswith("codec_model.") or ".codec_model." in path


def selected_slots(model: nn.Module, spec: MoESpec) -> list[Slot]:
    """The FFN slots `spec` selects; a spec that selects none, or names blocks no stack has, is an error. In a
    multimodal model only its language model's FFNs are candidates unless `spec.target` names others (SPRI §3.2
    upcycles the decoder of Qwen3-ASR, whose audio encoder's blocks have FFNs too); an audio codec's FFNs
    (Kyutai's Mimi) are candidates only where `spec.target` names them too."""
    lm = language_model_path(model)
    slots = [s for s in find_slots(model) if spec.target is not None or (
        not in_audio_codec(s.path) and (lm is None or s.path.startswith(f"{lm}.")))]
    chosen = [s for s in slots if spec.selects(s.index, s.path)]
    stacks = sorted({f"{s.stack} ({sum(t.stack == s.stack for t in slots)} blocks)" for s in slots})
    if spec.layers is not None:
        eligible = [s.index for s in slots if spec.target is None or re.search(spec.target, s.path)]
        beyond = sorted(i for i in set(spec.layers) if i > max(eligible, default=-1))
        if beyond:
            raise ConfigError(f"layers {beyond} do not exist; the model has {', '.join(stacks)}")
    if not chosen:
        raise ConfigError(f"the MoE spec selects no FFN; the model has {', '.join(stacks)}")
    G = spec.granularity
    uneven = next((s for s in chosen if s.read().intermediate_size % G), None)
    if uneven is not None:
        raise ConfigError(f"granularity {G} must divide the FFN's intermediate size, but {uneven.path} has "
                          f"{uneven.read().intermediate_size}")
    return chosen


def check_finite_experts(w: ExpertWeights, path: str, method: str) -> None:
    """Every init method's output must be finite (a NaN in the dense FFN would otherwise spread: SPRI turns
    one into a whole down-projection)."""
    shared = w.shared
    tensors = {"up": w.up, "down": w.down, "gate": w.gate, "router": w.router,
               **({} if shared is None else {"shared.up": shared.up, "shared.down": shared.down,
                                             "shared.gate": shared.gate})}
    for name, t in tensors.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            raise NumericsError(f"{method} produced non-finite {name} weights for {path}; "
                                "pass allow_nonfinite=True to proceed anyway")


def check_branches(model: nn.Module, branches: list[nn.Module], method: str) -> None:
    """Every branch (source model) has the base model's parameter names and shapes."""
    target = model.state_dict()
    for i, b in enumerate(branches):
        st = b.state_dict()
        if st.keys() != target.keys() or any(st[k].shape != v.shape for k, v in target.items()):
            raise ConfigError(f"{method} branch {i} does not have the architecture of the base model "
                              "(parameter names or shapes differ)")


def average_branches(model: nn.Module, branches: list[nn.Module], ffn_paths: list[str], seed: bool) -> None:
    """BTX: every non-FFN parameter of `model` becomes the mean over the branches (and over the seed
    `model` itself, with `seed`)."""
    target = model.state_dict()
    states = [b.state_dict() for b in branches] + ([{k: v.clone() for k, v in target.items()}] if seed else [])
    with torch.no_grad():
        for k, v in target.items():
            if v.is_floating_point() and not any(k.startswith(p + ".") for p in ffn_paths):
                v.copy_(torch.stack([st[k] for st in states]).float().mean(0).to(v.dtype))


def upcycle_slot(slot: Slot, spec: MoESpec, branch_slots: list[Slot], router: Router | None,
                 allow_nonfinite: bool = False, rows: torch.Tensor | None = None) -> Router:
    """Replace one dense FFN by an MoE layer; returns its router (`router` if one is given to share; else one
    made by init_router, from `rows` for the prompt inits). A function of its own so that the layer's
    temporaries are freed before the next layer starts."""
    gen = layer_generator(spec.seed, slot.path)
    dense = slot.read()
    ctx = InitContext(dense=dense.math(), spec=spec, generator=gen, path=slot.path,
                      branches=[b.read().math() for b in branch_slots])
    with torch.no_grad():
        w = spec.init.init_experts(ctx).to(dense.up.dtype)  # math in float32 or wider, stored as the model
    if not allow_nonfinite:
        check_finite_experts(w, slot.path, spec.init.method)
    if router is None:
        router = Router(w.up.shape[2], spec.routed_experts, spec.routed_top_k, spec.scoring, spec.router.jitter)
        init_router(router, spec, gen, rows)
        router = router.to(w.up.dtype)
        if w.router is not None:
            with torch.no_grad():
                router.weight.copy_(w.router)
    gate = shared_gate_weight(spec, w.up.shape[2], gen, rows)  # drawn after the router, as the streaming path does
    moe = build_moe(w, router, slot.dropout(), None if gate is None else gate.to(w.up.dtype))
    moe.slot = slot.describe()
    moe.init_diversity = expert_diversity(moe.experts.down)  # SPRI A.1, recorded in moekit.json
    slot.install(moe.train(slot.block.training))
    return router


def router_groups(slots: list[Slot], spec: MoESpec) -> dict[str, str | None]:
    """{FFN path: its router-sharing group (None: own router)}; a group's layers need one hidden size."""
    groups = {slot.path: spec.router_group(slot.path) for slot in slots}
    sizes: dict[str, set[int]] = {}
    for slot in slots:
        if groups[slot.path] is not None:
            sizes.setdefault(groups[slot.path], set()).add(slot.read().hidden_size)
    for group, hidden in sizes.items():
        if len(hidden) > 1:
            raise ConfigError(f"router_sharing group {group!r} spans hidden sizes {sorted(hidden)}; "
                              "one router needs one hidden size")
    return groups


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return freed heap memory to the OS. glibc keeps freed blocks under its mmap threshold (up to
    32 MiB, e.g. one expert matrix) in the heap, so the layers' temporaries would stay in the RSS:
    upcycling + saving SmolLM2-135M with spri peaked at 1.86-1.88 GB without this, 1.63 GB with it.
    No-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def upcycle(model: nn.Module, spec: MoESpec, branches: list[nn.Module] | None = None,
            allow_nonfinite: bool = False, tokenizer=None) -> nn.Module:
    """Replace the FFNs `spec` selects by MoE layers initialized with `spec.init`. Returns `model`.

    Works layer by layer (read dense FFN -> init experts -> install), so at most one extra layer's
    experts are alive beside the model at any time. `branches` are the models of spec.init.source_models() (btx,
    sources); `tokenizer` tokenizes the router prompts (router.init hidden or cheap_embed), whose rows are computed
    on the dense model first. Non-finite expert weights are a NumericsError unless `allow_nonfinite`.
    """
    slots = selected_slots(model, spec)
    branch_slots: list[dict[str, Slot]] = []
    if spec.init.needs_branches:
        need = len(spec.init.source_models())
        if not branches or len(branches) != need:
            raise ConfigError(f"{spec.init.method} needs {need} branch models, got {len(branches or [])}")
        check_branches(model, branches, spec.init.method)
        branch_slots = [{s.path: s for s in find_slots(b)} for b in branches]
    for slot in [*slots, *(bs[s.path] for bs in branch_slots for s in slots)]:
        slot.checked_read()  # each FFN computes what is read from it: checked before the model changes
    groups = router_groups(slots, spec)  # checked before any layer changes
    if branch_slots and spec.init.averages_non_ffn:
        average_branches(model, branches, [s.path for s in slots], spec.init.include_seed)
    rows = prompt_rows(model, slots, spec, tokenizer) if spec.router_init in PROMPT_INITS else {}
    routers: dict[str, Router] = {}  # router-sharing group -> its router (Omni-router)
    for done, slot in enumerate(slots, 1):
        group = groups[slot.path]
        router = upcycle_slot(slot, spec, [bs[slot.path] for bs in branch_slots], routers.get(group), allow_nonfinite,
                              rows.get(slot.path))
        if group is not None:
            routers.setdefault(group, router)
        release_freed_memory()  # this layer's temporaries are gone: hand them back before the next
        report("upcycling", done, len(slots), slot.path)
    model_state(model).spec = spec
    return adopt(model)  # model.save_pretrained writes the moekit format
