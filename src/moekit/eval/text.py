"""Evaluation of text recipes (moekit.training.text): held-out loss and perplexity over the labelled tokens,
expert usage, diversity and parameter counts; results.json/csv and plots in the run directory."""
from __future__ import annotations

import math
from pathlib import Path

from moekit.data.parallel import TranslationCollator
from moekit.eval.plots import plot_curves, plot_usage
from moekit.eval.translation import examples_loss, write_results
from moekit.moe.diversity import diversity, init_diversity
from moekit.routing.sites import param_counts
from moekit.eval.usage import model_usage
from moekit.moe.layer import moe_layers


def evaluate_text(model, test: list[dict], batch_size: int) -> dict:
    """Held-out loss and perplexity, expert usage, diversity and parameter counts, in the layout of
    moekit.eval.translation.evaluate_run (one "direction": test) so results.csv and the CLI table read it."""
    loss = examples_loss(model, test, batch_size)
    collate = TranslationCollator(pad_id=0)  # padding is masked out: its id does not matter
    usage = model_usage(model, (collate(test[i:i + batch_size]) for i in range(0, len(test), batch_size)))
    total, active = param_counts(model)
    row = {"n": len(test), "loss": loss, "perplexity": math.exp(loss)}
    return {"directions": {"test": row}, "avg": {"loss": loss}, "kl": None, "diversity_init": init_diversity(model),
            "diversity": diversity(model) if moe_layers(model) else None, "usage": usage,
            "params": {"total": total, "active": active}}


def report_text(recipe, model, test: list[dict], log_history: list[dict]) -> dict:
    """`evaluate_text`, then results.json/csv and plots in the run directory."""
    out = Path(recipe.out)
    results = evaluate_text(model, test, recipe.eval.batch_size)
    write_results(results, out)
    plot_curves(log_history, out)
    if results["usage"]:
        plot_usage(results["usage"], out / "usage.png", title=f"{recipe.name}: expert usage (test)")
    return results
