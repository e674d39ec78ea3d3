"""Export moekit MoE models to native transformers MoE architectures (one module per format).

The result loads with plain `transformers.AutoModelForCausalLM.from_pretrained(out)` (no moekit) and
gives the moekit model's outputs. Formats that cannot represent a model exactly refuse with ExportError.
The routed experts are written in the Hub's classic per-expert layout (read by transformers 4 and 5, llama.cpp,
vLLM) or, with layout="fused", in transformers 5's (moekit.checkpoint.export.base).
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from moekit.checkpoint.export.base import EXPORTERS, LAYOUTS
from moekit.checkpoint.export import mixtral, qwen2_moe, qwen3_moe  # noqa: F401  (registration)
from moekit._fs import output


def export_model(model: nn.Module, fmt: str, out: str | Path, overwrite: bool = False, tokenizer=None,
                 layout: str = "classic") -> Path:
    """Write `model` as a native `fmt` checkpoint (safetensors, in the model's dtype) to `out`, atomically, with
    the routed experts in `layout` (classic or fused; see moekit.checkpoint.export.base). The same files, byte for byte, as
    the streaming `export_checkpoint` of the model saved in moekit's format.

    Everything is checked and converted before anything is written: a refusal leaves no output.
    """
    from moekit.checkpoint.stream import write_units
    from moekit.checkpoint.writer import DEFAULT_SHARD
    from moekit.checkpoint.export.write import in_memory_units, legacy_tokenizer

    exporter = EXPORTERS.get(fmt)
    p = exporter.plan(model, layout)
    exporter(model)  # the mapped weights fit the native class (strict load), or ExportError
    units = in_memory_units(model, exporter, p)
    with output(out, overwrite=overwrite) as tmp:
        write_units(tmp, units, p.dtype, DEFAULT_SHARD, "exporting")
        exporter.write_config(model, p, tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            legacy_tokenizer(tmp)
    return Path(out)


__all__ = ["EXPORTERS", "LAYOUTS", "export_model"]
