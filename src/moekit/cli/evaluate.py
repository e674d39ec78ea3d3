"""`moekit evaluate RUN_DIR`: re-evaluate a finished run of any task (translation and instruct: BLEU/chrF, ROUGE-L,
loss, KL, diversity, usage; text: held-out loss and perplexity; asr: WER/CER and routing statistics; speech_llm:
BLEU/chrF/COMET or WER/CER per direction, loss, usage)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moekit.cli.common import device_arg, out_console
from moekit.cli.progress import progress
from moekit.errors import CheckpointError


def add_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="evaluate a trained run directory",
                       description="Evaluate RUN_DIR/model on the recipe's held-out test sets; writes "
                                   "results.json, results.csv and plots into RUN_DIR.")
    p.add_argument("run_dir")
    p.add_argument("--device", default="cpu", type=device_arg, help="auto, cpu, cuda or cuda:N (default: cpu)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from moekit.cli.tables import result_rows, results_table
    from moekit.eval.translation import DenseReference
    from moekit.methods import method
    from moekit.training.recipe import load_recipe
    from moekit.training.run import load_data, report
    from moekit.training.common import load_tokenizer

    run_dir = Path(args.run_dir)
    if not (run_dir / "recipe.yaml").is_file() or not (run_dir / "model").is_dir():
        raise CheckpointError(f"{run_dir} is not a finished run (needs recipe.yaml and model/)")
    recipe = load_recipe(run_dir / "recipe.yaml", [f"out={run_dir}"])
    if recipe.task == "speech_llm":
        return run_speech_llm(recipe, run_dir, args.device)
    if recipe.task in ("asr", "text"):
        return (run_asr if recipe.task == "asr" else run_text)(recipe, run_dir, args.device)
    tok = load_tokenizer(run_dir / "model", recipe.model.trust_remote_code)
    ref_file = run_dir / "dense_reference.safetensors"
    ref = DenseReference.load(run_dir) if ref_file.is_file() else None
    _, test = load_data(recipe)
    log = run_dir / "log_history.json"
    history = json.loads(log.read_text()) if log.is_file() else []
    model = method(recipe.method).load_trained(recipe, run_dir / "model").to(args.device)
    with progress():
        results = report(recipe, model, tok, test, ref, history)
    out_console().print(results_table(result_rows(results), title=f"{recipe.name} ({run_dir})"))


def run_asr(recipe, run_dir: Path, device: str) -> None:
    from moekit.cli.tables import asr_table
    from moekit.methods import method
    from moekit.speech.data import load_split
    from moekit.training.asr import load_speech, report

    _, test = load_split(recipe.data)
    log = run_dir / "log_history.json"
    history = json.loads(log.read_text()) if log.is_file() else []
    model = method(recipe.method).load_trained(recipe, run_dir / "model").to(device)
    with progress():
        results = report(recipe, model, load_speech(recipe, run_dir / "model"), test, history)
    out_console().print(asr_table(results, title=f"{recipe.name} ({run_dir})"))


def run_speech_llm(recipe, run_dir: Path, device: str) -> None:
    from moekit.cli.tables import run_table
    from moekit.training.speech_llm import evaluate_run

    with progress():
        results = evaluate_run(recipe, run_dir, device)
    out_console().print(run_table(recipe.model_copy(update={"out": str(run_dir)}), results))


def run_text(recipe, run_dir: Path, device: str) -> None:
    from moekit.cli.tables import result_rows, results_table
    from moekit.data.hf import load_text_data
    from moekit.eval.text import report_text
    from moekit.methods import method
    from moekit.training.common import load_tokenizer

    _, test = load_text_data(recipe.data, load_tokenizer(run_dir / "model", recipe.model.trust_remote_code))
    log = run_dir / "log_history.json"
    history = json.loads(log.read_text()) if log.is_file() else []
    model = method(recipe.method).load_trained(recipe, run_dir / "model").to(device)
    with progress():
        results = report_text(recipe, model, test, history)
    out_console().print(results_table(result_rows(results), title=f"{recipe.name} ({run_dir})"))
