"""Shared by the benchmarks: replace one marked section of BENCHMARKS.md, summarize timings, cache runs."""
from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

from moekit._fs import write_text_atomic


def log_progress() -> None:
    """Print moekit's progress records (each training step with its loss, generation, transcription, upcycling)
    with a timestamp on stderr, so that a long benchmark's log shows where it is and how fast it goes."""
    import logging

    logger = logging.getLogger("moekit.progress")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


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


def stopwatch(folder: Path):
    """Start timing a run into `folder`. Returns a function giving the run's wall time for its summary:
    {"seconds": s}, plus {"resumed_at": step} where the run continues from a checkpoint (the last complete one of its
    interrupted partial directory); a resumed run's seconds count only the process that finished it."""
    from moekit._fs import partial_path
    from moekit.training.common import last_checkpoint

    last = last_checkpoint(partial_path(folder))
    start, t0 = {} if last is None else {"resumed_at": int(last.name.removeprefix("checkpoint-"))}, time.perf_counter()
    return lambda: {"seconds": time.perf_counter() - t0, **start}


def wall_of(summary: dict) -> dict:
    """What a committed run keeps of its summary's wall time: "seconds", and "resumed_at" where there is one."""
    return {k: summary[k] for k in ("seconds", "resumed_at") if k in summary}


def wall(r: dict) -> str:
    """A table's wall time in minutes, naming the step a resumed run continued from (`stopwatch`)."""
    step = r.get("resumed_at")
    return f"{r['seconds'] / 60:.1f}" + (f" (resumed at step {step})" if step else "")


def resumable(out: Path):
    """(the results cached in OUT/results.json, step(name, fn)): step runs fn once, caches its result and returns
    it, so an interrupted benchmark resumes where it stopped."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}

    def step(name, fn):
        if name not in results:
            print(f"{time.strftime('%H:%M:%S')} {name}", flush=True)
            results[name] = fn()
            path.write_text(json.dumps(results, indent=1))
        return results[name]

    return results, step


def cached(folder: Path, run) -> dict:
    """`run()`'s summary dict (its wall time added as "seconds", and "resumed_at" where it continued from a
    checkpoint: `stopwatch`), kept in folder/summary.json: a bench that is interrupted resumes with the systems it has
    not finished (written atomically: a kill mid-write leaves no half file to trip over)."""
    path = folder / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    clock = stopwatch(folder)
    summary = {**run(), **clock()}
    folder.mkdir(parents=True, exist_ok=True)
    return finish(folder, summary)


def finish(folder: Path, summary: dict) -> dict:
    """Mark a run finished: write folder/summary.json (atomically), then delete folder/checkpoints. Checkpoints only
    serve to resume an interrupted run, and a finished MoE run's last one is ~3x its model (the optimizer's two
    moments): left in place, five seeds of a few systems fill a disk. The trained model and results stay."""
    write_text_atomic(folder / "summary.json", json.dumps(summary))
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return summary


def device_name(device=None) -> str:
    """What this process computes on (`device`, or by default the first GPU if there is one), for a run's summary:
    the GPU's name, or the CPU and its thread count."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} thread(s)"


def cpu_name() -> str:
    """The CPU's model name as Linux reports it (/proc/cpuinfo), else the architecture: "AMD EPYC CPU"."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + " CPU"
    except OSError:
        pass
    return f"{platform.machine()} CPU"


UNRECORDED = "CPU (device not recorded)"  # runs summarized before the device was: all ran on CPU machines


def measured_on(summaries) -> str:
    """When and on what a table's runs were measured, from their committed records: "2026-11-27 to 2026-11-28,
    measured on AMD EPYC CPU, 1 thread(s)" (the days the runs finished, evidence.save_scores; each device named
    once, "; " between them: a device name may hold a comma)."""
    summaries = list(summaries)
    days = sorted({s["date"] for s in summaries if s.get("date")})
    when = "date not recorded" if not days else days[0] if days[0] == days[-1] else f"{days[0]} to {days[-1]}"
    return f"{when}, measured on " + "; ".join(sorted({s.get("device") or UNRECORDED for s in summaries}))


def corpus(out: Path, **cfg) -> Path:
    """A speech corpus (moekit.speech.corpus) built once into `out`."""
    from moekit.speech.corpus import CorpusConfig, build_corpus

    if not (out / "manifest.jsonl").is_file():
        build_corpus(CorpusConfig(**cfg), out)
    return out


# --- seeds: where each run lives ---


def seed_folder(out: Path, name: str, seed: int) -> Path:
    """Where one (system, seed) run lives: seed 0 where the single-seed benchmarks always kept it (so their
    cached runs stay valid), other seeds under out/seed{n}/."""
    return out / name if seed == 0 else out / f"seed{seed}" / name


def seed_overrides(recipe: Path, seed: int) -> list[str]:
    """Seed n of a recipe: the Trainer's seed (initialization of anything drawn in training, data order) and the seed
    of each seeded section the recipe has (moe: the upcycling's draws, simoe: the masks' initialization); seed 0
    leaves the recipe as it is."""
    if seed == 0:
        return []
    import yaml

    sections = yaml.safe_load(recipe.read_text())
    return [f"train.seed={seed}", *(f"{key}.seed={seed}" for key in ("moe", "simoe") if key in sections)]


def paired_bootstrap(a, b, weights=None, resamples: int = 2000, seed: int = 0) -> dict:
    """The mean difference a − b over seeds × test items and its 95 % interval, by a two-level paired
    bootstrap: each resample draws the seeds with replacement and, within each drawn seed, its test items
    with replacement; both systems take the same draw (paired: same seeds, same items). For one seed's
    table of differences over test items; over several seeds it under-covers (the items' effect, shared by
    the seeds, averages away; issue 41), and the claims' verdicts use evidence.claim_interval instead.

    a, b: (seeds, items) per-item scores of two systems, row s from the runs with seed s, column i the same
    test item in every row. weights: (seeds, items) or (items,), default equal; the statistic is the
    weighted mean Σ w·(a − b) / Σ w over the drawn (seed, item) cells (weights = reference lengths make it
    the difference of corpus-level error rates). Returns {"mean", "lo", "hi", "per_seed" (the statistic
    of each seed alone), "a", "b" (each system's weighted mean per seed), "seeds", "items", "resamples"}."""
    import numpy as np

    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.ndim != 2 or a.shape != b.shape or a.size == 0:
        raise ValueError(f"a and b must be (seeds, items) arrays of one shape, got {a.shape} and {b.shape}")
    S, N = a.shape
    w = np.ones_like(a) if weights is None else np.broadcast_to(np.asarray(weights, float), a.shape)
    if (w < 0).any() or (w.sum(1) <= 0).any():
        raise ValueError("weights must be non-negative with a positive sum in every seed")
    d = a - b
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, S, (resamples, S))  # (R, S) drawn seeds
    items = rng.integers(0, N, (resamples, S, N))  # (R, S, N) items drawn within each drawn seed
    dw, ww = (d * w)[seeds[..., None], items], w[seeds[..., None], items]  # (R, S, N)
    boot = dw.sum((1, 2)) / ww.sum((1, 2))  # (R,)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    wsum = w.sum(1)
    return {"mean": float((d * w).sum() / w.sum()), "lo": float(lo), "hi": float(hi),
            "per_seed": ((d * w).sum(1) / wsum).tolist(), "a": ((a * w).sum(1) / wsum).tolist(),
            "b": ((b * w).sum(1) / wsum).tolist(), "seeds": S, "items": N, "resamples": resamples}
