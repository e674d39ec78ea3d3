"""SIMoE checkpoints and exports (Chen et al. 2025, §3.2 and Table 8).

* `save` / `load`: the SIMoE form (frozen pretrained weights, δ, masks, router, λ) in safetensors with
  simoe.json; `prune` first drops the δ columns no expert's median gate uses (compact form).
* `merge`: for fixed routing weights (e.g. one task's mean routing) fold every SI module into a plain
  weight θ_pre + δ ⊙ m, giving an ordinary dense HF model.
* `CODEC`: SIMoE as a checkpoint format of its own (moekit.checkpoint.codecs).
Parameter counts (stored, active per input) are moekit.simoe.model.param_counts."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers.initialization import no_init_weights

from moekit._fs import output
from moekit.checkpoint.card import write_model_card
from moekit.checkpoint.codecs import StateCodec
from moekit.checkpoint.dense import architecture, load_config, load_generation_config, model_class
from moekit.checkpoint.files import read_headers
from moekit.checkpoint.format import adopt, check_headers, load_state, save_configs, save_weights, unique_tensors
from moekit.checkpoint.format import read_meta as io_read_meta
from moekit.checkpoint.meta import SIMoEMeta
from moekit.config import validate
from moekit.errors import CheckpointError
from moekit.simoe import hard_concrete as hc
from moekit.simoe.layer import SILinear, SparseInterpolated
from moekit.simoe.model import SIMoEConfig, _replace, install, si_modules
from moekit.moe.state import model_state

ROUTER_IN = "simoe.router.0.weight"  # (router_hidden, H): H, the backbone's last hidden size


def is_simoe(model: nn.Module) -> bool:
    return model_state(model).simoe is not None


def write_checkpoint(model: nn.Module, folder: Path, full: dict | None = None) -> None:
    """config.json, weights and simoe.json into an existing folder (`full`: see moekit.checkpoint.format.unique_tensors)."""
    kept = {p: m.delta.shape[1] for p, m in si_modules(model) if isinstance(m, SILinear) and m.keep is not None}
    meta = {"format": SIMoEMeta.FORMATS[0], "architecture": architecture(model),
            "config": model.simoe.cfg.model_dump(mode="json"), "kept": kept, "skipped": model.simoe.skipped}
    save_configs(model, folder)
    tensors, aliases = unique_tensors(model, full)  # tied embeddings once
    meta["aliases"] = aliases
    save_weights(tensors, folder)
    (folder / "simoe.json").write_text(json.dumps(meta, indent=2))
    write_model_card(model, folder, extra={"paper": "SIMoE (Chen et al. 2025): sparse interpolated experts"})


def save(model: nn.Module, out: str | Path, overwrite: bool = False, tokenizer=None) -> Path:
    """Save a SIMoE model atomically."""
    with output(out, overwrite=overwrite) as tmp:
        write_checkpoint(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out)


def read_meta(folder: str | Path) -> dict:
    return io_read_meta(folder, "simoe.json", SIMoEMeta, "SIMoE")


def _router_in(folder: Path) -> int:
    """The stored router's input size (the backbone's last hidden size)."""
    router = read_headers(folder).get(ROUTER_IN)
    if router is None or len(router.shape) != 2:
        raise CheckpointError(f"{folder} has no SIMoE router ({ROUTER_IN}, 2-D)")
    return router.shape[1]


def _build(meta: dict, config, cfg: SIMoEConfig, folder: Path, hidden: int) -> nn.Module:
    with no_init_weights():
        model = model_class(meta["architecture"], folder)._from_config(config)
    try:
        install(model, cfg, meta["kept"], hidden=hidden, skipped=meta["skipped"])
    except (ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"{folder}/simoe.json does not fit the model: {e}") from None
    return model


def load(folder: str | Path) -> nn.Module:
    """Load a SIMoE checkpoint (pruned or not), in eval mode; validated against the shard headers on the
    meta device first (as moekit.checkpoint.format.load)."""
    folder = Path(folder)
    meta = read_meta(folder)
    config = load_config(folder)
    cfg = validate(SIMoEConfig, meta["config"], source=f"SIMoE config in {folder}/simoe.json")
    hidden = _router_in(folder)
    with torch.device("meta"):
        check_headers(_build(meta, config, cfg, folder, hidden), folder, meta["aliases"])
    model = _build(meta, config, cfg, folder, hidden)
    load_state(model, folder, meta)
    model.tie_weights()
    load_generation_config(model, folder)
    return adopt(model.eval())


def prune(model: nn.Module) -> nn.Module:
    """Drop, in place, every δ column whose median gate is 0 for all experts (eval outputs unchanged)."""
    for _, m in si_modules(model):
        if isinstance(m, SILinear):
            m.prune()
    return model


@torch.no_grad()
def merge(model: nn.Module, weights: torch.Tensor) -> nn.Module:
    """A plain dense model (in place) with every SI module folded for the (M,) routing `weights`:
    W = W_pre + δ ⊙ m, m = Σ_i weights_i ẑ_i (median gates). An SI module at several paths (tied layers) is folded
    once and its base put back at each."""
    for _, m in si_modules(model):
        base = m.base
        if isinstance(m, SILinear):
            z = m.full_gates()  # (M, in) or (M, out, in) with full-granular masks
            mix = (weights.to(z.dtype) @ z.flatten(1)).view(z.shape[1:])
            base.weight += m.full_delta() * mix.to(base.weight.dtype)
        else:
            base.weight += (weights.to(m.log_alpha.dtype) @ m.gate_values()).to(base.weight.dtype) * m.delta
    for path, m in list(model.named_modules(remove_duplicate=False)):
        if isinstance(m, SparseInterpolated):
            _replace(model, path, m.base)
    model.simoe.hook.remove()
    del model.simoe
    model_state(model).simoe = None
    return model


# a SIMoE model (ModelState.simoe) is a checkpoint format of its own (entry point in pyproject.toml)
CODEC = StateCodec(field="simoe", file="simoe.json", save=write_checkpoint, load=load)
