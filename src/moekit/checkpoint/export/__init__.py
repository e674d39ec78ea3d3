"""Export moekit MoE models to native transformers MoE architectures (one module per format; `moekit.export`,
in moekit.checkpoint.convert, writes them).

The result loads with plain `transformers.AutoModelForCausalLM.from_pretrained(out)` (no moekit) and
gives the moekit model's outputs. Formats that cannot represent a model exactly refuse with ExportError.
The routed experts are written in the Hub's classic per-expert layout (read by transformers 4 and 5, llama.cpp,
vLLM) or, with layout="fused", in transformers 5's (moekit.checkpoint.export.base).
"""
from __future__ import annotations

from moekit.checkpoint.export.base import EXPORTERS, LAYOUTS
from moekit.checkpoint.export import mixtral, qwen2_moe, qwen3_moe  # noqa: F401  (registration)


__all__ = ["EXPORTERS", "LAYOUTS"]
