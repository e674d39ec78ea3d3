"""bench/report.py's paired bootstrap over seeds × test items and its verdict rule, against hand-computed cases;
bench/claims.py's copy of the claims tables into README.md, against BENCHMARKS.md as it is."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from claims import MARK, claim_tables, section  # noqa: E402
from report import (claims_table, device_name, measured_on, paired_bootstrap, seed_folder, t_interval,  # noqa: E402
                    verdict)

ROOT = Path(__file__).resolve().parents[1]


def test_t_interval_over_per_seed_differences_by_hand():
    # d = (2, 3, 4): mean 3, sd 1, t(0.975, 2) = 4.302653 -> half width 4.302653 / sqrt(3) = 2.484138
    s = t_interval([3.0, 5.0, 7.0], [1.0, 2.0, 3.0])
    assert s["mean"] == 3.0 and s["per_seed"] == [2.0, 3.0, 4.0] and s["seeds"] == 3
    assert s["lo"] == pytest.approx(3 - 2.484138, abs=1e-6) and s["hi"] == pytest.approx(3 + 2.484138, abs=1e-6)
    assert verdict(s["lo"], s["hi"], 1) == "reproduced"
    one = t_interval([1.0], [0.0])  # one seed: no interval, so no verdict either way
    assert np.isnan(one["lo"]) and verdict(one["lo"], one["hi"], 1) == "not reproduced at this scale"


def test_a_table_names_every_device_its_runs_were_measured_on_once():
    # runs summarized before the device was recorded count as "CPU"
    runs = [{"device": "NVIDIA H100 80GB HBM3"}, {}, {"device": "NVIDIA H100 80GB HBM3"}, {"device": device_name()}]
    assert measured_on(runs) == ", ".join(sorted({"NVIDIA H100 80GB HBM3", "CPU", device_name()}))
    assert measured_on([{}]) == "CPU"


def test_a_device_is_named_as_asked_and_the_default_is_the_gpu_when_there_is_one():
    import platform

    import torch

    assert device_name("cpu") == f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s)"
    assert device_name() == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else device_name("cpu"))


def test_constant_difference_gives_a_degenerate_interval_even_with_noisy_items():
    # paired: the items' own noise is shared by both systems, so a constant difference has no spread
    a = np.random.default_rng(1).normal(size=(3, 20))
    s = paired_bootstrap(a, a - 0.7)
    assert s["mean"] == pytest.approx(0.7) and s["lo"] == pytest.approx(0.7) and s["hi"] == pytest.approx(0.7)
    assert s["per_seed"] == pytest.approx([0.7] * 3) and (s["seeds"], s["items"]) == (3, 20)


def test_one_seed_two_items_symmetric():
    # items' differences −1 and +1: a resample's mean is −1, 0, +1 with probability 1/4, 1/2, 1/4, so the
    # 2.5 and 97.5 percentiles are −1 and +1, and the point estimate 0
    s = paired_bootstrap([[1.0, 3.0]], [[2.0, 2.0]], resamples=4000)
    assert s["mean"] == 0.0 and s["lo"] == -1.0 and s["hi"] == 1.0
    assert s["a"] == [2.0] and s["b"] == [2.0]


def test_seeds_are_resampled():
    # two seeds, items without spread inside each: differences 0 and 2, so resamples draw (0,0), (0,2), (2,2)
    # with probability 1/4, 1/2, 1/4: means 0, 1, 2 and the interval [0, 2]
    a = np.array([[5.0, 5.0, 5.0], [7.0, 7.0, 7.0]])
    b = np.full((2, 3), 5.0)
    s = paired_bootstrap(a, b, resamples=4000)
    assert s["mean"] == 1.0 and s["per_seed"] == [0.0, 2.0] and (s["lo"], s["hi"]) == (0.0, 2.0)


def test_weighted_mean_is_the_corpus_level_difference():
    # per-item error rates 0.5 and 0.0 vs 0.0 and 0.0 with 1 and 3 reference words: corpus 0.5·1/4 = 0.125
    s = paired_bootstrap([[0.5, 0.0]], [[0.0, 0.0]], weights=[1.0, 3.0])
    assert s["mean"] == pytest.approx(0.125) and s["a"] == pytest.approx([0.125]) and s["b"] == [0.0]
    assert 0.0 <= s["lo"] <= s["mean"] <= s["hi"] <= 0.5


def test_bad_shapes_and_weights_are_refused():
    with pytest.raises(ValueError):
        paired_bootstrap([1.0, 2.0], [1.0, 2.0])  # not (seeds, items)
    with pytest.raises(ValueError):
        paired_bootstrap([[1.0, 2.0]], [[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError):
        paired_bootstrap([[1.0, 2.0]], [[1.0, 2.0]], weights=[0.0, 0.0])


@pytest.mark.parametrize("lo, hi, direction, expected", [
    (0.1, 0.5, 1, "reproduced"), (-0.5, -0.1, 1, "contradicted"), (-0.1, 0.5, 1, "not reproduced at this scale"),
    (-0.5, -0.1, -1, "reproduced"), (0.1, 0.5, -1, "contradicted"), (0.0, 0.5, 1, "not reproduced at this scale"),
    (0.0, 0.0, -1, "not reproduced at this scale")])
def test_verdict_rule(lo, hi, direction, expected):
    assert verdict(lo, hi, direction) == expected


def test_claims_table_row():
    s = paired_bootstrap([[1.0, 3.0]], [[2.0, 2.0]], resamples=4000)
    lines = claims_table([{"claim": "X beats Y", "a": "x", "b": "y", "metric": "m", "direction": 1, "stat": s,
                           "seeds": [0]}])
    assert len(lines) == 3 and lines[2].endswith("| not reproduced at this scale |") and "+0.00 [-1.00, +1.00]" in lines[2]


def test_seed_folder_keeps_seed_0_where_it_was():
    assert seed_folder(Path("runs/x"), "spri", 0) == Path("runs/x/spri")
    assert seed_folder(Path("runs/x"), "spri", 2) == Path("runs/x/seed2/spri")


def test_claim_tables_finds_each_table_under_its_heading():
    row = claims_table([{"claim": "X beats Y", "a": "x", "b": "y", "metric": "m", "direction": -1, "seeds": [0, 1],
                         "stat": paired_bootstrap([[1.0], [1.0]], [[2.0], [2.0]])}])
    text = "\n".join(["# B", "## One (bench/one.py)", "| a | b |", "|---|---|", "", *row, "", "text",
                      "## Two", "no table", "## Three", *row, "|x|"])
    assert claim_tables(text) == [("One (bench/one.py)", row), ("Three", [*row, "|x|"])]
    assert row[2].endswith("| reproduced |")


def test_readme_claims_are_benchmarks_words():
    """README's claims section is bench/claims.py's output for BENCHMARKS.md as committed: each verdict row the same
    line in both files."""
    readme, benchmarks = (ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()
    inside = MARK[0] + readme.split(MARK[0], 1)[1].split(MARK[1], 1)[0] + MARK[1]
    assert inside == section(benchmarks)
    rows = [line for line in inside.splitlines() if line.startswith("| ")]
    assert set(rows) <= set(benchmarks.splitlines())
