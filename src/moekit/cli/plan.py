"""`--dry-run` of `moekit train` and `moekit finetune`: the options and the rendering of a moekit.training.plan.Plan."""
from __future__ import annotations

import argparse

from rich.table import Table

from moekit.cli.common import out_console


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive count, got {text!r}")
    return n


def memory_size(text: str) -> int:
    from moekit.checkpoint.writer import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="print the memory plan (parameters, gradients, optimizer state, activations, per device "
                        "under DDP, ZeRO-2/3, FSDP2, expert parallelism) from config.json and the safetensors "
                        "headers, then exit: no weight read, nothing written")
    p.add_argument("--devices", type=positive, default=8, help="--dry-run: devices the engines spread over")
    p.add_argument("--expert-parallel", type=positive, metavar="N",
                   help="expert-parallel ranks: a run's under a distributed launch (train: the same as "
                        "train.expert_parallel=N), or the plan's with --dry-run (default: --devices, where it divides "
                        "every MoE layer's experts)")
    p.add_argument("--device-memory", type=memory_size, metavar="SIZE",
                   help="--dry-run: memory of one device (e.g. 80GB, 24GiB): says which engines fit")


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n:,} ({n / div:.2f}{unit})"
    return f"{n:,}"


def state_table(plan) -> Table:
    t = Table(title="What one device holds without sharding")
    for c in ("", "parameters", "bytes"):
        t.add_column(c, justify="left" if not c else "right")
    t.add_row(f"model ({plan.dtype})", count(plan.params), size(plan.param_bytes))
    for s in plan.stages:
        t.add_row(f"trainable: {s.name}", count(s.params), size(s.bytes))
    t.add_row("frozen throughout (resident)", "", size(plan.frozen_bytes))
    if plan.routed:
        t.add_row("routed experts (what EP splits)", count(plan.routed), "")
    t.add_row("gradients (largest stage)", "", size(plan.grad_bytes))
    t.add_row("optimizer state (AdamW)", "", size(plan.optimizer_bytes))
    t.add_row("activations per 1k tokens (estimate)", "", size(plan.activations_per_1k))
    t.add_row(f"activations per micro-batch of {plan.micro_batch} × {plan.max_length} tokens (estimate)", "",
              size(plan.activations))
    return t


def share_table(plan, rows, dtype: str, device_memory: int | None) -> Table:
    how = "as the recipe stores the parameters" if dtype == plan.dtype else f"model.dtype {dtype}"
    t = Table(title=f"Per device over {plan.devices} devices, every engine's weights, gradients and AdamW state in "
                    f"{dtype} ({how}; computed from the counts above, not measured)")
    columns = ["engine", "parameters", "gradients", "optimizer", "buffers", "activations", "total"]
    columns += [f"fits {size(device_memory)}"] if device_memory else []
    for c in columns:
        t.add_column(c, justify="left" if c == "engine" else "right")
    for s in rows:
        if s.engine.startswith("EP: "):
            t.add_row(f"expert parallel: {s.engine[4:]}", *[""] * (len(columns) - 1))
            continue
        fits = ["yes" if s.total <= device_memory else "no"] if device_memory else []
        t.add_row(s.engine, size(s.params), size(s.grads), size(s.optimizer), size(s.buffers),
                  size(s.activations) if plan.activations is not None else "-", size(s.total), *fits)
    return t


def print_plan(plan, device_memory: int | None = None) -> None:
    from moekit.training.memory import ACTIVATION_TOLERANCE

    out = out_console()
    out.print(f"plan of {plan.title} (dry run: no weight read, nothing written)")
    out.print(f"shapes: {plan.model}: {plan.shapes}")
    out.print(f"parameters {plan.dtype}, precision {plan.precision}, gradient checkpointing "
              f"{'on' if plan.gradient_checkpointing else 'off'}; optimizer state as torch AdamW keeps it (2 states "
              "in the parameter dtype and a float32 step per tensor)")
    out.print(state_table(plan))
    out.print(share_table(plan, plan.shares, plan.dtype, device_memory))
    out.print(share_table(plan, plan.other_shares, plan.other_dtype, device_memory))
    notes = [
        "DDP: everything replicated, plus its gradient buckets; ZeRO-2: gradients and optimizer state sharded, "
        "parameters replicated; ZeRO-3 and FSDP2: parameters, gradients and optimizer state sharded; EP: each MoE "
        "layer's routed experts split over the EP ranks (moekit.training.memory states each engine's convention)",
        "each table keeps every engine's weights and AdamW state in one dtype: float32 (16 B per trainable "
        "parameter under bf16 autocast: DeepSpeed's default fp32 master copy, or the float32 parameters of DDP and "
        "FSDP2) or bfloat16 (8 B: DDP and FSDP2 on bfloat16 parameters, DeepSpeed with bf16_master_weights_and_grads "
        "and bf16_optimizer_states; ZeRO-2 10 B, its master partition being a copy); DeepSpeed's parameters and "
        "gradients are in bf16 under bf16/fp16 precision",
        "buffers: autocast's bf16 copies of fp32 Linear weights (single, DDP, EP), DDP's gradient buckets, the "
        "decoder layers ZeRO-3 / FSDP2 gather",
        f"activations: an estimate of what autograd keeps for the backward (moekit.training.memory.token_bytes; within "
        f"{ACTIVATION_TOLERANCE:.0%} of the tensors tiny models really saved); the backward's transient buffers, "
        "communication buckets and allocator fragmentation come on top",
        *plan.notes,
    ]
    for note in notes:
        out.print(f"- {note}")
