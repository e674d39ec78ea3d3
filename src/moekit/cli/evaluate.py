"""`moekit evaluate RUN_DIR`: re-evaluate a finished run of any task (translation and instruct: BLEU/chrF, ROUGE-L,
loss, KL, diversity, usage; text: held-out loss and perplexity; asr: WER/CER and routing statistics; speech_llm:
BLEU/chrF/COMET or WER/CER per direction, loss, usage)."""
from __future__ import annotations

import argparse

from moekit.cli.common import device_arg, out_console
from moekit.cli.progress import progress


def add_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="evaluate a trained run directory",
                       description="Evaluate RUN_DIR/model on the recipe's held-out test sets; writes "
                                   "results.json, results.csv and plots into RUN_DIR.")
    p.add_argument("run_dir")
    p.add_argument("--device", default="cpu", type=device_arg, help="auto, cpu, cuda or cuda:N (default: cpu)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from moekit.cli.tables import asr_table, result_rows, results_table, run_table
    from moekit.training.api import evaluate

    with progress():
        e = evaluate(args.run_dir, device=args.device)
    title = f"{e.recipe.name} ({e.run_dir})"
    table = run_table(e.recipe, e.results) if e.recipe.task == "speech_llm" else \
        asr_table(e.results, title=title) if e.recipe.task == "asr" else results_table(result_rows(e.results), title=title)
    out_console().print(table)
