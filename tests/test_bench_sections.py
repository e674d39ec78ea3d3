"""Issue 41: every BENCHMARKS.md section of a bench that commits its runs (bench/evidence.py) is what that bench's
`--report-only` makes of the files committed under bench/results/, byte for byte (its date included: the days the
runs finished, from their files); a section measured before its bench committed anything must be named in
BENCHMARKS' "Single runs that no code rebuilds" paragraph instead. A section added without its files, or edited by
hand, fails here."""
from __future__ import annotations

import importlib
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

COMMAND = re.compile(r"^`\.venv/bin/python bench/(\w+)\.py ([^`]*)`")


def sections(text: str) -> dict[str, str]:
    """{marker name: the section's text from <!-- name --> to <!-- /name -->}."""
    return {m[1]: m[0] for m in re.finditer(r"<!-- ([a-z0-9_]+) -->.*?<!-- /\1 -->", text, re.S)}


def command(section: str) -> tuple[str, str] | None:
    """(bench, its arguments) of the section's command line, or None if it names none."""
    for line in section.splitlines():
        if found := COMMAND.match(line):
            return found[1], found[2]
    return None


def not_rebuilt(text: str) -> set[str]:
    """The marker names BENCHMARKS' "Single runs that no code rebuilds" paragraph lists."""
    para = text.split("**Single runs that no code rebuilds.**", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`([a-z0-9_]+)`", para))


def commits_runs(bench: str) -> bool:
    return "from evidence import" in (BENCH / f"{bench}.py").read_text()


TEXT = (ROOT / "BENCHMARKS.md").read_text()
REBUILT = sorted(name for name, sec in sections(TEXT).items()
                 if (cmd := command(sec)) and commits_runs(cmd[0]) and name not in not_rebuilt(TEXT))


def test_every_section_of_a_bench_that_commits_runs_is_rebuilt_or_listed():
    listed = not_rebuilt(TEXT)
    assert listed <= set(sections(TEXT)), f"the paragraph names no such sections: {listed - set(sections(TEXT))}"
    assert {"spri_mini", "rise_mini", "omni_ctc", "ume_whisper"} <= set(REBUILT)
    assert not listed & set(REBUILT)


@pytest.mark.parametrize("name", REBUILT)
def test_section_is_what_report_only_makes_of_the_committed_runs(name, tmp_path, monkeypatch):
    bench, args = command(sections(TEXT)[name])
    shutil.copy(ROOT / "BENCHMARKS.md", tmp_path / "BENCHMARKS.md")
    monkeypatch.chdir(tmp_path)  # --out runs/... does not exist here: only bench/results/ can feed the report
    argv = shlex.split(args)
    assert argv[-2:] == ["--write", "BENCHMARKS.md"], "the command must write BENCHMARKS.md"
    importlib.import_module(bench).main([*argv, "--report-only"])
    assert not (tmp_path / "runs").exists()
    rebuilt = sections((tmp_path / "BENCHMARKS.md").read_text())[name]
    assert rebuilt == sections(TEXT)[name]
