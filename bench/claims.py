"""The headline claims' tables, rebuilt by code: every claims table of BENCHMARKS.md recomputed from the per-item
scores committed under bench/results/<bench>/ (bench/evidence.py; a table measured before those were committed: from
its own printed per-seed columns, marked as such), then copied word for word into the documentation site's benchmarks page, docs/benchmarks.md (between
<!-- claims --> and <!-- /claims -->), so that the two files cannot give a claim different words or numbers.
tests/test_bench_stats.py checks that both files are this script's output for what the repository holds.

    .venv/bin/python bench/claims.py            # after a benchmark wrote its section to BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from claim_specs import BEST, NDIGITS, SPECS, WEIGHTS, specs
from evidence import RESULTS, VERDICT_RULE, claim_rows, claims_table, from_printed, load_scores
from report import write_section  # bench/report.py

HEADER = "| claim (paper's direction) |"
MARK = ("<!-- claims -->", "<!-- /claims -->")


def claim_tables(text: str) -> list[tuple[str, list[str]]]:
    """(heading of the section, lines of its claims table: header, rule, rows) of every claims table in a
    BENCHMARKS.md text, in order."""
    tables, heading, lines = [], "", text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            heading = line[3:].strip()
        if line.startswith(HEADER):
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            tables.append((heading, lines[i:end]))
    return tables


def bench_of(heading: str) -> str:
    found = re.search(r"\(bench/(\w+)\.py\)", heading)
    if not found or found[1] not in SPECS:
        raise ValueError(f"a claims table under '{heading}', a section of no benchmark with claims")
    return found[1]


def best(bench: str, scores: dict) -> str:
    """BEST's system of a bench with the highest mean of BEST's metric over its committed runs' items ("{best}"
    while none is committed)."""
    key, names = BEST.get(bench, ("", ()))
    means = {n: np.concatenate([v[key] for (m, _), v in scores.items() if m == n]).mean()
             for n in names if any(m == n for m, _ in scores)}
    return max(means, key=means.get, default="{best}")


def committed_rows(bench: str, root: Path = RESULTS) -> list[dict]:
    """claims_table's rows of a bench's claims from its per-item scores committed under `root` ([] if none):
    every seed committed for both systems of a claim (omni_ctc: at 4 experts, else the fewest committed; "{best}":
    best())."""
    scores = load_scores(bench, root)
    experts = {int(m[1]) for n, _ in scores if (m := re.fullmatch(r"omni-(\d+)", n))}
    return claim_rows(specs(bench, 4 if 4 in experts or not experts else min(experts), best(bench, scores)), scores,
                      WEIGHTS.get(bench))


def committed_claims(bench: str, intro: str, root: Path = RESULTS) -> list[str]:
    """A bench's claims paragraph (`intro`, the verdict rule) and table from its committed per-item scores, the very
    table rebuild() makes of them; [] while no claim has both systems committed."""
    rows = committed_rows(bench, root)
    return [f"{intro} {VERDICT_RULE}", "", *claims_table(rows, NDIGITS[bench])] if rows else []


def rebuild_table(heading: str, table: list[str], root: Path = RESULTS) -> list[str]:
    """A claims table recomputed: from the bench's committed per-item scores if it has any, else from the table's
    own per-seed columns (evidence.from_printed)."""
    bench = bench_of(heading)
    rows = committed_rows(bench, root) or [from_printed(line, SPECS[bench], NDIGITS[bench]) for line in table[2:]]
    return claims_table(rows, NDIGITS[bench])


def rebuild(benchmarks: str, root: Path = RESULTS) -> str:
    """BENCHMARKS.md's text with every claims table rebuilt."""
    for heading, table in claim_tables(benchmarks):
        benchmarks = benchmarks.replace("\n".join(table), "\n".join(rebuild_table(heading, table, root)), 1)
    return benchmarks


def section(benchmarks: str) -> str:
    parts = [MARK[0], "Measured in miniature over the seeds named in each row; copied from BENCHMARKS.md by "
                      f"bench/claims.py. {VERDICT_RULE}"]
    tables = claim_tables(benchmarks)
    if not tables:
        parts.append("\nNo claim has been measured over seeds yet.")
    for heading, table in tables:
        parts += ["", f"*{heading}*", "", *table]
    return "\n".join([*parts, MARK[1]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmarks", type=Path, default=Path("BENCHMARKS.md"))
    ap.add_argument("--page", type=Path, default=Path("docs/benchmarks.md"))
    args = ap.parse_args()
    text = rebuild(args.benchmarks.read_text())
    args.benchmarks.write_text(text)
    write_section(args.page, section(text), MARK)


if __name__ == "__main__":
    main()
