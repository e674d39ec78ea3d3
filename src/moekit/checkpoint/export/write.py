"""Writing a native export, shared by the in-memory export (`moekit.export` of a model) and the streaming ones
(moekit.checkpoint.upcycle): the units in file order, the files besides the weights that other readers need as they
read them (tokenizer_config.json), and what each reader computes (the command's final line and the model card).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torch import nn

from moekit.checkpoint.parts import LayerParts
from moekit.checkpoint.stream import Const, moe_units, ordered_units
from moekit.checkpoint.export.base import LLAMA_CPP, TF4, MoEPlan, NativeFormat

# tokenizer classes transformers 4.x cannot import; what it reads instead (the same tokenizer.json)
V5_ONLY_TOKENIZERS = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def native_units(model: nn.Module, fmt: NativeFormat, p: MoEPlan, make_parts: Callable, copy_of: Callable) -> list:
    """Every unit of the export in state-dict order: tensors copied (`copy_of(key, aliases)`), MoE layers named by
    the format (`make_parts(path, moe)`), tied tensors the format stores anyway, and the format's extra tensors."""
    layers = moe_units(model, make_parts, lambda path, parts: fmt.layer_items(parts, p),
                       lambda path: fmt.prefix(path, p))
    units, aliases = ordered_units(model, layers, copy_of)
    for key in fmt.tied_copies(model, p):
        if key in aliases:  # tied in the model: stored once by the copy, written under this name too
            unit = copy_of(aliases[key], aliases)
            unit.name = key
            units.append(unit)
    return units + [Const(k, v) for k, v in fmt.extra_tensors(model, p).items()]


def in_memory_units(model: nn.Module, fmt: NativeFormat, p: MoEPlan) -> list:
    """native_units of an in-memory model (its own tensors)."""
    state = model.state_dict()
    return native_units(model, fmt, p, lambda path, moe: LayerParts(moe),
                        lambda key, aliases: Const(key, state[key].detach()))


def legacy_tokenizer(folder: Path) -> None:
    """tokenizer_config.json that transformers 4.x (and so llama.cpp's converter, vLLM, older stacks) reads: a
    tokenizer class only transformers 5 has ("TokenizersBackend", what it writes for a tokenizer.json) becomes
    PreTrainedTokenizerFast, which both read from the same tokenizer.json; any other class is kept."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file() or path.is_symlink():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    cls = config.get("tokenizer_class")
    if cls in V5_ONLY_TOKENIZERS and (Path(folder) / "tokenizer.json").is_file():
        config["tokenizer_class"] = V5_ONLY_TOKENIZERS[cls]
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def readers_note(gaps: dict[str, list[str]]) -> str:
    """What reads the export as moekit computes it, for the final line and the model card."""
    same = ["transformers 5", *(r for r in (TF4, LLAMA_CPP) if not gaps.get(r))]
    if len(same) == 3:
        return "transformers 5, transformers 4.57 and llama.cpp compute it the same"
    others = "; ".join(f"{r} cannot represent {', '.join(g)}" for r, g in gaps.items() if g)
    return f"only {' and '.join(same)} compute{'s' * (len(same) == 1)} it as moekit does ({others})"
