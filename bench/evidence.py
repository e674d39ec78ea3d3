"""The statistics behind the benchmarks' claims tables (issue 41): an interval over seeds × test items, verdict rules
that say what they test (a difference, or agreement within a margin), Holm's correction across a table, and the
per-item scores each verdict is computed from, committed under bench/results/ so that a clone rebuilds the tables.

The interval (`claim_interval`). A claim compares two systems A and B, each trained over seeds s and scored on the same
test items i; d[s, i] = A − B. Two things vary that a claim about the methods must carry: the seed (training draws:
initialization, data order) and the test item (the test set is a sample of the task). Their contributions are
crossed, not nested: every seed is scored on the same items, so an item on which A beats B in one seed tends to in
every seed (an item × system effect shared by the seeds). With the two-way random-effects model
d[s, i] = Δ + γ_s + β_i + ε_si the mean over the S × N cells has variance σ_γ²/S + σ_β²/N + σ_ε²/(S·N), estimated
without bias by (MS_seeds + MS_items − MS_residual) / (S·N) from the two-way ANOVA of d, with Satterthwaite's
degrees of freedom for the t quantile. A t-interval over the S per-seed means alone leaves σ_β²/N out (it covers
the difference on these very test items, not on the task); a bootstrap that redraws items within each drawn seed
(bench/report.py paired_bootstrap, used before issue 41) averages the shared item effect away, and with 3 seeds
its percentile interval also ignores how little 3 seeds say about their own spread. tests/test_bench_stats.py
simulates all three at the seed and item variances of the SPRI runs, and this interval also at the seed, item and
residual variances estimated from every committed claim's runs: 93-97 % coverage, 95-98 % where the residual is
most of the mean's variance (the estimate is then often floored at one shared component's: wide, not narrow). Weighted statistics (corpus error rates:
per-item rates weighted by reference length) are linearized first (the delta method for a ratio of means).

One seed. With S = 1 the seed variance cannot be estimated: the interval is over the test items only and every
verdict from it says "in one seed": it speaks of this one trained pair, not of the methods.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np
from scipy import stats

from moekit._fs import write_text_atomic

LEVEL = 0.95
RESULTS = Path(__file__).resolve().parent / "results"  # bench/results/<bench>/seed{n}/<system>.json
VERDICTS = ("reproduced", "not reproduced at this scale", "contradicted")
VERDICT_RULE = (
    "Verdict rule (the same for every claim): a claim holds in a region of Δ = A − B: Δ on the side of 0 the paper "
    "reports (a difference claim), or Δ within a stated margin of it (an equivalence claim: \"no degradation\", "
    "\"matches\"; the margin taken from the paper's own numbers). **reproduced** if the 95 % interval of Δ lies "
    "inside that region, **contradicted** if it lies entirely outside, **not reproduced at this scale** otherwise. "
    "Interval: Student's t over seeds × test items (two-way random effects, Satterthwaite's degrees of freedom; "
    "bench/evidence.py claim_interval), or over the test items alone where there is one seed, and every verdict says "
    "which (\"over N seeds\", \"in one seed\"). p: the smallest level at which the interval would give a verdict; "
    "the Holm-adjusted verdict applies Holm's step-down correction to the p of every claim of the table (family-wise "
    "error 5 %).")


@dataclass(frozen=True)
class Claim:
    """A headline claim: A − B on `metric` (the key of the per-item scores), the paper's direction (+1: A > B,
    −1: A < B, 0: neither, with a margin: A matches B). With `margin`, an equivalence claim: Δ within `margin` of
    the paper's side (direction ±1: not worse by more than margin; 0: |Δ| < margin); `relative`: the margin is that
    fraction of B's mean. `source`: where the paper states the claim and its margin."""

    text: str
    a: str
    b: str
    key: str
    metric: str
    direction: int
    margin: float | None = None
    relative: bool = False
    source: str = ""

    def __post_init__(self):
        if self.direction not in (1, 0, -1) or (self.direction == 0 and self.margin is None):
            raise ValueError("direction must be +1 or -1, or 0 with a margin")
        if self.margin is not None and self.margin <= 0:
            raise ValueError("a margin must be positive")

    def margin_for(self, b_mean: float) -> float | None:
        return None if self.margin is None else self.margin * abs(b_mean) if self.relative else self.margin


# --- intervals ---

def _t(mean: float, var: float, df: float, unit: str, n: int, level: float) -> dict:
    se = float(np.sqrt(max(var, 0.0)))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    return {"mean": float(mean), "lo": float(mean) - half, "hi": float(mean) + half, "se": se, "df": float(df),
            "unit": unit, "n": n, "level": level}


def seed_interval(per_seed, level: float = LEVEL) -> dict:
    """t-interval (df = S − 1) of the mean of per-seed differences: what a table that printed only per-seed means
    allows. It covers the difference on the test items those means were taken over (their item effect is shared
    by every seed, so it is not in the spread). Returns {"mean", "lo", "hi", "se", "df", "unit": "seeds", "n"}."""
    x = np.asarray(per_seed, float)
    if x.ndim != 1 or len(x) < 2:
        raise ValueError(f"a seed interval needs the differences of at least 2 seeds, got {x.tolist()}")
    return _t(x.mean(), x.var(ddof=1) / len(x), len(x) - 1, "seeds", len(x), level)


def _linearized(a, b, weights):
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.ndim != 2 or a.shape != b.shape or a.shape[1] < 2:
        raise ValueError(f"a and b must be (seeds, items) arrays of one shape with 2 items or more, got {a.shape} "
                         f"and {b.shape}")
    w = np.ones_like(a) if weights is None else np.broadcast_to(np.asarray(weights, float), a.shape)
    if (w < 0).any() or (w.sum(1) <= 0).any():
        raise ValueError("weights must be non-negative with a positive sum in every seed")
    d = a - b
    mean = float((w * d).sum() / w.sum())
    wsum = w.sum(1)
    means = {"per_seed": ((w * d).sum(1) / wsum).tolist(), "a": ((w * a).sum(1) / wsum).tolist(),
             "b": ((w * b).sum(1) / wsum).tolist(), "seeds": a.shape[0], "items": a.shape[1]}
    return w * (d - mean) / w.mean(), mean, means  # u: each cell's contribution to the mean's error, Σu = 0


def claim_interval(a, b, weights=None, level: float = LEVEL) -> dict:
    """The mean difference A − B over seeds × test items and its `level` t-interval (module docstring).

    a, b: (seeds, items) per-item scores, row s the run with seed s, column i the same test item in every row.
    weights: (seeds, items) or (items,), default equal; the statistic is Σ w·(a − b) / Σ w (weights = reference
    lengths make it the difference of corpus-level error rates). Returns seed_interval's keys ("unit": "seeds ×
    items", or "items" for one seed) and "per_seed", "a", "b" (each seed's weighted mean), "seeds", "items"."""
    u, mean, means = _linearized(a, b, weights)
    S, N = u.shape
    if S == 1:
        return {**_t(mean, u.var(ddof=1) / N, N - 1, "items", N, level), **means}
    rows, cols = u.mean(1), u.mean(0)
    ms = {"seeds": (N * (rows ** 2).sum() / (S - 1), S - 1), "items": (S * (cols ** 2).sum() / (N - 1), N - 1),
          "residual": (((u - rows[:, None] - cols) ** 2).sum() / ((S - 1) * (N - 1)), (S - 1) * (N - 1))}
    (m_s, df_s), (m_i, df_i), (m_r, df_r) = ms.values()
    total = m_s + m_i - m_r
    if total < max(m_s, m_i):  # the estimate fell below a single component's: keep that component alone
        total, df = max((m_s, df_s), (m_i, df_i))
    else:
        df = total ** 2 / (m_s ** 2 / df_s + m_i ** 2 / df_i + m_r ** 2 / df_r) if total > 0 else S - 1
    return {**_t(mean, total / (S * N), df, "seeds × items", S, level), **means}


# --- verdicts ---

def _region(direction: int, margin: float | None) -> tuple[float, float]:
    """The interval of Δ in which the claim holds (open at its finite ends)."""
    m = 0.0 if margin is None else margin
    if direction == 0:
        return -m, m
    return (-m, np.inf) if direction > 0 else (-np.inf, m)


def verdict(lo: float, hi: float, direction: int, margin: float | None = None) -> str:
    """VERDICT_RULE for an interval [lo, hi] of A − B: a difference the paper reports as > 0 (direction +1) or < 0
    (−1); with a margin, agreement: A − B > −margin (+1), < margin (−1), or |A − B| < margin (0)."""
    if direction not in (1, 0, -1) or (direction == 0 and margin is None):
        raise ValueError("direction must be +1 or -1, or 0 with a margin")
    r_lo, r_hi = _region(direction, margin)
    if r_lo < lo and hi < r_hi:
        return VERDICTS[0]
    return VERDICTS[2] if hi < r_lo or lo > r_hi else VERDICTS[1]


def p_value(stat: dict, direction: int, margin: float | None = None) -> float:
    """The smallest 1 − level at which stat's t-interval would give a verdict other than "not reproduced": every
    finite end of the claim's region outside the interval (so p ≤ 0.05 exactly when the 95 % interval decides)."""
    ends = [e for e in _region(direction, margin) if np.isfinite(e)]
    dist = min(abs(stat["mean"] - e) for e in ends)
    if stat["se"] == 0:
        return 0.0 if dist > 0 else 1.0
    return float(2 * stats.t.sf(dist / stat["se"], stat["df"]))


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values (in the input's order): the k-th smallest p times (m − k + 1), made
    non-decreasing, capped at 1. A claim keeps its verdict at family-wise level α when its adjusted p ≤ α."""
    p = np.asarray(pvalues, float)
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (len(p) - np.arange(len(p)))))
    out = np.empty_like(p)
    out[order] = adjusted
    return out.tolist()


def evidence(stat: dict) -> str:
    """How much a verdict rests on: "over N seeds", "over N seeds (per-seed means)" (seed_interval: the test items'
    variance not in it), or "in one seed" (test items only)."""
    if stat["unit"] == "items":
        return "in one seed (test items only)"
    return f"over {stat['n']} seeds" + (" (per-seed means)" if stat["unit"] == "seeds" else "")


# --- the claims table ---

HEAD = ("| claim (paper's direction) | A − B | metric | seeds | A mean (per seed) | B mean (per seed) | Δ mean [95 % CI] "
        "| Δ per seed | p (Holm) | verdict | verdict, Holm-adjusted |")


def _side(claim: Claim, margin: float | None, nd: int) -> str:
    if margin is None:
        return "A > B" if claim.direction > 0 else "A < B"
    m = f"{margin:.{nd}f}" + (f" = {100 * claim.margin:g} % of B" if claim.relative else "")
    return {1: f"A − B > −{m}", -1: f"A − B < {m}", 0: f"|A − B| < {m}"}[claim.direction]


def claims_table(rows: list[dict], nd: int = 2) -> list[str]:
    """Markdown table of claims, one row per {"claim": Claim, "seeds": [seed numbers], "stat": claim_interval's or
    seed_interval's result with "a", "b", "per_seed"}; verdicts by VERDICT_RULE, raw and Holm-adjusted over the
    rows of this table."""
    fmt = lambda x, sign="": f"{x:{sign}.{nd}f}"  # noqa: E731
    per = lambda xs, sign="": " / ".join(fmt(x, sign) for x in xs)  # noqa: E731
    margins = [r["claim"].margin_for(np.mean(r["stat"]["b"])) for r in rows]
    ps = [p_value(r["stat"], r["claim"].direction, m) for r, m in zip(rows, margins)]
    out = [HEAD, "|---" * 11 + "|"]
    for r, m, p, p_adj in zip(rows, margins, ps, holm(ps)):
        c, s = r["claim"], r["stat"]
        word = verdict(s["lo"], s["hi"], c.direction, m)
        adjusted = word if p_adj <= 1 - s["level"] else VERDICTS[1]
        source = f"; {c.source}" if c.source else ""
        out.append(f"| {c.text} ({_side(c, m, nd)}{source}) | {c.a} − {c.b} | {c.metric} | "
                   f"{', '.join(map(str, r['seeds']))} | {fmt(np.mean(s['a']))} ({per(s['a'])}) | "
                   f"{fmt(np.mean(s['b']))} ({per(s['b'])}) | {fmt(s['mean'], '+')} [{fmt(s['lo'], '+')}, "
                   f"{fmt(s['hi'], '+')}] | {per(s['per_seed'], '+')} | {p:.3f} ({p_adj:.3f}) | {word} {evidence(s)} | "
                   f"{adjusted} {evidence(s)} |")
    return out


# --- per-item scores, committed ---

def scores_path(bench: str, system: str, seed: int, root: Path = RESULTS) -> Path:
    return root / bench / f"seed{seed}" / f"{system.replace(' ', '_').replace('/', '')}.json"


def save_scores(bench: str, system: str, seed: int, scores: dict[str, list[float]], root: Path = RESULTS,
                run: dict | None = None) -> dict:
    """Write one run's per-item scores (metric → one number per test item, same item order in every run) to
    bench/results/<bench>/seed{n}/<system>.json, compact (6 significant digits), and return them as read back, so
    that a table computed from the return value is the one a clone rebuilds from the file. `run`: the run's other
    reported values (small, JSON: the numbers of its row in the bench's table; no weights, no outputs), kept beside
    the scores for load_runs, with the day the run is committed (its "date": the day it finished; for the files
    committed before dates were kept, 2026-11-27/28, the day git first holds the file)."""
    if not scores or any(len(v) == 0 for v in scores.values()):
        raise ValueError(f"no per-item scores for {system} seed {seed}")
    data = {"bench": bench, "system": system, "seed": seed, "date": str(date.today()),
            "scores": {k: [float(f"{x:.6g}") for x in np.asarray(v, float).tolist()] for k, v in scores.items()},
            **({"run": run} if run is not None else {})}
    path = scores_path(bench, system, seed, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, separators=(",", ":")) + "\n")
    return load_scores(bench, root)[(system, seed)]


def _committed(bench: str, root: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((root / bench).glob("seed*/*.json"))]


def load_scores(bench: str, root: Path = RESULTS) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """Every committed run of a bench: (system, seed) → metric → per-item scores."""
    return {(d["system"], d["seed"]): {k: np.asarray(v, float) for k, v in d["scores"].items()}
            for d in _committed(bench, root)}


def load_runs(bench: str, root: Path = RESULTS) -> dict[tuple[str, int], dict]:
    """Every committed run of a bench: (system, seed) → the `run` values saved with its scores and its "date"."""
    return {(d["system"], d["seed"]): {**d.get("run", {}), "date": d.get("date")} for d in _committed(bench, root)}


def claim_rows(claims: list[Claim], scores: dict, weights: dict[str, str] | None = None) -> list[dict]:
    """claims_table's rows from per-item scores ((system, seed) → metric → items): each claim over the seeds where
    both systems have scores; `weights` maps a metric to the metric whose values weight its items (taken from
    B's run: the references are the same for both)."""
    rows = []
    for c in claims:
        if paired := paired_items(scores, c.a, c.b, c.key, (weights or {}).get(c.key)):
            seeds, A, B, w = paired
            rows.append({"claim": c, "seeds": seeds, "stat": claim_interval(A, B, w)})
    return rows


def paired_items(scores: dict, a: str, b: str, key: str, weight_key: str | None = None,
                 only: list[int] | None = None) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(seeds, A, B, W) of systems a and b from per-item scores ((system, seed) → metric → items): the seeds where
    both have scores (of `only`, if given), A and B their (seeds, items) scores under `key`, W (seeds, items) the
    weights under `weight_key`, taken from b's runs (None without it); None where no seed has both."""
    seeds = sorted(s for n, s in scores if n == a and (b, s) in scores and (only is None or s in only))
    if not seeds:
        return None
    A, B = (np.stack([scores[(n, s)][key] for s in seeds]) for n in (a, b))
    return seeds, A, B, None if weight_key is None else np.stack([scores[(b, s)][weight_key] for s in seeds])


# --- tables printed before issue 41: recomputed from their per-seed columns ---

PRINTED_NOTE = ("**Recomputed (issue 41) from this table's printed per-seed Δ** by `.venv/bin/python bench/claims.py`: "
                "Student's t over the per-seed means (bench/evidence.py seed_interval); the runs' per-item scores are "
                "not in the repository, so the test items' variance is not in these intervals (\"per-seed means\" in "
                "each verdict), and the verdicts are **pending a re-run over ≥ 5 seeds** that commits its per-item scores "
                "under bench/results/. The intervals quoted in the reading below are the earlier bootstrap's, which "
                "under-covers (issue 41).")


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"[+-]?\d+(?:\.\d+)?", cell.replace("−", "-"))]


def from_printed(line: str, claims: list[Claim], nd: int) -> dict:
    """claims_table's row for a printed claims row (this format or the one before issue 41): the claim of
    `claims` with its A − B and metric, its seeds, per-seed means and per-seed Δ as printed; the interval by
    seed_interval over the printed per-seed Δ."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    names, metric = cells[1], cells[2]
    match = [c for c in claims if re.fullmatch(re.escape(f"{c.a} − {c.b}").replace(r"\{e\}", r"\d+")
                                               .replace(r"\{best\}", r"\w+"), names)
             and c.metric == metric]
    if len(match) != 1:
        raise ValueError(f"no single claim for {names} on {metric}")
    a, b = [n.strip() for n in names.split("−")]
    c = match[0]
    per_a, per_b = (_numbers(cells[i].split("(", 1)[1]) for i in (4, 5))
    stat = seed_interval(_numbers(cells[7]))
    return {"claim": Claim(**{**c.__dict__, "a": a, "b": b}), "seeds": [int(s) for s in _numbers(cells[3])],
            "stat": {**stat, "per_seed": _numbers(cells[7]), "a": per_a, "b": per_b}}
