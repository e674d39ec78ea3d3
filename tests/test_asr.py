"""ASR recipes (moekit.training.asr), data collators and evaluation on a tiny synthesized corpus and tiny models."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moekit.config import validate
from moekit.errors import ConfigError
from moekit.checkpoint.dense import load_dense
from moekit.checkpoint.format import load_model
from moekit.moe import moe_layers
from moekit.speech.corpus import read_manifest
from moekit.speech.data import ASRDataConfig, CTCCollator, WhisperCollator, load_split
from moekit.eval.asr import error_table
from moekit.speech.features import log_mel, stack_frames
from moekit.speech.text import CharVocab, spoken_text
from moekit.speech.tts import load_audio
from moekit.training.recipe import ASRRecipe
from moekit.training.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "asr").glob("*.yaml"))
ids = [p.stem for p in RECIPES]
CTC_TINY = {"model.ctc.hidden_size": 16, "model.ctc.num_layers": 2, "model.ctc.num_heads": 2,
            "model.ctc.intermediate_size": 32}


def tiny_overrides(recipe_path: Path, speech: dict, out: Path, **extra) -> list[str]:
    kind = load_recipe(recipe_path).model.kind
    keys = {"out": str(out), "data.corpus": str(speech["corpus"]), "data.langs": ["en", "fr"],
            "train.steps": 2, "train.batch_size": 2, "train.logging_steps": 1, "train.eval_every": 1,
            "train.save_every": 0, "eval.batch_size": 2, "eval.max_new_tokens": 4, "eval.loss_per_lang": 2,
            "eval.routing_batches": 1, **{"whisper": {"model.path": str(speech["whisper"])},
                                          "pretrained_ctc": {"model.path": str(speech["wav2vec2"])}}.get(kind, CTC_TINY),
            **extra}
    return [f"{k}={json.dumps(v)}" for k, v in keys.items()]


def test_asr_recipes_exist():
    assert {"ume_whisper_tiny", "ume_whisper_tiny_nofreeze", "ume_whisper_tiny_nobalance", "fmft_whisper_tiny",
            "omni_ctc", "switch_ctc", "dense_ctc", "ume_wav2vec2"} <= set(ids)


@pytest.mark.parametrize("path", RECIPES, ids=ids)
def test_asr_recipe_validates(path, run):
    recipe = load_recipe(path)
    assert isinstance(recipe, ASRRecipe) and recipe.name == path.stem and recipe.out == f"runs/asr/{path.stem}"
    assert path.read_text().startswith("#")
    rc, out, err = run("validate", path)
    assert rc == 0 and "valid (asr" in out


@pytest.mark.parametrize("path", RECIPES, ids=ids)
def test_asr_recipe_trains_two_steps(path, tiny_speech, tmp_path, run):
    out = tmp_path / "run"
    rc, stdout, err = run("train", path, *tiny_overrides(path, tiny_speech, out))
    assert rc == 0, err
    assert "WER" in stdout and "trained" in stdout
    results = json.loads((out / "results.json").read_text())
    assert set(results["languages"]) == {"en", "fr"} and results["rtf"] > 0
    assert {"espeak-ng", "flite"} == set(results["families"])  # flite: English test voices only
    history = json.loads((out / "log_history.json").read_text())
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert all(f"eval_{lang}_loss" in {k for h in history for k in h} for lang in ("en", "fr"))
    recipe = load_recipe(path)
    model = load_model(out / "model")
    assert bool(moe_layers(model)) == (recipe.method == "moe")
    if recipe.method == "moe":
        assert len(results["routing"]["cramers_v"]) == len(results["routing"]["layers"]) - 1
        assert (out / "usage.png").is_file()


def test_whisper_labels_and_features(tiny_speech):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_speech["whisper"])
    utts = [u for u in read_manifest(tiny_speech["corpus"]) if u.lang == "fr"][:2]
    batch = WhisperCollator(tok, multilingual=True)(utts)
    assert batch["input_features"].shape == (2, 80, 3000)
    first = batch["labels"][0][batch["labels"][0] != -100].tolist()
    ids = tok.convert_tokens_to_ids
    assert first[:3] == [ids("<|fr|>"), ids("<|transcribe|>"), ids("<|notimestamps|>")]
    assert first[-1] == tok.eos_token_id
    assert tok.decode(first[3:-1]) == " " + utts[0].text.strip()
    english_only = WhisperCollator(tok, multilingual=False)(utts)["labels"][0]
    assert english_only[0] == ids("<|notimestamps|>")


def test_ctc_batches_stack_frames_and_spell_spoken_text(tiny_speech):
    utts = read_manifest(tiny_speech["corpus"])[:3]
    vocab = CharVocab.build(spoken_text(u.text) for u in utts)
    batch = CTCCollator(vocab, stack=4)(utts)
    feats, lengths = log_mel([load_audio(u.audio) for u in utts], pad_to_30s=False)
    stacked, stacked_len = stack_frames(feats, lengths, 4)
    assert torch.equal(batch["input_features"], stacked)
    assert batch["attention_mask"].sum(-1).tolist() == stacked_len.tolist()
    for row, u in zip(batch["labels"], utts):
        assert vocab.decode(row[row != -100].tolist()) == spoken_text(u.text)


def test_augmented_batches_differ_only_inside_utterances(tiny_speech):
    from moekit.speech.data import SpecAugmentConfig

    utts = read_manifest(tiny_speech["corpus"])[:2]
    vocab = CharVocab.build(spoken_text(u.text) for u in utts)
    plain = CTCCollator(vocab)(utts)
    aug = CTCCollator(vocab, augment=SpecAugmentConfig())(utts)
    assert not torch.equal(plain["input_features"], aug["input_features"])
    pad = plain["attention_mask"] == 0
    assert torch.equal(plain["input_features"][pad], aug["input_features"][pad])
    assert torch.equal(plain["labels"], aug["labels"])


def test_split_keeps_held_out_voices_and_caps(tiny_speech):
    train, test = load_split(ASRDataConfig(corpus=str(tiny_speech["corpus"]), train_per_lang=3))
    assert len(train) == 6 and set(test) == {"en", "fr"}
    assert not {u.voice for u in train} & {u.voice for utts in test.values() for u in utts}
    with pytest.raises(ConfigError, match="no utterances in"):
        load_split(ASRDataConfig(corpus=str(tiny_speech["corpus"]), langs=["en", "sw"]))


def test_error_table_pools_edits_over_voices(tiny_speech):
    test = {"en": [u for u in read_manifest(tiny_speech["corpus"]) if u.lang == "en" and u.split == "test"]}
    hyps = {"en": [u.text for u in test["en"]]}
    hyps["en"][0] = "wrong"
    table = error_table(test, hyps)
    words = [len(spoken_text(u.text).split()) for u in test["en"]]
    assert table["languages"]["en"]["words"] == sum(words)
    wrong_voice = test["en"][0].voice
    rows = [u for u in test["en"] if u.voice == wrong_voice]
    assert table["voices"][wrong_voice]["words"] == sum(len(spoken_text(u.text).split()) for u in rows)
    assert table["voices"][wrong_voice]["wer"] > 0
    assert all(v["wer"] == 0 for k, v in table["voices"].items() if k != wrong_voice)
    total = sum(v["wer"] * v["words"] for v in table["families"].values())
    assert total == pytest.approx(table["languages"]["en"]["wer"] * table["languages"]["en"]["words"])


def test_ume_whisper_freezing_keeps_everything_but_moe_layers(tiny_speech, tmp_path):
    from moekit.config import load_yaml
    from moekit.training.asr import train_asr

    path = next(p for p in RECIPES if p.stem == "ume_whisper_tiny")
    recipe = load_yaml(path, ASRRecipe, tiny_overrides(path, tiny_speech, tmp_path / "r",
                                                        **{"optim.weight_decay": 0.1, "optim.lr": 1e-2}))
    before = load_dense(tiny_speech["whisper"]).state_dict()
    trained = train_asr(recipe).model
    layers = moe_layers(trained)
    for name, value in trained.state_dict().items():
        if not any(name.startswith(p + ".") for p, _ in layers):
            assert torch.equal(before[name], value), name  # frozen, weight decay included
    for path, moe in layers:  # every MoE layer trained: its experts left the dense copy they started as
        dense_up = before[f"{path}.weight"]  # (I, H): the replaced fc1
        assert any(not torch.equal(moe.experts.up[e], dense_up) for e in range(moe.experts.num_experts)), path


def test_recipe_errors():
    with pytest.raises(ConfigError, match="model.kind=whisper needs model.path"):
        validate(ASRRecipe, {"model": {"kind": "whisper"}, "method": "dense"})
    with pytest.raises(ConfigError, match="trains from scratch"):
        validate(ASRRecipe, {"model": {"kind": "ctc", "path": "x"}, "method": "dense"})
    with pytest.raises(ConfigError, match="method=moe needs a `moe` section"):
        validate(ASRRecipe, {"model": {"kind": "ctc", "ctc": {}}, "method": "moe"})
    with pytest.raises(ConfigError, match="model.kind=pretrained_ctc needs model.path"):
        validate(ASRRecipe, {"model": {"kind": "pretrained_ctc"}, "method": "dense"})
    with pytest.raises(ConfigError, match="set data.spec_augment: null"):  # the default masks log-mel features
        validate(ASRRecipe, {"model": {"kind": "pretrained_ctc", "path": "x"}, "method": "dense"})


@pytest.mark.parametrize("name,model", [("omni_ctc", None), ("ume_whisper_tiny", None), ("ume_wav2vec2", None),
                                        ("ume_wav2vec2", "parakeet")])
def test_evaluate_reproduces_a_finished_run(name, model, tiny_speech, tmp_path, run):
    """(ume_wav2vec2 also on the Parakeet CTC checkpoint: model.kind=pretrained_ctc reads its processor too.)"""
    path = next(p for p in RECIPES if p.stem == name)
    out = tmp_path / "run"
    keys = {"model.path": str(tiny_speech[model])} if model else {}
    rc, _, err = run("train", path, *tiny_overrides(path, tiny_speech, out, **keys))
    assert rc == 0, err
    first = json.loads((out / "results.json").read_text())
    rc, stdout, err = run("evaluate", out)
    assert rc == 0, err
    again = json.loads((out / "results.json").read_text())
    assert again["languages"] == first["languages"] and again["transcripts"] == first["transcripts"]
    assert again["routing"]["cramers_v"] == first["routing"]["cramers_v"]


def test_whisper_moe_in_both_stacks_trains_and_evaluates_without_routing_stack(tiny_speech, tmp_path, run):
    """Experts in Whisper's encoder and decoder route different token counts; the default routing statistics
    are the encoder's (the run used to pass validation, train, then fail in evaluation); Fig. 5's token entropy
    is None there (no encoder frame carries a token; it was a list of NaN, which is not JSON)."""
    path = RECIPES[ids.index("ume_whisper_tiny")]
    out = tmp_path / "run"
    over = tiny_overrides(path, tiny_speech, out, **{"moe.target": None, "eval.routing_stack": None})
    rc, _, err = run("train", path, *over)
    assert rc == 0, err
    model = load_model(out / "model")
    assert {p.split(".")[1] for p, _ in moe_layers(model)} == {"encoder", "decoder"}
    routing = json.loads((out / "results.json").read_text(), parse_constant=pytest.fail)["routing"]  # no NaN
    assert routing["layers"] and all(".encoder." in layer for layer in routing["layers"])
    assert routing["token_entropy"] is None and routing["token_entropy_tokens"] == 0  # encoder frames carry no token


def test_fig5_token_entropy_and_fig6_relative_wer_change(tiny_speech):
    """Omni-router Figs. 5-6 for a CTC MoE: token entropy per layer over frames labelled by their best-path
    token (blanks left out); relative WER change 0 at p = 0 (the same decoding) and defined at p > 0."""
    from moekit.moe.spec import MoESpec
    from moekit.speech.ctc import CTCConfig, CTCEncoderForASR
    from moekit.eval.asr import CTCTranscriber, permuted_wer, routing_report
    from moekit.checkpoint.upcycle_model import upcycle

    train, test = load_split(ASRDataConfig(corpus=str(tiny_speech["corpus"]), langs=["en", "fr"]))
    vocab = CharVocab.build(spoken_text(u.text) for u in train)
    torch.manual_seed(0)
    model = CTCEncoderForASR(CTCConfig(input_dim=320, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=32, vocab_size=len(vocab))).eval()
    upcycle(model, MoESpec(num_experts=4, top_k=1, init="scratch", router_sharing="all"))
    tr = CTCTranscriber(vocab, 4)
    change = permuted_wer(model, tr, test, 4, [0.0, 0.5])
    assert change["0.0"] == 0.0 and math.isfinite(change["0.5"])
    report = routing_report(model, tr, [tr.batch(test["en"][:4])], None, [0.5])
    assert len(report["token_entropy"]) == len(report["layers"]) == 2
    assert report["token_entropy_tokens"] >= 1 and all(0 <= h <= math.log(4) + 1e-9 for h in report["token_entropy"])


@pytest.mark.parametrize("name,model", [("ume_whisper_tiny", "whisper"), ("ume_wav2vec2", "wav2vec2"),
                                        ("ume_wav2vec2", "parakeet")])
def test_asr_recipe_trains_its_upcycled_checkpoint_as_it_is(name, model, tiny_speech, tmp_path, run):
    """model.path holding the recipe's own upcycle of the Whisper, the wav2vec 2.0 or the Parakeet checkpoint
    (moekit.checkpoint.upcycle, as `moekit upcycle` writes it, its processor files kept) trains as it is, as text and
    speech-LLM recipes do (TrainingMethod.prepared): the same trained weights and transcripts as the run that upcycles
    the dense model itself; a checkpoint upcycled with another spec is refused naming the field, before any run
    directory is made."""
    from moekit.checkpoint.upcycle import upcycle_checkpoint
    from moekit.config import load_yaml

    path = RECIPES[ids.index(name)]
    dense = tiny_overrides(path, tiny_speech, tmp_path / "dense", **{"model.path": str(tiny_speech[model])})
    upcycle_checkpoint(tiny_speech[model], tmp_path / "up", load_yaml(path, ASRRecipe, dense).moe)
    rc, _, err = run("train", path, *dense)
    assert rc == 0, err
    rc, _, err = run("train", path, *tiny_overrides(path, tiny_speech, tmp_path / "from_up",
                                                    **{"model.path": str(tmp_path / "up")}))
    assert rc == 0, err
    ran, again = (load_model(tmp_path / name / "model").state_dict() for name in ("dense", "from_up"))
    assert ran.keys() == again.keys() and all(torch.equal(ran[k], again[k]) for k in ran)
    results = [json.loads((tmp_path / name / "results.json").read_text()) for name in ("dense", "from_up")]
    assert results[0]["transcripts"] == results[1]["transcripts"]
    rc, _, err = run("train", path, *tiny_overrides(path, tiny_speech, tmp_path / "other",
                                                    **{"model.path": str(tmp_path / "up"), "moe.top_k": 1}))
    assert rc == 2 and err.splitlines()[-1] == (
        f"moekit: error: {tmp_path / 'up'} was upcycled with moe.top_k=2 (its moekit.json), the recipe has "
        "moe.top_k=1: give the recipe the checkpoint's spec, or start from the dense model")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("kind", ["wav2vec2", "wav2vec2-upper", "parakeet"])
def test_a_pretrained_ctc_checkpoints_processor_makes_the_batches(kind, tiny_speech, tmp_path):
    """model.kind=pretrained_ctc: inputs are what the checkpoint's own feature extractor makes of the audio; labels
    are the spoken transcript as its tokenizer encodes it, in the vocabulary's case (upper-case vocabularies:
    facebook/wav2vec2-base-960h's): characters with words joined by its delimiter (wav2vec 2.0), or word pieces
    (Parakeet); the frame mask counts each utterance's encoder frames by the model's length rule (wav2vec 2.0's feature
    encoder, Parakeet's subsampling), and the transcriber decodes a best path as the tokenizer's CTC decoding does."""
    import transformers as tf

    from moekit.eval.asr import ProcessorCTCTranscriber
    from moekit.speech.data import ProcessorCTCCollator
    from moekit.testing import save_tiny_wav2vec2_ctc

    upper = kind.endswith("upper")
    folder = tiny_speech["parakeet"] if kind == "parakeet" else save_tiny_wav2vec2_ctc(
        tmp_path / "w2v", [t for lines in tiny_speech["texts"].values() for t in lines], upper=upper)
    processor, model = tf.AutoProcessor.from_pretrained(folder), tf.AutoModelForCTC.from_pretrained(folder)
    utts = [u for u in read_manifest(tiny_speech["corpus"]) if u.split == "train"][:3]
    batch = ProcessorCTCCollator(processor)(utts)
    audio = [load_audio(u.audio) for u in utts]
    own = processor.feature_extractor(audio, sampling_rate=16000, padding=True, return_tensors="pt")
    assert batch.keys() - {"labels"} == own.keys() and all(torch.equal(batch[k], own[k]) for k in own)
    for row, u in zip(batch["labels"], utts):
        text = spoken_text(u.text)
        ids = row[row >= 0].tolist()
        assert processor.tokenizer.decode(ids, group_tokens=False) == (text.upper() if upper else text)
        assert processor.tokenizer.unk_token_id not in ids and (kind != "parakeet" or len(ids) < len(text))
    transcriber = ProcessorCTCTranscriber(processor)
    frames = transcriber.frame_mask(batch, model).sum(-1)
    if kind == "parakeet":
        assert frames.tolist() == model._get_output_attention_mask(own["attention_mask"]).sum(-1).tolist()
    else:
        assert frames.tolist() == [int(model._get_feat_extract_output_lengths(len(a))) for a in audio]
    with torch.no_grad():
        best = model(**own).logits.argmax(-1)  # (B, T')
    assert transcriber.transcribe(model, utts) == [
        processor.tokenizer.decode(row[:n].tolist()).strip() for row, n in zip(best, frames)]


def test_a_ctc_vocabulary_lacking_the_corpus_characters_is_refused_before_anything_is_written(tiny_speech, tmp_path,
                                                                                            run):
    """A checkpoint whose vocabulary lacks characters of the transcripts (French's in an English vocabulary) would
    train them as its unknown token: refused in one line naming them, before the weights load; nothing written."""
    import hashlib

    from moekit.testing import save_tiny_wav2vec2_ctc

    folder = save_tiny_wav2vec2_ctc(tmp_path / "en_only", tiny_speech["texts"]["en"])
    before = {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.rglob("*") if f.is_file()}
    path = next(p for p in RECIPES if p.stem == "ume_wav2vec2")
    out = tmp_path / "run"
    rc, _, err = run("train", path, *tiny_overrides(path, tiny_speech, out, **{"model.path": str(folder)}))
    assert rc != 0 and "vocabulary lacks" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert before == {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.rglob("*") if f.is_file()}


def test_a_checkpoint_without_a_ctc_tokenizer_is_refused_in_one_line(tiny_speech, tmp_path, run):
    """model.kind=pretrained_ctc on a checkpoint whose tokenizer does not decode CTC (Whisper's, here): refused in one
    line naming what it reads, before the weights load; nothing written."""
    path = next(p for p in RECIPES if p.stem == "ume_wav2vec2")
    out = tmp_path / "run"
    whisper = {"model.path": str(tiny_speech["whisper"])}
    rc, _, err = run("train", path, *tiny_overrides(path, tiny_speech, out, **whisper))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "a CTC tokenizer (Wav2Vec2CTCTokenizer" in err and "this one has TokenizersBackend" in err
    assert not out.exists()
