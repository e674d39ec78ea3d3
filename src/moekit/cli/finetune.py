"""`moekit finetune` (train only the selected experts) and `moekit prune` (disable them)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from moekit.cli.common import lang_file, err_console, human, load_tokenizer, out_console
from moekit.errors import CheckpointError, ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune only the selected experts",
                       description="Causal-LM training on plain text (one example per line) in which only the "
                                   "experts of a selection JSON train; routers, attention, embeddings, norms and "
                                   "every other expert stay bit-identical. Saves the merged model.")
    common(p)
    p.add_argument("--data", type=lang_file, action="append", required=True, metavar="LANG=FILE",
                   help="training text, one example per line (repeatable)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate, linear decay (default 1e-4)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128, help="tokens per line, longer lines are cut")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (selected rows only)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_finetune)

    p = sub.add_parser("prune", help="disable the selected experts",
                       description="Disable the experts of a selection JSON: the routers never pick them and the "
                                   "top-k is renormalized over the rest. Saves the model with pruned_experts.json "
                                   "(re-applied when moekit loads it).")
    common(p)
    p.set_defaults(run=run_prune)


def common(p) -> None:
    p.add_argument("--model", required=True, help="MoE model: moekit checkpoint, HF model directory or asset name")
    p.add_argument("--experts", required=True, help="selection JSON ({layer: [expert ids]}, `moekit select`)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def prepare(args: argparse.Namespace):
    """Check the inputs and the output directory, then load the selection, model and tokenizer."""
    from moekit.assets import resolve_model
    from moekit.io import check_output_dir, load_model
    from moekit.select.selection import Selection

    out = check_output_dir(args.out, args.overwrite)
    selection = Selection.load(args.experts)
    model_dir = resolve_model(args.model, log=err_console().print)
    if out.resolve() == Path(model_dir).resolve():
        raise ConfigError(f"the output directory {out} is the model directory; choose another --out")
    with err_console().status(f"loading {model_dir}"):
        model = load_model(model_dir)
    return out, selection, model, load_tokenizer(model_dir)


def read_lines(data: list[tuple[str, Path]]) -> list[str]:
    lines = []
    for lang, path in data:
        if not path.is_file():
            raise ConfigError(f"--data {lang}={path}: no such file")
        lines += path.read_text(encoding="utf-8").splitlines()
    return lines


def run_finetune(args: argparse.Namespace) -> None:
    from moekit.select.common import save_model
    from moekit.select.finetune import train_selected

    if min(args.steps, args.batch_size, args.max_length) < 1:
        raise ConfigError("--steps, --batch-size and --max-length must be positive")
    lines = read_lines(args.data)
    start = time.perf_counter()
    out, selection, model, tokenizer = prepare(args)
    if tokenizer is None:
        raise CheckpointError(f"{args.model} has no tokenizer files; finetune needs one to read the text")
    with err_console().status(f"training {selection.count} experts for {args.steps} steps"):
        log = train_selected(model, selection, tokenizer, lines, steps=args.steps, lr=args.lr,
                             batch_size=args.batch_size, max_length=args.max_length,
                             weight_decay=args.weight_decay, seed=args.seed)
    losses = [e["loss"] for e in log if "loss" in e]
    record = {"selection": selection.model_dump(), "data": {lang: str(p) for lang, p in args.data},
              "steps": args.steps, "lr": args.lr, "batch_size": args.batch_size, "max_length": args.max_length,
              "weight_decay": args.weight_decay, "seed": args.seed, "log_history": log}
    with err_console().status(f"saving {out}"):
        save_model(model, out, args.overwrite, tokenizer, extra={"finetune.json": record})
    loss = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, " if losses else ""
    out_console().print(f"trained {selection.count} experts in {len(selection.experts)} layers for {args.steps} "
                        f"steps ({loss}{time.perf_counter() - start:.1f} s); saved to {out}")


def run_prune(args: argparse.Namespace) -> None:
    from moekit.select.prune import prune, save_pruned

    out, selection, model, tokenizer = prepare(args)
    prune(model, selection)
    save_pruned(model, out, args.overwrite, tokenizer)
    total = sum(p.numel() for p in model.parameters())
    out_console().print(f"disabled {selection.count} experts in {len(selection.experts)} layers "
                        f"(model {human(total)} parameters, weights unchanged); saved to {out}")
