"""Expert selections: `{layer: [expert ids]}` plus the scores that produced them, as JSON."""
from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import Field

from ..config import Config
from ..errors import ConfigError


class Selection(Config):
    """Which experts of which MoE layers (keys are the layers' module paths, as in RoutingTrace.layers)."""

    method: str
    target: str | None = None
    budget: int = Field(ge=0)
    experts: dict[str, list[int]]
    scores: dict[str, list[float]] = {}  # per layer, one score per expert (method-specific)
    params: dict = {}  # the method's settings (alpha, ratios, top_p, seed, ...)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.experts.values())

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.model_dump(), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Selection:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a moekit expert selection ({e})") from e
