"""`moekit finetune` (train only the selected experts) and `moekit prune` (disable them, or remove experts from a
native checkpoint)."""
from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

from moekit.cli.common import device_arg, err_console, human, lang_file, lang_files, out_console
from moekit.cli.plan import add_plan_args
from moekit.cli.progress import progress
from moekit.errors import CheckpointError, ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune only the selected experts",
                       description="Causal-LM training on plain text (one example per line) in which only the "
                                   "experts of a selection JSON train; routers, attention, embeddings, norms and "
                                   "every other expert stay bit-identical. Saves the merged model.")
    common(p)
    p.add_argument("--data", type=lang_file, nargs="+", action="extend", required=True, metavar="LANG=FILE",
                   help="training text, one example per line (several per flag, or repeat the flag)")
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the data (RISE §5.1)")
    p.add_argument("--steps", type=int, help="optimizer steps instead of --epochs")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate, linear decay (RISE §5.1)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per optimizer step (RISE §5.1)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="split each optimizer step's batch into this many micro-batches (RISE: 8 of 2)")
    p.add_argument("--max-length", type=int, default=128, help="tokens per line, longer lines are cut")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (selected rows only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order")
    p.add_argument("--device", default="auto", type=device_arg,
                   help="auto (a CUDA device when torch sees one), cpu, cuda or cuda:N")
    shard = p.add_mutually_exclusive_group()
    shard.add_argument("--deepspeed", metavar="CONFIG",
                       help="a DeepSpeed config (JSON) to train with, under torchrun or accelerate launch; ZeRO-3 "
                            "shards the model, with --weight-decay 0 (docs/guides/distributed.md)")
    shard.add_argument("--fsdp", action="store_true",
                       help="FSDP2 full shard over the processes of a distributed launch (transformers' FSDP2)")
    add_plan_args(p)
    p.set_defaults(run=run_finetune)

    p = sub.add_parser("prune", help="disable the selected experts, or remove experts from a checkpoint",
                       description="Disable the experts of a selection JSON: the routers never pick them and the "
                                   "top-k is renormalized over the rest. Saves the model with pruned_experts.json "
                                   "(re-applied when moekit loads it). With --keep or --drop, remove experts from a "
                                   "native transformers MoE checkpoint instead, one tensor at a time (a model larger "
                                   "than memory): the output is the same family with fewer experts per layer.")
    common(p)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--keep", action="store_true", help="keep only the selected experts, remove the others "
                     "(after `moekit select usage|reap|ean --top N`)")
    how.add_argument("--drop", action="store_true", help="remove the selected experts")
    p.set_defaults(run=run_prune)


def common(p) -> None:
    p.add_argument("--model", required=True, help="MoE model: moekit checkpoint, HF model directory or asset name")
    p.add_argument("--experts", required=True, help="selection JSON ({layer: [expert ids]}, `moekit select`)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model directory that ships its own Python code (auto_map); it will run")
    p.add_argument("--allow-other-model", action="store_true",
                   help="use a selection made for another model (another config, or other MoE layers or expert "
                        "counts than its trace recorded); the layers and expert ids are still checked")


def warn(text: str) -> None:
    err_console().print(f"moekit: warning: {text}", markup=False)


def inputs_of(args: argparse.Namespace) -> list[Path]:
    from moekit.assets import model_inputs

    return [*model_inputs(args.model), Path(args.experts), *(path for _, path in getattr(args, "data", None) or [])]


def prepare(args: argparse.Namespace):
    """Load the selection, model and tokenizer (inside the output's reservation)."""
    from moekit.assets import resolve_model
    from moekit.checkpoint.format import load_model
    from moekit.checkpoint.dense import load_tokenizer
    from moekit.selection.selection import Selection

    selection = Selection.load(args.experts)
    model_dir = resolve_model(args.model, log=err_console().print)
    with err_console().status(f"loading {model_dir}"):
        model = load_model(model_dir, trust_remote_code=args.trust_remote_code)
    return selection, model, load_tokenizer(model_dir, args.trust_remote_code)


def read_lines(data: dict[str, Path]) -> list[str]:
    from moekit._fs import read_small

    lines = []
    for lang, path in data.items():
        lines += read_small(path, f"--data file for {lang}", ConfigError, limit=4 << 30).splitlines()
    return lines


# DeepSpeed keys the Trainer fills -> the options of `moekit finetune` that set them
FINETUNE_OWNED = {"train_micro_batch_size_per_gpu": "--batch-size / --grad-accum",
                  "gradient_accumulation_steps": "--grad-accum", "train_batch_size": "--batch-size × processes",
                  "gradient_clipping": "the Trainer's default (1.0)", "optimizer.params.lr": "--lr",
                  "optimizer.params.weight_decay": "--weight-decay", "scheduler.params.warmup_max_lr": "--lr",
                  "fp16.enabled": "float32 training", "bf16.enabled": "float32 training"}


def run_finetune(args: argparse.Namespace) -> None:
    from moekit.selection.common import check_source, save_model
    from moekit.training.finetune import check_finetune, finetune
    from moekit.training.parallel import engine_of, is_main, leave_launch

    from moekit._fs import reserve

    if min(args.steps or 1, args.batch_size, args.max_length, args.grad_accum) < 1 or args.epochs <= 0:
        raise ConfigError("--epochs, --steps, --batch-size, --grad-accum and --max-length must be positive")
    if args.batch_size % args.grad_accum:
        raise ConfigError(f"--batch-size {args.batch_size} is not a multiple of --grad-accum {args.grad_accum}")
    data = lang_files(args.data, "--data")
    if args.dry_run:
        from moekit.cli.plan import print_plan
        from moekit.training.plan import plan_finetune

        print_plan(plan_finetune(args.model, args.experts, batch_size=args.batch_size, grad_accum=args.grad_accum,
                                 max_length=args.max_length, trust_remote_code=args.trust_remote_code,
                                 devices=args.devices, expert_parallel=args.expert_parallel,
                                 allow_other_model=args.allow_other_model, log=err_console().print, warn=warn),
                   args.device_memory)
        return
    engine = engine_of({} if args.deepspeed is None else {"deepspeed": args.deepspeed}, args.fsdp,
                       args.expert_parallel or 1)
    settings = dict(steps=args.steps, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                    grad_accum=args.grad_accum, weight_decay=args.weight_decay, seed=args.seed)
    check_finetune(engine, args.model, args.deepspeed, _trainer_settings(settings), args.trust_remote_code,
                   FINETUNE_OWNED)
    start, main = time.perf_counter(), is_main()
    # only the main process of a distributed launch reserves and writes the output
    with reserve(args.out, inputs_of(args), args.overwrite) if main else contextlib.nullcontext(args.out) as out:
        lines = read_lines(data)
        selection, model, tokenizer = prepare(args)
        check_source(selection, model, args.allow_other_model, warn)
        if tokenizer is None:
            raise CheckpointError(f"{args.model} has no tokenizer files; finetune needs one to read the text")
        with progress():
            trained, log = finetune(model, selection, tokenizer, lines, engine, lambda: prepare(args)[1],
                                    max_length=args.max_length, device=args.device, deepspeed=args.deepspeed,
                                    **settings)
        leave_launch()
        if not main:
            return
        losses = [e["loss"] for e in log if "loss" in e]
        steps = max((e["step"] for e in log if "step" in e), default=0)
        record = {"selection": selection.model_dump(), "data": {lang: str(p) for lang, p in data.items()},
                  "steps": steps, "epochs": None if args.steps else args.epochs, "lr": args.lr,
                  "batch_size": args.batch_size, "grad_accum": args.grad_accum, "max_length": args.max_length,
                  "weight_decay": args.weight_decay, "seed": args.seed, "engine": engine.describe(),
                  "log_history": log}
        with err_console().status(f"saving {args.out}"):
            save_model(trained, out, args.overwrite, tokenizer, extra={"finetune.json": record})
    loss = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, " if losses else ""
    out_console().print(f"trained {selection.count} experts in {len(selection.experts)} layers for {steps} "
                        f"steps ({loss}{time.perf_counter() - start:.1f} s); saved to {args.out}")


def _trainer_settings(s: dict) -> dict:
    from moekit.training.finetune import trainer_settings

    return trainer_settings(1, s["steps"], s["epochs"], s["lr"], s["batch_size"], s["grad_accum"],
                            s["weight_decay"], s["seed"])


def run_prune(args: argparse.Namespace) -> None:
    from moekit._fs import reserve
    from moekit.selection.common import check_source
    from moekit.selection.prune import prune, save_pruned

    if args.keep or args.drop:
        return run_remove(args)
    with reserve(args.out, inputs_of(args), args.overwrite) as out:
        selection, model, tokenizer = prepare(args)
        check_source(selection, model, args.allow_other_model, warn)
        prune(model, selection)
        save_pruned(model, out, args.overwrite, tokenizer)
    total = sum(p.numel() for p in model.parameters())
    out_console().print(f"disabled {selection.count} experts in {len(selection.experts)} layers "
                        f"(model {human(total)} parameters, weights unchanged); saved to {args.out}")


def run_remove(args: argparse.Namespace) -> None:
    """`prune --keep|--drop`: experts removed from a native checkpoint, tensor by tensor."""
    from moekit._fs import peak_memory, reserve
    from moekit.assets import resolve_model
    from moekit.checkpoint.remove import remove_experts
    from moekit.selection.prune import kept_experts
    from moekit.selection.selection import Selection

    start = time.perf_counter()
    with reserve(args.out, inputs_of(args), args.overwrite):
        selection = Selection.load(args.experts)
        model = resolve_model(args.model)
        keep = kept_experts(model, selection, "keep" if args.keep else "drop", args.allow_other_model,
                            args.trust_remote_code, warn)
        with progress():
            nbytes = remove_experts(model, args.out, keep, args.overwrite, inputs_of(args),
                                    trust_remote_code=args.trust_remote_code)
    kept, mode = len(next(iter(keep.values()))), "--keep" if args.keep else "--drop"
    out_console().print(f"kept {kept} experts in each of {len(keep)} MoE layers ({mode}); wrote {args.out}: "
                        f"{nbytes / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s, peak RSS "
                        f"{peak_memory() / 2**30:.2f} GiB")
