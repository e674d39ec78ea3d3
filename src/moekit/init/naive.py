from __future__ import annotations

from typing import Literal

from moekit.init.base import EXPERT_INITS, ExpertInitConfig


@EXPERT_INITS.register("naive")
class NaiveInit(ExpertInitConfig):
    """Sparse upcycling (Komatsuzaki et al. 2022, §3): every expert is an exact copy of the dense FFN."""

    method: Literal["naive"] = "naive"
