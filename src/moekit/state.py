"""What moekit attaches to a model, declared once: `model.moekit`, a `ModelState` (never ad-hoc attributes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from moekit.moe.spec import MoESpec
    from moekit.simoe.model import SIMoE


@dataclass
class ModelState:
    spec: MoESpec | None = None  # how the MoE layers were made (moekit.upcycle, a streamed meta model, moekit.json)
    simoe: SIMoE | None = None  # the SIMoE router and dual variable; also the submodule `model.simoe` (it trains, saves)
    pruned: dict[str, list[int]] = field(default_factory=dict)  # {router site: disabled expert ids} (moekit.select)


def model_state(model: nn.Module) -> ModelState:
    """The model's ModelState, created empty on first use (a plain attribute: not a submodule, not saved)."""
    state = model.__dict__.get("moekit")
    if state is None:
        state = model.__dict__["moekit"] = ModelState()
    return state


def spec_of(model: nn.Module) -> MoESpec | None:
    return model_state(model).spec
