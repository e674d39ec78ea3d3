"""`moekit.simoe_report` and `moekit.simoe_export`: the `moekit simoe report|export RUN_DIR` commands as functions.

They read a SIMoE run's recipe (its test tasks give the mean routing per task), so they live above moekit.simoe, in
the training layer, and `moekit` exports them as `simoe_report` / `simoe_export` rather than as `moekit.simoe.*`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moekit.errors import CheckpointError, ConfigError

__all__ = ["SIMoEExported", "simoe_export", "simoe_report"]


@dataclass(frozen=True)
class SIMoEExported:
    """What `simoe_export` wrote: parameter counts of the SIMoE form before, and of what was saved."""

    out: Path
    before_total: int
    before_active: int
    total: int
    active: int
    merged_task: str | None  # the task a dense model was merged for; None: the SIMoE form was saved


def _open(run_dir: Path) -> tuple[Any, Any, Any]:
    """(model, tokenizer or None, recipe or None) of a run directory or a bare SIMoE checkpoint."""
    from moekit.checkpoint.dense import load_tokenizer
    from moekit.simoe.export import load
    from moekit.training.recipe import load_recipe

    folder = run_dir / "model" if (run_dir / "model").is_dir() else run_dir
    model = load(folder)
    recipe = load_recipe(run_dir / "recipe.yaml", [f"out={run_dir}"]) if (run_dir / "recipe.yaml").is_file() else None
    return model, load_tokenizer(folder), recipe


def _routing(model: Any, tok: Any, recipe: Any) -> dict[str, list[float]] | None:
    """Mean routing per test task (or direction) of the run's recipe; None without a recipe and tokenizer."""
    from moekit.data.parallel import prompt_of
    from moekit.simoe.analysis import task_routing
    from moekit.training.run import load_data

    if recipe is None or tok is None:
        return None
    _, test = load_data(recipe)
    routing: dict[str, list[float]] = task_routing(
        model, tok, {t: [prompt_of(p, recipe.data.template) for p in ps] for t, ps in test.items()},
        recipe.eval.batch_size)
    return routing


def simoe_report(run_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write a SIMoE model's analysis (`moekit simoe report RUN_DIR --out OUT`).

    Non-zero expert parameters per layer type and depth, expert overlaps, and, for a run directory, the task
    dendrogram of its test tasks' mean routing (PNG files and report.json).

    Args:
        run_dir: A SIMoE run directory (`method: simoe`), or a bare SIMoE checkpoint (no task routing then).
        out: The output directory.
        overwrite: Replace a non-empty `out`.

    Returns:
        The report's directory.

    Raises:
        CheckpointError: `run_dir` holds no SIMoE model.
        OutputError: `out` exists and is not empty (without `overwrite`), or holds an input.

    Example:
        >>> moekit.simoe_report("runs/simoe", "runs/simoe-report")  # doctest: +SKIP
    """
    from moekit._fs import reserve
    from moekit.simoe.analysis import write_report

    with reserve(out, [run_dir], overwrite):
        model, tok, recipe = _open(Path(run_dir))
        return Path(write_report(model, out, _routing(model, tok, recipe), overwrite=overwrite))


def simoe_export(run_dir: str | Path, out: str | Path, *, prune: bool = False, merge: str | None = None,
                 overwrite: bool = False) -> SIMoEExported:
    """Save a SIMoE model's compact form, or a dense model for one task (`moekit simoe export RUN_DIR --out OUT`).

    Args:
        run_dir: A SIMoE run directory or checkpoint.
        out: The output directory.
        prune: Remove the δ columns whose gates are 0 for every expert before saving.
        merge: A test task of the run: fold the experts for its mean routing into dense weights and save a plain
            transformers model instead (needs a run directory: recipe.yaml and tokenizer).
        overwrite: Replace a non-empty `out`.

    Returns:
        Parameter counts before and after, and the merged task.

    Raises:
        CheckpointError: `run_dir` holds no SIMoE model, or `merge` is given for a bare checkpoint.
        ConfigError: `merge` is not a test task of the run.
        OutputError: `out` exists and is not empty (without `overwrite`), or holds an input.

    Example:
        >>> moekit.simoe_export("runs/simoe", "runs/simoe-fr", merge="en-fr")  # doctest: +SKIP
    """
    from moekit._fs import reserve

    with reserve(out, [run_dir], overwrite):
        return _export(Path(run_dir), Path(out), prune, merge, overwrite)


def _export(run_dir: Path, out: Path, prune: bool, merge: str | None, overwrite: bool) -> SIMoEExported:
    from moekit.simoe.export import merge as merge_experts, prune as prune_columns, save
    from moekit.simoe.model import param_counts

    model, tok, recipe = _open(run_dir)
    before = param_counts(model)
    if merge is None:
        if prune:
            prune_columns(model)
        save(model, out, overwrite, tokenizer=tok)
        after = param_counts(model)
        return SIMoEExported(out, before["total"], before["active"], after["total"], after["active"], None)
    routing = _routing(model, tok, recipe)
    if routing is None:
        raise CheckpointError(f"merging needs a run directory (recipe.yaml and tokenizer): {run_dir}")
    if merge not in routing:
        raise ConfigError(f"unknown task {merge!r}; the run's test tasks: {', '.join(routing)}")
    import torch

    from moekit._fs import output
    from moekit.checkpoint.card import write_model_card

    dense = merge_experts(model, torch.tensor(routing[merge]))
    with output(out, overwrite=overwrite) as tmp:
        dense.save_pretrained(tmp)
        write_model_card(dense, tmp, title=f"SIMoE model merged for task {merge!r}")
        if tok is not None:
            tok.save_pretrained(tmp)
    total = sum(p.numel() for p in dense.parameters())
    return SIMoEExported(out, before["total"], before["active"], total, total, merge)
