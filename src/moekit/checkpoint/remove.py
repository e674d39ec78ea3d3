"""Removing experts from a native transformers MoE checkpoint, one tensor at a time (REAP-style one-shot pruning;
moekit.selection.prune only disables them).

What changes is read off the family's own model, built on the meta device twice: from config.json as it is (E
experts per MoE layer) and with its expert count set to E' (every config entry that names experts and holds E:
num_local_experts, num_experts, n_routed_experts, moe_num_experts, ..., in a nested text config too). Every tensor
of the checkpoint is then read, cut and written in its own dtype, so memory holds one tensor:
  per expert   the Hub's per-expert tensors `<block>.experts.N.*` (Mixtral's w1/w2/w3, Qwen and OLMoE's
               gate/up/down_proj, ...) are kept and renumbered 0..E'-1 in order;
  cut          a tensor under an MoE block whose stored shape differs between the two models (transformers 5's fused
               experts, GPT-OSS's biases, routers, selection biases such as e_score_correction_bias, expert_bias,
               Ernie's (1, E) moe_statics) differs along one axis, by E - E' entries: it keeps the kept experts'
               entries in order, then the entries after the E experts that some routers have (Inkling's shared
               experts, Zaya's skip class); or from E·n to E'·n (DBRX's 2-D experts): the kept experts' n rows;
  copied       everything else, a shared expert included.
A quantized checkpoint (moekit.checkpoint.quantized) stays quantized, byte for byte: a scaled weight's scales
(`_scale_inv`, `_scale`) are kept, renumbered or cut with it (`_cut_scales`), MXFP4's `_blocks` and `_scales` are cut
along their expert axis, per-expert pack-quantized tensors (`_packed`, `_shape`, ...) are renumbered (fused ones are
refused: their stored shape would change), and config.json keeps its quantization_config.
config.json gets the new expert count; top-k is left as it is (a selection that leaves fewer experts than top-k is
refused). Every MoE layer must keep the same number of experts, since these configs hold one number; group-limited
routing (DeepSeek's n_group) must keep as many per group; hash routing by token id (DeepSeek-V4) is refused, as is a
tensor that changes otherwise (it could not be cut without knowing its layout). LongCat-Flash's zero-computation
experts (ids E .. E+Z-1 after its E routed ones) are always kept and renumbered after the kept routed ones; a
checkpoint stored without their tensors (the Hub's) is written without them too. All of it is checked before anything
is written. The output is the same family, loaded by plain transformers; its logits equal the model with the removed
experts disabled (tested on every family whose routing moekit reads: tests/test_selection_families.py).
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from torch import nn

from moekit._fs import output
from moekit.checkpoint.card import hub_id, write_card
from moekit.checkpoint.dense import check_dense_dir, check_stored_shapes, meta_model, stored_shapes
from moekit.checkpoint.files import ShardReader, TensorInfo, copy_file, quantization, read_headers, read_text
from moekit.checkpoint.layerwise import model_names
from moekit.checkpoint.quantized import PACKED, PACKED_SHAPE, PACKED_WORDS, Mxfp4, Scaled
from moekit.checkpoint.writer import DEFAULT_SHARD, Planned, ShardWriter
from moekit.config import validate
from moekit.errors import ConfigError, UnsupportedModelError
from moekit.progress import report
from moekit.routing.sites import RouterSite, expert_groups, find_sites, hash_routed, routed_ids, zero_experts

_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(.+)")  # the Hub's per-expert names: prefix, expert, rest
OTHER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
               "chat_template.jinja", "chat_template.json")


@dataclass
class Cut:
    """What becomes of one tensor: copied whole (`rows` None), or these entries of axis `axis` kept; `name` in the
    output."""

    source: str
    name: str
    info: TensorInfo
    rows: list[int] | None = None
    axis: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        if self.rows is None:
            return self.info.shape
        return tuple(len(self.rows) if i == self.axis else n for i, n in enumerate(self.info.shape))


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


def moe_blocks(model: nn.Module) -> dict[str, RouterSite]:
    """{MoE block name: site} of a native model (built on the meta device), every layer with one expert count;
    refused in one line: hash routing, or layers with different counts (one config number could not describe them)."""
    sites = {s.name: s for s in find_sites(model)}
    hashed = [n for n, s in sites.items() if hash_routed(s)]
    if hashed:
        raise UnsupportedModelError(f"{hashed[0]} picks experts by token id (hash routing, a table of expert ids): "
                                    "removing experts would change which experts its tokens reach; disable them "
                                    "instead (moekit prune without keep or drop) in the other layers")
    counts = sorted({s.num_experts for s in sites.values()})
    if len(counts) != 1:
        raise UnsupportedModelError(f"its MoE layers hold different numbers of experts ({counts}): removing experts "
                                    "needs one count for every layer")
    return sites


def _count_keys(config: dict, experts: int, path: tuple = ()) -> list[tuple]:
    """Paths of the config entries that name experts and hold their count (in nested configs too)."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += _count_keys(value, experts, (*path, key))
        elif (type(value) is int and value == experts and "expert" in key
              and not any(w in key for w in ("per_tok", "shared", "top", "group", "activ", "zero"))):
            out.append((*path, key))
    return out


def _set_count(config, keys: list[tuple], count: int):
    """A copy of `config` (config.json's content, or the model's config object) with `count` at every path of keys."""
    out = copy.deepcopy(config)
    for path in keys:
        node = out
        for k in path[:-1]:
            node = node[k] if isinstance(node, dict) else getattr(node, k)
        if isinstance(node, dict):
            node[path[-1]] = count
        else:
            setattr(node, path[-1], count)
    return out


def _rebuilt(model: nn.Module, keys: list[tuple], count: int) -> nn.Module:
    """`model`'s class built on the meta device with `count` experts at every path of keys in its config."""
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():
        out = type(model)._from_config(_set_count(model.config, keys, count))
    out.tie_weights()
    return out


def routed_kept(keep: dict[str, list[int]], sites: dict[str, RouterSite]) -> dict[str, list[int]]:
    """`keep` without LongCat-Flash's zero-computation experts (ids E .. E+Z-1 after its E routed ones), which are
    always kept: they hold no weights to remove, and one config number (zero_expert_num) counts them in every layer."""
    return {b: sorted(routed_ids(sites[b], ids)) for b, ids in keep.items()}


def check_keep(keep: dict[str, list[int]], sites: dict[str, RouterSite]) -> int:
    """The routed experts every MoE layer keeps (E'), or ConfigError: every layer named, one count for all, at least
    top-k (with LongCat-Flash's zero-computation experts, which are always kept), per group equal."""
    if sorted(keep) != sorted(sites):
        other = sorted(set(sites) ^ set(keep))
        raise ConfigError(f"the selection must cover every MoE layer of the checkpoint ({len(sites)}: "
                          f"{list(sites)[:3]}{' ...' if len(sites) > 3 else ''}); it differs at {other[:5]}")
    bad = [i for b, ids in keep.items() for i in ids if not 0 <= i < sites[b].num_experts]
    if bad or any(len(set(ids)) != len(ids) for ids in keep.values()):
        raise ConfigError(f"expert ids must be distinct and in [0, {next(iter(sites.values())).num_experts})")
    counts = {len(ids) for ids in routed_kept(keep, sites).values()}
    if len(counts) != 1:
        raise ConfigError(f"the layers would keep different numbers of experts ({sorted(counts)}), but the config "
                          "holds one expert count for every layer; keep the same number per layer (moekit select "
                          "usage, reap or ean with top=N), or disable experts instead (moekit prune without keep or "
                          "drop)")
    kept = counts.pop()
    site = next(iter(sites.values()))
    experts = site.num_experts
    if kept + zero_experts(site) < site.top_k:
        raise ConfigError(f"keeping {kept} experts per layer leaves fewer than the {site.top_k} each token is routed "
                          "to (num_experts_per_tok); keep at least that many")
    groups = expert_groups(site)
    if groups is not None:
        size = experts // groups
        per = {tuple(sum(1 for i in ids if i // size == g) for g in range(groups)) for ids in keep.values()}
        if len(per) != 1 or len(set(next(iter(per)))) != 1:
            raise ConfigError(f"group-limited routing (n_group={groups}) needs the same number of kept experts in each "
                              f"group of {size}; the selection keeps {sorted(per)[0]} per group (select "
                              f"usage, reap or ean with groups={groups} keeps as many in each)")
    return kept


def _block_of(name: str, blocks: list[str]) -> str | None:
    return next((b for b in blocks if name.startswith(b + ".")), None)


def _cut(name: str, info: TensorInfo, want: tuple[int, ...], experts: int, ids: list[int]) -> Cut:
    """The cut of a tensor stored as `info` that the output model holds as `want`: along the one axis that differs by
    the removed experts' count (module docstring), else ConfigError."""
    have = tuple(info.shape)
    axes = [i for i, (a, b) in enumerate(zip(have, want)) if a != b]
    if len(have) == len(want) and len(axes) == 1:
        axis = axes[0]
        if have[axis] - want[axis] == experts - len(ids) and have[axis] >= experts:
            return Cut(name, name, info, [*ids, *range(experts, have[axis])], axis)
        n, rest = divmod(have[axis], experts)
        if not rest and want[axis] == n * len(ids):  # DBRX's (E·n, ...): expert e's rows e·n .. (e+1)·n - 1
            return Cut(name, name, info, [e * n + j for e in ids for j in range(n)], axis)
    raise ConfigError(f"{name} is {list(have)} and would be {list(want)} with {len(ids)} experts: not one axis of "
                      f"the {experts} experts (and entries after them, or n rows each) that moekit can cut")


def plan_cuts(model: nn.Module, target: nn.Module, headers: dict[str, TensorInfo], sites: dict[str, RouterSite],
              keep: dict[str, list[int]], fmt: Scaled | Mxfp4 | None = None) -> list[Cut]:
    """Every output tensor in the source's order, for the kept experts {MoE block: sorted ids} (module docstring);
    `fmt`: the checkpoint's quantization, whose scales (FP8: `_cut_scales`) or blocks and scales (MXFP4: experts
    first, as the weight they pack) are cut with their weights."""
    want = stored_shapes(target)
    names = model_names(model, list(headers))
    blocks = sorted(sites, key=len, reverse=True)
    site = next(iter(sites.values()))
    experts, zero = site.num_experts - zero_experts(site), zero_experts(site)  # routed; zero-computation after them
    cuts = []
    for name, info in headers.items():
        block = _block_of(names[name][0], blocks) or _block_of(name, blocks)
        per = _PER_EXPERT.fullmatch(name) if block else None
        if per and int(per.group(2)) < experts + zero:
            e, kept = int(per.group(2)), [*keep[block], *range(experts, experts + zero)]
            if e in kept:
                cuts.append(Cut(name, f"{per.group(1)}.{kept.index(e)}.{per.group(3)}", info))
        elif block and name in want and tuple(info.shape) != want[name]:
            cuts.append(_cut(name, info, want[name], experts, keep[block]))
        elif block and isinstance(fmt, Mxfp4) and name.endswith(PACKED) and name.rpartition("_")[0] in want \
                and info.shape[0] == experts:  # MXFP4 blocks or scales: experts first
            cuts.append(Cut(name, name, info, keep[block]))
        elif block and isinstance(fmt, Scaled) and fmt.bits and name.endswith(PACKED_WORDS) \
                and info.shape[0] == experts:
            shape = name.removesuffix(PACKED_WORDS) + PACKED_SHAPE
            raise ConfigError(f"{name} holds the pack-quantized values of every expert (or router row) in one tensor "
                              f"beside its shape {shape}, which removing experts would change; moekit removes "
                              "per-expert pack-quantized tensors (as llm-compressor saves them) only")
        elif name in want and tuple(info.shape) != want[name]:
            raise UnsupportedModelError(f"{name} lies outside the MoE layers moekit reads but changes with the "
                                        f"expert count ({list(info.shape)} -> {list(want[name])}; JetMoE's "
                                        "mixture-of-attention experts share the count): moekit cannot remove experts "
                                        "from it; disable them instead (moekit prune without keep or drop)")
        else:
            cuts.append(Cut(name, name, info))
    if isinstance(fmt, Scaled) and fmt.block is not None:
        _cut_scales(cuts, fmt)
    return cuts


def _cut_scales(cuts: list[Cut], fmt: Scaled) -> None:
    """The block scales (and zero points) of a scaled weight cut along its expert axis, cut the same way (fused
    experts (E, O, I) and their scales (E, ⌈O/bo⌉, ⌈I/bi⌉); a per-channel router's rows and their scales); ConfigError
    for a weight cut along a dimension stored in blocks of more than one (a block-quantized router's rows), which
    would split its blocks. Per-expert tensors and their scales are kept or dropped together by name."""
    weights = {c.source: c for c in cuts}
    for c in cuts:
        suffix = next((x for x in fmt.suffixes if c.source.endswith(x)), None)
        w = weights.get(c.source.removesuffix(suffix)) if suffix else None
        if w is None or w.rows is None or c.rows is not None:
            continue
        block = fmt.resolve(w.info.shape)
        if block is not None and w.axis >= len(w.info.shape) - 2 and block[w.axis - len(w.info.shape)] != 1:
            raise ConfigError(f"{w.source} is {fmt.label} in blocks of {block[w.axis - len(w.info.shape)]} along the "
                              "axis of its experts: removing experts would split its blocks")
        c.rows, c.axis = w.rows, w.axis


@dataclass
class Removal:
    """What remove_experts will write: the cuts, the output's config.json content, and E' of E."""

    cuts: list[Cut]
    config: dict
    kept: int
    experts: int


def plan_removal(src: Path, keep: dict[str, list[int]], trust_remote_code: bool = False) -> Removal:
    """Check everything (module docstring) and plan every tensor, reading headers only."""
    config = native_config(json.loads(read_text(src, "config.json", "config")))
    model = meta_model(src, trust_remote_code)
    check_stored_shapes(src, model)  # else a misshapen tensor is copied on as it is
    sites = moe_blocks(model)
    kept = check_keep(keep, sites)
    site = next(iter(sites.values()))
    experts = site.num_experts - zero_experts(site)  # routed
    keys = _count_keys(config, experts)
    target = _rebuilt(model, keys, kept) if keys else None
    if target is None or any(s.num_experts - zero_experts(s) != kept for s in find_sites(target)):
        raise ConfigError(f"{src}/config.json: no entry that names experts and holds {experts} sets the expert count "
                          f"(tried {['.'.join(k) for k in keys] or 'none'})")
    cuts = plan_cuts(model, target, read_headers(src), sites, routed_kept(keep, sites), quantization(src))
    return Removal(cuts, _set_count(config, keys, kept), kept, experts)


def remove_experts(src: str | Path, out: str | Path, keep: dict[str, list[int]], overwrite: bool = False,
                   inputs=(), max_shard_size: int = DEFAULT_SHARD, trust_remote_code: bool = False) -> int:
    """Write `src` with only the experts `keep` {MoE block name: expert ids} to `out` (atomically; module
    docstring); returns the bytes written. Everything is checked against the config's model first
    (`trust_remote_code`: a family with its own code builds it). Progress: "pruning" per tensor."""
    src = check_dense_dir(src)
    if Path(os.path.realpath(src)) in Path(os.path.realpath(out)).parents:
        raise ConfigError(f"the output {out} is inside the checkpoint {src}: write it elsewhere (a checkpoint "
                          "directory holds only its own files)")
    plan = plan_removal(src, keep, trust_remote_code)
    cuts = plan.cuts
    planned = [Planned(c.name, c.shape, c.info.torch_dtype) for c in cuts]
    with output(out, [src, *inputs], overwrite, sum(p.nbytes for p in planned)) as tmp, \
            ShardReader(src, dequantize=False) as reader:  # a quantized checkpoint stays so, byte for byte
        writer = ShardWriter(tmp, planned, max_shard_size)
        try:
            for n, c in enumerate(cuts, 1):
                t = reader.get(c.source)
                writer.write(c.name, t if c.rows is None else t.index_select(c.axis, torch.tensor(c.rows)))
                report("pruning", n, len(cuts), c.name)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=2))
        for name in OTHER_FILES:
            if (src / name).is_file():
                copy_file(src, name, tmp / name)
        dtype = next(p.dtype for p, c in zip(planned, cuts) if c.rows is not None or ".experts." in c.name)
        write_card(tmp, title=f"{src.name} with {plan.kept} of {plan.experts} experts per MoE layer",
                   base_model=hub_id(src), method=None, fmt="native, experts removed",
                   dtype=str(dtype).removeprefix("torch."),
                   architecture=(plan.config.get("architectures") or [None])[0],
                   extra={"experts kept": json.dumps({b: ids for b, ids in sorted(keep.items())})})
        read_headers(tmp)  # the written shards parse and cover their files exactly
    return sum(p.nbytes for p in planned)
