"""mergekit-moe configs (mergekit 0.1.5's MoEMergeConfig and docs/moe.md) read as moekit upcycling recipes.

Key by key: `base_model` -> the model upcycled (every weight but the FFNs); `experts[i].source_model` -> routed
expert i's FFN (init `sources`; only its FFN tensors are read or needed, as mergekit reads only those); its `positive_prompts` / `negative_prompts` -> router.prompts[i]; `noise_scale`
/ `residual_scale` -> init.scaling; `gate_mode` -> router.init (GATE_MODES); `experts_per_token` -> top_k;
`shared_experts` (at most one) -> the shared expert and its model, gated as Qwen-MoE's where mergekit writes Qwen
MoE (`shared_gated`; its prompts -> router.shared_prompts); `dtype` -> the output dtype; `architecture` -> the
output format (ARCHITECTURES). Every decoder layer becomes an MoE layer whose top-k weights are
renormalized (topk_softmax), as in all of mergekit's outputs. The YAML is untrusted: read with yaml.safe_load
(moekit.config.read_yaml), every key checked.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from moekit.config import Config, validate
from moekit.errors import ConfigError
from moekit.moe.spec import MoESpec

# gate_mode -> router init and pooling (random: torch.randn rows, i.e. N(0, 1); uniform_random: nn.Linear's init)
GATE_MODES = {"hidden": {"init": "hidden"}, "hidden_last": {"init": "hidden"},
              "hidden_avg": {"init": "hidden", "pool": "mean"}, "cheap_embed": {"init": "cheap_embed"},
              "random": {"init": "normal", "init_std": 1.0}, "uniform_random": {"init": "uniform"}}
# mergekit's output architectures (an `architecture` value selects those whose name starts with it, any case) and the
# moekit format writing each: DeepSeek-MoE has no transformers class (mergekit writes remote code), so moekit's own
# format holds its ungated shared expert; Qwen MoE is Qwen2-MoE, with exactly one shared expert
ARCHITECTURES = {"mixtral": "mixtral", "deepseek moe": "moekit", "qwen moe": "qwen2_moe", "qwen3 moe": "qwen3_moe"}
DTYPES = ("float32", "float16", "bfloat16")


def check_architectures(model_types: dict[str, str], allow_crimes: bool) -> None:
    """{model: model_type} of the base and every expert source: one architecture, as mergekit-moe requires, unless
    `allow_crimes` (mergekit's flag of that name)."""
    kinds = sorted(set(model_types.values()))
    if len(kinds) > 1 and not allow_crimes:
        listed = ", ".join(f"{m} ({t})" for m, t in model_types.items())
        raise ConfigError(f"the models mix architectures ({', '.join(kinds)}): {listed}; mergekit-moe refuses this "
                          "and so does moekit, unless allow_crimes=True")


class MergekitExpert(Config):
    source_model: str
    positive_prompts: list[str] | None = None
    negative_prompts: list[str] | None = None
    noise_scale: float | None = Field(None, ge=0.0)
    residual_scale: float | None = None


class MergekitMoE(Config):
    base_model: str
    experts: list[MergekitExpert] = Field(min_length=1)
    gate_mode: Literal[tuple(GATE_MODES)] = "hidden"
    dtype: str | None = None
    experts_per_token: int = Field(2, ge=1)
    shared_experts: list[MergekitExpert] | None = Field(None, max_length=1)
    architecture: str | None = None


def is_mergekit(data: dict) -> bool:
    """Whether a YAML mapping is a mergekit-moe config (it has base_model and experts, not a moekit spec)."""
    return "base_model" in data and "experts" in data and "spec" not in data


def _unknown_keys(data: dict, cls: type[BaseModel], where: str, source: str) -> None:
    extra = [k for k in data if k not in cls.model_fields]
    if extra:
        raise ConfigError(f"{source}: unknown key {where}{extra[0]!r}; the valid keys{' of ' + where.rstrip('.') if where else ''} "
                          f"are {', '.join(cls.model_fields)}")


def read_mergekit(data: dict, source: str) -> MergekitMoE:
    """The validated config; an unknown key is one ConfigError naming the valid keys where it stands."""
    _unknown_keys(data, MergekitMoE, "", source)
    for field in ("experts", "shared_experts"):
        for i, e in enumerate(data.get(field) if isinstance(data.get(field), list) else []):
            if isinstance(e, dict):
                _unknown_keys(e, MergekitExpert, f"{field}[{i}].", source)
    cfg = validate(MergekitMoE, data, source=source)
    for e in (*cfg.experts, *(cfg.shared_experts or [])):
        if "+" in e.source_model:
            raise ConfigError(f"{source}: {e.source_model}: LoRA references (model+lora) are not supported; merge the "
                              "LoRA into the model first")
    return cfg


def output_format(cfg: MergekitMoE) -> str:
    """moekit's format for `architecture` (None: auto, the first native format that represents the MoE)."""
    if cfg.architecture is None:
        return "auto"
    names = [a for a in ARCHITECTURES if a.startswith(cfg.architecture.lower())]
    if not names:
        raise ConfigError(f"architecture {cfg.architecture!r} names none of mergekit's output architectures: "
                          f"{', '.join(ARCHITECTURES)}")
    if names == ["qwen moe", "qwen3 moe"]:  # mergekit takes the one that supports the config: Qwen MoE needs a shared expert
        names = names[:1] if cfg.shared_experts else names[1:]
    return ARCHITECTURES[names[0]]


def output_dtype(cfg: MergekitMoE) -> str:
    """The output dtype (auto: the checkpoint's own, as mergekit's default, the base config's)."""
    if cfg.dtype is None:
        return "auto"
    name = cfg.dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"dtype {cfg.dtype!r} is not an output dtype; choose {', '.join(DTYPES)}")
    return name


def _prompts(e: MergekitExpert) -> dict:
    return {"positive": e.positive_prompts, "negative": e.negative_prompts or []}


def shared_gated(cfg: MergekitMoE, source: str) -> bool:
    """Whether the shared expert gets Qwen-MoE's sigmoid gate: where mergekit writes Qwen MoE, i.e. the shared
    expert has prompts (its gate row), or `architecture` is qwen with a random gate_mode (a random gate row).
    DeepSeek-MoE's shared expert is ungated and takes no prompts."""
    shared = cfg.shared_experts[0] if cfg.shared_experts else None
    if shared is None:
        return False
    if shared.negative_prompts and not shared.positive_prompts:
        raise ConfigError(f"{source}: shared_experts[0] has negative_prompts but no positive_prompts")
    fmt = output_format(cfg)
    if shared.positive_prompts and fmt == "moekit":
        raise ConfigError(f"{source}: architecture {cfg.architecture} has no gate on its shared expert, so "
                          "shared_experts[0] takes no prompts (architecture qwen has one)")
    return bool(shared.positive_prompts) or (fmt == "qwen2_moe" and GATE_MODES[cfg.gate_mode]["init"] in
                                             ("normal", "uniform"))


def _router(cfg: MergekitMoE, gated: bool) -> dict:
    router = {"scoring": "topk_softmax", **GATE_MODES[cfg.gate_mode]}
    if router["init"] not in ("hidden", "cheap_embed"):
        return router
    missing = next((i for i, e in enumerate(cfg.experts) if not e.positive_prompts), None)
    if missing is not None:
        raise ConfigError(f"experts[{missing}] has no positive_prompts, which gate_mode {cfg.gate_mode} needs (or use "
                          "gate_mode random)")
    return {**router, "prompts": [_prompts(e) for e in cfg.experts],
            **({"shared_prompts": _prompts(cfg.shared_experts[0])} if gated else {})}


def to_spec(cfg: MergekitMoE, source: str, allow_same_experts: bool = False, seed: int = 0) -> MoESpec:
    """The MoESpec of a mergekit-moe config (module docstring); `allow_same_experts` builds experts that all come from one
    model (mergekit's --i-understand-this-is-not-useful-without-training)."""
    shared = cfg.shared_experts[0] if cfg.shared_experts else None
    gated = shared_gated(cfg, source)
    models = [e.source_model for e in cfg.experts]
    if len(models) > 1 and len(set(models)) == 1 and not allow_same_experts:
        raise ConfigError(f"{source}: every expert is {models[0]}, so the MoE would compute what that model computes at "
                          "a higher cost; allow it explicitly to train it afterwards (allow_same_experts=True; mergekit's "
                          "i-understand-this-is-not-useful-without-training flag)")
    sources = [*cfg.experts, *([shared] if shared is not None else [])]
    scaled = any(e.noise_scale or e.residual_scale is not None for e in sources)
    init = {"method": "sources", "branches": models, "allow_same": allow_same_experts,
            "shared_source": None if shared is None else shared.source_model,
            "scaling": [{"noise_scale": e.noise_scale or 0.0, "residual_scale": 1.0 if e.residual_scale is None
                         else e.residual_scale} for e in sources] if scaled else []}
    return validate(MoESpec, {"num_experts": len(cfg.experts), "top_k": cfg.experts_per_token, "init": init,
                              "shared_expert": shared is not None, "shared_gate": gated, "router": _router(cfg, gated),
                              "seed": seed},
                    source=source)
