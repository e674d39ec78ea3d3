"""Helpers shared by the commands: consoles, number formatting, LANG=FILE arguments."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from moekit.errors import ConfigError


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


def lang_file(text: str) -> tuple[str, Path]:
    """argparse type for LANG=FILE."""
    lang, sep, path = text.partition("=")
    if not sep or not lang or not path:
        raise argparse.ArgumentTypeError(f"expected LANG=FILE, got {text!r}")
    return lang, Path(path)


def lang_files(pairs: list[tuple[str, Path]] | None, flag: str) -> dict[str, Path]:
    """{LANG: FILE} of a repeatable/extendable LANG=FILE option; a language given twice is refused."""
    out: dict[str, Path] = {}
    for lang, path in pairs or []:
        if lang in out:
            raise ConfigError(f"{flag} gives language {lang!r} twice ({out[lang]} and {path}); give each once")
        out[lang] = path
    return out
