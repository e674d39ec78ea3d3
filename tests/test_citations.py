"""Every "§", "eq." and "Table/Fig." reference in README.md, BENCHMARKS.md, the documentation site's pages (docs/) and
the sources under src/moekit and bench/
names a section, equation, table or figure that exists in its paper (issue 41): the paper is the one named nearest
before the reference (same line, else the same paragraph, else the file's or section's paper), and its headings,
numbered equations and table/figure captions are extracted from the full text in ../shared/papers (beside the
repository, as in the workspace; the test skips where that folder is absent)."""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ROOT.parent / "shared" / "papers"
NAMES = {"SPRI": "spri", "UME": "ume", "Omni-router": "omni_router", "Omni-Router": "omni_router", "SIMoE": "simoe",
         "RISE": "rise"}
NAMES.update({f"`{p}`": p for p in ("spri", "ume", "simoe")})  # the method names of README and docs/
NAME = re.compile(r"(" + "|".join(map(re.escape, NAMES)) + r")\b|\bet al\.")  # et al.: a paper not among the five
ROMAN = "IVX"
NUM = r"(?:[IVX]+|[A-Z]?\d+(?:\.\d+)*|[A-Z](?:\.\d+)+)"
REFS = {  # kind -> pattern whose groups are the first and (for ranges) last number
    "section": re.compile(r"§\s?([IVX]+(?:-[A-Z](?:-\d+)?)?|[A-Z](?:\.\d+)+|\d+(?:\.\d+)*)"),
    "equation": re.compile(r"\b[Ee]q(?:n|s)?\.\s*\(?(\d+(?:\.\d+)?)\)?(?:\s*[-–]\s*(\d+(?:\.\d+)?))?"),
    "table": re.compile(r"\b(?:Tables?|Tab\.)\s+([IVX]+|\d+)\b(?:\s*[-–]\s*([IVX]+|\d+)\b)?"),
    "figure": re.compile(r"\b(?:Figures?|Figs?\.)\s+(\d+)\b(?:\s*[-–]\s*(\d+)\b)?"),
}
pytestmark = pytest.mark.skipif(not PAPERS.is_dir(), reason=f"the papers' text is not at {PAPERS}")


@cache
def contents(paper: str) -> dict[str, set[str]]:
    """The section, equation, table and figure numbers a paper's text has."""
    text = (PAPERS / f"{paper}.txt").read_text()
    text = text.replace("\\fontspec_if_language:nTFENG\\addfontfeatureLanguage=English", "\n")  # RISE's markup
    text = re.sub(r"<span[^>]*></span>", "", text)
    sections = set(re.findall(rf"^\s*({NUM})\.?\s+\*?[A-Z]", text, re.M)) | set(re.findall(r"^Appendix ([A-Z])\b", text, re.M))
    sections |= {s.split(".")[0] for s in sections}
    top = sub = ""
    for line in text.splitlines():  # UME: "# III. ...", "## *C. ...*", "*2) ...:*" make III, III-C, III-C-2
        if m := re.match(r"#+\s*\*?([IVX]+)\.\s", line):
            top = m[1]
            sections.add(top)
        elif m := re.match(r"#+\s*\*?([A-Z])\.\s", line):
            sub = f"{top}-{m[1]}"
            sections.add(sub)
        elif (m := re.match(r"\*(\d)\)\s", line)) and sub:
            sections.add(f"{sub}-{m[1]}")
    equations = set(re.findall(r"\((\d+(?:\.\d+)?)\)\s*\$*\s*$", text, re.M)) | set(re.findall(r"\\tag\{(\d+)\}", text))
    caption = r"^\s*(?:\*\*)?"
    tables = set(re.findall(caption + r"(?:TABLE|Table)\s+([IVX]+|\d+)\b", text, re.M)) | set(re.findall(r"TABLE ([IVX]+):", text))
    figures = set(re.findall(caption + r"(?:Fig\.|Figure)\s+(\d+)\b", text, re.M))
    return {"section": sections, "equation": equations, "table": tables, "figure": figures}


def paper_of_path(path: Path) -> str | None:
    found = [p for p in ("simoe", "spri", "ume", "omni", "rise") if p in path.name]
    return {"omni": "omni_router"}.get(found[0], found[0]) if len(found) == 1 else None


def named(text: str, last: bool = True) -> str | None:
    """The paper named last (or first) in a text; None where that is another work ("X et al.") or there is none."""
    names = NAME.findall(text) if last else NAME.findall(text)[:1]
    return (NAMES.get(names[-1]) or "other") if names else None


def references(path: Path):
    """(line number, reference, kind, numbers, paper or None) of every reference in a file: the paper named nearest
    before it on its line, else first after it on its line, else last in its paragraph before it, else its
    section's (Markdown headings) or its file's."""
    text = path.read_text()
    heading_paper = None
    lines = text.splitlines()
    paragraph = []  # the lines of the current paragraph before this one
    for n, line in enumerate(lines, 1):
        if line.startswith("#"):
            heading_paper = named(line) if path.suffix == ".md" else heading_paper
        if not line.strip():
            paragraph = []
        for kind, pattern in REFS.items():
            for m in pattern.finditer(line):
                paper = (named(line[: m.start()]) or named(line[m.end():], last=False) or named(" ".join(paragraph))
                         or heading_paper or paper_of_path(path))
                yield n, m[0], kind, [g for g in m.groups() if g], None if paper == "other" else paper
        paragraph.append(line)


def files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "src" / "moekit").rglob("*.py")),
            *sorted((ROOT / "bench").glob("*.py"))]


def test_the_extraction_finds_each_papers_structure():
    assert {"III-C-2", "III-B", "IV"} <= contents("ume")["section"] and {"1", "2", "3"} == contents("ume")["equation"]
    assert {"5.1", "4.2", "C.3", "D"} <= contents("rise")["section"] and "28" in contents("rise")["equation"]
    assert {"3.3", "5.3"} <= contents("omni_router")["section"] and {"3.4", "4.1"} <= contents("omni_router")["equation"]
    assert {"I", "IV"} <= contents("ume")["table"] and {"1", "12"} <= contents("spri")["table"]
    assert {"4", "5"} <= contents("simoe")["figure"] and "13" in contents("simoe")["equation"]


def test_every_reference_names_something_its_paper_has():
    checked, wrong = 0, []
    for path in files():
        for n, ref, kind, numbers, paper in references(path):
            if paper is None:
                continue
            checked += 1
            missing = [x for x in numbers if x not in contents(paper)[kind]]
            if missing:
                wrong.append(f"{path.relative_to(ROOT)}:{n}: {ref!r} ({paper}: no {kind} {', '.join(missing)})")
    assert checked > 200 and not wrong, "\n".join(wrong)
