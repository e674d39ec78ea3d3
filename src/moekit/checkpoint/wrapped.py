"""The config.json of a moekit checkpoint: the base model's config with `model_type: "moekit"` (the base's own type
in `base_model_type`, its architectures in `base_architectures`), so that transformers without moekit refuses it
("unrecognized model type moekit") instead of building the dense model with random MLPs."""
from __future__ import annotations

import json
from pathlib import Path

from transformers.configuration_utils import PretrainedConfig

from moekit.errors import CheckpointError

MODEL_TYPE = "moekit"
WRAPPER_KEYS = ("model_type", "base_model_type", "base_architectures", "architectures", "transformers_version")


class MoekitConfig(PretrainedConfig):
    """The config.json of a moekit checkpoint: the base config plus where the base came from."""

    model_type = MODEL_TYPE

    def base(self) -> PretrainedConfig:
        return base_config(self.to_dict())


def wrapped(config: PretrainedConfig) -> dict:
    """The config.json content of a moekit checkpoint whose base model has `config`, without `_name_or_path`
    (where this machine held the base model: never published; moekit.checkpoint.dense.load_config sets it)."""
    base = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
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
