"""Shared by selective fine-tuning and pruning: a selection's layers as RouterSites, and saving any MoE model."""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ..errors import ConfigError
from .._fs import output
from ..checkpoint.card import write_model_card
from ..checkpoint.codecs import write_state
from ..checkpoint.format import write_checkpoint
from ..moe.layer import moe_layers
from ..routing.sites import RouterSite, find_sites, moe_sites
from ..routing.trace import config_digest
from .registry import SELECTORS
from .selection import Selection
from moekit.moe.state import model_state

PRUNED_FILE = "pruned_experts.json"


def experts_of(selection: Selection | dict[str, list[int]]) -> dict[str, list[int]]:
    return selection.experts if isinstance(selection, Selection) else dict(selection)


def resolve(model: nn.Module, selection: Selection | dict[str, list[int]]) -> list[tuple[RouterSite, list[int]]]:
    """(site, sorted expert ids) for every layer the selection names; unknown layers or ids are errors."""
    experts = experts_of(selection)
    sites = {s.name: s for s in find_sites(model)}
    unknown = sorted(set(experts) - set(sites))
    if unknown:
        raise ConfigError(f"the selection names layers the model does not have: {unknown[:5]} "
                          f"(the model's MoE layers: {list(sites)[:5]}{' ...' if len(sites) > 5 else ''})")
    out = []
    for name, ids in experts.items():
        site = sites[name]
        bad = [i for i in ids if not 0 <= i < site.num_experts]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(f"{name}: expert ids must be distinct and in [0, {site.num_experts}), got {ids}")
        out.append((site, sorted(ids)))
    return out


def check_source(selection: Selection, model: nn.Module, allow_other_model: bool = False, log=None) -> None:
    """Refuse (ConfigError naming what differs) a selection made for another model than `model` (loaded, or built on
    the meta device): another config (moekit.routing.trace.config_digest), or a MoE layer of its trace that `model`
    lacks or holds another number of experts in; `allow_other_model` takes it anyway. A selection without a source
    (written by hand, or by moekit before selections recorded one) is taken as it is, `log` told so when a selection
    method made it."""
    src = selection.source
    if src is None:
        if log is not None and selection.method in SELECTORS:
            log(f"the {selection.method} selection does not record the model it was made for (made by an older "
                "moekit): only its layers and expert ids are checked")
        return
    digest, sites = config_digest(model.config), {s.name: s.num_experts for s in moe_sites(model)}
    differ = [f"its config (sha256 {src.config_sha256[:12]}) is not this model's ({digest[:12]})"
              ] if src.config_sha256 not in (None, digest) else []
    differ += [f"{name} has {n} experts there, " + (f"{sites[name]} here" if name in sites else "no such MoE layer here")
               for name, n in src.experts.items() if sites.get(name) != n][:3]
    if differ and not allow_other_model:
        where = f" (trace {src.trace})" if src.trace else ""
        raise ConfigError(f"the selection was made for another model{where}: {'; '.join(differ)}; pass "
                          "allow_other_model=True to use it anyway")


def write_pruned(model: nn.Module, folder: Path) -> None:
    """pruned_experts.json for a model pruned by moekit.selection.prune (its routing hooks are not weights)."""
    pruned = model_state(model).pruned
    if pruned:
        sel = Selection(method="pruned", budget=sum(map(len, pruned.values())), experts=pruned)
        (folder / PRUNED_FILE).write_text(json.dumps(sel.model_dump(), indent=2))


def save_model(model: nn.Module, out: str | Path, overwrite: bool = False, tokenizer=None,
               extra: dict[str, dict] | None = None) -> Path:
    """Save atomically: the moekit format for moekit models, save_pretrained (safetensors) for HF models,
    with pruned_experts.json if the model is pruned. `extra` maps file names to JSON objects to add."""
    with output(out, overwrite=overwrite) as tmp:
        if moe_layers(model):
            write_checkpoint(model, tmp)  # with its state codecs' files (pruned_experts.json)
        else:
            model.save_pretrained(tmp)  # transformers v5 writes safetensors only
            write_state(model, tmp)
            write_model_card(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, obj in (extra or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2))
    return Path(out)
