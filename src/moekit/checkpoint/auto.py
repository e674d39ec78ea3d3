"""The moekit format is never misread as a dense model.

A moekit checkpoint's config.json is the base model's config with `model_type: "moekit"` (the base's own
type in `base_model_type`, its architectures in `base_architectures`). Without moekit, transformers refuses it
("unrecognized model type moekit") instead of building the dense model with random MLPs. With moekit
imported, the Auto classes know that type: `AutoModelForCausalLM.from_pretrained(dir)` (or AutoModel,
AutoModelForSpeechSeq2Seq, ...) returns `moekit.load(dir)`, the MoE model. moekit/__init__ registers the
classes as soon as transformers' auto modules are imported (moekit._auto), so `import moekit` stays light.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers.configuration_utils import PretrainedConfig

from moekit.errors import CheckpointError
from moekit.state import model_state

MODEL_TYPE = "moekit"
WRAPPER_KEYS = ("model_type", "base_model_type", "base_architectures", "architectures", "transformers_version")


class MoekitConfig(PretrainedConfig):
    """The config.json of a moekit checkpoint: the base config plus where the base came from."""

    model_type = MODEL_TYPE

    def base(self) -> PretrainedConfig:
        return base_config(self.to_dict())


def wrapped(config: PretrainedConfig) -> dict:
    """The config.json content of a moekit checkpoint whose base model has `config`."""
    base = config.to_dict()
    return {**base, "model_type": MODEL_TYPE, "base_model_type": base["model_type"],
            "base_architectures": base.get("architectures"), "architectures": ["MoekitModel"]}


def base_config(data: dict) -> PretrainedConfig:
    """The base model's config from a config.json dict, wrapped (moekit format) or not."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if data.get("model_type") != MODEL_TYPE:
        return CONFIG_MAPPING[data["model_type"]].from_dict(data)
    kind = data.get("base_model_type")
    if kind not in CONFIG_MAPPING:
        raise CheckpointError(f"config.json names an unknown base model type {kind!r}")
    fields = {k: v for k, v in data.items() if k not in WRAPPER_KEYS}
    return CONFIG_MAPPING[kind].from_dict({**fields, "architectures": data.get("base_architectures")})


def save_config(config: PretrainedConfig, folder: Path) -> None:
    """Write the wrapped config.json of a moekit checkpoint."""
    (folder / "config.json").write_text(json.dumps(wrapped(config), indent=2, sort_keys=True) + "\n")


class MoekitModel:
    """What the Auto classes map a moekit config to (they need only `config_class` and `from_pretrained`): `from_pretrained` returns the checkpoint loaded by moekit
    (the base model's class with its MoE or SIMoE layers), cast to `dtype` and moved to `device_map` if given."""

    config_class = MoekitConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from moekit.io import load_model

        model = load_model(pretrained_model_name_or_path)  # moekit.json or simoe.json decides
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype not in (None, "auto"):
            model = model.to(dtype)
        if isinstance(kwargs.get("device_map"), str) and kwargs["device_map"] != "auto":
            model = model.to(kwargs["device_map"])
        return model


def register_config() -> None:
    """Register MoekitConfig with AutoConfig (idempotent; configuration_auto must be loaded)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        CONFIG_MAPPING.register(MODEL_TYPE, MoekitConfig)


def register() -> None:
    """Register MoekitConfig / MoekitModel with the Auto model classes (idempotent; modeling_auto must be
    loaded: it is read from sys.modules, so this is safe while transformers is still importing)."""
    register_config()
    auto = sys.modules["transformers.models.auto.modeling_auto"]
    for name in ("AutoModel", "AutoModelForCausalLM", "AutoModelForSpeechSeq2Seq", "AutoModelForMaskedLM",
                 "AutoModelForCTC", "AutoModelForSeq2SeqLM"):
        getattr(auto, name).register(MoekitConfig, MoekitModel, exist_ok=True)


_ADOPTED: dict[type, type] = {}


def _save_pretrained(self, save_directory, *args, **kwargs):
    """save_pretrained of an MoE or SIMoE model made by moekit: its own format, which reloads as this model
    (transformers' would reload as the dense model); a non-empty directory is refused, as moekit.save does.
    A model that has neither (e.g. a merged SIMoE model) is saved by transformers."""
    from moekit.moe.layer import moe_layers

    if model_state(self).simoe is not None:
        from moekit.simoe.export import save
    elif moe_layers(self):
        from moekit.io import save
    else:
        return super(type(self), self).save_pretrained(save_directory, *args, **kwargs)
    save(self, save_directory)


def adopt(model):
    """Make `model.save_pretrained` write moekit's format: the model's class becomes a subclass of the same name
    with only that method replaced (so isinstance, type names and copies behave as before). Returns `model`."""
    cls = type(model)
    if cls in _ADOPTED.values():
        return model
    if cls not in _ADOPTED:
        _ADOPTED[cls] = type(cls.__name__, (cls,), {"save_pretrained": _save_pretrained, "__module__": cls.__module__,
                                                     "__doc__": cls.__doc__})
    model.__class__ = _ADOPTED[cls]
    return model
