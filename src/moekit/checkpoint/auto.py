"""The moekit format in transformers' Auto classes.

A moekit checkpoint's config.json names model type `moekit` (moekit.checkpoint.wrapped), which transformers alone
refuses. With moekit imported, the Auto classes know that type: `AutoModelForCausalLM.from_pretrained(dir)` (or AutoModel,
AutoModelForSpeechSeq2Seq, ...) returns `moekit.load(dir)`, the MoE model. moekit/__init__ registers the
classes as soon as transformers' auto modules are imported (moekit._auto), so `import moekit` stays light.
"""
from __future__ import annotations

import sys

from moekit.checkpoint.wrapped import MODEL_TYPE, MoekitConfig


class MoekitModel:
    """What the Auto classes map a moekit config to (they need only `config_class` and `from_pretrained`):
    `from_pretrained` returns the checkpoint loaded by moekit (the base model's class with its MoE or SIMoE layers) from a directory or
    a Hub repository id (at `revision`; moekit.checkpoint.hub.resolve_hub: the Hugging Face cache, HF_HUB_OFFLINE, the
    environment's token), cast to `dtype` and moved to `device_map` if given."""

    config_class = MoekitConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from pathlib import Path

        from moekit.checkpoint.hub import resolve_hub
        from moekit.checkpoint.format import load_model

        path, revision = Path(pretrained_model_name_or_path), kwargs.get("revision")
        if not path.is_dir():  # AutoConfig found its config.json on the Hub
            path = resolve_hub(f"{pretrained_model_name_or_path}@{revision}" if revision else str(path))
        model = load_model(path)  # moekit.json or a state codec's own format decides
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
