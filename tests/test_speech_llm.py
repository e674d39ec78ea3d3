"""Speech-LLM recipes (task: speech_llm): data readers and their bad-row accounting, the processor-built training
batches, upcycling a speech-LLM, training and evaluation end to end on tiny Qwen3-ASR / Qwen2-Audio stand-ins and a
tiny CoVoST 2 layout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf

from moekit.checkpoint.dense import load_dense
from moekit.errors import ConfigError
from moekit.moe.layer import moe_layers
from moekit.moe.spec import MoESpec
from moekit.speech.llm import SpeechLLMInputs, audio_paths, family_of, load_processor
from moekit.speech.s2tt import Example, S2TTDataConfig, load_s2tt
from moekit.testing.speech_llm import save_tiny_covost, save_tiny_qwen2_audio, save_tiny_qwen3_asr, write_wav
from moekit.training.recipe import SpeechLLMRecipe, load_recipe
from moekit.checkpoint.upcycle_model import upcycle

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "spri_s2tt.yaml"
BUILDERS = {"qwen3_asr": save_tiny_qwen3_asr, "qwen2_audio": save_tiny_qwen2_audio}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("speech_llm")
    return {"data": save_tiny_covost(root / "covost"),
            **{kind: build(root / kind) for kind, build in BUILDERS.items()}}


def _inputs(folder: Path) -> tuple[torch.nn.Module, SpeechLLMInputs]:
    model = load_dense(folder)
    return model, SpeechLLMInputs(load_processor(folder), family_of(model.config, str(folder)))


def _rows(data: Path, **kw) -> tuple[list[Example], dict, object]:
    cfg = S2TTDataConfig(path=str(data), directions=["de", "fr"], **kw)
    return load_s2tt(cfg, lambda e: 0)


# ------------------------------------------------------------------------------------------------------ data


def test_covost_rows_shuffled_across_directions(tiny):
    train, test, report = _rows(tiny["data"])
    assert sorted((e.tgt, e.target) for e in train) == sorted((d, f"{d} {i}") for d in ("de", "fr") for i in range(6))
    assert [e.tgt for e in train] != sorted(e.tgt for e in train)  # A.2: not grouped by direction
    assert [e.target for e in test["de"]] == ["de 6", "de 7"] and test["fr"][0].source == "sentence 6"
    assert train[0].seconds == 1.0 and report.as_dict()["train"]["de"] == {"kept": 6}


def test_transcription_alone_reads_the_transcripts_of_one_direction(tiny):
    train, test, _ = load_s2tt(S2TTDataConfig(path=str(tiny["data"]), directions=["en"], transcripts_from="fr"),
                               lambda e: 0)
    assert sorted(e.target for e in train) == [f"sentence {i}" for i in range(6)]
    assert {e.tgt for e in train} == {"en"} and [e.target for e in test["en"]] == ["sentence 6", "sentence 7"]
    with pytest.raises(ValueError, match=r"name one besides en, or name it in data.transcripts_from"):
        S2TTDataConfig(path=str(tiny["data"]), directions=["en"])


def _broken(tmp_path: Path, tiny) -> Path:
    """The tiny CoVoST with a missing clip and a clip that is not audio (both directions read them), and an empty
    translation in en_de's training file."""
    data = save_tiny_covost(tmp_path / "bad")
    (data / "clips" / "c1.wav").unlink()
    (data / "clips" / "c2.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot a wave file")
    tsv = data / "covost_v2.en_de.train.tsv"
    tsv.write_text(tsv.read_text().replace("\tde 3\t", "\t\t"))
    return data


def test_bad_rows_counted_and_refused(tmp_path, tiny):
    data = _broken(tmp_path, tiny)
    with pytest.raises(ConfigError, match=r"^5 unusable rows .*\(2 missing clip, 2 unreadable audio, 1 empty target\), "
                                          r"first covost_v2.en_de.train.tsv:3: clip .*c1.wav not found; "
                                          r"data.on_bad=skip"):
        _rows(data)
    train, _, report = _rows(data, on_bad="skip")
    counts = report.as_dict()["train"]
    assert counts["de"] == {"missing_clip": 1, "unreadable_audio": 1, "empty_target": 1, "kept": 3}
    assert counts["fr"] == {"missing_clip": 1, "unreadable_audio": 1, "kept": 4}
    assert len(train) == 7


def test_length_filters_count_what_they_leave_out(tmp_path):
    data = save_tiny_covost(tmp_path / "c")
    write_wav(data / "clips" / "c0.wav", 2.0)
    train, _, report = _rows(data, max_seconds=1.5)
    assert report.as_dict()["train"]["de"] == {"over_max_seconds": 1, "kept": 5} and len(train) == 10
    with pytest.raises(ConfigError, match=r"direction en->de has no train rows left \(left out: "
                                          r"\{'over_max_prompt_tokens': 6\}\)"):
        load_s2tt(S2TTDataConfig(path=str(data), directions=["de"], max_prompt_tokens=3), lambda e: 4)


def test_hf_datasets_form_reads_as_covost(tmp_path, tiny):
    import datasets

    src = tiny["data"]
    for d in ("de", "fr"):
        splits = {}
        for split in ("train", "test"):
            rows = [line.split("\t") for line in (src / f"covost_v2.en_{d}.{split}.tsv").read_text().splitlines()[1:]]
            splits[split] = datasets.Dataset.from_dict({
                "audio": [{"bytes": (src / "clips" / r[0]).read_bytes(), "path": None} for r in rows],
                "sentence": [r[1] for r in rows], "translation": [r[2] for r in rows]}).cast_column(
                "audio", datasets.Audio(decode=False))
        datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "hf" / f"en_{d}"))
    hf = _rows(tmp_path / "hf", format="hf")
    covost = _rows(src)
    assert [(e.tgt, e.target, e.source, e.seconds) for e in hf[0]] == \
           [(e.tgt, e.target, e.source, e.seconds) for e in covost[0]]
    assert (hf[0][0].samples() == covost[0][0].samples()).all()


def test_europarl_layout(tmp_path):
    root = tmp_path / "ep"
    (root / "en" / "audios").mkdir(parents=True)
    write_wav(root / "en" / "audios" / "talk1.wav", 3.0)
    for d in ("de",):
        for split in ("train", "test"):
            folder = root / "en" / d / split
            folder.mkdir(parents=True)
            (folder / "segments.lst").write_text("talk1 0.0 1.0\ntalk1 1.5 2.5\n")
            (folder / "segments.en").write_text("one\ntwo\n")
            (folder / f"segments.{d}").write_text("eins\nzwei\n")
    train, test, _ = load_s2tt(S2TTDataConfig(format="europarl", path=str(root), directions=["de"], seed=1),
                               lambda e: 0)
    assert sorted((e.target, e.source, e.seconds) for e in train) == [("eins", "one", 1.0), ("zwei", "two", 1.0)]
    assert test["de"][1].samples().shape == (16000,)


# ------------------------------------------------------------------------------------------------------ inputs


@pytest.mark.parametrize("kind", BUILDERS)
def test_batch_labels_are_the_target_tokens_only(tiny, kind):
    model, inputs = _inputs(tiny[kind])
    train, _, _ = _rows(tiny["data"])
    batch = inputs(train[:3])
    tok = inputs.tok
    for i, e in enumerate(train[:3]):
        labelled = batch["labels"][i][batch["labels"][i] != -100].tolist()
        assert labelled == tok(e.target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = int(batch["attention_mask"][i].sum())
        assert batch["input_ids"][i, n - len(labelled):n].tolist() == labelled  # the target ends the row
        assert (batch["attention_mask"][i, n:] == 0).all()  # right padding
    audio_id = tok.convert_tokens_to_ids(inputs.processor.audio_token)
    assert int((batch["input_ids"] == audio_id).sum()) > 3  # the placeholder expanded to the clips' audio tokens
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


def test_qwen3_asr_prompt_is_the_processors_transcription_request(tiny):
    import numpy as np

    _, inputs = _inputs(tiny["qwen3_asr"])
    e = Example(id="x", audio=b"", seconds=1.0, target="t", tgt="de")
    expected = inputs.processor.apply_transcription_request(np.zeros(1600, "float32"), language="de", tokenize=False)
    assert inputs.prompt(e) == expected[0] and expected[0].endswith("language German<asr_text>")
    welsh = Example(id="x", audio=b"", seconds=1.0, target="t", tgt="cy")  # not in the processor's 30 names
    assert inputs.prompt(welsh) == expected[0].replace("German", "Welsh")


def test_text_only_model_is_refused(tmp_path):
    from moekit.testing import tiny_qwen3

    with pytest.raises(ConfigError, match=r"is a qwen3 model, not a speech-LLM: task speech_llm trains qwen3_asr, "
                                          r"qwen2_audio"):
        family_of(tiny_qwen3().config, "m")


# ------------------------------------------------------------------------------------------------------ upcycling


@pytest.mark.parametrize("kind", BUILDERS)
def test_upcycling_changes_the_decoder_ffns_only(tiny, kind):
    dense, inputs = _inputs(tiny[kind])
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    moe = upcycle(dense, MoESpec(num_experts=8, top_k=2, every=4, shared_expert=True, init={"method": "spri"}))
    paths = [p for p, _ in moe_layers(moe)]
    assert paths == ["model.language_model.layers.3.mlp", "model.language_model.layers.7.mlp"]
    after = moe.state_dict()
    changed = {k for k in before if k not in after or not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(tuple(f"{p}." for p in paths)) for k in changed)
    audio = audio_paths(moe, inputs.family)
    assert audio == ["model.audio_tower", "model.multi_modal_projector"]
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(tuple(audio)))


def test_upcycling_leaves_a_deep_audio_encoder_alone():
    """Whisper base's 6 encoder blocks have FFNs too: with every=4 its block 3 was upcycled (found on real weights);
    only the language model's FFNs are candidates unless the spec's target names the encoder."""
    cfg = tf.Qwen2AudioConfig(audio_config=dict(num_mel_bins=16, encoder_layers=4, encoder_attention_heads=1,
                                                 encoder_ffn_dim=32, d_model=16),
                              text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    spec = dict(num_experts=4, top_k=2, every=4, init={"method": "naive"})
    moe = upcycle(tf.Qwen2AudioForConditionalGeneration(cfg), MoESpec(**spec))
    assert [p for p, _ in moe_layers(moe)] == ["model.language_model.layers.3.mlp"]
    moe = upcycle(tf.Qwen2AudioForConditionalGeneration(cfg), MoESpec(**spec, target="audio_tower"))
    assert [p for p, _ in moe_layers(moe)] == ["model.audio_tower.layers.3.fc1"]


@pytest.mark.parametrize("kind", BUILDERS)
def test_ume_generates_what_the_dense_model_generates(tiny, kind):
    dense, inputs = _inputs(tiny[kind])
    _, test, _ = _rows(tiny["data"])
    rows = [*test["de"], *test["fr"]]
    with torch.no_grad():
        want = inputs.generate(dense, rows, 6)
        moe = upcycle(dense, MoESpec(num_experts=4, top_k=2, init={"method": "ume"}))
        assert inputs.generate(moe.eval(), rows, 6) == want


# ------------------------------------------------------------------------------------------------------ training


def _overrides(tiny, kind: str, out: Path, **extra) -> list[str]:
    keys = {"model.path": str(tiny[kind]), "data.path": str(tiny["data"]), "data.directions": ["de", "fr"],
            "out": str(out), "train.steps": 4, "train.batch_size": 4, "train.grad_accum": 1, "train.precision": "fp32",
            "train.logging_steps": 1, "train.eval_every": 2, "train.save_every": 0, "eval.batch_size": 4,
            "eval.max_new_tokens": 4, "eval.loss_per_direction": 2, "optim.lr": 1e-3, **extra}
    return [f"{k}={json.dumps(v)}" for k, v in keys.items()]


def test_spri_s2tt_recipe_is_the_papers():
    r = load_recipe(RECIPE)
    assert isinstance(r, SpeechLLMRecipe) and r.task == "speech_llm" and r.method == "moe"
    assert (r.moe.num_experts, r.moe.top_k, r.moe.every, r.moe.shared_expert) == (8, 2, 4, True)
    assert (r.moe.init.method, r.moe.init.rho, r.moe.init.delta) == ("spri", 1e-3, 1e-12)
    assert (r.freeze.schedule, r.freeze.tau, r.aux.load_balance, r.aux.z_loss) == ("spri_two_stage", 0.1, 1e-2, 1e-3)
    assert (r.optim.lr, r.optim.warmup_ratio, r.optim.schedule, r.train.precision) == (2e-5, 0.02, "linear", "bf16")
    assert (r.data.max_seconds, r.data.max_prompt_tokens, len(r.data.directions)) == (15.0, 512, 15)
    assert "Deviations" in RECIPE.read_text()


def test_spri_s2tt_trains_evaluates_and_reloads(tiny, tmp_path, run):
    out = tmp_path / "run"
    rc, stdout, err = run("train", RECIPE, *_overrides(tiny, "qwen3_asr", out, **{"model.freeze_audio": True}))
    assert rc == 0, err
    assert "not computed" in stdout and "trained spri_s2tt" in stdout
    results = json.loads((out / "results.json").read_text())
    assert set(results["directions"]) == {"de", "fr"} and results["avg"]["comet"] == "not computed"
    assert all(isinstance(r["bleu"], float) and isinstance(r["chrf"], float) for r in results["directions"].values())
    assert {d: [len(v) for v in s.values()] for d, s in results["per_item"].items()} == {
        d: [r["n"], r["n"]] for d, r in results["directions"].items()}  # sentence BLEU and chrF of every test row
    assert json.loads((out / "data.json").read_text())["train"] == {"de": {"kept": 6}, "fr": {"kept": 6}}
    logs = json.loads((out / "log_history.json").read_text())
    assert [h["step"] for h in logs if "eval_de_loss" in h] == [2, 4]
    import moekit  # noqa: F401  (registers the moekit format with transformers' Auto classes)

    trained = tf.AutoModelForSpeechSeq2Seq.from_pretrained(out / "model")
    dense = load_dense(tiny["qwen3_asr"])
    sd, base = trained.state_dict(), dense.state_dict()
    audio = [k for k in base if k.startswith(("model.audio_tower.", "model.multi_modal_projector."))]
    assert audio and all(torch.equal(sd[k], base[k]) for k in audio)  # model.freeze_audio: never trained
    assert not torch.equal(sd["model.language_model.layers.0.mlp.up_proj.weight"],
                           base["model.language_model.layers.0.mlp.up_proj.weight"])
    assert len(moe_layers(trained)) == 2
    before = json.loads((out / "results.json").read_text())
    rc, stdout, err = run("evaluate", out)
    assert rc == 0, err
    assert json.loads((out / "results.json").read_text())["outputs"] == before["outputs"]  # the same greedy outputs


def test_per_item_scores_are_sacrebleus_sentence_scores_beside_the_corpus_scores():
    import jiwer
    import sacrebleu

    from moekit.eval.s2tt import _scores

    refs = ["Im Anfang schuf Gott Himmel und Erde.", "Und Gott sprach: Es werde Licht!", "Und es ward Licht."]
    hyps = ["Am Anfang schuf Gott den Himmel und die Erde.", "Gott sprach: Licht!", "Und es ward Licht."]
    rows = [Example(id=str(i), audio=b"", seconds=1.0, target=r, tgt="de") for i, r in enumerate(refs)]
    corpus, items = _scores(rows, hyps, None, 8)
    assert corpus == {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
                      "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score, "comet": "not computed"}
    assert items == {"bleu": [sacrebleu.sentence_bleu(h, [r]).score for h, r in zip(hyps, refs)],
                     "chrf": [sacrebleu.sentence_chrf(h, [r]).score for h, r in zip(hyps, refs)]}
    assert items["bleu"][2] == pytest.approx(100.0) and 0 < items["bleu"][1] < items["chrf"][1] < 100
    refs, hyps = ["in the beginning", "god"], ["in the begin", "good god"]
    asr = [Example(id=str(i), audio=b"", seconds=1.0, target=r, tgt="en") for i, r in enumerate(refs)]
    corpus, items = _scores(asr, hyps, None, 8)
    assert items == {"wer": [1 / 3, 1.0], "cer": [jiwer.cer(r, h) for r, h in zip(refs, hyps)]}
    assert corpus["wer"] == 2 / 4  # corpus WER: edits over all reference words, the per-item WERs weighted by words


def test_dense_qwen2_audio_reloads_in_plain_transformers(tiny, tmp_path, run):
    out = tmp_path / "dense"
    rc, _, err = run("train", RECIPE, *_overrides(tiny, "qwen2_audio", out), "method=dense", "moe=null",
                     "freeze.schedule=none")
    assert rc == 0, err
    reloaded = tf.Qwen2AudioForConditionalGeneration.from_pretrained(out / "model").eval()
    _, inputs = _inputs(out / "model")
    _, test, _ = _rows(tiny["data"])
    results = json.loads((out / "results.json").read_text())
    assert inputs.generate(reloaded, test["de"], 4) == results["outputs"]["de"]


@pytest.mark.parametrize("kind", BUILDERS)
def test_loss_falls_on_a_fixed_batch(tiny, kind):
    model, inputs = _inputs(tiny[kind])
    moe = upcycle(model, MoESpec(num_experts=8, top_k=2, every=4, shared_expert=True, init={"method": "spri"})).train()
    train, _, _ = _rows(tiny["data"])
    batch = inputs(train[:4])
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    losses = []
    for _ in range(16):
        loss = moe(**batch).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------------------------------------------------ corpus


def test_speech_corpus_targets_write_covost_layout_that_trains(tiny, tmp_path, monkeypatch, run):
    from moekit.assets import bible_verses
    from moekit.data.parallel import BIBLE_CODE
    from moekit.testing.standins import standin_cache

    monkeypatch.setenv("MOEKIT_CACHE", str(standin_cache(tmp_path / "cache")))
    corpus = tmp_path / "corpus"
    rc, _, err = run("speech", "corpus", "--langs", "en", "--targets", "de,fr", "--voices", 2, "--test-voices", 1,
                     "--train-per-lang", 4, "--test-per-lang", 2, "--out", corpus)
    assert rc == 0, err
    manifest = [json.loads(line) for line in (corpus / "manifest.jsonl").read_text().splitlines()]
    de = {f"{v.book}:{v.chapter}:{v.verse}": v.text for v in bible_verses(BIBLE_CODE["de"])}
    train, test, _ = load_s2tt(S2TTDataConfig(path=str(corpus), clips=str(corpus / "audio" / "en"),
                                              directions=["de", "fr"]), lambda e: 0)
    assert len(train) == 8 and [len(test[d]) for d in ("de", "fr")] == [2, 2]
    by_text = {m["text"]: m for m in manifest}
    for e in test["de"]:  # the same verse: English speech, German target
        assert " ".join(de[by_text[e.source]["text_id"]].split()) == e.target and by_text[e.source]["split"] == "test"
    out = tmp_path / "run"
    rc, _, err = run("train", RECIPE, *_overrides(tiny, "qwen3_asr", out, **{
        "data.path": str(corpus), "data.clips": str(corpus / "audio" / "en"), "train.steps": 1}))
    assert rc == 0, err
    assert json.loads((out / "data.json").read_text())["test"] == {"de": {"kept": 2}, "fr": {"kept": 2}}


# ------------------------------------------------------------------------------------------------------ dry run


def test_dry_run_counts_the_audio_modules_and_the_decoders_moe_layers(tiny, tmp_path):
    from moekit.training.plan import plan_recipe

    keys = _overrides(tiny, "qwen3_asr", tmp_path / "run", **{"train.steps": 10})
    plans = {frozen: plan_recipe(load_recipe(RECIPE, [*keys, f"model.freeze_audio={str(frozen).lower()}"]))
             for frozen in (False, True)}
    dense, inputs = _inputs(tiny["qwen3_asr"])
    moe = upcycle(dense, load_recipe(RECIPE, keys).moe)
    audio = sum(p.numel() for path in audio_paths(moe, inputs.family) for p in moe.get_submodule(path).parameters())
    experts = sum(p.numel() for path, m in moe_layers(moe) for p in m.experts.parameters())
    for plan in plans.values():
        assert (plan.params, plan.routed) == (sum(p.numel() for p in moe.parameters()), experts)
        assert plan.max_length == 512 - 1 + 15 * 13  # the prompt bound, its placeholder as 15 s of audio tokens
        assert plan.activations == plan.activations_per_1k * 4 * plan.max_length // 1000 > 0
    trains, frozen = plans[False], plans[True]
    assert [s.params for s in trains.stages][0] == [s.params for s in frozen.stages][0]  # routers, down projections
    assert trains.stages[1].params - frozen.stages[1].params == audio > 0
    assert (trains.frozen_bytes, frozen.frozen_bytes) == (0, 4 * audio)


# ------------------------------------------------------------------------------------------------------ clips


def test_mp3_and_flac_clips_decode_through_soundfile(tmp_path):
    """Common Voice's MP3 (48 kHz) and a stereo FLAC read as WAV clips do: 16 kHz mono, the tone's pitch kept, FLAC
    (lossless) to its 16-bit quantization; a non-WAV file that is not audio is an unreadable row."""
    import numpy as np

    sf = pytest.importorskip("soundfile")
    from moekit.speech.audio import decode

    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(48000) / 48000)
    data = save_tiny_covost(tmp_path / "covost", directions=("de",), train=2, test=2)
    sf.write(data / "clips" / "c0.mp3", tone, 48000, format="MP3")
    sf.write(data / "clips" / "c1.flac", np.stack([tone[::3], tone[::3]], axis=1), 16000, format="FLAC")
    (data / "clips" / "c2.mp3").write_bytes(b"not an mp3 " * 20)
    for split in ("train", "test"):
        tsv = data / f"covost_v2.en_de.{split}.tsv"
        tsv.write_text(tsv.read_text().replace("c0.wav", "c0.mp3").replace("c1.wav", "c1.flac")
                       .replace("c2.wav", "c2.mp3"))
    train, _, report = load_s2tt(S2TTDataConfig(path=str(data), directions=["de"], on_bad="skip"), lambda e: 0)
    assert report.as_dict()["test"]["de"] == {"unreadable_audio": 1, "kept": 1} and len(train) == 2
    for e in train:
        samples = e.samples()
        assert e.seconds == pytest.approx(1.0, abs=0.01) and samples.shape == (16000,)
        assert np.argmax(np.abs(np.fft.rfft(samples))) == 440  # 1 Hz bins over one second
    flac = decode(data / "clips" / "c1.flac", "c1.flac")
    assert np.abs(flac - tone[::3]).max() <= 1 / 32768
