import csv
import importlib.util
import json
import sys

import pytest
import torch
import transformers as tf
from sacrebleu.metrics import BLEU, CHRF
from tokenizers import Tokenizer, models, pre_tokenizers

from moekit.data.parallel import DEFAULT_TEMPLATE, Pair, TranslationCollator
from moekit.errors import CheckpointError, ConfigError
from moekit.cli.tables import results_table
from moekit.eval.translation import (CSV_COLUMNS, DenseReference, bleu_chrf, bleu_tokenizer, direction_loss, encode_pairs,
                                     evaluate_run, result_rows, translate, write_results)
from moekit.eval.usage import model_usage
from moekit.eval.upcycling import kl_dense_moe
from moekit.moe.layer import moe_layers
from moekit.moe.spec import MoESpec
from moekit.eval.plots import plot_curves, plot_usage
from moekit.testing import tiny_llama
from moekit.checkpoint.upcycle_model import upcycle

WORDS = ("Translate from English to French German . : in the beginning God created heaven and earth light was good "
         "au commencement Dieu créa le ciel et la terre lumière était bonne im Anfang schuf Gott Himmel die Erde "
         "Licht war gut").split()
VOCAB = ["[PAD]", "[UNK]", "</s>", *dict.fromkeys(WORDS)]  # ids: pad 0, eos 2 (LlamaConfig's eos_token_id)
PAIRS = {"fr": [Pair("in the beginning God created the heaven and the earth", "au commencement Dieu créa le ciel",
                     "fr"),
                Pair("the light was good", "la lumière était bonne", "fr"),
                Pair("God created light", "Dieu créa la lumière", "fr")],
         "de": [Pair("in the beginning God created the earth", "im Anfang schuf Gott die Erde", "de"),
                Pair("the light was good", "Licht war gut", "de")]}
PNG = b"\x89PNG\r\n\x1a\n"


def assert_usage_close(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k] == pytest.approx(b[k]), k


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>")


@pytest.fixture(scope="module")
def dense():
    return tiny_llama(vocab_size=len(VOCAB))


@pytest.fixture(scope="module")
def moe():
    spec = MoESpec(num_experts=4, top_k=2, init={"method": "noise", "std": 1.0, "ratio": 1.0},
                   router={"init": "normal"})
    return upcycle(tiny_llama(vocab_size=len(VOCAB)), spec)


@pytest.fixture(scope="module")
def examples(tokenizer):
    return encode_pairs(PAIRS["fr"] + PAIRS["de"], tokenizer, DEFAULT_TEMPLATE, max_length=64)


def test_translate_is_greedy_deterministic_and_batch_invariant(dense, tokenizer):
    pairs = PAIRS["fr"] + PAIRS["de"]
    dense.train()
    hyps = translate(dense, tokenizer, pairs, DEFAULT_TEMPLATE, max_new_tokens=6, batch_size=5)
    assert dense.training  # eval mode only while translating
    dense.eval()
    assert len(hyps) == len(pairs) and all(isinstance(h, str) and "\n" not in h for h in hyps)
    assert any(hyps)
    assert translate(dense, tokenizer, pairs, DEFAULT_TEMPLATE, max_new_tokens=6, batch_size=5) == hyps
    # left padding: a prompt decodes the same alone as in a padded batch
    assert translate(dense, tokenizer, pairs, DEFAULT_TEMPLATE, max_new_tokens=6, batch_size=1) == hyps


def test_translate_needs_eos(dense, tokenizer):
    no_eos = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    with pytest.raises(ConfigError, match="eos"):
        translate(dense, no_eos, PAIRS["fr"], DEFAULT_TEMPLATE)


def test_bleu_chrf():
    refs = ["the cat sat on the mat .", "God created the heaven and the earth"]
    assert bleu_chrf(refs, refs) == pytest.approx((100.0, 100.0))
    hyps = ["the cat sat on a mat", "God made heaven and earth"]
    bleu, chrf = bleu_chrf(hyps, refs, "fr")
    assert bleu == BLEU(tokenize="13a").corpus_score(hyps, [refs]).score
    assert chrf == CHRF().corpus_score(hyps, [refs]).score
    assert 0 < bleu < 100 and 0 < chrf < 100
    assert bleu_tokenizer("zh") == "zh" and bleu_tokenizer("de") == "13a"
    with pytest.raises(ConfigError):
        bleu_chrf(hyps, refs[:1])


@pytest.mark.skipif(importlib.util.find_spec("MeCab") is not None, reason="sacrebleu[ja] is installed")
def test_bleu_tokenizer_missing_mecab_is_a_config_error():
    with pytest.raises(ConfigError, match=r"moekit\[cjk\]"):
        bleu_chrf(["a"], ["a"], "ja")


def test_direction_loss_is_mean_target_token_nll(dense, tokenizer):
    nll, n = 0.0, 0
    for ex in encode_pairs(PAIRS["fr"], tokenizer, DEFAULT_TEMPLATE, max_length=64):
        ids, labels = torch.tensor([ex["input_ids"]]), torch.tensor(ex["labels"])
        with torch.no_grad():
            logp = dense(input_ids=ids).logits[0].log_softmax(-1)  # (L, V)
        for t in range(len(labels) - 1):
            if labels[t + 1] != -100:
                nll, n = nll - float(logp[t, labels[t + 1]]), n + 1
    got = direction_loss(dense, tokenizer, PAIRS["fr"], DEFAULT_TEMPLATE, max_length=64, batch_size=2)
    assert got == pytest.approx(nll / n, rel=1e-5)


def test_dense_reference(dense, examples, tmp_path):
    ref = DenseReference.compute(dense, examples, batch_size=2)
    n_scored = sum(sum(t != -100 for t in ex["labels"][1:]) for ex in examples)
    assert ref.logprobs.shape == (n_scored, len(VOCAB)) and ref.logprobs.dtype == torch.float16
    assert ref.nbytes == n_scored * len(VOCAB) * 2
    assert 0.0 <= ref.kl(dense) < 1e-3

    other = tiny_llama(seed=1, vocab_size=len(VOCAB))
    batch = TranslationCollator(pad_id=0)(examples)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = float(kl_dense_moe(dense(**inputs).logits, other(**inputs).logits, batch["labels"]))
    got = ref.kl(other, batch_size=3)
    assert expected > 0.01 and got == pytest.approx(expected, rel=1e-3)

    ref.save(tmp_path)
    loaded = DenseReference.load(tmp_path)
    assert loaded.examples == examples and torch.equal(loaded.logprobs, ref.logprobs)
    assert loaded.kl(other) == pytest.approx(got, rel=1e-6)
    with pytest.raises(CheckpointError):
        DenseReference.load(tmp_path / "missing")


def test_expert_usage_sums_to_one_and_ignores_padding(moe, examples):
    collate = TranslationCollator(pad_id=0)
    padded = model_usage(moe, [collate(examples[:2])])
    assert list(padded) == [p for p, _ in moe_layers(moe)]
    for v in padded.values():
        assert len(v) == 4 and sum(v) == pytest.approx(1.0)
    # the same tokens without padding (one example per batch) route identically
    unpadded = model_usage(moe, [collate([ex]) for ex in examples[:2]])
    assert_usage_close(padded, unpadded)
    garbage = collate(examples[:2])
    garbage["input_ids"][garbage["attention_mask"] == 0] = 5  # what padding holds must not matter
    assert_usage_close(model_usage(moe, [garbage]), padded)
    assert model_usage(tiny_llama(), [collate(examples[:1])]) == {}


def test_evaluate_run_and_results_round_trip(moe, dense, tokenizer, examples, tmp_path):
    ref = DenseReference.compute(dense, examples)
    res = evaluate_run(moe, tokenizer, PAIRS, DEFAULT_TEMPLATE, dense_ref=ref, max_length=64, max_new_tokens=4)
    assert set(res["directions"]) == {"fr", "de"} and res["directions"]["fr"]["n"] == 3
    assert res["avg"]["bleu"] == pytest.approx((res["directions"]["fr"]["bleu"] + res["directions"]["de"]["bleu"]) / 2)
    assert res["directions"]["de"]["loss"] == pytest.approx(
        direction_loss(moe, tokenizer, PAIRS["de"], DEFAULT_TEMPLATE, max_length=64))
    assert res["kl"] == pytest.approx(ref.kl(moe)) and res["kl"] > 1e-5 and 0 < res["diversity"] < 1
    assert res["params"]["active"] < res["params"]["total"]
    assert [len(res["translations"][d]) for d in ("fr", "de")] == [3, 2]
    for usage in (res["usage"], *res["usage_by_direction"].values()):
        assert all(sum(v) == pytest.approx(1.0) for v in usage.values())

    json_path, csv_path = write_results(res, tmp_path)
    assert json.loads(json_path.read_text()) == res
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["direction"] for r in rows] == ["fr", "de", "avg"] and tuple(rows[0]) == CSV_COLUMNS
    expected = result_rows(res)
    for got, exp in zip(rows, expected):
        assert {k: v for k, v in got.items() if v != ""} == {k: str(v) for k, v in exp.items() if v is not None}
    assert float(rows[2]["kl"]) == res["kl"] and rows[0]["kl"] == ""
    table = results_table(expected)
    assert table.row_count == 3 and "bleu" in [c.header for c in table.columns]


def test_evaluate_run_without_generation_on_a_dense_model(dense, tokenizer):
    res = evaluate_run(dense, tokenizer, PAIRS, DEFAULT_TEMPLATE, max_length=64, generate=False)
    assert set(res["avg"]) == {"loss"} and res["kl"] is None and res["diversity"] is None
    assert res["usage"] == {} and res["translations"] == {}
    assert [c.header for c in results_table(result_rows(res)).columns] == [
        "direction", "n", "loss", "total_params", "active_params"]
    with pytest.raises(ConfigError, match="no test pairs"):
        evaluate_run(dense, tokenizer, {"fr": []}, DEFAULT_TEMPLATE, generate=False)


def test_plots_write_pngs_and_show_nothing(tmp_path, monkeypatch):
    history = [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 20, "eval_loss": 2.7, "eval_kl": 0.1},
               {"step": 30, "loss": 2.2}, {"step": 40, "eval_loss": 2.4, "eval_fr_loss": 2.3, "eval_kl": 0.2},
               {"step": 40, "train_runtime": 1.0}]
    paths = plot_curves(history, tmp_path / "plots")
    assert [p.name for p in paths] == ["loss.png", "kl.png"]
    assert plot_curves([{"step": 1, "loss": 1.0}], tmp_path / "only_loss") == [tmp_path / "only_loss" / "loss.png"]
    usage = {"model.layers.1.mlp": [0.4, 0.3, 0.2, 0.1], "model.layers.3.mlp": [0.25] * 4}
    paths.append(plot_usage(usage, tmp_path / "usage" / "usage.png"))
    for p in paths:
        assert p.read_bytes().startswith(PNG)
    assert "matplotlib.pyplot" not in sys.modules or not sys.modules["matplotlib.pyplot"].get_fignums()
    with pytest.raises(ConfigError):
        plot_usage({}, tmp_path / "none.png")


def test_model_fields_of_translation_and_speech_llm_results(moe):
    """The run-level fields both evaluations report (moekit.eval.translation.model_fields, used by evaluate_run and
    moekit.eval.s2tt.evaluate_speech_llm): usage summed over directions then normalized, per direction normalized."""
    from moekit.eval.translation import model_fields
    from moekit.routing.sites import param_counts

    layer = moe_layers(moe)[0][0]
    counts = {"fr": {layer: torch.tensor([1, 3, 0, 0])}, "de": {layer: torch.tensor([3, 1, 2, 2])}}
    fields = model_fields(moe, counts, {"fr": "13a", "de": "13a"})
    total, active = param_counts(moe)
    assert fields == {"diversity_init": fields["diversity_init"], "diversity": fields["diversity"],
                      "usage": {layer: [4 / 12, 4 / 12, 2 / 12, 2 / 12]},
                      "usage_by_direction": {"fr": {layer: [0.25, 0.75, 0.0, 0.0]},
                                             "de": {layer: [3 / 8, 1 / 8, 2 / 8, 2 / 8]}},
                      "params": {"total": total, "active": active}, "bleu_tokenize": {"fr": "13a", "de": "13a"}}
    assert 0 < fields["diversity"] < 1
