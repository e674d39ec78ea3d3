"""Dense (and any transformers) checkpoints as moekit reads them, and the policy for reading them: safetensors only
unless pickles are allowed, a model's own Python code only with trust_remote_code (never a prompt on stdin), every
file inside the directory (moekit.checkpoint.files), weights checked finite; the model's config and tokenizer; its
architecture built on the meta device (shapes without memory) for checks and streaming."""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
from importlib.metadata import entry_points
from pathlib import Path

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.initialization import meta_device_safe_creation_ops, no_init_weights

from moekit.checkpoint.codecs import read_state
from moekit.checkpoint.files import ShardReader, check_dir, quantization, read_headers, read_text, refuse_adapter
from moekit.errors import CheckpointError, NumericsError

REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


# moekit's own architectures (transformers PreTrainedModels that transformers does not ship): entry points of this
# group map a config model_type to the module that defines it and registers its config with AutoConfig
MODEL_TYPES = "moekit.model_types"


def _config_json(folder: Path) -> dict:
    """config.json as a dict ({} if unreadable: the loaders report that)."""
    try:
        data = json.loads(read_text(folder, "config.json", "config"))
    except (CheckpointError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _native_module(folder: Path):
    """Import (and so register) the moekit module of `folder`'s model type (for a moekit checkpoint: its base
    model's), if it is one of ours (an entry point of MODEL_TYPES)."""
    data = _config_json(folder)
    kind = data.get("base_model_type") or data.get("model_type")
    found = [ep for ep in entry_points(group=MODEL_TYPES) if ep.name == kind]
    return found[0].load() if found else None


def declared_architecture(folder: Path) -> str:
    """The model class the directory's config.json names (its model_type where it names none)."""
    data = _config_json(folder)
    names = data.get("architectures")
    ok = isinstance(names, list) and names and isinstance(names[0], str)
    return names[0] if ok else str(data.get("model_type"))


def model_class(name: str, folder: Path | None = None) -> type[nn.Module]:
    """A transformers model class by name, or one of moekit's own (see MODEL_TYPES) for `folder`."""
    native = None if folder is None else _native_module(folder)
    cls = getattr(transformers, name, None) or getattr(native, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"model class {name!r} is not a transformers or moekit model class "
                              "(custom code is not loaded)")
    return cls


# what a config.json of wrong values raises inside transformers' config and model code, besides its own checks
CONFIG_FAULTS = (ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError, OverflowError)


def load_config(folder: Path, trust_remote_code: bool = False):
    """The directory's transformers config (for a moekit checkpoint, its base model's, named after the checkpoint
    as transformers names a config after where it was loaded from); remote code only with `trust_remote_code` (never
    a prompt)."""
    from moekit.checkpoint.wrapped import MODEL_TYPE, base_config

    check_dir(folder)
    check_remote_code(folder, trust_remote_code)
    _native_module(folder)
    data = _config_json(folder)
    check_layer_counts(folder, data)  # against the weights' layer indices; without safetensors, a fixed limit:
    check_layer_limit(data, f"{folder}/config.json")
    try:
        if data.get("model_type") == MODEL_TYPE:
            config = base_config(data)
            config.name_or_path = str(folder)  # its card names the base model (moekit.checkpoint.card.hub_id)
        else:
            config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, RecursionError, StrictDataclassError, *CONFIG_FAULTS) as e:
        # transformers 5 checks its config fields' types (huggingface_hub's strict dataclasses) and looks a dtype
        # name up on torch: a field of the wrong type is one of these, not a bug; a config class's own checks divide
        # by its sizes (num_attention_heads 0) and index its fields (a list where a dtype name belongs)
        raise CheckpointError(f"{folder}/config.json does not load: {' '.join(str(e).split())[:500]}") from None
    arch = getattr(config, "architectures", None)
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise CheckpointError(f"{folder}/config.json: architectures must be a list of class names, got {arch!r:.100}")
    if quantization(folder) is not None:  # the float model moekit reads it as (moekit.checkpoint.quantized)
        del config.quantization_config
    return config


MAX_LAYERS = 10_000  # no published model has more; building 2**64 layers (even on the meta device) never ends
LAYER_COUNT = re.compile(r"(^|_)(n_)?layers?$")  # num_hidden_layers, encoder_layers, n_layer, num_layers


def check_layer_limit(data: dict, source: str, at: str = "") -> None:
    """Refuse a layer count (of the config or a sub-config such as text_config) above MAX_LAYERS, whatever the
    weights (check_layer_counts compares the counts with the weights where there are safetensors)."""
    for key, value in data.items():
        if isinstance(value, dict):
            check_layer_limit(value, source, f"{at}{key}.")
        elif isinstance(key, str) and LAYER_COUNT.search(key) and isinstance(value, int) and value > MAX_LAYERS:
            raise CheckpointError(f"{source}: {at}{key} is {value}, more layers than any model has "
                                  f"(at most {MAX_LAYERS:,} are accepted)")


LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                "num_layers_per_stack")
# a count of layer slots, not of layers, where the config also counts its layers: HRM-Text's num_hidden_layers is
# num_layers_per_stack · H_cycles · (L_cycles + 1), the slots its stacks' layers fill as they cycle (its cache's)
SLOT_COUNTS = {"num_hidden_layers": "num_layers_per_stack"}


SUB_CONFIG_LAYERS = 512  # a count a sub-config may claim beyond the weights: built in seconds on the meta device


def check_layer_counts(folder: Path, data: dict) -> None:
    """Refuse a config.json claiming more layers than its safetensors weights hold (a count above 1 + the largest
    layer index, the first number in a tensor's name) before transformers builds them: building 200,000 layers,
    even on the meta device, takes minutes. Counts are read at the top level and in sub-configs (text_config); a
    sub-config may describe a part whose weights another checkpoint holds (MoshiForCausalLM's audio_encoder_config:
    the Mimi codec is not in its weights), and a count of layer slots (SLOT_COUNTS) is not one of layers, so those are
    refused only above SUB_CONFIG_LAYERS."""
    claims = [(f"{k}.{c}" if k else c, v, bool(k) or isinstance(d.get(SLOT_COUNTS.get(c, "")), int))
              for k, d in [("", data), *data.items()] if isinstance(d, dict)
              for c in LAYER_COUNTS if isinstance(v := d.get(c), int) and not isinstance(v, bool)]
    if not claims or not has_safetensors(folder, allow_pickle=True):
        return
    firsts = [next((int(p) for p in name.split(".") if p.isascii() and p.isdigit() and len(p) < 19), None)
              for name in read_headers(folder)]
    top = max((i for i in firsts if i is not None), default=None)
    for key, count, lenient in claims:
        if top is not None and count > top + 1 and (not lenient or count > SUB_CONFIG_LAYERS):
            raise CheckpointError(f"{folder}/config.json: {key} is {count}, but no tensor of its weights has a layer "
                                  f"index above {top}")


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


def load_generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)


def architecture(model: nn.Module) -> str:
    """The model's class name; FSDP2's fully_shard swaps a model's class for a subclass FSDP<name>."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def load_dense(path: str | Path, allow_pickle: bool = False, trust_remote_code: bool = False,
               dtype: torch.dtype = torch.float32, allow_nonfinite: bool = False) -> nn.Module:
    """Load a dense HF model from a local directory: safetensors only unless `allow_pickle`, custom code only
    with `trust_remote_code`, shard files validated first, weights checked finite unless `allow_nonfinite`."""
    path = check_dense_dir(path)
    has_st = has_safetensors(path, allow_pickle)
    config = load_config(path, trust_remote_code)
    if quantization(path) is not None or (has_st and getattr(config.get_text_config(), "zero_expert_num", None)):
        model = _load_own(path, dtype, trust_remote_code)
    else:
        model = _from_pretrained(path, config, has_st, dtype, trust_remote_code)
    if not allow_nonfinite:
        check_finite(model.named_parameters(), str(path))
    return read_state(model.eval(), path)


def _from_pretrained(path: Path, config, has_st: bool, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    if has_st:  # shard names, headers, coverage, shapes and size checked before transformers opens anything
        check_stored_shapes(path, meta_model(path, trust_remote_code))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = model_class(arch, path) if arch and not trust_remote_code else transformers.AutoModel
    try:
        return cls.from_pretrained(path, use_safetensors=has_st, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} does not load: {' '.join(str(e).split())[:500]}") from None


def _load_own(path: Path, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The model read by moekit's reader and loaded with transformers' own renaming and fusing
    (moekit.checkpoint.layerwise.LayerStream): the float model of a quantized checkpoint (its config has no
    quantization_config: load_config), and LongCat-Flash, whose Hub checkpoints hold no rows for the zero-computation
    experts that transformers 5.23 gives a row of gate_up_proj (it refuses them as a size mismatch; moekit fills
    them with zeros, never read: layerwise.zero_rows)."""
    from moekit.checkpoint.layerwise import LayerStream

    model = streamable_model(path, dtype, trust_remote_code)
    with LayerStream(path, model) as stream:
        stream.load("")
    model.tie_weights()
    load_generation_config(model, path)
    return model


def check_dense_dir(path: str | Path) -> Path:
    """A HF model directory that is not one of moekit's MoE formats (those have their own commands)."""
    path = Path(path)
    if path.is_dir():
        check_dir(path)
        refuse_adapter(path)
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
    cls = model_class(arch, path) if arch and not trust_remote_code else None
    try:
        with torch.device("meta"), meta_device_safe_creation_ops(), no_init_weights():
            if cls is not None:
                model = cls._from_config(config)
            else:
                model = transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
        if buffers:
            _real_buffers(model)
    except (RuntimeError, AssertionError, *CONFIG_FAULTS) as e:
        # sizes, names and kinds in config.json that the model's code cannot build with (negative or overflowing
        # sizes, a rope theta beyond int64, an unknown activation or rope type)
        raise CheckpointError(f"{path}/config.json describes no model that can be built: "
                              f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    model.tie_weights()  # tied embeddings are one tensor, as in the checkpoint
    return model


def _real_buffers(model: nn.Module) -> None:
    """Give a model built on the meta device real buffers, with the values transformers' from_pretrained gives them
    (which builds on the meta device too): each buffer allocated on the CPU, then the family's own weight
    initialization (`initialize_weights`), which computes buffers such as rotary frequencies and leaves the
    parameters on the meta device. A parameter is never allocated (DeepSeek-V3's fused experts are 30 GB in
    float32: building them before moving them to the meta device, as accelerate's init_empty_weights does, fails)."""
    for name, buf in list(model.named_buffers()):
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf, torch.empty_like(buf, device="cpu"))
    model.initialize_weights()


def streamable_model(path: Path, dtype: torch.dtype | None, trust_remote_code: bool = False) -> nn.Module:
    """The model of a dense or transformers MoE directory to fill from its checkpoint a part at a time
    (moekit.checkpoint.layerwise.LayerStream): parameters on the meta device in `dtype` (None: the config's), real
    buffers, its stored shapes checked (a misshapen tensor is named as such before any weight is read)."""
    from moekit.checkpoint.layerwise import in_dtype

    model = meta_model(path, trust_remote_code, buffers=True)
    check_stored_shapes(path, model)
    return in_dtype(model, dtype)


def check_size(model: nn.Module, headers: dict, path: Path) -> None:
    """The model that config.json describes (on the meta device) may not need more than twice the values the shard
    headers hold plus 2**20: a config that declares a model far larger than its files is refused before that memory
    is allocated."""
    need = sum({id(p): p.numel() for p in model.parameters()}.values())
    have = sum(math.prod(info.shape) for info in headers.values())
    if need > 2 * have + 2**20:
        raise CheckpointError(f"{path}/config.json describes a model of {need:,} parameters, but its weights hold "
                              f"{have:,} values: the config does not belong to these weights")


def stored_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the tensors a checkpoint of `model` (built from its config on the meta device) may hold: the
    model's own names (transformers 5's fused experts) and the names transformers saves it under
    (revert_weight_conversion, as save_pretrained: the Hub's per-expert tensors). Shapes come from the family's own
    model class, so this holds for every family transformers converts."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    own = model.state_dict()
    saved = revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(own), model))
    return {k: tuple(v.shape) for k, v in (own | saved).items()}


def check_stored_shapes(folder: Path, model: nn.Module) -> None:
    """Every safetensors tensor of `folder` that `model` (its config's model on the meta device) names has the shape
    the config gives it, and the config declares no model far larger than the weights (check_size), before any
    weight is read: a header with a transposed shape of the same byte count is refused (transformers would report the
    tensor missing, or a copy would carry the wrong shape on), and so is a config with more experts than its weights.
    The model's own names come first (a router's or fused experts' shape is the telling line), the size next, and the
    names transformers saves under last (one per expert: as many as the config declares, so only once it fits).
    A quantized checkpoint's weights count as the model holds them (ShardReader's headers: 4-bit values packed 8 to
    a word, MXFP4's 2 to a byte)."""
    with ShardReader(folder) as reader:  # a float checkpoint's headers as they are
        headers = reader.headers
    _compare_shapes(folder, headers, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    check_size(model, headers, folder)
    _compare_shapes(folder, headers, stored_shapes(model))


def _compare_shapes(folder: Path, headers: dict, want: dict[str, tuple[int, ...]]) -> None:
    for name, info in headers.items():
        if name in want and tuple(info.shape) != want[name]:
            raise CheckpointError(f"{folder}: {name} is {list(info.shape)} in the weights but {list(want[name])} by "
                                  "its config.json")


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
