"""RoutingTrace: what every MoE layer decided for every recorded (non-padding) token."""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MoekitError


class TraceError(MoekitError):
    """A trace file is unreadable or two traces cannot be merged."""


@dataclass
class RoutingTrace:
    """N tokens routed by L MoE layers with up to k experts each.

    ids (L, N, k) int16 expert ids (-1 pads layers with a smaller k), weights (L, N, k) float32
    combine weights, token/sample/position (N,) int32, lang (N,) int16 index into `languages`,
    num_experts (L,) experts per layer, layers the MoE layers' module paths.
    """

    layers: list[str]
    num_experts: np.ndarray  # (L,)
    languages: list[str]
    ids: np.ndarray  # (L, N, k)
    weights: np.ndarray  # (L, N, k)
    token: np.ndarray  # (N,)
    sample: np.ndarray  # (N,)
    position: np.ndarray  # (N,)
    lang: np.ndarray  # (N,)
    meta: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        return int(self.token.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[-1])

    def language_mask(self, language: str) -> np.ndarray:
        """(N,) bool: tokens of `language`; raises if the trace has none."""
        if language not in self.languages:
            raise TraceError(f"language {language!r} not in trace (has {', '.join(self.languages)})")
        return self.lang == self.languages.index(language)

    def select(self, mask: np.ndarray) -> RoutingTrace:
        """The sub-trace of the tokens where `mask` (N,) is true."""
        return RoutingTrace(self.layers, self.num_experts, self.languages, self.ids[:, mask],
                            self.weights[:, mask], self.token[mask], self.sample[mask], self.position[mask],
                            self.lang[mask], dict(self.meta))

    def save(self, path: str | Path) -> Path:
        """Write an .npz atomically (temp file, then rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, layers=np.array(self.layers), num_experts=self.num_experts,
                            languages=np.array(self.languages), ids=self.ids, weights=self.weights,
                            token=self.token, sample=self.sample, position=self.position, lang=self.lang,
                            meta=np.array(repr(self.meta)))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls([str(s) for s in z["layers"]], z["num_experts"], [str(s) for s in z["languages"]],
                           z["ids"], z["weights"], z["token"], z["sample"], z["position"], z["lang"],
                           ast.literal_eval(str(z["meta"])))
        except (OSError, KeyError, ValueError) as e:
            raise TraceError(f"{path}: not a moekit routing trace ({e})") from e

    @classmethod
    def merge(cls, traces: list[RoutingTrace]) -> RoutingTrace:
        """Concatenate traces of the same model; sample ids are offset so they stay distinct."""
        if not traces:
            raise TraceError("nothing to merge")
        first = traces[0]
        for t in traces[1:]:
            if t.layers != first.layers or not np.array_equal(t.num_experts, first.num_experts) or t.top_k != first.top_k:
                raise TraceError("cannot merge traces of different models (layers, experts or top-k differ)")
        languages = list(dict.fromkeys(lang for t in traces for lang in t.languages))
        offset, parts = 0, []
        for t in traces:
            remap = np.array([languages.index(lang) for lang in t.languages], dtype=np.int16)
            parts.append((t.sample + offset, remap[t.lang] if t.num_tokens else t.lang))
            offset += int(t.sample.max()) + 1 if t.num_tokens else 0
        cat = np.concatenate
        return cls(first.layers, first.num_experts, languages, cat([t.ids for t in traces], axis=1),
                   cat([t.weights for t in traces], axis=1), cat([t.token for t in traces]),
                   cat([p[0] for p in parts]).astype(np.int32), cat([t.position for t in traces]),
                   cat([p[1] for p in parts]).astype(np.int16), dict(first.meta))
