"""The expert-selection interface: one config class per method, registered in SELECTORS, and the
checks and the deterministic ranking every method shares."""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from moekit.config import Config, validate
from moekit.errors import ConfigError
from moekit.registry import Registry
from moekit.routing.trace import RoutingTrace
from moekit.selection.selection import Selection, Source


class Selector(Config):
    """Base class. Subclasses set `method: Literal[...]` and implement `select`."""

    method: str
    needs_budget: ClassVar[bool] = True  # False: the method decides how many experts (ESFT's threshold)
    per_layer: ClassVar[bool] = False  # True: a number of experts per layer (`top`); the target is optional

    def select(self, trace: RoutingTrace, target: str | None, budget: int | None = None) -> Selection:
        raise NotImplementedError

    def params(self) -> dict:
        return self.model_dump(mode="json", exclude={"method"})  # JSON types, so save -> load is equal


SELECTORS: Registry[type[Selector]] = Registry("expert selection method")


def select(trace: RoutingTrace, method: str, target: str | None, budget: int | None = None, **params) -> Selection:
    """Run the registered selection `method` with its settings `params` (validated: ConfigError if invalid).

    e.g. `select(trace, "rise", "sw", 128, alpha=10.0)`, `select(trace, "esft", "sw", score="gate")`.
    """
    selector = validate(SELECTORS.get(method), {"method": method, **params}, f"{method} settings")
    return selector.select(trace, target, budget)


def check_target(trace: RoutingTrace, target: str) -> np.ndarray:
    """(N,) bool: the target language's tokens. ConfigError if the trace has none."""
    if target not in trace.languages:
        raise ConfigError(f"target language {target!r} is not in the trace (it has: {', '.join(trace.languages)})")
    mask = trace.language_mask(target)
    if not mask.any():
        raise ConfigError(f"the trace has no tokens of the target language {target!r}")
    return mask


def check_budget(trace: RoutingTrace, budget: int | None) -> int:
    """The budget K as an int. ConfigError unless K is a whole number, 1 ≤ K ≤ the experts of all layers."""
    total = int(trace.num_experts.sum())
    if budget is None:
        raise ConfigError("this selection method needs a budget (the number of experts to select)")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= total:
        raise ConfigError(f"budget must be a whole number between 1 and the {total} experts of the trace's "
                          f"{trace.num_layers} layers, got {budget}")
    return int(budget)


def expert_mask(trace: RoutingTrace) -> np.ndarray:
    """(L, E) bool, E = the most experts of any layer: which (layer, expert) pairs exist."""
    E = int(trace.num_experts.max())
    return np.arange(E)[None, :] < np.asarray(trace.num_experts)[:, None]  # (L, E)


def top(scores: np.ndarray, eligible: np.ndarray, k: int) -> np.ndarray:
    """(L, E) bool: the k eligible entries of `scores` (L, E) with the highest score.

    Ties go to the lower layer, then the lower expert id (a stable sort of the row-major order).
    """
    flat = np.flatnonzero(eligible)  # (M,) in (layer, expert) order
    order = flat[np.argsort(-scores.ravel()[flat], kind="stable")]  # (M,) best first
    out = np.zeros(scores.size, dtype=bool)
    out[order[:k]] = True
    return out.reshape(scores.shape)  # (L, E)


def to_selection(trace: RoutingTrace, selector: Selector, target: str, chosen: np.ndarray, scores: np.ndarray,
                 **extra) -> Selection:
    """A Selection of the experts where `chosen` (L, E) is true, with each layer's `scores` (L, E), the
    selector's settings (plus `extra`) as params and the trace's model as its source. Every layer of the trace gets a
    key, empty or not."""
    n = [int(e) for e in trace.num_experts]
    return Selection(
        method=selector.method, target=target, budget=int(chosen.sum()),
        experts={name: np.flatnonzero(chosen[li]).tolist() for li, name in enumerate(trace.layers)},
        scores={name: [float(s) for s in scores[li, :n[li]]] for li, name in enumerate(trace.layers)},
        params={**selector.params(), **extra},
        source=Source(config_sha256=trace.meta.get("config_sha256"), experts=dict(zip(trace.layers, n))),
    )
