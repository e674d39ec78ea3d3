"""Helpers shared by the commands: the parser classes, consoles, number formatting, argument types."""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from moekit.errors import ConfigError, WriteError


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already words it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "(default" in text or not action.option_strings or not shows_default(action) else \
            f"{text} (default: %(default)s)"


def shows_default(action: argparse.Action) -> bool:
    """Whether the option has a default worth stating (not None, False, an empty list or suppressed)."""
    d = action.default
    return not (d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, list) and not d))


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line, like every other error, and defaults shown in the help
    (subparsers inherit both)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        print(f"moekit: error: {self.prog}: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


class LazyParser(Parser):
    """A subcommand's parser whose arguments `build(parser)` adds only when that subcommand is parsed (its
    help included): they may need modules that `moekit --help` and the other commands should not import.
    Use it as `add_subparsers(parser_class=LazyParser)` and `add_parser(name, build=...)`."""

    def __init__(self, *args, build: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.build = build

    def parse_known_args(self, args=None, namespace=None):
        self.built()
        return super().parse_known_args(args, namespace)

    def built(self) -> LazyParser:
        """This parser with its arguments added."""
        if self.build is not None:
            build, self.build = self.build, None
            build(self)
        return self


class PlainConsole(Console):
    """A console for a pipe or a file: each line as long as its content needs (nothing wrapped at a width,
    no padding, no trailing spaces), so that tables stay greppable."""

    def __init__(self, **kwargs):
        super().__init__(width=1 << 16, **kwargs)  # wide enough that nothing wraps; the padding is stripped

    def print(self, *objects, **kwargs) -> None:
        with self.capture() as captured:
            super().print(*objects, **kwargs)
        self.file.write(re.sub(r"[ \t]+$", "", captured.get(), flags=re.MULTILINE))
        self.file.flush()


def check_stdout() -> None:
    """Standard output closed (`moekit ... >&-`, where Python sets sys.stdout to None): one clear error, raised by
    moekit.cli.main before the command runs, so no command writes an output and then fails to report it."""
    if sys.stdout is None:
        raise WriteError("standard output is closed: moekit prints its results there; redirect it to a file or "
                         "/dev/null instead of closing it")


def out_console() -> Console:
    """Results go to stdout (created per call so redirected/captured streams are honoured): at the terminal's
    width on a terminal, else at the content's natural width (PlainConsole)."""
    check_stdout()
    return (Console if sys.stdout.isatty() else PlainConsole)(highlight=False, soft_wrap=True)


def err_console() -> Console:
    """Progress and status go to stderr."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def summary(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph (docstrings wrap mid-sentence)."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    return re.split(r"(?<=[\w)\]])\.\s+(?=[A-Z])", para, maxsplit=1)[0].removesuffix(".") + "."


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


def device_arg(text: str) -> str:
    """argparse type for --device: auto | cpu | cuda | cuda:N (moekit.config.resolve_device)."""
    from moekit.config import resolve_device

    try:
        return resolve_device(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def lang_files(pairs: list[tuple[str, Path]] | None, flag: str) -> dict[str, Path]:
    """{LANG: FILE} of a repeatable/extendable LANG=FILE option; a language given twice is refused."""
    out: dict[str, Path] = {}
    for lang, path in pairs or []:
        if lang in out:
            raise ConfigError(f"{flag} gives language {lang!r} twice ({out[lang]} and {path}); give each once")
        out[lang] = path
    return out
