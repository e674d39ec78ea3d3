"""The headline claims' verdicts, copied word for word from BENCHMARKS.md into README.md (between
<!-- claims --> and <!-- /claims -->), so that the two files cannot give a claim different words: every claims
table the benchmarks wrote (report.claims_table, one per benchmark run with --seeds) goes to README under its
benchmark's heading. tests/test_bench_stats.py checks that each row of README's tables is a line of BENCHMARKS.md.

    .venv/bin/python bench/claims.py            # after the benchmarks wrote their sections to BENCHMARKS.md
"""
from __future__ import annotations

import argparse
from pathlib import Path

from report import VERDICT_RULE, write_section  # bench/report.py

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
    ap.add_argument("--readme", type=Path, default=Path("README.md"))
    args = ap.parse_args()
    write_section(args.readme, section(args.benchmarks.read_text()), MARK)


if __name__ == "__main__":
    main()
