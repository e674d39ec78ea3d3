"""`moekit inspect DIR`: prints moekit.inspect's summary of a moekit checkpoint or a transformers MoE directory."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from moekit.cli.common import human, out_console

if TYPE_CHECKING:
    from rich.table import Table

    from moekit.checkpoint.summary import InspectSummary


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a moekit checkpoint or a transformers MoE model",
                       description="Show the base model, the MoE layers (experts, top-k), total and active "
                                   "parameter counts and, for a moekit checkpoint, the init method. A transformers "
                                   "MoE directory (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) is read from its "
                                   "config alone: no weights are loaded.")
    p.add_argument("dir", help="moekit checkpoint or transformers MoE model directory")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model directory that ships its own Python code (auto_map); it will run")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from moekit.checkpoint.summary import inspect

    show(inspect(args.dir, trust_remote_code=args.trust_remote_code))


def show(s: InspectSummary) -> None:
    print_ = out_console().print
    print_(f"[bold]{s.path}[/bold]: {s.description}")
    print_(config_table(s.config))
    print_(f"\n{len(s.layers)} MoE layers")
    print_(native_table(s) if s.native else layers_table(s))
    print_(f"\nparameters: total {human(s.total_params)}, active per token {human(s.active_params)}")
    if not s.native:
        print_(init_line(s))


def config_table(config: dict[str, str]) -> Table:
    from rich.table import Table

    table = Table("base config", "value", box=None, pad_edge=False)
    for key, value in config.items():
        table.add_row(key, value)
    return table


def layers_table(s: InspectSummary) -> Table:
    from rich.table import Table

    table = Table("MoE layer", "experts", "top-k", "scoring", "expert FFN", "shared expert", "router")
    for x in s.layers:
        table.add_row(x.path, str(x.experts), str(x.top_k), x.scoring, x.expert_ffn, x.shared_expert, x.router)
    return table


def native_table(s: InspectSummary) -> Table:
    from rich.table import Table

    table = Table("MoE layer", "experts", "top-k", "params per expert", "shared expert", "block")
    for x in s.layers:
        experts = f"{x.experts} ({x.zero_experts} zero-computation)" if x.zero_experts else str(x.experts)
        table.add_row(x.path, experts, str(x.top_k), f"{x.params_per_expert:,}", x.shared_expert, x.block)
    return table


def init_line(s: InspectSummary) -> str:
    spec = s.spec
    if spec is None:
        return "init: not recorded (no MoE spec in moekit.json)"
    init = spec.init.model_dump(mode="json")
    params = ", ".join(f"{k}={v}" for k, v in init.items() if k != "method")
    return (f"init: {init['method']}{f' ({params})' if params else ''}, seed {spec.seed}, "
            f"router init {spec.router_init}, router sharing {spec.router_sharing}"
            f"{f', granularity {spec.granularity}' if spec.granularity > 1 else ''}")
