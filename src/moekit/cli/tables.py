"""Rich tables of evaluation results (the library returns dicts; only the CLI renders them)."""
from __future__ import annotations

from rich.table import Table

from moekit.eval.translation import CSV_COLUMNS, result_rows


_FORMATS = {"rougeL": "{:.2f}", "bleu": "{:.2f}", "chrf": "{:.2f}", "comet": "{:.2f}", "wer": "{:.3f}", "cer": "{:.3f}", "loss": "{:.4f}", "kl": "{:.4g}",
            "diversity_init": "{:.4f}", "diversity": "{:.4f}", "n": "{:,}", "total_params": "{:,}", "active_params": "{:,}"}


def results_table(rows: list[dict], title: str | None = None, columns: tuple[str, ...] = CSV_COLUMNS) -> Table:
    """A rich Table of `result_rows` (columns that are empty in every row are left out; text shown as it is, e.g.
    COMET's "not computed")."""
    columns = [c for c in columns if any(r.get(c) is not None for r in rows)]
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c == "direction" else "right")
    for r in rows:
        table.add_row(*("" if r.get(c) is None else r[c] if isinstance(r[c], str) else _FORMATS.get(c, "{}").format(r[c])
                        for c in columns))
    return table


def asr_table(results: dict, title: str | None = None):
    """A rich Table of `evaluate_asr` results: WER/CER per language, their mean, per voice family, and the RTF."""
    table = Table(title=title)
    for c in ("", "n", "WER", "CER"):
        table.add_column(c, justify="left" if not c else "right")
    rows = [*results["languages"].items(), ("avg", {"n": "", **results["avg"]}),
            *((f"family {k}", v) for k, v in results["families"].items())]
    for name, r in rows:
        table.add_row(name, str(r["n"]), f"{100 * r['wer']:.1f}%", f"{100 * r['cer']:.1f}%")
    table.caption = f"RTF {results['rtf']:.3f}; params {results['params']['total']:,} total, " \
                    f"{results['params']['active']:,} active"
    return table


def run_table(recipe, results: dict) -> Table:
    """The results table of a finished run of any task."""
    title = f"{recipe.name} ({recipe.out})"
    if recipe.task == "speech_llm":
        from moekit.eval import s2tt

        return results_table(s2tt.result_rows(results), title=title, columns=s2tt.CSV_COLUMNS)
    return asr_table(results, title=title) if recipe.task == "asr" else results_table(result_rows(results), title=title)
