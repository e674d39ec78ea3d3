"""Build MoE layers from ExpertWeights (upcycling) or from a recorded layout (loading)."""
from __future__ import annotations

import math

import torch
from transformers.initialization import no_init_weights

from moekit.moe.ffn import ExpertWeights, FFNWeights
from moekit.moe.experts import Experts
from moekit.moe.layer import MoELayer, SharedExpert
from moekit.moe.router import Router
from moekit.moe.spec import PROMPT_INITS, MoESpec

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def router_rows(spec: MoESpec, n: int, hidden: int, gen: torch.Generator, given: torch.Tensor | None) -> torch.Tensor:
    """(n, H) float32 rows per `spec.router_init`: zeros; normal, N(0, init_std²); uniform, U(±1/√H) as
    torch.nn.Linear; hidden or cheap_embed, the `given` prompt rows (moekit.moe.prompts)."""
    how = spec.router_init
    if how in PROMPT_INITS:
        return given
    if how == "zeros":
        return torch.zeros(n, hidden)
    if how == "uniform":
        return (torch.rand((n, hidden), generator=gen) * 2 - 1) / math.sqrt(hidden)
    return torch.randn((n, hidden), generator=gen) * spec.router.init_std


def init_router(router: Router, spec: MoESpec, gen: torch.Generator, rows: torch.Tensor | None = None) -> None:
    """The router's weight (E·G, H) from `router_rows` (`rows`: the prompt rows, the experts' first). With
    granularity G, one row serves each group of G consecutive experts, repeated over the group (He et al. 2024's
    virtual groups: the G shards of a dense FFN tie, so the router picks them together at init; Megatron-Core's
    upcycling router)."""
    E, H = spec.num_experts, router.weight.shape[1]
    base = router_rows(spec, E, H, gen, None if rows is None else rows[:E])  # (E, H)
    with torch.no_grad():
        router.weight.copy_(base.repeat_interleave(spec.granularity, dim=0))  # (E·G, H)


def shared_gate_weight(spec: MoESpec, hidden: int, gen: torch.Generator,
                       rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """The shared expert's gate row (1, H) when `spec.shared_gate`, from `router_rows` after the router's (the
    prompt rows' last, from router.shared_prompts); else None."""
    if not spec.shared_gate:
        return None
    return router_rows(spec, 1, hidden, gen, None if rows is None else rows[spec.num_experts:])


def build_moe(w: ExpertWeights, router: Router, dropout: float = 0.0,
              shared_gate: torch.Tensor | None = None) -> MoELayer:
    """An MoE layer holding `w` (in w's dtype) and the shared expert's gate row (1, H) if given; `router` may be
    shared with other layers."""
    dtype = w.up.dtype
    experts = Experts.from_weights(w).to(dtype)
    with no_init_weights():  # the shared expert's Linear layers are overwritten: skip their random init
        shared = None if w.shared is None else SharedExpert(w.shared).to(dtype)
        gate = None if shared_gate is None else torch.nn.Linear(shared_gate.shape[1], 1, bias=False, dtype=dtype)
    if gate is not None:
        with torch.no_grad():
            gate.weight.copy_(shared_gate)
    return MoELayer(router, experts, shared, dropout, gate)


def layout(moe: MoELayer) -> dict:
    """Everything needed to rebuild an empty copy of `moe` (recorded in moekit.json)."""
    ex, r, sh = moe.experts, moe.router, moe.shared
    out = {
        "num_experts": ex.num_experts, "top_k": r.top_k, "scoring": r.scoring, "jitter": r.jitter,
        "hidden_size": ex.hidden_size, "intermediate_size": ex.intermediate_size, "act": ex.act,
        "gated": ex.gated, "bias": ex.first_bias is not None,
        "dropout": 0.0 if moe.dropout is None else moe.dropout.p,
        "dtype": str(ex.down.dtype).removeprefix("torch."), "shared": None,
    }
    if sh is not None:
        out["shared"] = {
            "intermediate_size": sh.up_proj.out_features, "gated": sh.gate_proj is not None,
            "bias": [lin is not None and lin.bias is not None for lin in (sh.gate_proj, sh.up_proj, sh.down_proj)],
            "gate": moe.shared_gate is not None,
        }
    return out


def _zeros_ffn(H: int, I: int, act: str, gated: bool, bias: list[bool], dtype, E: tuple[int, ...] = ()) -> FFNWeights:
    """All-zero FFN weights of these shapes; with E = (n,), n of them stacked: (n, I, H), ..."""
    z = lambda *s: torch.zeros(*E, *s, dtype=dtype)  # noqa: E731
    return FFNWeights(up=z(I, H), down=z(H, I), act=act, gate=z(I, H) if gated else None,
                      gate_bias=z(I) if bias[0] else None, up_bias=z(I) if bias[1] else None,
                      down_bias=z(H) if bias[2] else None)


def from_layout(lay: dict, router: Router | None = None) -> MoELayer:
    """An MoE layer of the recorded shapes, all zeros (weights are loaded afterwards); on the meta device
    under `torch.device("meta")`, which costs nothing whatever the recorded sizes."""
    E, H, I, dtype = lay["num_experts"], lay["hidden_size"], lay["intermediate_size"], _DTYPES[lay["dtype"]]
    b = lay["bias"]
    stacked = _zeros_ffn(H, I, lay["act"], lay["gated"], [b and lay["gated"], b, b], dtype, E=(E,))
    w = ExpertWeights(**{k: getattr(stacked, k) for k in ("up", "down", "act", "gate", "up_bias", "gate_bias",
                                                          "down_bias")})
    gate = None
    if lay["shared"] is not None:
        s = lay["shared"]
        w.shared = _zeros_ffn(H, s["intermediate_size"], lay["act"], s["gated"], s["bias"], dtype)
        gate = torch.zeros(1, H, dtype=dtype) if s.get("gate") else None  # layouts before shared gates have no key
    if router is None:
        router = Router(H, E, lay["top_k"], lay["scoring"], lay["jitter"]).to(dtype)
    return build_moe(w, router, lay["dropout"], gate)
