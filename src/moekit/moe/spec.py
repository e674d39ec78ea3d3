"""MoESpec: what MoE to build (experts, top-k, which FFNs, router, init method)."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from moekit.config import Config
from moekit.errors import ConfigError
from moekit.moe.router import Scoring
from moekit.registry import Registry


PROMPT_INITS = ("hidden", "cheap_embed")  # router inits computed from prompts (moekit.moe.prompts)
# The expert-init methods (one file each in moekit.init, `@EXPERT_INITS.register(name)`): a spec's `init` names one.
# moekit.init registers into it when the registry is first asked; this module never imports moekit.init.
EXPERT_INITS: Registry = Registry("expert init method", fill="moekit.init")


class ExpertPrompts(Config):
    """Texts one expert should (positive) and should not (negative) receive: mergekit-moe's positive_prompts and
    negative_prompts of one expert."""

    positive: list[str] = Field(min_length=1)
    negative: list[str] = []


class RouterSpec(Config):
    """How routers score and start. `init`: normal, N(0, init_std²) entries; zeros; uniform, U(±1/√H) as
    torch.nn.Linear (mergekit-moe's uniform_random); hidden or cheap_embed, rows computed from `prompts`, one
    entry per expert (mergekit-moe's gate modes; moekit.moe.prompts), `pool` choosing the hidden state of each
    prompt's last token (mergekit's hidden) or the mean over its tokens. None: the init method's default. The
    shared expert's gate (MoESpec.shared_gate) starts the same way, from `shared_prompts` for hidden and
    cheap_embed."""

    scoring: Scoring | None = None  # None -> the init method's default (see ExpertInitConfig)
    jitter: float = Field(0.0, ge=0.0, lt=1.0)
    init: Literal["normal", "zeros", "uniform", "hidden", "cheap_embed"] | None = None
    init_std: float = Field(0.02, gt=0.0)
    prompts: list[ExpertPrompts] | None = None
    shared_prompts: ExpertPrompts | None = None
    pool: Literal["last", "mean"] = "last"

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if (self.prompts is not None) != (self.init in PROMPT_INITS):
            raise ValueError(f"router.prompts go with router.init {' or '.join(PROMPT_INITS)}, and those need them")
        return self


class MoESpec(Config):
    """Which dense FFNs become MoE layers and how.

    Layer selection is per stack of blocks (e.g. Whisper has an encoder and a decoder stack):
    `every=N` makes block i an MoE layer when (i + 1) % N == 0 (Qwen-MoE's decoder_sparse_step),
    `layers=[...]` lists block indices, neither means all. `target` is a regular expression the
    FFN's module path must match (e.g. "encoder" for Whisper's encoder only).

    `granularity` G (He et al. 2024, arXiv:2410.07524, granular upcycling; Megatron-Core's upcycling
    granularity): each dense FFN's intermediate dimension I is cut into G contiguous shards, so a layer has
    E·G routed experts of width I/G (expert e·G + g is shard g of copy e) and its router picks k·G of them.
    `num_experts` and `top_k` stay the number of copies E and of copies per token k; `routed_experts` and
    `routed_top_k` are what the router sees. I must be divisible by G; only init methods that declare
    `granular` (scaled_copy) accept G > 1.

    `shared_gate` (Qwen2-MoE's shared expert gate) scales the shared expert by sigmoid(g·x), g a router row of
    its own (RouterSpec); without it the shared expert is always on (SPRI eq. 3, DeepSeek-MoE).

    `router_sharing` (Omni-router, Gu et al. 2025, eq. 4.1): "none" gives every MoE layer its own
    router; "all" makes one router module serve every MoE layer (each feeds it its own hidden
    state); a mapping {group name: regular expression} shares one router among the MoE layers whose
    path matches the group's expression (e.g. {"enc": "encoder", "dec": "decoder"} for Whisper);
    layers matching no group keep their own router, a layer matching two groups is an error.
    """

    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    granularity: int = Field(1, ge=1)
    every: int | None = Field(None, ge=1)
    layers: list[int] | None = None
    target: str | None = None
    shared_expert: bool = False
    shared_gate: bool = False
    router: RouterSpec = RouterSpec()
    router_sharing: Literal["none", "all"] | dict[str, str] = "none"
    init: SerializeAsAny[Any] = Field("naive", validate_default=True)
    seed: int = 0

    @field_validator("init", mode="before")
    @classmethod
    def _parse_init(cls, v: Any) -> Any:
        if isinstance(v, Config) and getattr(v, "method", None) in EXPERT_INITS and \
                type(v) is EXPERT_INITS.get(v.method):
            return v
        if isinstance(v, str):
            v = {"method": v}
        if not isinstance(v, dict) or "method" not in v:
            raise ValueError("init must be a method name or a mapping with a 'method' key")
        try:
            init_cls = EXPERT_INITS.get(v["method"])
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return init_cls.model_validate(v)

    @field_validator("target")
    @classmethod
    def _check_regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"target is not a valid regular expression: {e}") from None
        return v

    @field_validator("router_sharing")
    @classmethod
    def _check_groups(cls, v: str | dict[str, str]) -> str | dict[str, str]:
        if isinstance(v, dict):
            if not v:
                raise ValueError('router_sharing groups must not be empty (use "none")')
            for name, pattern in v.items():
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(f"router_sharing group {name!r} is not a valid regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        if self.every is not None and self.layers is not None:
            raise ValueError("give either every or layers, not both")
        if self.layers is not None and any(i < 0 for i in self.layers):
            raise ValueError("layers must be non-negative block indices")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            twice = sorted({i for i in self.layers if self.layers.count(i) > 1})
            raise ValueError(f"layers lists block {', '.join(map(str, twice))} more than once")
        if self.granularity > 1 and not self.init.granular:
            able = [m for m in EXPERT_INITS.names() if EXPERT_INITS.get(m).granular]
            raise ValueError(f"granularity {self.granularity} (experts cut into shards of the dense FFN) works with "
                             f"init {' or '.join(able)} only, not {self.init.method}")
        self.init.check(self)
        self._check_prompts()
        return self

    def _check_prompts(self) -> None:
        if self.shared_gate and not self.shared_expert:
            raise ValueError("shared_gate gates the shared expert: it needs shared_expert=true")
        prompts = self.router.prompts
        if (self.router.shared_prompts is not None) != (prompts is not None and self.shared_gate):
            raise ValueError("router.shared_prompts start the shared expert's gate (shared_gate) from prompts, as "
                             "router.prompts start the router: give both or neither")
        if prompts is None:
            return
        if len(prompts) != self.num_experts:
            raise ValueError(f"router.prompts has {len(prompts)} entries for {self.num_experts} experts; give one "
                             "per expert")
        if self.num_experts > 1 and all(p == prompts[0] for p in prompts[1:]):
            raise ValueError("every expert has the same router prompts, so every expert gets the same router row: "
                             "give each expert prompts of what it should receive")
        if self.router.init == "hidden" and self.router_sharing != "none":
            raise ValueError("router.init hidden gives each MoE layer its own router rows; use router_sharing none")

    @property
    def routed_experts(self) -> int:
        """Experts per MoE layer as the router sees them: E·G."""
        return self.num_experts * self.granularity

    @property
    def routed_top_k(self) -> int:
        """Experts per token as the router picks them: k·G."""
        return self.top_k * self.granularity

    @property
    def summary(self) -> str:
        """E.g. "8 experts, top-2", or with granularity 2: "16 experts (8 copies x 2 shards), top-4"."""
        if self.granularity == 1:
            return f"{self.num_experts} experts, top-{self.top_k}"
        return (f"{self.routed_experts} experts ({self.num_experts} copies x {self.granularity} shards), "
                f"top-{self.routed_top_k}")

    @property
    def scoring(self) -> Scoring:
        return self.router.scoring or self.init.scoring_default(self)

    @property
    def router_init(self) -> str:
        return self.router.init or self.init.router_init_default(self)

    def router_group(self, path: str) -> str | None:
        """The name of the router-sharing group of the MoE layer at `path` (None: a router of its own)."""
        if self.router_sharing == "none":
            return None
        if self.router_sharing == "all":
            return "all"
        groups = [name for name, pattern in self.router_sharing.items() if re.search(pattern, path)]
        if len(groups) > 1:
            raise ConfigError(f"MoE layer {path} matches several router_sharing groups: {', '.join(groups)}")
        return groups[0] if groups else None

    def selects(self, index: int, path: str) -> bool:
        """Whether block `index` of its stack (FFN at module path `path`) becomes an MoE layer."""
        if self.target is not None and not re.search(self.target, path):
            return False
        if self.layers is not None:
            return index in self.layers
        return self.every is None or (index + 1) % self.every == 0
