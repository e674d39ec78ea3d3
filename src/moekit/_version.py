"""moekit's version: the installed distribution's, else the source tree's pyproject.toml's."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def version() -> str:
    """The version of the installed moekit distribution, else of the source tree's pyproject.toml (a checkout on
    PYTHONPATH), else "(not installed)"."""
    import importlib.metadata

    try:
        return importlib.metadata.version("moekit")
    except importlib.metadata.PackageNotFoundError:
        return source_version(PACKAGE.parents[1] / "pyproject.toml") or "(not installed)"


def source_version(pyproject: Path) -> str | None:
    """The version in a moekit pyproject.toml, or None (no such file, or another project's)."""
    import tomllib

    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return project.get("version") if project.get("name") == "moekit" else None
