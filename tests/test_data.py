import json

import pytest
import torch

from moekit.assets import Verse
from moekit.config import validate
from moekit.data import parallel
from moekit.data.parallel import DataConfig, Pair, TranslationCollator, encode_pair, load_pairs, prompt_of
from moekit.errors import ConfigError
from moekit.testing import tiny_tokenizer


@pytest.fixture
def fake_bible(monkeypatch):
    """40 aligned verses per translation; Swahili lacks verse 7 and has an empty verse 9."""
    def verses(code, books=None, log=None):
        out = [Verse(1, 1, v, f"{code} verse {v}") for v in range(1, 41)]
        if code == parallel.BIBLE_CODE["sw"]:
            out = [Verse(1, 1, v, "" if v == 9 else t) for (_, _, v, t) in out if v != 7]
        return out

    monkeypatch.setattr("moekit.assets.bible_verses", verses)


def test_bible_split_is_aligned_and_disjoint(fake_bible):
    cfg = DataConfig(directions=["fr", "sw"], train_per_direction=10, test_per_direction=5)
    train, test = load_pairs(cfg)
    ids = {lang: {p.id for p in pairs} for lang, pairs in test.items()}
    assert ids["fr"] == ids["sw"] and len(ids["fr"]) == 5  # identical content across directions
    assert not ids["fr"] & {p.id for p in train}  # held out
    assert "1:1:7" not in {p.id for p in train} | ids["fr"] and "1:1:9" not in {p.id for p in train}
    assert len(train) == 20 and {p.tgt_lang for p in train} == {"fr", "sw"}
    assert [p.tgt_lang for p in train] != sorted(p.tgt_lang for p in train)  # directions shuffled together
    assert load_pairs(cfg) == (train, test)  # deterministic under the seed


def test_jsonl_source_and_errors(tmp_path):
    rows = [{"src": f"s{i}", "tgt": f"t{i}", "tgt_lang": "fr" if i % 2 else "de"} for i in range(6)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(source="jsonl", directions=["fr"], train_files=[str(tmp_path / "a.jsonl")],
                     test_files=[str(tmp_path / "a.jsonl")], test_per_direction=2)
    train, test = load_pairs(cfg)
    assert {p.tgt_lang for p in train} == {"fr"} and len(train) == 3 and len(test["fr"]) == 2
    (tmp_path / "bad.jsonl").write_text('{"src": "x"}\n')
    bad = cfg.model_copy(update={"train_files": [str(tmp_path / "bad.jsonl")]})
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_pairs(bad)
    with pytest.raises(ConfigError, match="unknown target languages"):
        validate(DataConfig, {"directions": ["xx"]})
    with pytest.raises(ConfigError, match="template must contain"):
        validate(DataConfig, {"template": "no placeholders"})


def test_labels_score_only_the_target_and_eos():
    tok = tiny_tokenizer()
    pair = Pair("hello world", "bonjour", "fr")
    e = encode_pair(pair, tok, parallel.DEFAULT_TEMPLATE, 200)
    n_prompt = len(tok(prompt_of(pair, parallel.DEFAULT_TEMPLATE), add_special_tokens=False)["input_ids"])
    assert e["labels"][:n_prompt] == [-100] * n_prompt
    assert e["labels"][n_prompt:] == e["input_ids"][n_prompt:] and e["input_ids"][-1] == tok.eos_token_id
    assert tok.decode(e["input_ids"][n_prompt:-1]) == " bonjour"


def test_collator_pads_with_mask_and_ignored_labels():
    batch = TranslationCollator(pad_id=0)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                                           {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["input_ids"].dtype == torch.long
