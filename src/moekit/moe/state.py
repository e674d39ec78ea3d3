"""What moekit attaches to a model, declared once: `model.moekit`, a `ModelState` (never ad-hoc attributes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from moekit.moe.spec import MoESpec


@dataclass
class ModelState:
    """Each field is kept in checkpoints by moekit's format or by the StateCodec registered for it
    (moekit.checkpoint.codecs), so a new kind of state is one field here and one codec where it is made."""

    spec: MoESpec | None = None  # how the MoE layers were made (moekit.upcycle, a streamed meta model, moekit.json)
    # moekit.simoe.model.SIMoE: the SIMoE router and dual variable, also the submodule `model.simoe` (it trains, saves)
    simoe: nn.Module | None = None
    pruned: dict[str, list[int]] = field(default_factory=dict)  # {router site: disabled expert ids} (moekit.selection)


def model_state(model: nn.Module) -> ModelState:
    """The model's ModelState, created empty on first use (a plain attribute: not a submodule, not saved)."""
    state = model.__dict__.get("moekit")
    if state is None:
        state = model.__dict__["moekit"] = ModelState()
    return state


def spec_of(model: nn.Module) -> MoESpec | None:
    return model_state(model).spec
