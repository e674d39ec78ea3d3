"""SIMoE upcycling of a dense HF model (Chen, Wei & Schwarz 2025, "Automatic Expert Discovery in LLM
Upcycling via Sparse Interpolated Mixture-of-Experts", §3).

`simoe_upcycle` freezes the model, wraps its linear layers (and norms) in sparse interpolated modules sharing one
`Routing`, and attaches `model.simoe`: the instance router (§3.1.3: the pretrained
model's last-token embedding of the prompt → MLP → softmax over M experts) and the Lagrange multiplier
of the sparsity constraint. A forward pre-hook routes every call before the model runs."""
from __future__ import annotations

import contextlib
import types
from typing import Iterator, Literal

import torch
from pydantic import Field
from torch import nn

from moekit.config import Config
from moekit.errors import ConfigError
from moekit.simoe import hard_concrete as hc
from moekit.simoe.layer import MaskInit, Routing, SILinear, SINorm, SparseInterpolated
from moekit.moe.state import model_state

class SIMoEConfig(Config):
    """Architecture (experts, targets, router) and objective (eqs. 10-13) of a SIMoE model."""

    num_experts: int = Field(8, ge=1)  # M
    modules: Literal["all"] | list[str] = "all"  # "all": every nn.Linear of the model's layer stacks (§4: "every
    #                                             linear layer in the pre-trained LLM"; a multimodal model's language
    #                                             model's only); or the linear layers by name
    norms: bool = True  # norm weights get experts too
    routing: Literal["instance", "token"] = "instance"  # token: the paper's ablation (d)
    router_hidden: int = Field(256, ge=1)
    gates: Literal["median", "sampled"] = "median"  # A.1 eqs. 6-7: median gates in training and inference;
    #                                                 sampled: hard-concrete draws in training (eq. 4-5)
    p_zero: float = Field(0.05, gt=0.0, lt=1.0)  # B.1: log φ's Gaussian has the mean giving P(z = 0) = 0.05
    init_std: float = Field(0.01, ge=0.0)  # its std (the paper gives none; 0.01 as Louizos et al. 2018)
    seed: int = 0  # the mask init's draws
    tau: float = Field(0.75, ge=0.0, lt=1.0)  # constraint 1 − L0(Z) ≥ τ (eq. 3)
    sparsity: Literal["masks", "params"] = "masks"  # L0 over mask entries (eq. 3, A.2); params: weighted by
    #                                                 the δ parameters each gate switches
    ortho: float = Field(5e-6, ge=0.0)  # β of the orthogonality penalty
    ortho_norm: Literal["spectral", "frobenius"] = "spectral"  # ‖ZZᵀ − I‖_2 (§3.1); frobenius: ‖·‖_F
    dual_lr: float = Field(0.01, gt=0.0)  # step of the projected gradient ascent on λ (eq. 13)
    mask_lr: float | None = Field(None, gt=0.0)  # the masks' own lr; None: the one lr of Table 6
    masks: Literal["hard_concrete", "real"] = "hard_concrete"  # real: Table 4 ablation (c), unconstrained
    #                                                            real-valued masks, no sparsity constraint
    mask_granularity: Literal["input", "parameter"] = "input"  # parameter: appendix C.1's full-granular masks


class SIMoE(nn.Module):
    """The router MLP, the multiplier λ and the shared routing state of one SIMoE model."""

    def __init__(self, cfg: SIMoEConfig, hidden_size: int):  # hidden_size: the backbone's last hidden states
        super().__init__()
        self.cfg = cfg
        self.router = nn.Sequential(nn.Linear(hidden_size, cfg.router_hidden), nn.GELU(),
                                    nn.Linear(cfg.router_hidden, cfg.num_experts))
        nn.init.zeros_(self.router[2].weight)  # uniform routing at init
        nn.init.zeros_(self.router[2].bias)
        self.register_buffer("lam", torch.zeros(()))  # λ ≥ 0
        self.register_buffer("violation", torch.zeros(()))  # τ − (1 − L0) at the last training step
        self.routing = Routing()
        self.skipped: list[str] = []  # targets left unwrapped: the family never calls them (_probe)
        self.fixed: torch.Tensor | None = None  # (M,) or (B, M) routing weights imposed on the next calls

    def param_counts(self, model: nn.Module) -> tuple[int, int]:
        """(total, active) parameters of the SIMoE `model` this state belongs to (module function param_counts)."""
        counts = param_counts(model)
        return counts["total"], counts["active"]

    def route(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              labels: torch.Tensor | None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Routing weights (B, M), or (B, T, M) for token-level routing, from the pretrained model's
        final hidden states (no gradient into the model). The prompt is every attended token before the
        first scored label."""
        B, T = input_ids.shape
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        prompt = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if labels is not None:
            first = torch.where(labels != -100, pos, T).min(1, keepdim=True).values  # (B, 1)
            prompt = prompt & (pos < first)
        last = torch.where(prompt, pos, -1).max(1).values.clamp_min(0)  # (B,) last prompt token
        n = T if self.cfg.routing == "token" else int(last.max()) + 1  # causal: later tokens do not matter
        kwargs = {} if position_ids is None else {"position_ids": position_ids[:, :n]}
        with self.pretrained(), torch.no_grad():
            mask = None if attention_mask is None else attention_mask[:, :n]
            h = _backbone(model)(input_ids=input_ids[:, :n], attention_mask=mask, **kwargs).last_hidden_state
        feats = h if self.cfg.routing == "token" else h[torch.arange(B, device=h.device), last]  # (B,[T,] H)
        return torch.softmax(self.router(feats.to(self.router[0].weight.dtype)), dim=-1)  # (B, [T,] M)

    @contextlib.contextmanager
    def pretrained(self) -> Iterator[None]:
        """Run the model as the frozen pretrained one (δ skipped)."""
        saved, self.routing.weights = self.routing.weights, None
        try:
            yield
        finally:
            self.routing.weights = saved


def _pre_hook(model: nn.Module, args: tuple, kwargs: dict) -> None:
    s: SIMoE = model.simoe
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ConfigError("SIMoE routing needs input_ids (inputs_embeds alone cannot be routed)")
    if s.fixed is not None:
        s.routing.weights = s.fixed.expand(ids.shape[0], -1)  # (B, M) from (M,) or (B, M)
        return
    past = kwargs.get("past_key_values")
    if past is not None and past.get_seq_length() > 0:  # generation continues the prompt
        if s.cfg.routing == "token":
            raise ConfigError("token-level SIMoE routing generates without a KV cache: pass use_cache=False")
        return  # instance routing keeps the prompt's weights
    s.routing.weights = s.route(model, ids, kwargs.get("attention_mask"), kwargs.get("labels"),
                                kwargs.get("position_ids"))


def _generate(model: nn.Module, *args, **kwargs):
    """model.generate with instance routing decided once, from the prompt (with or without a KV cache)."""
    s: SIMoE = model.simoe
    if s.cfg.routing == "token" or s.fixed is not None:
        return type(model).generate(model, *args, **kwargs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    with fixed_routing(model, s.route(model, ids, kwargs.get("attention_mask"), None)):
        return type(model).generate(model, *args, **kwargs)


def _backbone(model: nn.Module) -> nn.Module:
    """The model without its head, whose last_hidden_state the router reads (Mllama's text model names its
    base_model_prefix after another attribute: base_model is the model itself there)."""
    base = model.base_model
    if base is model:
        base = getattr(model, "model", None)
        if not isinstance(base, nn.Module):
            raise ConfigError(f"{type(model).__name__} has no backbone (base_model or .model) for the SIMoE router")
    return base


def _stacked(model: nn.Module) -> set[str]:
    """Paths of the modules inside the model's layer stacks (the entries of its nn.ModuleLists)."""
    out = set()
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            out |= {f"{path}.{sub}" for sub, _ in mod.named_modules() if sub}
    return out


def _targets(model: nn.Module, cfg: SIMoEConfig) -> list[tuple[str, nn.Module]]:
    """The linear layers (and norms) SIMoE wraps: in a multimodal model, those of its language model only (§4: "every
    linear layer in the pre-trained LLM"; its audio or vision encoder is not the LLM), never an audio codec's."""
    from moekit.checkpoint.upcycle_model import in_audio_codec, language_model_path

    found = []
    stacked = _stacked(model) if cfg.modules == "all" else set()
    lm = language_model_path(model)
    for path, mod in model.named_modules():
        if in_audio_codec(path) or (lm is not None and not path.startswith(f"{lm}.")):
            continue
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Linear) and (path in stacked if cfg.modules == "all" else leaf in cfg.modules):
            found.append((path, mod))
        elif cfg.norms and "norm" in type(mod).__name__.lower() and getattr(mod, "weight", None) is not None:
            found.append((path, mod))
    return found


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _probe(model: nn.Module) -> tuple[int, list[str]]:
    """Two tokens through the backbone: the size of its last hidden states (the router's input: OPT projects them to
    word_embed_proj_dim, ELECTRA's and RemBERT's heads take another size) and the SI modules it never calls though it
    calls the module holding them, which are unwrapped again: the family computes with their weights directly (Mamba's
    dt_proj), so no δ could act there. (A module whose holder is not called either, such as cross-attention without
    encoder states or a vision tower, stays wrapped.)"""
    called, mods = set(), si_modules(model)
    holder = {p: model.get_submodule(p.rpartition(".")[0]) for p, _ in mods}
    watched = {id(m): m for m in (*holder.values(), *(m for _, m in mods))}.values()
    hooks = [m.register_forward_pre_hook(lambda mod, args: called.add(id(mod))) for m in watched]
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            hidden = _backbone(model)(input_ids=ids).last_hidden_state.shape[-1]
    finally:
        for h in hooks:
            h.remove()
    skipped = [p for p, m in mods if id(m) not in called and id(holder[p]) in called]
    for path in skipped:
        _replace(model, path, model.get_submodule(path).base)
    return hidden, skipped


def _check_reads_token_ids(model: nn.Module, run: bool) -> None:
    """SIMoE routes each instruction prompt by its final token embedding (Chen et al. 2025, §3.1.3): refused, before
    anything changes, for a model that reads audio (a CTC encoder, Whisper) or, with `run` (a fresh upcycle: real
    weights), whose backbone does not run on (batch, tokens) ids (Kyutai's speech-to-text model reads a text token
    and K audio codes per step)."""
    why = f"reads {model.main_input_name}" if getattr(model, "main_input_name", "input_ids") != "input_ids" else None
    if why is None and run:
        ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
        try:
            with torch.no_grad():
                _backbone(model)(input_ids=ids)
        except Exception as e:  # noqa: BLE001 - whatever the family raises, the same refusal
            first = str(e).splitlines()[0] if str(e) else ""
            why = f"does not run on (batch, tokens) ids ({type(e).__name__}: {first})"
    if why is not None:
        raise ConfigError(f"SIMoE routes each instruction prompt by its final token embedding (Chen et al. 2025, "
                          f"§3.1.3), so it needs a model that reads token ids; {type(model).__name__} {why}")


def install(model: nn.Module, cfg: SIMoEConfig, kept: dict[str, int] | None = None,
            hidden: int | None = None, skipped: list[str] | None = None) -> nn.Module:
    """Wrap the targets in SI modules (in place), attach `model.simoe` and its routing hook. A checkpoint being
    loaded gives `kept` (its pruned δ column counts), `hidden` (its router's input size) and `skipped` (the targets
    its family never calls); else those two are measured (_probe)."""
    if model_state(model).simoe is not None:
        raise ConfigError("the model is already a SIMoE model")
    _check_reads_token_ids(model, run=hidden is None)
    targets = [(p, m) for p, m in _targets(model, cfg) if p not in (skipped or ())]
    if not targets:
        raise ConfigError(f"no SIMoE targets: no nn.Linear named {cfg.modules}" + (" and no norm" if cfg.norms else ""))
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    masks = MaskInit(cfg.p_zero, cfg.init_std, gen, sampled=cfg.gates == "sampled", kind=cfg.masks,
                     granularity=cfg.mask_granularity)
    routing = Routing()
    wrapped: dict[int, SparseInterpolated] = {}  # a module whose weight is another's (tied) shares its SI module
    for path, mod in targets:
        si = wrapped.get(id(mod.weight))
        if si is None and isinstance(mod, nn.Linear):
            si = SILinear(mod, cfg.num_experts, masks, routing, (kept or {}).get(path))
        elif si is None:
            si = SINorm(mod, cfg.num_experts, masks, routing)
        _replace(model, path, wrapped.setdefault(id(mod.weight), si))
    if hidden is None:
        hidden, skipped = _probe(model)
    s = SIMoE(cfg, hidden).to(next(model.parameters()).device)
    s.routing, s.skipped = routing, list(skipped or [])
    model.simoe = model_state(model).simoe = s
    s.hook = model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    model.generate = types.MethodType(_generate, model)
    return model


def simoe_upcycle(model: nn.Module, cfg: SIMoEConfig) -> nn.Module:
    """Turn a dense HF model into a SIMoE model in place; outputs are unchanged (δ = 0)."""
    from moekit.checkpoint.format import adopt

    return adopt(install(model, cfg).train(model.training))  # model.save_pretrained writes the SIMoE format


def si_modules(model: nn.Module) -> list[tuple[str, SparseInterpolated]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, SparseInterpolated)]


@contextlib.contextmanager
def fixed_routing(model: nn.Module, weights: torch.Tensor) -> Iterator[None]:
    """Route with fixed weights: (M,) for every input (e.g. a task's mean routing) or (B, M) per row."""
    s: SIMoE = model.simoe
    saved, s.fixed = s.fixed, weights
    try:
        yield
    finally:
        s.fixed = saved


def param_counts(model: nn.Module) -> dict[str, int]:
    """total: every stored parameter (frozen pretrained, δ, masks, router). active: what one input uses,
    the pretrained weights, the router and the δ columns some expert's median gate keeps (all M experts
    are mixed with softmax weights, so the union of their masks is active)."""
    total = sum(p.numel() for p in model.parameters())
    masks = sum(m.log_alpha.numel() for _, m in si_modules(model))
    unused = 0
    for _, m in si_modules(model):
        idle = int(m.gate_values().eq(0).flatten(0, -2).all(0).sum())  # stored δ columns no expert uses
        unused += idle * (m.delta.shape[0] if isinstance(m, SILinear) else 1)
    return {"total": total, "active": total - masks - unused}
