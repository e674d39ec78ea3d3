"""Shared by the benchmarks: replace one marked section of BENCHMARKS.md, summarize timings, cache runs."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from moekit._fs import write_text_atomic


def write_section(path: Path, section: str, mark: tuple[str, str]) -> None:
    """Put `section` (which starts with mark[0] and ends with mark[1]) in place of the old one, or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if mark[0] in text:
        head, rest = text.split(mark[0], 1)
        text = head + section + rest.split(mark[1], 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def spread(times: list[float]) -> tuple[float, float]:
    """(median, (p75 - p25) / median) of repeated timings: the value a table reports and how noisy it was."""
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return med, (q[2] - q[0]) / med


def cached(folder: Path, run) -> dict:
    """`run()`'s summary dict (its wall time added as "seconds"), kept in folder/summary.json: a bench that
    is interrupted resumes with the systems it has not finished (written atomically: a kill mid-write
    leaves no half file to trip over)."""
    path = folder / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    t0 = time.perf_counter()
    summary = {**run(), "seconds": time.perf_counter() - t0}
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(summary))
    return summary


def corpus(out: Path, **cfg) -> Path:
    """A speech corpus (moekit.speech.corpus) built once into `out`."""
    from moekit.speech.corpus import CorpusConfig, build_corpus

    if not (out / "manifest.jsonl").is_file():
        build_corpus(CorpusConfig(**cfg), out)
    return out
