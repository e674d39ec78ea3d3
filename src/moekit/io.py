"""moekit checkpoint format, dense-model loading, and atomic output directories.

A moekit checkpoint directory holds:
  config.json                the dense base model's HF config (unchanged)
  generation_config.json     for models that generate (e.g. Whisper's language and task tokens)
  moekit.json                format version, model class, MoE spec, one entry per MoE layer
                             (slot + layout), tensor aliases (tied / shared tensors stored once)
  model-0000i-of-0000n.safetensors (+ model.safetensors.index.json when sharded)
  tokenizer files, if a tokenizer was given
  pruned_experts.json        only for pruned models (moekit.select.prune): re-applied on load
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path

import torch
import transformers
from pydantic import BaseModel, ValidationError
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.initialization import no_init_weights

from moekit._fs import output
from moekit.checkpoint.auto import adopt
from moekit.checkpoint.card import write_model_card
from moekit.checkpoint.files import ShardReader, check_dir, read_headers, read_text
from moekit.checkpoint.meta import MoekitMeta
from moekit.checkpoint.writer import DEFAULT_SHARD, Planned, ShardWriter
from moekit.config import validate
from moekit.errors import CheckpointError, MoekitError, NumericsError
from moekit.moe.build import from_layout, layout
from moekit.moe.layer import moe_layers
from moekit.moe.spec import MoESpec
from moekit.surgery import slot_at
from moekit.state import model_state, spec_of

REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


def unique_tensors(model: nn.Module, full: dict[str, torch.Tensor] | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict with each tensor once (tied embeddings, shared routers); aliases maps a dropped key to the
    key that is kept. Real tensors are matched by storage, meta ones (no storage) by identity. `full`: the
    values to keep instead of the model's own, e.g. the full state dict the Trainer gathered from FSDP or ZeRO-3
    shards; the model's own tensors are then shards or placeholders, matched by identity (tied weights are
    one Parameter object)."""
    kept, aliases, seen = {}, {}, {}
    for k, v in model.state_dict(keep_vars=True).items():
        if full is None and isinstance(v, DTensor):
            raise CheckpointError("the model's parameters are FSDP shards: pass the full state dict gathered from "
                                  "them (torch.distributed.checkpoint.state_dict.get_model_state_dict)")
        by_id = v.is_meta or full is not None
        key = id(v) if by_id else (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype)
        if key in seen:
            aliases[k] = seen[key]
        else:
            seen[key] = k
            kept[k] = (v if full is None else full[k]).detach().contiguous()
    return kept, aliases


def save_weights(tensors: dict[str, torch.Tensor], folder: Path, shard_bytes: int = DEFAULT_SHARD) -> None:
    """Sharded safetensors (+ index), written by moekit.checkpoint.writer like the streaming paths."""
    writer = ShardWriter(folder, [Planned(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], shard_bytes)
    try:
        for k, v in tensors.items():
            writer.write(k, v)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint's validated safetensors files, read from their checked descriptors
    (moekit.checkpoint.files)."""
    with ShardReader(folder) as reader:
        return {k: reader.get(k) for k in reader.keys()}


def save_configs(model: nn.Module, folder: Path) -> None:
    """config.json of a moekit (or SIMoE) checkpoint: the base config with the dtype (load builds in it),
    wrapped so that transformers never reads it as the dense model (moekit.checkpoint.auto); and, for
    generative models, generation_config.json (e.g. Whisper's language and task tokens)."""
    from moekit.checkpoint.auto import save_config

    model.config.dtype = str(model.dtype).removeprefix("torch.")
    save_config(model.config, folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)


def load_generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)


def architecture(model: nn.Module) -> str:
    """The model's class name; FSDP2's fully_shard swaps a model's class for a subclass FSDP<name>."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def moekit_meta(model: nn.Module, aliases: dict[str, str]) -> dict:
    """moekit.json of an MoE model (also of one on the meta device: layouts and router owners only)."""
    spec = spec_of(model)
    router_owner: dict[int, str] = {}
    entries = []
    for path, moe in moe_layers(model):
        owner = router_owner.setdefault(id(moe.router), path)
        entries.append({"path": path, **moe.slot, "layout": layout(moe), "router_of": owner,
                        "init_diversity": moe.init_diversity})
    return {"format": MoekitMeta.FORMATS[0], "architecture": architecture(model),
            "spec": None if spec is None else spec.model_dump(mode="json"), "layers": entries, "aliases": aliases}


def write_checkpoint(model: nn.Module, folder: Path, full: dict[str, torch.Tensor] | None = None) -> None:
    """Write config.json, the weights (shared tensors once; `full`: see unique_tensors) and moekit.json into an
    existing folder."""
    if not moe_layers(model):
        raise CheckpointError("the model has no MoE layers; use model.save_pretrained for dense models")
    tensors, aliases = unique_tensors(model, full)
    save_configs(model, folder)
    save_weights(tensors, folder)
    (folder / "moekit.json").write_text(json.dumps(moekit_meta(model, aliases), indent=2))
    write_model_card(model, folder)
    from moekit.select.common import write_pruned

    write_pruned(model, folder)  # a pruned model's disabled experts, re-applied by load()


def save(model: nn.Module, out: str | Path, overwrite: bool = False, tokenizer=None) -> Path:
    """Save an MoE model in the moekit format, atomically (moekit._fs.output: nothing half-written, an
    existing `out` replaced only with `overwrite` and only once the new one is complete)."""
    if not moe_layers(model):
        raise CheckpointError("the model has no MoE layers; use model.save_pretrained for dense models")
    with output(out, overwrite=overwrite) as tmp:
        write_checkpoint(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out)


# moekit's own architectures (transformers PreTrainedModels that transformers does not ship):
# config model_type -> the module that defines them and registers their config with AutoConfig
NATIVE_MODULES = {"moekit_ctc": "moekit.speech.ctc"}


def _config_json(folder: Path) -> dict:
    """config.json as a dict ({} if unreadable: the loaders report that)."""
    try:
        data = json.loads(read_text(folder, "config.json", "config"))
    except (CheckpointError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _native_module(folder: Path):
    """Import (and so register) the moekit module of `folder`'s model type (for a moekit checkpoint: its base
    model's), if it is one of ours."""
    data = _config_json(folder)
    kind = data.get("base_model_type") or data.get("model_type")
    return importlib.import_module(NATIVE_MODULES[kind]) if kind in NATIVE_MODULES else None


def model_class(name: str, folder: Path | None = None) -> type[nn.Module]:
    """A transformers model class by name, or one of moekit's own (see NATIVE_MODULES) for `folder`."""
    native = None if folder is None else _native_module(folder)
    cls = getattr(transformers, name, None) or getattr(native, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"model class {name!r} is not a transformers or moekit model class "
                              "(custom code is not loaded)")
    return cls


def read_meta(folder: str | Path, file: str = "moekit.json", schema: type[BaseModel] = MoekitMeta,
              kind: str = "moekit") -> dict:
    """The checkpoint's metadata file (moekit.json here; simoe.json for SIMoE), validated by `schema`."""
    f = Path(folder) / file
    if not (f.exists() or f.is_symlink()):
        raise CheckpointError(f"{folder} is not a {kind} checkpoint (no {file})")
    check_dir(folder)
    try:
        data = json.loads(read_text(folder, file, f"{kind} metadata"))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") not in schema.FORMATS:
        found = data.get("format") if isinstance(data, dict) else None
        raise CheckpointError(f"{folder}: unsupported {kind} checkpoint format {found!r} (expected "
                              f"{' or '.join(schema.FORMATS)})")
    try:
        return schema.model_validate(data).model_dump(mode="json")
    except ValidationError as e:
        where = ".".join(map(str, e.errors()[0]["loc"]))
        raise CheckpointError(f"{f} is invalid: {where}: {e.errors()[0]['msg']}") from None


def load_config(folder: Path, trust_remote_code: bool = False):
    """The directory's transformers config (for a moekit checkpoint, its base model's); remote code only with
    `trust_remote_code` (never a prompt)."""
    from moekit.checkpoint.auto import MODEL_TYPE, base_config

    check_dir(folder)
    check_remote_code(folder, trust_remote_code)
    _native_module(folder)
    data = _config_json(folder)
    try:
        if data.get("model_type") == MODEL_TYPE:
            return base_config(data)
        return transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder}/config.json does not load: {' '.join(str(e).split())}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(folder: str | Path, trust_remote_code: bool = False):
    """The tokenizer saved in `folder`, or None if it has no tokenizer files; custom tokenizer code only with
    `trust_remote_code`."""
    folder = Path(folder)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    check_dir(folder)
    check_remote_code(folder, trust_remote_code)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder} has tokenizer files but they do not load: {' '.join(str(e).split())}") from None


def check_remote_code(folder: Path, trust_remote_code: bool) -> None:
    """Refuse a directory whose config, tokenizer or processor names its own Python code (`auto_map`),
    unless the user trusts it: transformers would otherwise prompt on stdin or run it."""
    if trust_remote_code:
        return
    for name in REMOTE_CODE_FILES:
        if (folder / name).is_file():
            try:
                data = json.loads(read_text(folder, name, "config"))
            except (ValueError, RecursionError):
                continue  # not ours to judge here: the loader reports a broken file
            if isinstance(data, dict) and data.get("auto_map"):
                raise CheckpointError(f"{folder} needs its own Python code ({name} has an auto_map); pass "
                                      "trust_remote_code=True only if you trust that code")


def load_state(model: nn.Module, folder: Path, meta: dict) -> None:
    """Load a checkpoint's weights (aliases restored) into a model of the same layout."""
    tensors = load_weights(folder)
    tensors.update({alias: tensors[key] for alias, key in meta["aliases"].items() if key in tensors})
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{folder}: weights do not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")


def check_headers(model: nn.Module, folder: Path, aliases: dict[str, str]) -> None:
    """The shard headers hold exactly the tensors of `model` (built on the meta device from the metadata),
    with the same shapes and dtypes, before any memory is allocated for them."""
    headers = read_headers(folder)
    expected = {k: v for k, v in model.state_dict().items() if k not in aliases}
    wrong_alias = [a for a, k in aliases.items() if k not in expected]
    if wrong_alias:
        raise CheckpointError(f"{folder}: tensor aliases point at tensors the model does not have: {wrong_alias[:3]}")
    missing, unexpected = sorted(expected.keys() - headers.keys()), sorted(headers.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(f"{folder}: the weights do not match its metadata (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    for k, v in expected.items():
        h = headers[k]
        if h.shape != tuple(v.shape) or h.torch_dtype != v.dtype:
            raise CheckpointError(f"{h.file}: {k} is {h.dtype}{list(h.shape)}, the metadata says "
                                  f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}")


def _build(meta: dict, config, folder: Path) -> nn.Module:
    """The (empty) model a moekit.json describes, on the current default device."""
    cls = model_class(meta["architecture"], folder)
    with no_init_weights():  # _from_config builds in config.dtype (e.g. bf16), as from_pretrained does
        model = cls._from_config(config)
    routers = {}
    for e in meta["layers"]:
        moe = from_layout(e["layout"], router=routers.get(e["router_of"]))
        routers.setdefault(e["path"], moe.router)
        moe.slot = {k: e[k] for k in ("stack", "index", "adapter")}
        moe.init_diversity = e.get("init_diversity")
        try:
            slot = slot_at(model, e["stack"], e["index"], e["adapter"])
        except (MoekitError, IndexError, KeyError, AttributeError) as err:
            raise CheckpointError(f"{folder}/moekit.json: layer {e['path']} does not exist in the model ({err})") from None
        slot.install(moe)
    return model


def build_from_meta(folder: str | Path) -> tuple[nn.Module, dict]:
    """(the model a moekit checkpoint describes, on the meta device, checked against its shard headers; its
    validated moekit.json)."""
    folder = Path(folder)
    meta = read_meta(folder)
    config = load_config(folder)
    with torch.device("meta"):
        model = _build(meta, config, folder)
    model.tie_weights()  # tied embeddings are one tensor, as in the checkpoint (export copies it once)
    check_headers(model, folder, meta["aliases"])
    if meta["spec"] is not None:
        model_state(model).spec = validate(MoESpec, meta["spec"], source=f"MoE spec in {folder}/moekit.json")
    return model, meta


def load(folder: str | Path) -> nn.Module:
    """Load a moekit checkpoint; outputs are bit-identical to the saved model's. The metadata is validated
    and the model it describes is checked against the shard headers on the meta device first, so a
    damaged or hostile checkpoint is refused before any large allocation."""
    folder = Path(folder)
    empty, meta = build_from_meta(folder)
    model = _build(meta, empty.config, folder)
    load_state(model, folder, meta)
    model.tie_weights()
    load_generation_config(model, folder)
    model_state(model).spec = spec_of(empty)
    return adopt(reapply_pruning(model.eval(), folder))


def reapply_pruning(model: nn.Module, folder: str | Path) -> nn.Module:
    """Disable the experts a pruned checkpoint lists in pruned_experts.json (moekit.select.prune): its
    routing hooks are not in the weights, and losing them silently would re-enable the experts."""
    from moekit.select.prune import reapply

    return reapply(model, folder)


def load_dense(path: str | Path, allow_pickle: bool = False, trust_remote_code: bool = False,
               dtype: torch.dtype = torch.float32, allow_nonfinite: bool = False) -> nn.Module:
    """Load a dense HF model from a local directory: safetensors only unless `allow_pickle`, custom code only
    with `trust_remote_code`, shard files validated first, weights checked finite unless `allow_nonfinite`."""
    path = check_dense_dir(path)
    has_st = has_safetensors(path, allow_pickle)
    config = load_config(path, trust_remote_code)
    if has_st:
        read_headers(path)  # shard names, headers and coverage checked before transformers opens anything
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = model_class(arch, path) if arch and not trust_remote_code else transformers.AutoModel
    try:
        model = cls.from_pretrained(path, use_safetensors=has_st, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"{path} does not load: {' '.join(str(e).split())[:500]}") from None
    if not allow_nonfinite:
        check_finite(model.named_parameters(), str(path))
    return reapply_pruning(model.eval(), path)


def check_dense_dir(path: str | Path) -> Path:
    """A HF model directory that is not one of moekit's MoE formats (those have their own commands)."""
    path = Path(path)
    if path.is_dir():
        check_dir(path)
    for file, kind, hint in (("moekit.json", "a moekit MoE checkpoint", "moekit inspect / moekit export"),
                             ("simoe.json", "a SIMoE checkpoint", "moekit simoe export --merge TASK")):
        if (path / file).is_file():
            raise CheckpointError(f"{path} is {kind}, not a dense model; see `{hint}`")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def meta_model(path: str | Path, trust_remote_code: bool = False, buffers: bool = False) -> nn.Module:
    """The dense model of a directory built on the meta device from its config: shapes without memory, to
    check a spec and estimate sizes before any weight is read. With `buffers`, only the parameters are on the meta
    device and buffers (e.g. rotary frequencies) are real: a model whose weights can be assigned piece by piece
    and run (moekit.moe.prompts)."""
    path = check_dense_dir(path)
    config = load_config(path, trust_remote_code)
    arch = (getattr(config, "architectures", None) or [None])[0]
    if buffers:
        from accelerate import init_empty_weights

        where = init_empty_weights(include_buffers=False)
    else:
        where = torch.device("meta")
    with where, no_init_weights():
        if arch and not trust_remote_code:
            model = model_class(arch, path)._from_config(config)
        else:
            model = transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    model.tie_weights()  # tied embeddings are one tensor, as in the checkpoint
    return model


def has_safetensors(path: Path, allow_pickle: bool) -> bool:
    """Whether `path` holds safetensors weights; without them, pickle weights only with `allow_pickle`."""
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return True  # the index is checked when it is read: a shard it names outside the directory is refused
    if not allow_pickle:
        found = ", ".join(sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}))
        raise CheckpointError(f"{path} has no safetensors weights{f' (found {found})' if found else ''}; pickle "
                              "checkpoints can run arbitrary code: pass allow_pickle=True only if you trust them")
    return False


def check_finite(tensors, where: str) -> None:
    """NumericsError naming the first tensor with a NaN or Inf (allow_nonfinite=True proceeds anyway)."""
    for name, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise NumericsError(f"{where}: {name} has {bad} non-finite value{'s' * (bad > 1)} (NaN or Inf); "
                                "pass allow_nonfinite=True to proceed anyway")


def load_model(path: str | Path, allow_pickle: bool = False, trust_remote_code: bool = False) -> nn.Module:
    """A moekit checkpoint (moekit.json), a SIMoE one (simoe.json) or any local HF model directory (e.g.
    transformers' MoE families)."""
    path = Path(path)
    if (path / "simoe.json").is_file():
        from moekit.simoe.export import load as load_simoe

        return load_simoe(path)
    if (path / "moekit.json").is_file():
        return load(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a model directory")
    return load_dense(path, allow_pickle, trust_remote_code, allow_nonfinite=True)
