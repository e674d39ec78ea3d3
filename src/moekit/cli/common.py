"""Helpers shared by the commands: consoles, number formatting, tokenizer discovery."""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

from rich.console import Console

from moekit.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def out_console() -> Console:
    """Results go to stdout (created per call so redirected/captured streams are honoured). Not
    wrapped at 80 columns when stdout is a pipe or file, so tables stay greppable."""
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def err_console() -> Console:
    """Progress and status go to stderr."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def human(n: int) -> str:
    """1234567 -> '1,234,567 (1.23M)'."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n:,} ({n / div:.2f}{unit})"
    return f"{n:,}"


def load_tokenizer(folder: str | Path):
    """The tokenizer saved in `folder`, or None if it has no tokenizer files."""
    folder = Path(folder)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{folder} has tokenizer files but they do not load: {e}") from None


def lang_file(text: str) -> tuple[str, Path]:
    """argparse type for LANG=FILE."""
    lang, sep, path = text.partition("=")
    if not sep or not lang or not path:
        raise argparse.ArgumentTypeError(f"expected LANG=FILE, got {text!r}")
    return lang, Path(path)
