"""`moekit.export`: a moekit model, on disk or in memory, as a native transformers MoE checkpoint (`moekit export`)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from moekit.checkpoint.export import EXPORTERS
from moekit.checkpoint.upcycle import Written, export_checkpoint, named_dtype
from moekit.checkpoint.writer import DEFAULT_SHARD

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Written", "export"]


def export(source: str | Path | nn.Module, out: str | Path, fmt: str, *, layout: str = "classic", dtype: str = "auto",
           max_shard_size: int = DEFAULT_SHARD, overwrite: bool = False,
           tokenizer: PreTrainedTokenizerBase | None = None) -> Written:
    """Write a moekit MoE model as a native transformers MoE checkpoint (`moekit export`).

    The result loads with plain `transformers.AutoModelForCausalLM.from_pretrained(out)` and computes what the
    moekit model computes. A checkpoint directory is streamed layer by layer (a model larger than memory); an
    in-memory model gives the same files, byte for byte. Everything is checked before anything is written, and
    `out` appears complete or not at all.

    Args:
        source: A moekit checkpoint directory, or a moekit MoE model (`moekit.upcycle`, `moekit.load`).
        out: The output directory.
        fmt: The native format: mixtral, qwen2_moe or qwen3_moe (`moekit list formats`).
        layout: The routed experts' tensors: "classic" (one per expert, as the Hub's checkpoints) or "fused"
            (transformers 5's stacked tensors).
        dtype: The tensors' dtype as written: "auto" (the source's own), "float32", "bfloat16" or "float16".
        max_shard_size: The largest output shard, in bytes.
        overwrite: Replace a non-empty `out`.
        tokenizer: Saved beside the weights (an in-memory model; a directory's tokenizer files are copied).

    Returns:
        What was written: path, format, dtype, bytes, seconds and peak memory.

    Raises:
        ExportError: The format cannot represent the model exactly (the message says why).
        ConfigError: An unknown format, layout or dtype.
        OutputExistsError: `out` is not empty and `overwrite` is False.

    Example:
        >>> moekit.export("runs/llama-moe", "runs/llama-mixtral", "mixtral")  # doctest: +SKIP
    """
    from moekit._fs import reserve

    EXPORTERS.get(fmt)  # an unknown format or dtype: ConfigError before any loading
    named_dtype(dtype)
    if not isinstance(source, nn.Module):
        with reserve(out, [source], overwrite):
            return export_checkpoint(source, out, fmt, dtype=dtype, max_shard_size=max_shard_size,
                                     overwrite=overwrite, layout=layout)
    return _export_model(source, out, fmt, layout, dtype, max_shard_size, overwrite, tokenizer)


def _export_model(model: nn.Module, out: str | Path, fmt: str, layout: str, dtype: str, max_shard_size: int,
                  overwrite: bool, tokenizer: PreTrainedTokenizerBase | None) -> Written:
    """`export` of a model in memory: the same files as the streaming export of the model saved in moekit's
    format."""
    import time

    from moekit._fs import output, peak_memory
    from moekit.checkpoint.export.write import in_memory_units, legacy_tokenizer
    from moekit.checkpoint.stream import write_units
    from moekit.moe.layer import moe_layers
    from moekit.routing.sites import param_counts

    start, exporter = time.perf_counter(), EXPORTERS.get(fmt)
    p = exporter.plan(model, layout, named_dtype(dtype))
    exporter(model)  # the mapped weights fit the native class (strict load), or ExportError
    units = in_memory_units(model, exporter, p)
    with output(out, overwrite=overwrite) as tmp:
        nbytes = write_units(tmp, units, p.dtype, max_shard_size, "exporting")
        exporter.write_config(model, p, tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            legacy_tokenizer(tmp)
    return Written(Path(out), fmt, f"{fmt} requested", str(p.dtype).removeprefix("torch."), nbytes,
                   time.perf_counter() - start, peak_memory(), param_counts(model), len(moe_layers(model)))
