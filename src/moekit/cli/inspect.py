"""`moekit inspect DIR`: what a moekit checkpoint holds."""
from __future__ import annotations

import argparse

from rich.table import Table

from moekit.cli.common import human, out_console
from moekit.io import load, read_meta
from moekit.metrics import param_counts
from moekit.moe.layer import moe_layers
from moekit.state import spec_of

CONFIG_KEYS = ("model_type", "hidden_size", "d_model", "intermediate_size", "num_hidden_layers", "encoder_layers",
               "decoder_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "hidden_act",
               "activation_function", "dtype")


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a moekit checkpoint",
                       description="Show the base model, the MoE layers, parameter counts and the init method.")
    p.add_argument("dir", help="moekit checkpoint directory")
    p.set_defaults(run=run)


def config_table(config) -> Table:
    table = Table("base config", "value", box=None, pad_edge=False)
    d = config.to_dict()
    for key in CONFIG_KEYS:
        if d.get(key) is not None:
            table.add_row(key, str(d[key]))
    return table


def layers_table(model) -> Table:
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


def run(args: argparse.Namespace) -> None:
    meta = read_meta(args.dir)  # a clear error before loading anything
    model = load(args.dir)
    show = out_console().print
    layers = moe_layers(model)
    show(f"[bold]{args.dir}[/bold]: {meta['architecture']}, format {meta['format']}")
    show(config_table(model.config))
    show(f"\n{len(layers)} MoE layers")
    show(layers_table(model))
    total, active = param_counts(model)
    show(f"\nparameters: total {human(total)}, active per token {human(active)}")
    spec = spec_of(model)
    if spec is None:
        show("init: not recorded (no MoE spec in moekit.json)")
        return
    init = spec.init.model_dump(mode="json")
    params = ", ".join(f"{k}={v}" for k, v in init.items() if k != "method")
    show(f"init: {init['method']}{f' ({params})' if params else ''}, seed {spec.seed}, "
         f"router init {spec.router_init}, router sharing {spec.router_sharing}"
         f"{f', granularity {spec.granularity}' if spec.granularity > 1 else ''}")
