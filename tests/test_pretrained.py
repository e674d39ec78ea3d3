"""Issue 40 §3: an upcycled model behaves like a transformers model. `AutoModelForCausalLM.from_pretrained` loads a
moekit checkpoint from a directory or from the Hub, `save_pretrained` round-trips it, and `push_to_hub` (tested against
the fake Hub on 127.0.0.1) uploads moekit's format with moekit's model card: every path gives the same logits, bit for
bit."""
import pytest
import torch
import transformers as tf
from huggingface_hub import ModelCard, constants

import moekit
from moekit.testing import logits, tiny_inputs, tiny_llama
from moekit.testing.fake_hub import fake_hub


@pytest.fixture
def moe():
    spec = moekit.MoESpec(num_experts=4, top_k=2, every=2, shared_expert=True, init={"method": "spri"})
    return moekit.upcycle(tiny_llama(), spec).eval()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hub on 127.0.0.1 that takes pushes, and an empty Hugging Face cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with fake_hub({}, uploads=tmp_path / "uploads") as endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # both read from HF_ENDPOINT at import
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        yield tmp_path / "uploads"


def test_save_pretrained_then_auto_from_pretrained_gives_the_same_logits(moe, tmp_path):
    x = tiny_inputs(moe)
    moe.save_pretrained(tmp_path / "moe")
    auto = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert torch.equal(logits(auto, x), logits(moe, x))
    auto.save_pretrained(tmp_path / "again")  # the loaded model saves as moekit too, and round-trips
    assert (tmp_path / "again" / "moekit.json").is_file()
    assert torch.equal(logits(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "again"), x), logits(moe, x))
    assert torch.equal(logits(moekit.load(tmp_path / "again"), x), logits(moe, x))


def test_push_to_hub_then_from_pretrained_from_the_hub_gives_the_same_logits(moe, hub):
    x = tiny_inputs(moe)
    commit = moe.push_to_hub("org/tiny-moe")
    assert commit.oid and (hub / "org/tiny-moe" / "moekit.json").is_file()
    card = ModelCard.load(hub / "org/tiny-moe" / "README.md")  # moekit's card, not transformers' template
    assert card.data.library_name == "moekit" and "moe" in card.data.tags
    auto = tf.AutoModelForCausalLM.from_pretrained("org/tiny-moe")
    assert torch.equal(logits(auto, x), logits(moe, x))
    assert moekit.moe_layers(auto) and type(auto).__name__ == "LlamaForCausalLM"
