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

import importlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.initialization import no_init_weights

from moekit.errors import CheckpointError, OutputExistsError
from moekit.moe.build import from_layout, layout
from moekit.moe.layer import moe_layers
from moekit.moe.spec import MoESpec
from moekit.surgery import slot_at

FORMAT = "moekit/1"
SHARD_BYTES = 1 << 30


def check_output_dir(out: str | Path, overwrite: bool) -> Path:
    """Refuse an existing non-empty directory unless `overwrite` (call before doing any work)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise OutputExistsError(f"{out} exists and is not empty; pass --overwrite (overwrite=True) to replace it")
    return out


@contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `out`, on error it is removed."""
    out = check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:  # overwrite replaced a plain file
            old.unlink()


def unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict with each storage once; aliases maps a dropped key to the key that is kept."""
    kept, aliases, seen = {}, {}, {}
    for k, v in model.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype)
        if key in seen:
            aliases[k] = seen[key]
        else:
            seen[key] = k
            kept[k] = v.contiguous()
    return kept, aliases


def save_weights(tensors: dict[str, torch.Tensor], folder: Path, shard_bytes: int = SHARD_BYTES) -> None:
    shards, cur, size = [], {}, 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + n
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
             "weight_map": {}}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        index["weight_map"].update({k: name for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"no safetensors weights in {folder}")
    out = {}
    for f in files:
        out.update(load_file(folder / f))
    return out


def save_configs(model: nn.Module, folder: Path) -> None:
    """config.json (with the dtype, as save_pretrained writes it; load builds in it) and, for generative
    models, generation_config.json (e.g. Whisper's language and task tokens)."""
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)


def load_generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)


def write_checkpoint(model: nn.Module, folder: Path) -> None:
    """Write config.json, the weights (shared tensors once) and moekit.json into an existing folder."""
    layers = moe_layers(model)
    if not layers:
        raise CheckpointError("the model has no MoE layers; use model.save_pretrained for dense models")
    spec: MoESpec | None = getattr(model, "moekit_spec", None)
    router_owner: dict[int, str] = {}
    entries = []
    for path, moe in layers:
        owner = router_owner.setdefault(id(moe.router), path)
        entries.append({"path": path, **moe.slot, "layout": layout(moe), "router_of": owner})
    tensors, aliases = unique_tensors(model)
    meta = {"format": FORMAT, "architecture": type(model).__name__,
            "spec": None if spec is None else spec.model_dump(mode="json"),
            "layers": entries, "aliases": aliases}
    save_configs(model, folder)
    save_weights(tensors, folder)
    (folder / "moekit.json").write_text(json.dumps(meta, indent=2))
    from moekit.select.common import write_pruned

    write_pruned(model, folder)  # a pruned model's disabled experts, re-applied by load()


def save(model: nn.Module, out: str | Path, overwrite: bool = False, tokenizer=None) -> Path:
    """Save an MoE model in the moekit format, atomically."""
    if not moe_layers(model):
        raise CheckpointError("the model has no MoE layers; use model.save_pretrained for dense models")
    with atomic_dir(out, overwrite) as tmp:
        write_checkpoint(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out)


# moekit's own architectures (transformers PreTrainedModels that transformers does not ship):
# config model_type -> the module that defines them and registers their config with AutoConfig
NATIVE_MODULES = {"moekit_ctc": "moekit.speech.ctc"}


def _native_module(folder: Path):
    """Import (and so register) the moekit module of `folder`'s config model_type, if it is one of ours."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # AutoConfig reports the problem
    return importlib.import_module(NATIVE_MODULES[model_type]) if model_type in NATIVE_MODULES else None


def model_class(name: str, folder: Path | None = None) -> type[nn.Module]:
    """A transformers model class by name, or one of moekit's own (see NATIVE_MODULES) for `folder`."""
    native = None if folder is None else _native_module(folder)
    cls = getattr(transformers, name, None) or getattr(native, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"model class {name!r} is not a transformers or moekit model class "
                              "(custom code is not loaded)")
    return cls


def read_meta(folder: str | Path, file: str = "moekit.json", fmt: str = FORMAT, kind: str = "moekit") -> dict:
    """The checkpoint's metadata file, checked for its format (moekit.json here; simoe.json for SIMoE)."""
    f = Path(folder) / file
    if not f.is_file():
        raise CheckpointError(f"{folder} is not a {kind} checkpoint (no {file})")
    meta = json.loads(f.read_text())
    if meta.get("format") != fmt:
        raise CheckpointError(f"{folder}: unsupported {kind} checkpoint format {meta.get('format')!r} (expected {fmt})")
    return meta


def load_state(model: nn.Module, folder: Path, meta: dict) -> None:
    """Load a checkpoint's weights (aliases restored) into a model of the same layout."""
    tensors = load_weights(folder)
    tensors.update({alias: tensors[key] for alias, key in meta["aliases"].items()})
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{folder}: weights do not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")


def load(folder: str | Path) -> nn.Module:
    """Load a moekit checkpoint; outputs are bit-identical to the saved model's."""
    folder = Path(folder)
    meta = read_meta(folder)
    cls = model_class(meta["architecture"], folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    with no_init_weights():  # _from_config builds in config.dtype (e.g. bf16), as from_pretrained does
        model = cls._from_config(config)
    routers = {}
    for e in meta["layers"]:
        moe = from_layout(e["layout"], router=routers.get(e["router_of"]))
        routers.setdefault(e["path"], moe.router)
        moe.slot = {k: e[k] for k in ("stack", "index", "adapter")}
        slot_at(model, e["stack"], e["index"], e["adapter"]).install(moe)
    load_state(model, folder, meta)
    model.tie_weights()
    load_generation_config(model, folder)
    if meta["spec"] is not None:
        model.moekit_spec = MoESpec.model_validate(meta["spec"])
    return reapply_pruning(model.eval(), folder)


def reapply_pruning(model: nn.Module, folder: str | Path) -> nn.Module:
    """Disable the experts a pruned checkpoint lists in pruned_experts.json (moekit.select.prune): its
    routing hooks are not in the weights, and losing them silently would re-enable the experts."""
    from moekit.select.prune import reapply

    return reapply(model, folder)


def load_dense(path: str | Path, allow_pickle: bool = False, trust_remote_code: bool = False,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a dense HF model from a local directory: safetensors only unless `allow_pickle`."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a Hugging Face model directory (no config.json)")
    has_st = any(path.glob("*.safetensors"))
    if not has_st and not allow_pickle:
        found = ", ".join(sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}))
        raise CheckpointError(f"{path} has no safetensors weights{f' (found {found})' if found else ''}; pickle "
                              "checkpoints can run arbitrary code: pass --allow-pickle only if you trust them")
    _native_module(path)
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = model_class(arch, path) if arch and not trust_remote_code else transformers.AutoModel
    model = cls.from_pretrained(path, use_safetensors=has_st, dtype=dtype, trust_remote_code=trust_remote_code)
    return reapply_pruning(model.eval(), path)


def load_model(path: str | Path, allow_pickle: bool = False, trust_remote_code: bool = False) -> nn.Module:
    """A moekit checkpoint (moekit.json), a SIMoE one (simoe.json) or any local HF model directory (e.g.
    transformers' MoE families)."""
    if (Path(path) / "simoe.json").is_file():
        from moekit.simoe.export import load as load_simoe

        return load_simoe(path)
    return load(path) if (Path(path) / "moekit.json").is_file() else load_dense(path, allow_pickle, trust_remote_code)
