"""`moekit finetune` (train only the selected experts) and `moekit prune` (disable them, or remove experts from a
native checkpoint)."""
from __future__ import annotations

import argparse
import time

from moekit.cli.common import device_arg, err_console, human, lang_file, lang_files, out_console
from moekit.cli.plan import add_plan_args
from moekit.cli.progress import progress
from moekit.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune only the selected experts",
                       description="Causal-LM training on plain text (one example per line) in which only the "
                                   "experts of a selection JSON train; routers, attention, embeddings, norms and "
                                   "every other expert stay bit-identical. Saves the merged model.")
    common(p, out_required=False)
    p.add_argument("--data", type=lang_file, nargs="+", action="extend", metavar="LANG=FILE",
                   help="training text, one example per line (several per flag, or repeat the flag; not needed "
                        "with --dry-run)")
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


def common(p, out_required: bool = True) -> None:
    p.add_argument("--model", required=True, help="MoE model: moekit checkpoint, HF model directory or asset name")
    p.add_argument("--experts", required=True, help="selection JSON ({layer: [expert ids]}, `moekit select`)")
    p.add_argument("--out", required=out_required,
                   help="output directory" + ("" if out_required else " (not needed with --dry-run)"))
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model directory that ships its own Python code (auto_map); it will run")
    p.add_argument("--allow-other-model", action="store_true",
                   help="use a selection made for another model (another config, or other MoE layers or expert "
                        "counts than its trace recorded); the layers and expert ids are still checked")


def warn(text: str) -> None:
    err_console().print(f"moekit: warning: {text}", markup=False)


def run_finetune(args: argparse.Namespace) -> None:
    from moekit.training.api import finetune

    if min(args.steps or 1, args.batch_size, args.max_length, args.grad_accum) < 1 or args.epochs <= 0:
        raise ConfigError("--epochs, --steps, --batch-size, --grad-accum and --max-length must be positive")
    if args.batch_size % args.grad_accum:
        raise ConfigError(f"--batch-size {args.batch_size} is not a multiple of --grad-accum {args.grad_accum}")
    data = lang_files(args.data, "--data")
    if args.dry_run:
        from moekit.cli.plan import print_plan
        from moekit.training.api import finetune_plan

        print_plan(finetune_plan(args.model, args.experts, batch_size=args.batch_size, grad_accum=args.grad_accum,
                                 max_length=args.max_length, devices=args.devices, expert_parallel=args.expert_parallel,
                                 trust_remote_code=args.trust_remote_code, allow_other_model=args.allow_other_model,
                                 log=err_console().print, warn=warn),
                   args.device_memory)
        return
    if args.out is None or not data:
        raise ConfigError("finetune needs --out and --data (only --dry-run goes without them)")
    start = time.perf_counter()
    with progress():
        done = finetune(args.model, args.experts, data, args.out, epochs=args.epochs, steps=args.steps, lr=args.lr,
                        batch_size=args.batch_size, grad_accum=args.grad_accum, max_length=args.max_length,
                        weight_decay=args.weight_decay, seed=args.seed, device=args.device, deepspeed=args.deepspeed,
                        fsdp=args.fsdp, expert_parallel=args.expert_parallel, overwrite=args.overwrite,
                        trust_remote_code=args.trust_remote_code, allow_other_model=args.allow_other_model,
                        log=err_console().print, warn=warn)
    if done is None:  # not the main process of a distributed launch
        return
    loss = f"loss {done.losses[0]:.4f} -> {done.losses[-1]:.4f}, " if done.losses else ""
    out_console().print(f"trained {sum(map(len, done.trained.values()))} experts in {len(done.trained)} layers for "
                        f"{done.steps} steps ({loss}{time.perf_counter() - start:.1f} s); saved to {args.out}")


def run_prune(args: argparse.Namespace) -> None:
    from moekit._fs import peak_memory
    from moekit.selection.api import prune

    start, mode = time.perf_counter(), "keep" if args.keep else "drop" if args.drop else "disable"
    with progress():
        p = prune(args.model, args.experts, args.out, mode=mode, overwrite=args.overwrite,
                  trust_remote_code=args.trust_remote_code, allow_other_model=args.allow_other_model, log=err_console().print,
                  warn=warn)
    if p.kept is None:
        out_console().print(f"disabled {p.selection.count} experts in {len(p.selection.experts)} layers "
                            f"(model {human(p.params)} parameters, weights unchanged); saved to {args.out}")
        return
    out_console().print(f"kept {len(next(iter(p.kept.values())))} experts in each of {len(p.kept)} MoE layers "
                        f"(--{mode}); wrote {args.out}: {p.bytes / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s, "
                        f"peak RSS {peak_memory() / 2**30:.2f} GiB")
