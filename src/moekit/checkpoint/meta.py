"""Schemas of moekit's checkpoint metadata (moekit.json): validated before anything is built from it."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moekit.moe.router import Scoring


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SharedLayout(Strict):
    intermediate_size: int = Field(ge=1)
    gated: bool
    bias: list[bool] = Field(min_length=3, max_length=3)  # gate, up, down
    gate: bool = False  # a sigmoid gate row scales the shared expert (MoESpec.shared_gate)


class Layout(Strict):
    """What `moekit.moe.build.layout` records for one MoE layer."""

    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    scoring: Scoring
    jitter: float = Field(ge=0.0, lt=1.0)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    act: str
    gated: bool
    bias: bool
    dropout: float = Field(ge=0.0, lt=1.0)
    dtype: Literal["float32", "float16", "bfloat16", "float64"]
    shared: SharedLayout | None

    @field_validator("act")
    @classmethod
    def _known_act(cls, v: str) -> str:
        from transformers.activations import ACT2FN

        if v not in ACT2FN:
            raise ValueError(f"unknown activation {v!r}")
        return v


class LayerEntry(Strict):
    path: str
    stack: str
    index: int = Field(ge=0)
    adapter: str
    layout: Layout
    router_of: str
    init_diversity: float | None = None  # the routed experts' diversity when upcycled (SPRI A.1)


class MoekitMeta(Strict):
    """moekit.json."""

    FORMATS: ClassVar[tuple[str, ...]] = ("moekit/2", "moekit/1")  # 2: config.json wraps the base (checkpoint.wrapped)
    format: Literal["moekit/2", "moekit/1"]
    architecture: str
    spec: dict | None  # a MoESpec, validated by moekit.checkpoint.format.load
    layers: list[LayerEntry] = Field(min_length=1)
    aliases: dict[str, str]

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, layers: list[LayerEntry]) -> list[LayerEntry]:
        seen: dict[str, Layout] = {}
        for e in layers:
            lay = e.layout
            if lay.top_k > lay.num_experts:
                raise ValueError(f"{e.path}: top_k {lay.top_k} > num_experts {lay.num_experts}")
            if e.router_of != e.path:
                owner = seen.get(e.router_of)
                if owner is None:
                    raise ValueError(f"{e.path}: router_of {e.router_of!r} is not an earlier layer")
                if (owner.hidden_size, owner.num_experts, owner.top_k) != (lay.hidden_size, lay.num_experts, lay.top_k):
                    raise ValueError(f"{e.path} shares the router of {e.router_of} but has another shape")
            if e.path in seen:
                raise ValueError(f"layer {e.path} is listed twice")
            seen[e.path] = lay
        return layers


class SIMoEMeta(Strict):
    """simoe.json."""

    FORMATS: ClassVar[tuple[str, ...]] = ("moekit-simoe/2", "moekit-simoe/1")
    format: Literal["moekit-simoe/2", "moekit-simoe/1"]
    architecture: str
    config: dict  # a SIMoEConfig, validated by moekit.simoe.export.load
    kept: dict[str, int]  # pruned SI linear -> δ columns kept
    aliases: dict[str, str]
    skipped: list[str] = []  # targets the family computes with directly, never called (moekit.simoe.model._probe)

    @field_validator("kept")
    @classmethod
    def _positive(cls, kept: dict[str, int]) -> dict[str, int]:
        if any(n < 0 for n in kept.values()):
            raise ValueError("kept column counts must be non-negative")
        return kept
