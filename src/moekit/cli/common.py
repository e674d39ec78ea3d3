"""Helpers shared by the commands: consoles, number formatting, LANG=FILE arguments."""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
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


def device_arg(text: str) -> str:
    """argparse type for --device: auto | cpu | cuda | cuda:N (auto: cuda when torch sees one)."""
    if text not in ("auto", "cpu", "cuda") and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    if text == "cpu":
        return text
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: torch sees no CUDA device here; use --device cpu (or auto)")
    return text


def lang_files(pairs: list[tuple[str, Path]] | None, flag: str) -> dict[str, Path]:
    """{LANG: FILE} of a repeatable/extendable LANG=FILE option; a language given twice is refused."""
    out: dict[str, Path] = {}
    for lang, path in pairs or []:
        if lang in out:
            raise ConfigError(f"{flag} gives language {lang!r} twice ({out[lang]} and {path}); give each once")
        out[lang] = path
    return out


@contextlib.contextmanager
def progress(label: str, total: int | None = None) -> Iterator[Callable[..., None]]:
    """`step(done=None, total=None, note="")` reports progress on stderr: a rich bar on a terminal, plain
    lines with the elapsed time and an ETA otherwise (so redirected logs show it; at most one line a second)."""
    console = err_console()
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.description}"))
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("", total=total)

            def step(done=None, total=None, note=""):
                bar.update(task, **({"advance": 1} if done is None else {"completed": done}),
                           **({} if total is None else {"total": total}), description=note)

            yield step
        return
    start, state = time.monotonic(), {"done": 0, "total": total, "shown": 0.0}

    def step(done=None, total=None, note=""):
        state["done"] = state["done"] + 1 if done is None else done
        state["total"] = total or state["total"]
        now, n, of = time.monotonic(), state["done"], state["total"]
        if now - state["shown"] < 1 and n != of:
            return
        state["shown"] = now
        elapsed = now - start
        eta = f", ETA {elapsed / n * (of - n):.0f} s" if of and n else ""
        print(f"{label} {n}/{of or '?'} {note} ({elapsed:.0f} s{eta})".replace("  ", " "), file=sys.stderr,
              flush=True)

    yield step
