"""The training-method registry: recipe validation, the Trainer and `moekit evaluate` ask it (no branching)."""
import pytest
import torch

from moekit.config import validate
from moekit.errors import ConfigError
from moekit.methods import METHODS, TrainingMethod, method, method_for
from moekit.moe.spec import MoESpec
from moekit.simoe.model import SIMoEConfig, simoe_upcycle
from moekit.testing import tiny_llama
from moekit.training.recipe import ASRRecipe, LoraConfig, TranslationRecipe
from moekit.checkpoint.upcycle_model import upcycle

SECTIONS = {"moe": MoESpec(num_experts=2, top_k=1), "lora": LoraConfig(), "simoe": SIMoEConfig()}


def test_every_method_is_registered_with_its_section():
    assert METHODS.names() == ["dense", "lora", "moe", "simoe"]
    assert {n: METHODS.get(n).section for n in METHODS.names()} == {"dense": None, "lora": "lora", "moe": "moe",
                                                                     "simoe": "simoe"}


@pytest.mark.parametrize("name", ["dense", "lora", "moe", "simoe"])
def test_a_recipe_takes_exactly_its_methods_section(name):
    section = METHODS.get(name).section
    own = {section: SECTIONS[section]} if section else {}
    assert validate(TranslationRecipe, {"method": name, **own}).method == name
    if section:
        with pytest.raises(ConfigError, match=f"method={name} needs a `{section}` section"):
            validate(TranslationRecipe, {"method": name})
    for other, cfg in SECTIONS.items():
        if other != section:
            with pytest.raises(ConfigError, match=f"only method={other} takes one"):
                validate(TranslationRecipe, {"method": name, **own, other: cfg})


def test_unknown_method_and_task_mismatch_are_one_error():
    with pytest.raises(ConfigError, match="unknown method 'adapterx'; choose one of: dense, lora, moe, simoe"):
        validate(TranslationRecipe, {"method": "adapterx"})
    with pytest.raises(ConfigError, match="method=lora does not train task=asr"):
        validate(ASRRecipe, {"model": {"kind": "ctc", "ctc": {}}, "method": "lora", "lora": {}})


def test_a_new_method_needs_only_its_registration(monkeypatch):
    class Frozen(TrainingMethod):
        name = "frozen_embeddings"

    monkeypatch.setitem(METHODS._items, Frozen.name, Frozen)
    assert validate(TranslationRecipe, {"method": Frozen.name}).method == Frozen.name
    with pytest.raises(ConfigError, match="applies to MoE models"):
        validate(TranslationRecipe, {"method": Frozen.name, "freeze": {"schedule": "ume"}})


@pytest.mark.parametrize("method", ["lora", "simoe"])
def test_freeze_frozen_is_refused_where_training_would_ignore_it(method):
    """freeze.frozen is honoured by the moe and dense methods' FreezeCallback only; elsewhere it is refused."""
    section = {"lora": {"lora": {}}, "simoe": {"simoe": {}}}[method]
    with pytest.raises(ConfigError, match=f"freeze.frozen applies to method=moe or method=dense, not method={method}"):
        validate(TranslationRecipe, {"method": method, **section, "freeze": {"frozen": ["model.embed_tokens"]}})
    assert validate(TranslationRecipe, {"method": "dense", "freeze": {"frozen": ["model.embed_tokens"]}}).freeze.frozen


def test_method_for_reads_the_model_state():
    torch.manual_seed(0)
    assert method_for(tiny_llama()).name == "dense"
    assert method_for(upcycle(tiny_llama(), MoESpec(num_experts=2, top_k=1))).name == "moe"
    assert method_for(simoe_upcycle(tiny_llama(), SIMoEConfig())).name == "simoe"
    assert type(method("moe")) is METHODS.get("moe")
