"""Removing experts from a native transformers MoE checkpoint, one tensor at a time (REAP-style one-shot pruning;
moekit.selection.prune only disables them).

Every tensor of the checkpoint is read, cut and written in its own dtype, so memory holds one tensor. Under a
decoder layer's MoE block (`model.layers.N.{mlp, block_sparse_moe, feed_forward}`):
  experts    the Hub's per-expert tensors `experts.E.*` (Mixtral's w1/w2/w3, Qwen and OLMoE's gate/up/down_proj,
             DeepSeek's, ...) are kept and renumbered 0..E'-1 in order; transformers 5's fused tensors
             `experts.*` (E, ...) (with GPT-OSS's biases and quantized blocks) keep their kept rows;
  router     `gate.*` / `router.*` tensors of E rows (weights, biases, DeepSeek's e_score_correction_bias) keep
             the kept rows; a shared expert is untouched.
config.json gets the new expert count (num_local_experts, num_experts or n_routed_experts); top-k is left as it is
(a selection that leaves fewer experts than top-k is refused). Every MoE layer must keep the same number of experts,
since these configs hold one number; group-limited routing (DeepSeek's n_group) must keep as many per group. The
output is the same family, loaded by plain transformers; its logits equal the model with the removed experts
disabled (tested per family).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from moekit._fs import output
from moekit.checkpoint.card import hub_id, write_card
from moekit.checkpoint.dense import check_dense_dir, check_stored_shapes, meta_model
from moekit.checkpoint.files import ShardReader, TensorInfo, copy_file, read_headers, read_text
from moekit.checkpoint.writer import DEFAULT_SHARD, Planned, ShardWriter
from moekit.config import validate
from moekit.errors import ConfigError
from moekit.progress import report

COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # the config's expert count, by family
MOE_BLOCK = r"(model\.layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward))"  # a decoder layer's MoE block
_MOE = MOE_BLOCK + r"\."
_PER_EXPERT = re.compile(_MOE + r"experts\.(\d+)\.(.+)")  # classic: prefix, layer, expert, rest
_STACKED = re.compile(_MOE + r"(experts|gate|router)\.([^.]+(?:\.[^.]+)*)")  # fused experts, router tensors
OTHER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
               "chat_template.jinja", "chat_template.json")


@dataclass
class Cut:
    """What becomes of one tensor: copied whole (`rows` None), or these rows of dim 0 kept; `name` in the output."""

    source: str
    name: str
    info: TensorInfo
    rows: list[int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape if self.rows is None else (len(self.rows), *self.info.shape[1:])


class NativeConfig(BaseModel):
    """The fields of a native config.json that expert removal reads, strictly typed (the rest passes through)."""

    model_config = ConfigDict(extra="allow")
    num_local_experts: StrictInt | None = Field(None, ge=1)
    num_experts: StrictInt | None = Field(None, ge=1)
    n_routed_experts: StrictInt | None = Field(None, ge=1)
    num_experts_per_tok: StrictInt | None = Field(None, ge=1)
    n_group: StrictInt | None = Field(None, ge=1)


def native_config(config) -> dict:
    """config.json's content, its expert fields validated (NativeConfig): ConfigError naming the bad field."""
    validate(NativeConfig, config, source="config.json")
    return config


def expert_count(config: dict) -> tuple[str, int]:
    """(key, E) of the config's expert count. Several keys holding one number (moekit's Qwen3-MoE export writes
    both num_experts and num_local_experts) are one count; the first key is the one updated."""
    found = [(k, config[k]) for k in COUNT_KEYS if config.get(k) is not None]
    if not found or len({n for _, n in found}) != 1:
        raise ConfigError("not a transformers MoE config with one expert count (num_local_experts, num_experts or "
                          f"n_routed_experts): found {dict(found) or 'none'}")
    return found[0]


def plan_cuts(headers: dict[str, TensorInfo], experts: int, keep: dict[int, list[int]]) -> list[Cut]:
    """Every output tensor in the source's order, for the kept experts {decoder layer: ids} of each MoE layer."""
    cuts, seen = [], set()
    for name, info in headers.items():
        m = _PER_EXPERT.fullmatch(name)
        if m and int(m.group(2)) in keep:
            layer, e = int(m.group(2)), int(m.group(3))
            if e < experts and e in keep[layer]:
                cuts.append(Cut(name, f"{m.group(1)}.experts.{keep[layer].index(e)}.{m.group(4)}", info))
            seen.add(layer)
            continue
        m = _STACKED.fullmatch(name)
        if m and int(m.group(2)) in keep and info.shape and info.shape[0] == experts:
            cuts.append(Cut(name, name, info, keep[int(m.group(2))]))
            seen.add(int(m.group(2)))
            continue
        cuts.append(Cut(name, name, info))
    missing = sorted(set(keep) - seen)
    if missing:
        raise ConfigError(f"decoder layers {missing[:5]} have no expert tensors of {experts} experts in the checkpoint")
    return cuts


def check_keep(keep: dict[int, list[int]], moe_layers: list[int], experts: int, top_k: int | None,
               groups: int | None) -> int:
    """The experts every MoE layer keeps (E'), or ConfigError: one count for all, at least top-k, per group equal."""
    if sorted(keep) != sorted(moe_layers):
        other = sorted(set(moe_layers) ^ set(keep))
        raise ConfigError(f"the selection must cover every MoE layer of the checkpoint (decoder layers {moe_layers}); "
                          f"it differs at {other[:5]}")
    counts = {len(ids) for ids in keep.values()}
    if len(counts) != 1:
        raise ConfigError(f"the layers would keep different numbers of experts ({sorted(counts)}), but the config "
                          "holds one expert count for every layer; keep the same number per layer (moekit select "
                          "usage, reap or ean with top=N), or disable experts instead (moekit prune without keep or "
                          "drop)")
    kept = counts.pop()
    bad = [i for ids in keep.values() for i in ids if not 0 <= i < experts]
    if bad or any(len(set(ids)) != len(ids) for ids in keep.values()):
        raise ConfigError(f"expert ids must be distinct and in [0, {experts})")
    if top_k is not None and kept < top_k:
        raise ConfigError(f"keeping {kept} experts per layer leaves fewer than the {top_k} each token is routed to "
                          "(num_experts_per_tok); keep at least that many")
    if groups:
        size = experts // groups
        per = {tuple(sum(1 for i in ids if i // size == g) for g in range(groups)) for ids in keep.values()}
        if len(per) != 1 or len(set(next(iter(per)))) != 1:
            raise ConfigError(f"group-limited routing (n_group={groups}) needs the same number of kept experts in each "
                              f"group of {size}; the selection keeps {sorted(per)[0]} per group")
    return kept


def remove_experts(src: str | Path, out: str | Path, keep: dict[int, list[int]], overwrite: bool = False,
                   inputs=(), max_shard_size: int = DEFAULT_SHARD, trust_remote_code: bool = False) -> int:
    """Write `src` with only the experts `keep` {decoder layer index: expert ids} to `out` (atomically; module
    docstring); returns the bytes written. Every tensor's shape is checked against the config's model first
    (`trust_remote_code`: a family with its own code builds it). Progress: "pruning" per tensor."""
    src = check_dense_dir(src)
    if Path(os.path.realpath(src)) in Path(os.path.realpath(out)).parents:
        raise ConfigError(f"the output {out} is inside the checkpoint {src}: write it elsewhere (a checkpoint "
                          "directory holds only its own files)")
    config = native_config(json.loads(read_text(src, "config.json", "config")))
    key, experts = expert_count(config)
    headers = read_headers(src)
    moe_layers = sorted({i for n in headers if (i := _expert_layer(n)) is not None})
    kept = check_keep(keep, moe_layers, experts, config.get("num_experts_per_tok"), config.get("n_group"))
    check_stored_shapes(src, meta_model(src, trust_remote_code))  # else a misshapen tensor is copied on as it is
    cuts = plan_cuts(headers, experts, {i: sorted(ids) for i, ids in keep.items()})
    plan = [Planned(c.name, c.shape, c.info.torch_dtype) for c in cuts]
    with output(out, [src, *inputs], overwrite, sum(p.nbytes for p in plan)) as tmp, ShardReader(src) as reader:
        writer = ShardWriter(tmp, plan, max_shard_size)
        try:
            for n, c in enumerate(cuts, 1):
                t = reader.get(c.source)
                writer.write(c.name, t if c.rows is None else t[c.rows])
                report("pruning", n, len(cuts), c.name)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        counts = {k: kept for k in COUNT_KEYS if config.get(k) is not None}  # every key that held the count
        (tmp / "config.json").write_text(json.dumps({**config, **counts}, indent=2))
        for name in OTHER_FILES:
            if (src / name).is_file():
                copy_file(src, name, tmp / name)
        dtype = next(p.dtype for p, c in zip(plan, cuts) if c.rows is not None or ".experts." in c.name)
        write_card(tmp, title=f"{src.name} with {kept} of {experts} experts per MoE layer", base_model=hub_id(src),
                   method=None, fmt="native, experts removed", dtype=str(dtype).removeprefix("torch."),
                   architecture=(config.get("architectures") or [None])[0],
                   extra={"experts kept": json.dumps({str(i): ids for i, ids in sorted(keep.items())})})
        read_headers(tmp)  # the written shards parse and cover their files exactly
    return sum(p.nbytes for p in plan)


def _expert_layer(name: str) -> int | None:
    """The decoder layer whose experts tensor `name` is (classic per-expert or fused), else None."""
    m = _PER_EXPERT.fullmatch(name)
    if m is None:
        m = _STACKED.fullmatch(name)
        if m is None or m.group(3) != "experts":
            return None
    return int(m.group(2))
