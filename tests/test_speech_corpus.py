import json
import wave

import numpy as np
import pytest

from moekit.assets import Verse
from moekit.config import validate
from moekit.errors import ConfigError, OutputExistsError, ToolError
from moekit.speech import corpus as corpus_mod
from moekit.speech.corpus import CorpusConfig, build_corpus, read_manifest, split_texts
from moekit.speech.tts import Voice, load_audio, synthesize, voices_for

EN = ["The sun is warm.", "I like green tea.", "We walk to school.", "Birds sing at dawn.", "Open the door.",
      "The sun is warm.", "", "A very long sentence that goes on and on well past the limit of sixty characters.",
      "She reads a book.", "Rain falls (softly) today."]
FR = ["Le chat dort.", "Il fait beau.", "Nous mangeons du pain.", "La mer est calme.", "Ouvre la fenêtre.",
      "Je bois de l'eau.", "Elle chante bien."]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    (root / "en.txt").write_text("\n".join(EN) + "\n")
    (root / "fr.txt").write_text("\n".join(FR) + "\n")
    return {"en": str(root / "en.txt"), "fr": str(root / "fr.txt")}


def tiny(texts, **kw) -> CorpusConfig:
    data = dict(langs=["en", "fr"], voices=2, test_voices=1, train_per_lang=4, test_per_lang=2, texts=texts,
                max_chars=60, flite_test=True, seed=1) | kw
    return CorpusConfig(**data)


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "c"
    build_corpus(tiny(texts), out)
    return out


def test_manifest_splits_voices_and_texts(built):
    utts = read_manifest(built)
    assert len(utts) == 2 * (4 + 2) + 2  # + the English test texts spoken by flite
    for lang in ("en", "fr"):
        train = [u for u in utts if u.lang == lang and u.split == "train"]
        test = [u for u in utts if u.lang == lang and u.split == "test"]
        assert len(train) == 4 and {u.family for u in train} == {"espeak-ng"}
        assert len({u.voice for u in train}) == 2 and not {u.voice for u in train} & {u.voice for u in test}
        expected = [v.id for v in voices_for(lang, 3, seed=1)]  # 2 training voices, then 1 held out
        assert {u.voice for u in train} == set(expected[:2])
        assert {u.voice for u in test if u.family == "espeak-ng"} == {expected[2]}
        assert not {u.text for u in train} & {u.text for u in test}  # held-out texts
        assert all(len(u.text) <= 60 and u.text.strip() for u in train + test)
    flite = [u for u in utts if u.family == "flite"]
    assert {u.lang for u in flite} == {"en"} and all(u.voice.startswith("flite:") for u in flite)
    en_test = {u.text_id for u in utts if u.lang == "en" and u.split == "test" and u.family == "espeak-ng"}
    assert {u.text_id for u in flite} == en_test  # same held-out texts, unseen voice family
    assert not any("(" in u.text for u in utts)
    assert corpus_mod.clean(" Rain  falls (softly)\ttoday.") == "Rain falls softly today."
    summary = json.loads((built / "corpus.json").read_text())
    assert summary["utterances"] == 14 and summary["counts"]["en"] == {"train": 4, "test": 2, "flite_test": 2}
    assert summary["hours"] == pytest.approx(sum(u.seconds for u in utts) / 3600)


def test_wavs_are_16k_mono_non_silent(built):
    for u in read_manifest(built):
        assert u.audio.is_absolute() and u.audio.parent == built / "audio" / u.lang
        with wave.open(str(u.audio)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
            assert w.getnframes() / 16000 == pytest.approx(u.seconds)
        x = load_audio(u.audio)
        assert x.dtype == np.float32 and 0.05 < np.abs(x).max() <= 1.0 and np.sqrt(np.mean(x**2)) > 0.005
        assert 0.3 < u.seconds < 10


def test_build_is_deterministic(built, texts, tmp_path):
    again = build_corpus(tiny(texts), tmp_path / "again")
    assert (again / "manifest.jsonl").read_text() == (built / "manifest.jsonl").read_text()
    for u in read_manifest(built):
        assert (again / "audio" / u.lang / u.audio.name).read_bytes() == u.audio.read_bytes()
    other = split_texts(tiny(texts, seed=2))
    assert other != split_texts(tiny(texts))


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_refused_and_failed_rebuild_leaves_old_corpus(texts, tmp_path, monkeypatch):
    out = tmp_path / "c"
    build_corpus(tiny(texts, flite_test=False, train_per_lang=1, test_per_lang=1), out)
    before = snapshot(out)
    with pytest.raises(OutputExistsError):
        build_corpus(tiny(texts), out)

    def broken(text, voice, wav_path):
        raise ToolError("espeak-ng failed")
    monkeypatch.setattr(corpus_mod, "synthesize", broken)
    with pytest.raises(ToolError):
        build_corpus(tiny(texts), out, overwrite=True)
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temp dirs left


@pytest.mark.parametrize("change, message", [
    ({"langs": ["en", "xx"]}, "unknown languages"),
    ({"langs": ["en", "ja"], "texts": {}}, "no espeak-ng voice"),
    ({"langs": ["tl"], "texts": {}}, "no espeak-ng voice"),
    ({"voices": 0}, "greater than or equal to 1"),
    ({"test_per_lang": 0}, "greater than or equal to 1"),
    ({"langs": ["fr"], "texts": {"fr": "nope.txt"}, "flite_test": False}, "text files not found"),
    ({"langs": ["fr"], "flite_test": True}, "add en to langs"),
    ({"texts": {"en": "x"}}, "one file for each language"),
    ({"langs": ["en", "en"]}, "repeat"),
])
def test_bad_configs_fail_up_front(texts, change, message):
    data = tiny(texts).model_dump() | change
    with pytest.raises(ConfigError, match=message):
        validate(CorpusConfig, data)


def test_build_checks_before_writing(texts, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="en: only 7 distinct texts"):  # 10 lines: a repeat, a blank, a long one
        build_corpus(tiny(texts, train_per_lang=6), tmp_path / "a")
    monkeypatch.setattr("shutil.which", lambda name: None if name == "sox" else f"/usr/bin/{name}")
    with pytest.raises(ToolError, match="apt-get install sox"):
        build_corpus(tiny(texts), tmp_path / "b")
    assert not any(tmp_path.iterdir())


def test_bible_texts_are_aligned_and_held_out(monkeypatch):
    def verses(code, books=None, log=None):
        out = [Verse(1, 1, v, f"{code} verse [{v}]") for v in range(1, 31)]
        out[3] = Verse(1, 1, 4, out[2].text)  # a repeated text: kept once only
        out[5] = Verse(1, 1, 6, "x" * 300)  # too long
        return out
    monkeypatch.setattr("moekit.assets.bible_verses", verses)
    split = split_texts(CorpusConfig(langs=["en", "sw"], train_per_lang=20, test_per_lang=5, max_chars=50))
    (en_train, en_test), (sw_train, sw_test) = split["en"], split["sw"]
    assert [t for t, _ in en_test] == [t for t, _ in sw_test]  # identical verses in every language
    assert [t for t, _ in en_train] == [t for t, _ in sw_train]
    assert not {t for _, t in en_train} & {t for _, t in en_test} and len(en_train) == 20
    assert not {"1:1:4", "1:1:6"} & {t for t, _ in en_train + en_test}  # repeated text, too long
    assert all("[" not in text for _, text in en_train)  # brackets removed, content kept
    with pytest.raises(ConfigError, match="only 28 distinct texts"):
        split_texts(CorpusConfig(langs=["en"], train_per_lang=25, test_per_lang=5, max_chars=50))


def test_read_manifest_errors(tmp_path):
    good = {"id": "a", "audio": "audio/en/a.wav", "text": "hi", "text_id": "1", "lang": "en",
            "voice": "flite:slt", "family": "flite", "split": "test", "seconds": 1.5}
    path = tmp_path / "manifest.jsonl"
    path.write_text(json.dumps(good) + "\n\n")
    assert read_manifest(tmp_path)[0].audio == tmp_path.resolve() / "audio/en/a.wav"
    for bad, message in [("{oops", "not valid JSON"), (b"\xff", r"not UTF-8 \(byte 0xff at column 1\)"),
                         ("[" * 200_000, "not valid JSON: nested deeper than Python reads"), (json.dumps({"id": "a"}), "missing audio"),
                         (json.dumps(good | {"split": "dev"}), "split"), ("[1]", "expected a JSON object")]:
        path.write_bytes(json.dumps(good).encode() + b"\n" + (bad if isinstance(bad, bytes) else bad.encode()) + b"\n")
        with pytest.raises(ConfigError, match=f"manifest.jsonl:2: .*{message}"):
            read_manifest(path)
    with pytest.raises(ConfigError, match="cannot read manifest"):
        read_manifest(tmp_path / "missing")


def test_synthesize_passes_text_safely(tmp_path):
    wav = synthesize("--help; rm -rf / $(echo hi)", Voice("espeak-ng", "en-us", 170, 50), tmp_path / "x.wav")
    assert load_audio(wav).size > 16000  # spoken, not parsed as an option or by a shell
    with pytest.raises(ConfigError, match="unknown flite voice"):
        synthesize("hello", Voice("flite", "nosuch"), tmp_path / "y.wav")
    with pytest.raises(ToolError, match="espeak-ng"):
        synthesize("hello", Voice("espeak-ng", "nosuch"), tmp_path / "z.wav")


def test_load_audio_rejects_other_formats(tmp_path):
    with wave.open(str(tmp_path / "a.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(22050)
        w.writeframes(b"\0\0" * 100)
    with pytest.raises(ConfigError, match="expected 16 kHz mono 16-bit PCM, got 22050 Hz"):
        load_audio(tmp_path / "a.wav")
    (tmp_path / "b.wav").write_bytes(b"not a wav")
    with pytest.raises(ConfigError, match="cannot read WAV"):
        load_audio(tmp_path / "b.wav")


def test_voices_for_distinct_and_deterministic():
    voices = voices_for("fr", 14, seed=0)
    assert len({v.id for v in voices}) == 14 and voices == voices_for("fr", 14, seed=0)
    assert len({v.name for v in voices[:12]}) == 12  # the first 12 differ in variant
    assert voices_for("fr", 3, seed=0) == voices[:3] and voices_for("fr", 3, seed=1) != voices[:3]
    assert voices[0].id.startswith("espeak-ng:fr-fr+") and ":s" in voices[0].id and ":p" in voices[0].id
    with pytest.raises(ConfigError, match="no espeak-ng voice"):
        voices_for("ja", 1)


def test_cli_corpus(run, texts, tmp_path):
    out = tmp_path / "c"
    rc, stdout, err = run("speech", "corpus", "--langs", "en,fr", "--voices", "1", "--train-per-lang", "1",
                          "--test-per-lang", "1", "--max-chars", "60", "--texts", f"en={texts['en']}",
                          f"fr={texts['fr']}", "--out", out)
    assert rc == 0, err
    assert "4 utterances (2 train, 2 test)" in stdout and "4 voices, 2 languages" in stdout
    assert len(read_manifest(out)) == 4
    rc, _, err = run("speech", "corpus", "--langs", "en,zz", "--out", tmp_path / "d")
    assert rc == 2 and "unknown languages" in err and not (tmp_path / "d").exists()
    rc, _, err = run("speech", "corpus", "--langs", "en", "--out", out)
    assert rc == 2 and "--overwrite" in err
