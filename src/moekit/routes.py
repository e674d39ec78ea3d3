"""Routing analysis from Python, as `moekit routes collect|report`: record which experts an MoE model routes each
token of per-language texts to, and report on the trace (RISE, layer-wise similarity, usage, Cramér's V, entropy).

The work is done by moekit.routing (streamed: one decoder layer in memory at a time; capture: the loaded model);
these functions add what the commands do around it: reading the inputs, choosing the path, writing atomically.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from moekit.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from moekit.routing.streamed import Batch
    from moekit.routing.trace import RoutingTrace

__all__ = ["collect", "report", "IN_MEMORY_SHARE", "LOAD_PEAK"]

# the whole-model path's peak over its weights in the compute dtype: loading holds the checkpoint's tensors and the
# model at once (measured 2.3x on a 1.26 GB bf16 Qwen3-MoE cut loaded in float32: 5.7 GiB), plus activations
LOAD_PEAK = 2.5
IN_MEMORY_SHARE = 0.8


def collect(model: str | Path, texts: Mapping[str, str | Path], out: str | Path, *, max_length: int = 256,
            batch_size: int = 8, max_texts: int | None = None, layers: str | None = None, overwrite: bool = False,
            trust_remote_code: bool = False, device: str = "cpu",
            stream: Literal["auto", "on", "off"] = "auto", dtype: Literal["float32", "bfloat16", "float16"] = "float32",
            experts_per_load: int | None = None, log: Callable[[str], None] | None = None) -> RoutingTrace:
    """Record a routing trace (.npz) of per-language text files (`moekit routes collect`).

    Runs the model on every line of each text file and saves the top-k experts and weights of every MoE layer for
    every token. The streamed path (one decoder layer in memory, read from the checkpoint) and the whole-model
    path give the same trace.

    Args:
        model: A moekit checkpoint or transformers MoE model directory (with tokenizer), a built-in asset name, or
            a Hugging Face Hub id org/name[@revision].
        texts: {language: text file}, one text per line.
        out: The trace file (.npz).
        max_length: Texts are cut to this many tokens.
        batch_size: Texts per forward pass.
        max_texts: Use at most this many texts per language (None: all).
        layers: A regular expression on the MoE layer paths to record (None: all).
        overwrite: Replace an existing trace file.
        trust_remote_code: Allow a model directory that ships its own Python code (auto_map); it will run.
        device: auto, cpu, cuda or cuda:N.
        stream: "on": one decoder layer in memory at a time; "off": the whole model loaded; "auto": off when the
            whole model's load would peak under IN_MEMORY_SHARE of the memory available (LOAD_PEAK times its
            weights in `dtype`).
        dtype: The weights' dtype while recording (the trace records it).
        experts_per_load: Streamed: read each MoE layer's experts this many at a time, run on every batch before
            the rest of the layer (a layer bigger than memory: DeepSeek-V3's is 22.5 GB in bfloat16); None: all at
            once where they take at most a quarter of the memory available (of the GPU on one), else as many as fit
            in that quarter. The same decisions; weights and saliency sums to float rounding (the order in which a
            token's expert outputs are added).
        log: Called with status lines (e.g. a download); None: silent.

    Returns:
        The trace, as saved to `out` (its meta has model, max_length, streamed and dtype).

    Raises:
        ConfigError: A setting out of range, a text file without texts.
        CheckpointError: The model has no tokenizer, or no pad or eos token.
        OutputExistsError: `out` exists and `overwrite` is False.

    Example:
        >>> trace = moekit.routes.collect("olmoe", {"en": "en.txt", "fr": "fr.txt"}, "trace.npz")  # doctest: +SKIP
    """
    import torch

    from moekit._fs import reserve
    from moekit.assets import model_inputs, resolve_model
    from moekit.config import resolve_device
    from moekit.routing.streamed import batches_of

    if max_length < 1 or batch_size < 1 or (max_texts is not None and max_texts < 1) or \
            (experts_per_load is not None and experts_per_load < 1):
        raise ConfigError("max_length, batch_size, max_texts and experts_per_load must be ≥ 1")
    if experts_per_load is not None and stream == "off":
        raise ConfigError("experts_per_load reads a layer's experts a few at a time in the streamed capture; "
                          "stream='off' loads the whole model")
    if stream not in ("auto", "on", "off") or dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"stream must be auto, on or off and dtype float32, bfloat16 or float16, got {stream!r} and "
                          f"{dtype!r}")
    device = resolve_device(device)
    with reserve(out, [*model_inputs(str(model)), *texts.values()], overwrite, what="trace", kind="file"):
        folder = resolve_model(str(model), log=log)  # a directory, built-in asset or Hub id
        lines = {lang: _read_texts(Path(path), max_texts) for lang, path in texts.items()}
        batches = batches_of(_tokenizer(folder, trust_remote_code), lines, max_length, batch_size)
        torch_dtype = getattr(torch, dtype)
        streamed = stream == "on" or (stream == "auto" and too_big_to_load(folder, torch_dtype))
        trace = _collect(folder, batches, layers, torch_dtype, device, streamed, trust_remote_code, experts_per_load)
        trace.meta.update(model=str(folder), max_length=max_length, streamed=streamed, dtype=dtype)
        trace.save(out, overwrite=overwrite)
    return trace


def report(trace: str | Path, out: str | Path, *, reference: str | None = None, top_k_set: int | None = None,
           selection: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write report.md, metrics.json and figures of a routing trace (`moekit routes report`).

    Language routing isolation (RISE), layer-wise similarity to a reference language, expert usage, Cramér's V of
    adjacent layers and routing entropy (Omni-router).

    Args:
        trace: A trace file from `collect`.
        out: The output directory.
        reference: The reference language of the layer-wise similarity (None: the one with most tokens).
        top_k_set: K of the global expert sets (None: layers × top-k).
        selection: A selection JSON (`moekit.select`): adds Ω and the selected-expert map.
        overwrite: Replace a non-empty `out`.

    Returns:
        The output directory.

    Raises:
        CheckpointError: The trace or the selection file is damaged.
        ConfigError: `reference` is not a language of the trace.
        OutputExistsError: `out` is not empty and `overwrite` is False.

    Example:
        >>> moekit.routes.report("trace.npz", "report/")  # doctest: +SKIP
    """
    from moekit._fs import reserve
    from moekit.routing.report import write_report
    from moekit.routing.trace import RoutingTrace
    from moekit.selection.selection import Selection

    with reserve(out, [trace, *([selection] if selection is not None else [])], overwrite):
        t = RoutingTrace.load(trace)
        experts = target = None
        if selection is not None:
            sel = Selection.load(selection)
            experts, target = sel.experts, sel.target if sel.target in t.languages else None
        return Path(write_report(t, out, reference, top_k_set, experts, target, overwrite=overwrite))


def _read_texts(path: Path, limit: int | None) -> list[str]:
    from moekit._fs import read_small

    lines = [line.strip() for line in read_small(path, "text file", ConfigError, limit=4 << 30).splitlines()]
    texts = [t for t in lines if t][:limit]
    if not texts:
        raise ConfigError(f"{path} has no texts (one per line)")
    return texts


def _tokenizer(folder: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (batches need padding; the attention mask keeps pads out)."""
    from moekit.checkpoint.dense import load_tokenizer

    tok = load_tokenizer(folder, trust_remote_code)
    if tok is None:
        raise CheckpointError(f"{folder} has no tokenizer files")
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise CheckpointError(f"the tokenizer of {folder} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def in_memory_peak(model: str | Path, dtype: torch.dtype) -> int:
    """Predicted peak bytes of the whole-model path on `model` in `dtype` (a quantized checkpoint's weights counted as
    the model holds them: ShardReader's headers)."""
    from moekit.checkpoint.files import ShardReader

    with ShardReader(model) as reader:
        return int(LOAD_PEAK * sum(math.prod(i.shape) for i in reader.headers.values()) * dtype.itemsize)


def too_big_to_load(folder: str | Path, dtype: torch.dtype) -> bool:
    """Whether the whole model's predicted peak exceeds IN_MEMORY_SHARE of the memory available now."""
    from moekit._fs import available_memory

    return in_memory_peak(folder, dtype) > IN_MEMORY_SHARE * available_memory()


def _collect(folder: Path, batches: list[Batch], layers: str | None, dtype: torch.dtype, device: str, streamed: bool,
             trust_remote_code: bool, experts_per_load: int | None) -> RoutingTrace:
    """The trace of `batches`, streamed from the checkpoint or through the loaded model."""
    from moekit.routing.streamed import collect_in_memory, collect_streamed

    if streamed:
        return collect_streamed(folder, batches, layers, dtype, device, trust_remote_code=trust_remote_code,
                                experts_per_load=experts_per_load)
    from moekit.checkpoint.format import load_model

    model = load_model(folder, trust_remote_code=trust_remote_code, dtype=dtype).to(device)
    return collect_in_memory(model, batches, layers)
