"""moekit's own checkpoint format, and loading any model directory moekit reads.

A moekit checkpoint directory holds:
  config.json                the dense base model's HF config, wrapped so that transformers never reads it as the
                             dense model (moekit.checkpoint.wrapped)
  generation_config.json     for models that generate (e.g. Whisper's language and task tokens)
  moekit.json                format version, model class, MoE spec, one entry per MoE layer
                             (slot + layout), tensor aliases (tied / shared tensors stored once)
  model-0000i-of-0000n.safetensors (+ model.safetensors.index.json when sharded)
  tokenizer files, if a tokenizer was given
  README.md                  the model card (moekit.checkpoint.card)
  the files of state codecs  e.g. pruned_experts.json for pruned models (moekit.checkpoint.codecs), re-applied on load
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.initialization import no_init_weights

from moekit._fs import output
from moekit.checkpoint.card import write_model_card
from moekit.checkpoint.codecs import own_format, own_writer, read_state, write_state
from moekit.checkpoint.dense import architecture, load_config, load_dense, load_generation_config, model_class
from moekit.checkpoint.files import ShardReader, check_dir, read_headers, read_text, refuse_adapter
from moekit.checkpoint.meta import MoekitMeta
from moekit.checkpoint.writer import DEFAULT_SHARD, Planned, ShardWriter
from moekit.config import validate
from moekit.errors import CheckpointError, MoekitError
from moekit.moe.build import from_layout, layout
from moekit.moe.layer import moe_layers
from moekit.moe.spec import MoESpec
from moekit.moe.state import model_state, spec_of
from moekit.surgery import slot_at

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
    wrapped so that transformers never reads it as the dense model (moekit.checkpoint.wrapped); and, for
    generative models, generation_config.json (e.g. Whisper's language and task tokens)."""
    from moekit.checkpoint.wrapped import save_config

    model.config.dtype = str(model.dtype).removeprefix("torch.")
    save_config(model.config, folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)


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
    write_state(model, folder)  # e.g. a pruned model's disabled experts, re-applied by load()


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


def read_meta(folder: str | Path, file: str = "moekit.json", schema: type[BaseModel] = MoekitMeta,
              kind: str = "moekit") -> dict:
    """The checkpoint's metadata file (moekit.json here; simoe.json for SIMoE), validated by `schema`."""
    f = Path(folder) / file
    if not (f.exists() or f.is_symlink()):
        raise CheckpointError(f"{folder} is not a {kind} checkpoint (no {file})")
    check_dir(folder)
    refuse_adapter(folder)
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
        try:
            moe = from_layout(e["layout"], router=routers.get(e["router_of"]))
        except (RuntimeError, TypeError, ValueError, OverflowError) as err:  # sizes beyond what a tensor can have
            raise CheckpointError(f"{folder}/moekit.json: the layout of layer {e['path']} cannot be built "
                                  f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from None
        routers.setdefault(e["path"], moe.router)
        moe.slot = {k: e[k] for k in ("stack", "index", "adapter")}
        moe.init_diversity = e.get("init_diversity")
        try:
            slot = slot_at(model, e["stack"], e["index"], e["adapter"], e["path"])
        except (MoekitError, IndexError, KeyError, AttributeError) as err:
            raise CheckpointError(f"{folder}/moekit.json: layer {e['path']} does not exist in the model ({err})") from None
        slot.install(moe)
    return model


def build_from_meta(folder: str | Path, buffers: bool = False) -> tuple[nn.Module, dict]:
    """(the model a moekit checkpoint describes, on the meta device, checked against its shard headers; its
    validated moekit.json). With `buffers`, only the parameters are on the meta device and buffers (e.g. rotary
    frequencies) are real: a model that runs once its weights are loaded (moekit.checkpoint.layerwise)."""
    from accelerate import init_empty_weights

    folder = Path(folder)
    meta = read_meta(folder)
    config = load_config(folder)
    with torch.device("meta"):
        model = _build(meta, config, folder)
    model.tie_weights()  # tied embeddings are one tensor, as in the checkpoint (export copies it once)
    check_headers(model, folder, meta["aliases"])
    if buffers:  # built again once its sizes are checked: init_empty_weights creates each parameter before moving it
        with init_empty_weights(include_buffers=False):
            model = _build(meta, config, folder)
        model.tie_weights()
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
    return adopt(read_state(model.eval(), folder))


def load_model(path: str | Path, allow_pickle: bool = False, trust_remote_code: bool = False,
               dtype: torch.dtype | None = None) -> nn.Module:
    """A moekit checkpoint (moekit.json), one in a state codec's own format (e.g. SIMoE's simoe.json;
    moekit.checkpoint.codecs) or any local HF model directory (e.g. transformers' MoE families). `dtype`: a
    transformers directory is loaded in it (default float32); moekit's and the codecs' formats are cast to it."""
    path = Path(path)
    codec = own_format(path)
    if codec is not None:
        model = codec.load(path)
    elif (path / "moekit.json").is_file():
        model = load(path)
    elif not path.is_dir():
        raise CheckpointError(f"{path} is not a model directory")
    else:
        return load_dense(path, allow_pickle, trust_remote_code, dtype or torch.float32, allow_nonfinite=True)
    return model if dtype is None else model.to(dtype)


_ADOPTED: dict[type, type] = {}


def _save_pretrained(self, save_directory, *args, **kwargs):
    """save_pretrained of an MoE or SIMoE model made by moekit: its own format (moekit's, or a state codec's such as
    SIMoE's), which reloads as this model (transformers' would reload as the dense model); a non-empty directory is
    refused, as moekit.save does. A model that has neither (e.g. a merged SIMoE model) is saved by transformers."""
    codec = own_writer(self)
    if codec is not None:
        with output(save_directory) as tmp:
            codec.save(self, tmp)
    elif moe_layers(self):
        save(self, save_directory)
    else:
        super(type(self), self).save_pretrained(save_directory, *args, **kwargs)


def _push_to_hub(self, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                 private: bool | None = None, token: bool | str | None = None, revision: str | None = None,
                 create_pr: bool = False):
    """push_to_hub of a model made by moekit: what its save_pretrained writes (moekit's format with moekit's model
    card), uploaded to Hub repository `repo_id` (created if missing) in one commit; returns huggingface_hub's
    CommitInfo. transformers' push_to_hub would replace the card with its template. `AutoModelForCausalLM.
    from_pretrained(repo_id)` loads it back (with moekit imported)."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi(token=token, library_name="moekit")
    repo = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        self.save_pretrained(Path(tmp) / "model")
        return api.upload_folder(repo_id=repo, folder_path=Path(tmp) / "model", revision=revision, create_pr=create_pr,
                                 commit_message=commit_message or f"Upload {type(self).__name__} (moekit)",
                                 commit_description=commit_description)


def adopt(model):
    """Make `model.save_pretrained` and `model.push_to_hub` write moekit's format: the model's class becomes a
    subclass of the same name with only these methods replaced (so isinstance, type names and copies behave as
    before). Returns `model`."""
    cls = type(model)
    if cls in _ADOPTED.values():
        return model
    if cls not in _ADOPTED:
        _ADOPTED[cls] = type(cls.__name__, (cls,), {"save_pretrained": _save_pretrained, "push_to_hub": _push_to_hub,
                                                     "__module__": cls.__module__, "__doc__": cls.__doc__})
    model.__class__ = _ADOPTED[cls]
    return model
