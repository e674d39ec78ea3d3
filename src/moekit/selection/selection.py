"""Expert selections: `{layer: [expert ids]}` plus the scores that produced them, as JSON."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, StrictInt, field_validator

from .._fs import output, read_small
from ..config import Config, validate
from ..errors import ConfigError


class Source(Config):
    """What a selection was made from: the model its trace was recorded on (the config's digest,
    moekit.routing.trace.config_digest, and the trace's MoE layers with their experts) and the trace's file."""

    config_sha256: str | None = None  # None: the trace did not record it
    experts: dict[str, StrictInt]  # MoE layer path -> its experts
    trace: str | None = None


class Selection(Config):
    """Which experts of which MoE layers (keys are the layers' module paths, as in RoutingTrace.layers), and the
    model it was made for (`source`; None: written by hand, or by moekit before selections recorded it)."""

    method: str
    target: str | None = None
    budget: int = Field(ge=0)
    experts: dict[str, list[StrictInt]]  # JSON integers only: true, 2.0 and "2" are refused
    scores: dict[str, list[float]] = {}  # per layer, one score per expert (method-specific)
    params: dict = {}  # the method's settings (alpha, ratios, top_p, seed, ...)
    source: Source | None = None

    @field_validator("experts")
    @classmethod
    def _distinct(cls, experts: dict[str, list[int]]) -> dict[str, list[int]]:
        for layer, ids in experts.items():
            if any(e < 0 for e in ids):
                raise ValueError(f"{layer}: expert ids must be ≥ 0, got {min(ids)}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{layer}: expert {next(e for e in ids if ids.count(e) > 1)} is named twice")
        return experts

    def from_trace(self, path: str | Path) -> Selection:
        """This selection with its source naming the trace file `path` it was made from."""
        if self.source is None:
            return self
        return self.model_copy(update={"source": self.source.model_copy(update={"trace": str(path)})})

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.experts.values())

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the JSON file atomically (moekit._fs.output)."""
        with output(path, overwrite=overwrite, kind="file", what="selection") as tmp:
            tmp.write_text(json.dumps(self.model_dump(), indent=2))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Selection:
        text = read_small(path, "selection", ConfigError)
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"{path}: not a moekit expert selection (not JSON: {e})") from None
        return validate(cls, data, source=f"expert selection {path}")
