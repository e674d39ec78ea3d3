"""Export moekit MoE models to native transformers MoE architectures (one module per format).

The result loads with plain `transformers.AutoModelForCausalLM.from_pretrained(out)` (no moekit) and
gives the moekit model's outputs. Formats that cannot represent a model exactly refuse with ExportError.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from moekit.export.base import EXPORTERS
from moekit.export import mixtral, qwen2_moe, qwen3_moe  # noqa: F401  (registration)
from moekit._fs import output


def export_model(model: nn.Module, fmt: str, out: str | Path, overwrite: bool = False, tokenizer=None) -> Path:
    """Write `model` as a native `fmt` checkpoint (safetensors) to `out`, atomically.

    Everything is checked and converted before anything is written: a refusal leaves no output.
    """
    exporter = EXPORTERS.get(fmt)
    with output(out, overwrite=overwrite) as tmp:
        native = exporter(model)
        native.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out)


__all__ = ["EXPORTERS", "export_model"]
