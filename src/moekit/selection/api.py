"""`moekit.select` and `moekit.prune`: the `moekit select` and `moekit prune` commands as functions."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from torch import nn

    from moekit.routing.trace import RoutingTrace
    from moekit.selection.selection import Selection

__all__ = ["Pruned", "prune", "select"]

Log = Callable[[str], None]


def select(trace: str | Path | RoutingTrace, method: str, target: str | None = None, budget: int | None = None, *,
           out: str | Path | None = None, overwrite: bool = False, **settings: Any) -> Selection:
    """Choose experts from a routing trace (`moekit select METHOD`).

    RISE, ESFT, random and top-K choose an expert subnetwork for a target language within a budget; usage, REAP
    and EAN keep N experts per layer for pruning (`moekit list selectors`, `moekit select METHOD --help`).

    Args:
        trace: A routing trace file (`moekit.routes.collect`) or a loaded trace.
        method: The selection method: rise, esft, random, topk, usage, reap, ean.
        target: The target language, as labelled in the trace (per-layer methods: only its tokens count; None:
            every token).
        budget: The number of experts K (methods that take one).
        out: Write the selection as JSON here, atomically (None: not written).
        overwrite: Replace an existing `out`.
        **settings: The method's own settings (e.g. `alpha=10.0` for rise, `score="gate"` for esft, `top=4` for
            usage), validated by its config class.

    Returns:
        The selection ({layer: [expert ids]} with the scores that produced it); its source names the trace file.

    Raises:
        ConfigError: An unknown method, invalid settings, a target language the trace lacks, a budget out of range.
        CheckpointError: The trace file is damaged.
        OutputExistsError: `out` exists and `overwrite` is False.

    Example:
        >>> sel = moekit.select("trace.npz", "rise", "sw", 64, out="sw.json")  # doctest: +SKIP
    """
    from moekit._fs import reserve
    from moekit.routing.trace import RoutingTrace
    from moekit.selection.registry import select as run

    if isinstance(trace, RoutingTrace):
        return _saved(run(trace, method, target, budget, **settings), out, overwrite)
    with reserve(out, [trace], overwrite, what="selection", kind="file") if out is not None else _nothing():
        selection = run(RoutingTrace.load(trace), method, target, budget, **settings).from_trace(trace)
        return _saved(selection, out, overwrite)


@dataclass(frozen=True)
class Pruned:
    """What `prune` wrote. `mode` "disable": the model with its selected experts disabled (`params`: its
    parameter count, weights unchanged); "keep"/"drop": a native checkpoint with fewer experts (`kept`: expert ids
    kept per MoE block, `bytes` written)."""

    path: Path
    mode: Literal["disable", "keep", "drop"]
    selection: Selection
    params: int | None = None
    kept: dict[str, list[int]] | None = None
    bytes: int | None = None


def prune(model: str | Path, experts: str | Path, out: str | Path, *,
          mode: Literal["disable", "keep", "drop"] = "disable", overwrite: bool = False, trust_remote_code: bool = False,
          allow_other_model: bool = False, log: Log | None = None, warn: Log | None = None) -> Pruned:
    """Disable the experts of a selection, or remove experts from a native checkpoint (`moekit prune`).

    "disable": the routers never pick the selected experts and the top-k is renormalized over the rest; the model
    is saved with pruned_experts.json (re-applied when moekit loads it). "keep" / "drop": keep only the selected
    experts, or remove them, from a native transformers MoE checkpoint, one tensor at a time (a model larger than
    memory): the output is the same family with fewer experts per layer.

    Args:
        model: An MoE model: a moekit checkpoint, a transformers model directory or a built-in asset name.
        experts: A selection JSON (`moekit.select`).
        out: The output directory.
        mode: "disable", "keep" or "drop" (see above).
        overwrite: Replace a non-empty `out`.
        trust_remote_code: Allow a model directory that ships its own Python code (auto_map); it will run.
        allow_other_model: Use a selection made for another model (the layers and expert ids are still checked).
        log: Called with status lines (e.g. a download); None: silent.
        warn: Called with warnings (a selection that does not record its model); None: silent.

    Returns:
        What was written.

    Raises:
        ConfigError: The selection does not fit the model, or was made for another model.
        OutputExistsError: `out` is not empty and `overwrite` is False.

    Example:
        >>> moekit.prune("olmoe", "usage.json", "olmoe-pruned", mode="keep")  # doctest: +SKIP
    """
    from moekit._fs import reserve
    from moekit.assets import model_inputs
    from moekit.errors import ConfigError

    if mode not in ("disable", "keep", "drop"):
        raise ConfigError(f"unknown prune mode {mode!r}; choose disable, keep or drop")
    inputs = [*model_inputs(str(model)), Path(experts)]
    with reserve(out, inputs, overwrite) as real:
        if mode != "disable":
            return _remove(model, experts, out, mode, overwrite, inputs, trust_remote_code, allow_other_model, log, warn)
        return _disable(model, experts, real, overwrite, trust_remote_code, allow_other_model, log, warn)


def load_for_selection(folder: Path, experts: str | Path, trust_remote_code: bool, allow_other_model: bool,
                       warn: Log | None) -> tuple[Selection, nn.Module, PreTrainedTokenizerBase | None]:
    """(selection, model, tokenizer): the selection, and the model in `folder` it was checked against (`prune`,
    `finetune`)."""
    from moekit.checkpoint.dense import load_tokenizer
    from moekit.checkpoint.format import load_model
    from moekit.selection.common import check_source
    from moekit.selection.selection import Selection

    selection = Selection.load(experts)
    loaded = load_model(folder, trust_remote_code=trust_remote_code)
    check_source(selection, loaded, allow_other_model, warn)
    return selection, loaded, load_tokenizer(folder, trust_remote_code)


def _disable(model: str | Path, experts: str | Path, out: Path, overwrite: bool, trust_remote_code: bool,
             allow_other_model: bool, log: Log | None, warn: Log | None) -> Pruned:
    from moekit.assets import resolve_model
    from moekit.selection.prune import prune as disable, save_pruned

    folder = resolve_model(str(model), log=log)
    selection, loaded, tokenizer = load_for_selection(folder, experts, trust_remote_code, allow_other_model, warn)
    disable(loaded, selection)
    save_pruned(loaded, out, overwrite, tokenizer)
    return Pruned(out, "disable", selection, params=sum(p.numel() for p in loaded.parameters()))


def _remove(model: str | Path, experts: str | Path, out: str | Path, mode: Literal["keep", "drop"], overwrite: bool,
            inputs: list[Path], trust_remote_code: bool, allow_other_model: bool, log: Log | None,
            warn: Log | None) -> Pruned:
    from moekit.assets import resolve_model
    from moekit.checkpoint.remove import remove_experts
    from moekit.selection.prune import kept_experts
    from moekit.selection.selection import Selection

    selection = Selection.load(experts)
    folder = resolve_model(str(model), log=log)
    keep = kept_experts(folder, selection, mode, allow_other_model, trust_remote_code, warn)
    nbytes = remove_experts(folder, out, keep, overwrite, inputs, trust_remote_code=trust_remote_code)
    return Pruned(Path(out), mode, selection, kept=keep, bytes=nbytes)


def _saved(selection: Selection, out: str | Path | None, overwrite: bool) -> Selection:
    if out is not None:
        selection.save(out, overwrite=overwrite)
    return selection


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()
