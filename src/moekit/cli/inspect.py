"""`moekit inspect DIR`: what a moekit checkpoint, or a transformers MoE model directory, holds."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from moekit.cli.common import human, out_console

if TYPE_CHECKING:
    from rich.table import Table

CONFIG_KEYS = ("model_type", "hidden_size", "d_model", "intermediate_size", "moe_intermediate_size",
               "num_hidden_layers", "encoder_layers", "decoder_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "hidden_act", "activation_function", "dtype")


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a moekit checkpoint or a transformers MoE model",
                       description="Show the base model, the MoE layers (experts, top-k), total and active "
                                   "parameter counts and, for a moekit checkpoint, the init method. A transformers "
                                   "MoE directory (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) is read from its "
                                   "config alone, its shapes checked against the safetensors headers: no weights "
                                   "are loaded.")
    p.add_argument("dir", help="moekit checkpoint or transformers MoE model directory")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model directory that ships its own Python code (auto_map); it will run")
    p.set_defaults(run=run)


def config_table(config) -> Table:
    from rich.table import Table

    table = Table("base config", "value", box=None, pad_edge=False)
    d = config.to_dict()
    for key in CONFIG_KEYS:
        if d.get(key) is not None:
            table.add_row(key, str(d[key]))
    return table


def layers_table(model) -> Table:
    from rich.table import Table

    from moekit.moe.layer import moe_layers

    table = Table("MoE layer", "experts", "top-k", "scoring", "expert FFN", "shared expert", "router")
    owner: dict[int, str] = {}
    for path, moe in moe_layers(model):
        ex, r = moe.experts, moe.router
        first = owner.setdefault(id(r), path)
        shared = "no" if moe.shared is None else \
            f"yes (I={moe.shared.up_proj.out_features}{', gated' if moe.shared_gate is not None else ''})"
        kind = f"{'gated ' if ex.gated else ''}{ex.act}, I={ex.intermediate_size}"
        table.add_row(path, str(ex.num_experts), str(r.top_k), r.scoring, kind, shared,
                      "own" if first == path else f"shared with {first}")
    return table


def native_table(sites) -> Table:
    """The MoE blocks of a transformers model (moekit.routing.sites): experts, top-k, size, shared expert."""
    from rich.table import Table

    table = Table("MoE layer", "experts", "top-k", "params per expert", "shared expert", "block")
    for s in sites:
        shared = [n for n, m in s.block.named_children() if "shared" in n and any(True for _ in m.parameters())]
        table.add_row(s.name, str(s.num_experts), str(s.top_k), f"{s.params_per_expert:,}", ", ".join(shared) or "no",
                      type(s.block).__name__)
    return table


def run(args: argparse.Namespace) -> None:
    folder = Path(args.dir)
    if (folder / "config.json").is_file() and not (folder / "moekit.json").exists():
        return show_native(folder, args.trust_remote_code)
    show_moekit(args.dir)


def show_moekit(folder: str) -> None:
    from moekit.checkpoint.format import load, read_meta
    from moekit.moe.layer import moe_layers
    from moekit.moe.state import spec_of

    meta = read_meta(folder)  # a clear error before loading anything
    model = load(folder)
    show = show_summary(f"{meta['architecture']}, format {meta['format']}", folder, model, len(moe_layers(model)),
                        layers_table(model))
    spec = spec_of(model)
    if spec is None:
        show("init: not recorded (no MoE spec in moekit.json)")
        return
    init = spec.init.model_dump(mode="json")
    params = ", ".join(f"{k}={v}" for k, v in init.items() if k != "method")
    show(f"init: {init['method']}{f' ({params})' if params else ''}, seed {spec.seed}, "
         f"router init {spec.router_init}, router sharing {spec.router_sharing}"
         f"{f', granularity {spec.granularity}' if spec.granularity > 1 else ''}")


def show_native(folder: Path, trust_remote_code: bool) -> None:
    """A transformers MoE directory, built on the meta device from its config (no weight is read; the shapes it gives
    are checked against the safetensors headers where there are weights)."""
    from moekit.errors import CheckpointError, UnsupportedModelError
    from moekit.checkpoint.dense import check_stored_shapes, has_safetensors, meta_model
    from moekit.routing.sites import find_sites

    model = meta_model(folder, trust_remote_code)
    if has_safetensors(folder, allow_pickle=True):
        check_stored_shapes(folder, model)
    try:
        sites = find_sites(model)
    except UnsupportedModelError as e:
        raise CheckpointError(f"{folder} is not a moekit checkpoint (no moekit.json), and {e}") from None
    show_summary(f"{type(model).__name__}, native transformers MoE", folder, model, len(sites), native_table(sites))


def show_summary(kind: str, folder, model, layers: int, table: Table):
    """Print what every inspected model shows (base config, MoE layers, parameter counts); the print function."""
    from moekit.routing.sites import param_counts

    show = out_console().print
    show(f"[bold]{folder}[/bold]: {kind}")
    show(config_table(model.config))
    show(f"\n{layers} MoE layers")
    show(table)
    total, active = param_counts(model)
    show(f"\nparameters: total {human(total)}, active per token {human(active)}")
    return show
