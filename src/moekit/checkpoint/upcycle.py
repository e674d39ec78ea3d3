"""`upcycle_checkpoint`: a dense safetensors checkpoint -> an MoE checkpoint (moekit's format or a native
transformers one), streamed (moekit.checkpoint.stream): the dense model is never instantiated and the MoE
never held, so memory stays near one FFN whatever the model's size. Same tensors, bit for bit, as
`moekit.upcycle` on the model loaded in float32 and cast to the output dtype (tests/test_stream.py)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moekit._fs import available_memory, check_space, output, peak_memory
from moekit.checkpoint.card import diversity_fact, hub_id, hub_snapshot, licenses, public_names, write_card
from moekit.checkpoint.dense import check_dense_dir, declared_architecture, load_tokenizer, meta_model
from moekit.checkpoint.export.write import native_units
from moekit.checkpoint.files import ShardReader, copy_file, read_headers
from moekit.checkpoint.format import moekit_meta, unique_tensors
from moekit.checkpoint.layerwise import chunked, model_names, streamed_prompt_rows
from moekit.checkpoint.stream import (Copy, StoredParts, UpcycledParts, draw_router, ffn_keys, meta_moe_model,
                                      moe_units, moekit_naming, ordered_units, planned_bytes, read_ffn, write_units)
from moekit.checkpoint.wrapped import save_config
from moekit.checkpoint.writer import DEFAULT_SHARD
from moekit.config import Config
from moekit.errors import CheckpointError, ConfigError, ExportError, ResourceError
from moekit.init.base import InitContext
from moekit.moe.build import shared_gate_weight
from moekit.moe.diversity import init_diversity
from moekit.moe.layer import moe_layers
from moekit.moe.spec import PROMPT_INITS, MoESpec
from moekit.routing.sites import param_counts
from moekit.moe.state import spec_of
from moekit.checkpoint.upcycle_model import layer_generator, router_groups, selected_slots

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("auto", "moekit", "mixtral", "qwen2_moe", "qwen3_moe")
AUTO_ORDER = ("mixtral", "qwen3_moe", "qwen2_moe")  # the most widely served native format first
KEEP_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json")


class UpcycleRecipe(Config):
    """A YAML upcycling recipe (`moekit upcycle RECIPE`). `model`: a model directory or built-in asset name;
    `out`: the output directory (relative paths are relative to the working directory)."""

    model: str
    out: str
    spec: MoESpec


@dataclass
class Written:
    """What a streaming command wrote (the CLI's final line)."""

    path: Path
    format: str
    why: str  # why this format (for --format auto)
    dtype: str
    bytes: int
    seconds: float
    peak_rss: int
    params: tuple[int, int]
    layers: int  # MoE layers
    readers: str = ""  # native formats: which readers compute it as moekit does (moekit.checkpoint.export.write.readers_note)

    @property
    def note(self) -> str:
        """The final line's remark: said only where a reader computes the export differently."""
        return f"; {self.readers}" if self.readers.startswith("only") else ""


def stored_dtype(reader: ShardReader) -> torch.dtype:
    """The floating dtype holding most of a checkpoint's bytes (what --dtype auto keeps); for an FP8 checkpoint,
    that of its unquantized tensors (bf16 for DeepSeek-V3: the dtype its weights were quantized from)."""
    counts = Counter()
    for info in reader.headers.values():
        if info.torch_dtype.is_floating_point and info.torch_dtype.itemsize > 1:
            counts[info.torch_dtype] += info.nbytes
    return counts.most_common(1)[0][0] if counts else torch.float32


def output_dtype(name: str, reader: ShardReader) -> torch.dtype:
    return named_dtype(name) or stored_dtype(reader)


def named_dtype(name: str) -> torch.dtype | None:
    """The dtype an output dtype name means; None for "auto" (the source's own)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def choose_format(name: str, model: nn.Module, layout: str | None = None, dtype: torch.dtype | None = None):
    """(NativeFormat or None for moekit's format, plan or None, why). `auto`: the first native format that
    represents the spec exactly for this source and that every known reader (transformers 5 and 4.57, llama.cpp)
    computes the same, else the first that transformers computes exactly, else moekit's. `layout` (classic when
    None) applies to the native formats; moekit's format has none to choose."""
    from moekit.checkpoint.export import EXPORTERS
    from moekit.checkpoint.export.base import check_layout

    if name not in FORMATS:
        raise ConfigError(f"unknown format {name!r}; choose one of: {', '.join(FORMATS)}")
    if layout is not None:
        check_layout(layout)
    if name == "moekit":
        if layout is not None:
            raise ConfigError("the moekit format has no expert layout to choose; a layout applies to the native "
                              f"formats ({', '.join(AUTO_ORDER)}, or auto)")
        return None, None, "moekit format requested"
    if name != "auto":
        fmt = EXPORTERS.get(name)
        return fmt, fmt.plan(model, layout or "classic", dtype), f"{name} requested"
    reasons, exact = [], []
    for candidate in AUTO_ORDER:
        fmt = EXPORTERS.get(candidate)
        try:
            plan = fmt.plan(model, layout or "classic", dtype)
        except ExportError as e:
            reasons.append(str(e).removeprefix("cannot export to "))
            continue
        gaps = {r: g for r, g in fmt.reader_gaps(model, plan).items() if g}
        if not gaps:
            return fmt, plan, f"{candidate} represents this MoE exactly"
        exact.append((fmt, plan, gaps))
    if exact:
        fmt, plan, gaps = exact[0]
        return fmt, plan, f"{fmt.name} represents this MoE exactly, for transformers (no native format represents " \
                          f"it for every reader: {'; '.join(f'{r}: {g[0]}' for r, g in gaps.items())})"
    return None, None, "no native format represents this MoE exactly, so moekit's: " + "; ".join(reasons)


def model_named(reader: ShardReader, model: nn.Module) -> ShardReader:
    """`reader` serving its tensors under `model`'s names, renamed as transformers renames them when it loads the
    model (moekit.checkpoint.layerwise.model_names); a tensor transformers builds from several stored ones is not
    renamed (a streaming upcycle copies tensors as they are stored) but recorded, so that asking for it says why."""
    names, built, parts, split = {}, {}, {}, chunked(model)
    for k, (name, converted) in model_names(model, reader.keys()).items():
        targets = split.get(converted or "", [])
        if targets and targets[0] in name and reader.headers[k].shape[:1] > (0,) and k not in reader.scales \
                and k not in reader.packed:
            parts[k] = [name.replace(targets[0], t) for t in targets]  # read as rows of the stored tensor
        elif converted:
            built.setdefault(name, []).append(k)
        else:
            names[k] = name
    reader.rename(names, built, parts)
    return reader


def source_key(key: str, aliases: dict[str, str], reader: ShardReader) -> str:
    """The checkpoint's name for output tensor `key`: itself, or a tied alias the checkpoint stored instead."""
    for name in (key, *(a for a, k in aliases.items() if k == key)):
        if name in reader:
            return name
    if key in reader.built:
        raise ConfigError(f"{reader.folder}: transformers builds {key} from {', '.join(reader.built[key])} when it "
                          "loads the model, and a streaming upcycle copies tensors as they are stored: load the model "
                          "and upcycle it in memory (moekit.upcycle)")
    raise ConfigError(f"{reader.folder} has no tensor {key}, nor one that transformers loads as {key}")


def copy_files(src: Path, dst: Path) -> None:
    """Generation config, tokenizer and processor files of the source (regular files inside it, or links inside
    its Hugging Face cache folder: moekit.checkpoint.files.copy_file), the tokenizer class readable by
    transformers 4.x (moekit.checkpoint.export.write.legacy_tokenizer)."""
    from moekit.checkpoint.export.write import legacy_tokenizer

    for name in KEEP_FILES:
        if (src / name).is_file():
            copy_file(src, name, dst / name)
    legacy_tokenizer(dst)


def upcycle_checkpoint(src: str | Path, out: str | Path, spec: MoESpec, *, format: str = "moekit",
                       dtype: str = "auto", device: str | torch.device = "cpu",
                       max_shard_size: int = DEFAULT_SHARD, overwrite: bool = False, trust_remote_code: bool = False,
                       allow_nonfinite: bool = False, force: bool = False, inputs=(),
                       base_model: list | str | None = None, layout: str | None = None) -> Written:
    """Upcycle the dense checkpoint directory `src` into `out` (atomically; see moekit._fs.output), layer by
    layer: init math in float32 (or wider) on `device`, tensors written in `dtype` ("auto": the checkpoint's
    own) as `format` ("auto": a native format when one represents the spec exactly), a native format's experts in
    `layout` (classic when None, or fused; moekit.checkpoint.export.base). Memory and disk needs
    are checked first (`force` skips the memory check); `base_model`: the Hub id(s) the model card names (by default
    moekit.checkpoint.card.hub_id of `src`; None entries and local paths are never written).
    Progress: "upcycling" per MoE layer (moekit.progress)."""
    start, src = time.perf_counter(), check_dense_dir(src)
    dense = meta_model(src, trust_remote_code)
    branch_dirs = [check_dense_dir(b) for b in spec.init.source_models()]
    names = public_names([src, *branch_dirs])  # what the outputs publish: no path of this machine
    public = spec.model_copy(update={"init": spec.init.with_source_models(names[1:])}) if branch_dirs else spec
    reader, branches = model_named(ShardReader(src), dense), [model_named(ShardReader(b), dense) for b in branch_dirs]
    dt = output_dtype(dtype, reader)
    slots = selected_slots(dense, spec)
    check_shapes(dense, reader, src)
    for b in branches:  # a branch gives its FFNs only, unless its other weights are averaged in (btx)
        check_shapes(dense, b, src, None if spec.init.averages_non_ffn else ffn_names(slots))
    tokenizer = load_tokenizer(src, trust_remote_code)  # its files are copied: they must load
    moe, _ = meta_moe_model(dense, slots, router_groups(slots, spec), public, dt)
    fmt, plan, why = choose_format(format, moe, layout, dt)
    rows: dict[str, torch.Tensor] = {}  # router rows from prompts, computed below once all checks passed
    make_parts = _parts_maker(spec, {s.path: s for s in slots}, reader, branches, device, allow_nonfinite, rows)
    copies = [*branches, *([reader] if spec.init.include_seed else [])] if spec.init.averages_non_ffn else [reader]

    def copy_of(key, aliases):
        return Copy(key, source_key(key, aliases, reader), copies, finite=not allow_nonfinite)

    if fmt is None:
        units, aliases = ordered_units(moe, moe_units(moe, make_parts, moekit_naming(moe)), copy_of)
    else:
        units, aliases = native_units(moe, fmt, plan, make_parts, copy_of), unique_tensors(moe)[1]
    need = planned_bytes(units, dt)
    check_space(out, need)
    check_memory(dense, slots, spec, force)
    for r in (reader, *branches):  # the first FFN computes what is read from it (each one is checked as it is read)
        read_ffn(slots[0], r, not allow_nonfinite)
    if spec.router_init in PROMPT_INITS:
        prompt_model = meta_model(src, trust_remote_code, buffers=True)
        rows.update(streamed_prompt_rows(prompt_model, reader, selected_slots(prompt_model, spec), spec, tokenizer))
    with output(out, [src, *branch_dirs, *inputs], overwrite, need) as tmp:
        diversities: dict[str, float] = {}  # of the tensors as written
        nbytes = write_units(tmp, units, dt, max_shard_size, "upcycling", diversities)
        for path, m in moe_layers(moe):  # recorded in moekit.json / moekit_spec.json and the card
            m.init_diversity = diversities[path]
        title = f"{hub_id(src) if hub_snapshot(src) else names[0]} upcycled to an MoE ({spec.summary}, " \
                f"{spec.init.method})"
        readers = _write_metadata(tmp, dict(zip(names, [src, *branch_dirs])), moe, aliases, fmt, plan, dt, why,
                                  base_model, title)
        read_headers(tmp)  # the written shards parse and cover their files exactly
    for r in (reader, *branches):
        r.close()
    rss = peak_memory()
    return Written(Path(out), "moekit" if fmt is None else fmt.name, why, str(dt).removeprefix("torch."), nbytes,
                   time.perf_counter() - start, rss, param_counts(moe), len(moe_layers(moe)), readers)


def export_checkpoint(src: str | Path, out: str | Path, fmt_name: str, *, dtype: str = "auto",
                      max_shard_size: int = DEFAULT_SHARD, overwrite: bool = False, inputs=(),
                      layout: str = "classic") -> Written:
    """A moekit checkpoint -> a native transformers MoE checkpoint, streamed like `upcycle_checkpoint`: the
    model is built on the meta device from moekit.json (validated against the shard headers), each MoE layer
    is read expert by expert (moekit.checkpoint.stream.StoredParts) and renamed to the native layout (`layout`:
    classic or fused, moekit.checkpoint.export.base). Progress: "exporting" per MoE layer (moekit.progress)."""
    from moekit.checkpoint.export import EXPORTERS
    from moekit.checkpoint.format import build_from_meta

    from moekit.checkpoint.export.base import check_layout

    start, src = time.perf_counter(), Path(src)
    fmt = EXPORTERS.get(fmt_name)
    check_layout(layout)
    model, meta = build_from_meta(src)
    reader = ShardReader(src)
    dt = output_dtype(dtype, reader)
    plan = fmt.plan(model, layout, dt)
    owners = {e["path"]: e["router_of"] for e in meta["layers"]}
    lays = {e["path"]: e["layout"] for e in meta["layers"]}

    def copy_of(key, aliases):
        return Copy(key, source_key(key, aliases, reader), [reader], finite=False)

    units = native_units(model, fmt, plan, lambda path, moe: StoredParts(reader, path, lays[path], owners[path]),
                         copy_of)
    aliases = unique_tensors(model)[1]
    need = planned_bytes(units, dt)
    with output(out, [src, *inputs], overwrite, need) as tmp:
        nbytes = write_units(tmp, units, dt, max_shard_size, "exporting")
        name = public_names([src])[0]
        readers = _write_metadata(tmp, {name: src}, model, aliases, fmt, plan, dt, f"{fmt.name} requested", None,
                                  f"{name} exported to {fmt.name}")
        read_headers(tmp)
    reader.close()
    rss = peak_memory()
    return Written(Path(out), fmt.name, f"{fmt.name} requested", str(dt).removeprefix("torch."), nbytes,
                   time.perf_counter() - start, rss, param_counts(model), len(moe_layers(model)), readers)


def check_memory(dense: nn.Module, slots, spec: MoESpec, force: bool) -> None:
    """Refuse, before any work, an upcycle whose estimated peak memory exceeds what the machine has: about the
    largest tensor copied twice, plus per MoE layer its dense FFN, one expert and its cast in float32, and an
    SVD basis for spri (`force` tries anyway)."""
    largest = max(p.numel() for p in dense.parameters()) * 4 * 2
    ffn = max(sum(t.numel() for t in (f.up, f.down, f.gate) if t is not None) for f in (s.read() for s in slots))
    side = min(slots[0].read().hidden_size, slots[0].read().intermediate_size)
    need = max(largest, ffn * 4 * 3 * (1 + len(spec.init.source_models())) + side * side * 8)
    have = available_memory()
    if need > have and not force:
        raise ResourceError(f"upcycling needs about {need / 2**30:.1f} GiB of memory, {have / 2**30:.1f} GiB are "
                            "available; pass force=True to try anyway")


def ffn_names(slots) -> set[str]:
    """The checkpoint names of the dense FFN tensors of `slots` (what an expert source model gives)."""
    return {f"{slot.stack}.{slot.index}.{key}" for slot in slots for key in ffn_keys(slot)}


def check_shapes(model: nn.Module, reader: ShardReader, config_dir: Path, only: set[str] | None = None) -> None:
    """Every tensor of the model that `config_dir`'s config.json describes (or those of them named in `only`) is in
    the checkpoint with that shape (a config that disagrees with its weights, or a branch or expert model of another
    size or architecture, is refused before any work; for a mix of architectures, in one line naming both and the
    first missing tensor). mergekit-moe reads only the FFN tensors of its expert models (docs/moe.md: attention and
    norms come from the base model), so an expert source is checked with `only` its FFNs (ffn_names)."""
    kept, aliases = unique_tensors(model)
    base, folder = Path(config_dir), Path(reader.folder)
    kinds = (declared_architecture(folder), declared_architecture(base))
    for key, t in kept.items():
        if only is not None and key not in only:
            continue
        try:
            name = source_key(key, aliases, reader)
        except ConfigError:
            if kinds[0] == kinds[1]:
                raise
            raise CheckpointError(f"{folder} ({kinds[0]}) and the base model {base} ({kinds[1]}) mix architectures "
                                  f"whose tensors differ: the first has no {key}") from None
        shape = reader.headers[name].shape
        if shape != tuple(t.shape):
            whose = "its config.json" if folder == base else f"the config.json of the base model {base}"
            raise CheckpointError(f"{folder}: {name} is {list(shape)} in the weights but {list(t.shape)} by {whose}")


def _parts_maker(spec: MoESpec, slots: dict, reader: ShardReader, branches: list[ShardReader], device,
                 allow_nonfinite: bool, rows: dict[str, torch.Tensor]):
    """make_parts(path, moe) for moe_units: the layer's dense FFN (and branch FFNs) read, an init context; `rows`
    the router rows of the prompt inits by layer path."""
    routers: dict[str, torch.Tensor] = {}  # router-sharing group -> its router (drawn by its first layer)

    def make(path: str, moe) -> UpcycledParts:
        slot = slots[path]
        finite = not allow_nonfinite
        gen = layer_generator(spec.seed, path)
        stored = read_ffn(slot, reader, finite)
        dense = stored.math().to(device=device)
        ctx = InitContext(dense=dense, spec=spec, generator=gen, path=path,
                          branches=[read_ffn(slot, b, finite).math().to(device=device) for b in branches])
        group = spec.router_group(path)

        def router() -> torch.Tensor:
            if group is not None and group in routers:
                return routers[group]
            r = draw_router(spec, dense.hidden_size, gen, rows.get(path))
            if group is not None:
                routers[group] = r
            return r

        return UpcycledParts(ctx, stored, router, finite, lambda: shared_gate_weight(spec, dense.hidden_size, gen,
                                                                                    rows.get(path)))

    return make


def _write_metadata(tmp: Path, sources: dict[str, Path], moe: nn.Module, aliases: dict, fmt, plan, dt: torch.dtype,
                    why: str, base_model: list | str | None, title: str) -> str:
    """config.json, moekit.json (or, for a native format, moekit_spec.json beside the native config), the
    tokenizer/generation files of the source (the first of `sources`, {published name: folder}) and the model
    card, with the license the sources' cards agree on (moekit.checkpoint.card.licenses); returns which readers
    compute a native export as moekit does (moekit.checkpoint.export.write.readers_note; "" for moekit's
    format)."""
    import json

    from moekit.checkpoint.export.write import readers_note

    source, src = next(iter(sources.items()))
    license_fields, license_facts = licenses(list(sources.values()), list(sources))

    dtype = str(dt).removeprefix("torch.")
    spec = spec_of(moe).model_dump(mode="json")
    readers = ""
    if fmt is None:
        config = moe.config
        config.dtype = dtype
        save_config(config, tmp)  # wrapped: transformers never reads it as the dense model
        (tmp / "moekit.json").write_text(json.dumps(moekit_meta(moe, aliases), indent=2))
    else:
        fmt.write_config(moe, plan, tmp)
        diversities = {path: m.init_diversity for path, m in moe_layers(moe)}
        (tmp / "moekit_spec.json").write_text(json.dumps({"spec": spec, "source": source, "format": fmt.name,
                                                          "layout": plan.layout, "init_diversity": diversities},
                                                         indent=2))
        readers = readers_note(fmt.reader_gaps(moe, plan))
    copy_files(src, tmp)
    name = "moekit" if fmt is None else f"{fmt.name}, {plan.layout} expert layout"
    ids = [base_model] if isinstance(base_model, str) else base_model if base_model is not None else [hub_id(src)]
    ids = [i for x in ids for i in ([x] if isinstance(x, str) else x or [])]  # a card's base_model may be a list
    write_card(tmp, title=title, architecture=type(moe).__name__,
               base_model=ids, method=spec["init"]["method"],
               spec=spec, fmt=f"{name} ({why})", dtype=dtype, params=param_counts(moe),
               license=license_fields, extra={**diversity_fact(init_diversity(moe)), **license_facts,
                                              **({"readers": readers} if readers else {})},
               checked=["every planned tensor written exactly once, and the shard headers re-read and validated",
                        "dense weights and every initialized expert finite (unless --allow-nonfinite)"])
    return readers
