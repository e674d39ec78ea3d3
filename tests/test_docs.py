"""The documentation site builds with `mkdocs build --strict` (as `make docs` does), so CI (`make test`) fails on a
broken link, a missing anchor, an API object mkdocstrings cannot find, or a docstring griffe cannot read; and strict
mode with this site's settings really refuses a broken link."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def build(config: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
                          cwd=config.parent, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict(tmp_path):
    res = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "WARNING" not in res.stderr, res.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "moekit" / "index.html").read_text()
    assert 'id="moekit.checkpoint.upcycle_model.upcycle"' in reference and 'id="moekit.training.trainer.MoETrainer"' in reference
    for page in ("getting-started", "guides/train", "methods/spri", "benchmarks-details", "architecture"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_strict_mode_refuses_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# a page\n\nSee [the guide](guides/nowhere.md).\n")
    config = {key: CONFIG[key] for key in ("strict", "validation")} | {"site_name": "t", "docs_dir": "docs"}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    res = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert res.returncode != 0 and "guides/nowhere.md" in res.stderr, res.stderr[-2000:]
