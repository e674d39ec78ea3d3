"""Shared by the benchmarks: replace one marked section of BENCHMARKS.md."""
from __future__ import annotations

from pathlib import Path


def write_section(path: Path, section: str, mark: tuple[str, str]) -> None:
    """Put `section` (which starts with mark[0] and ends with mark[1]) in place of the old one, or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if mark[0] in text:
        head, rest = text.split(mark[0], 1)
        text = head + section + rest.split(mark[1], 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
