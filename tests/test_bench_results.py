"""Issue 41: every bench whose claims bench/claims.py rebuilds commits each finished run under bench/results/<bench>/
(per-item scores and its table row's numbers, bench/evidence.py save_scores) and makes its BENCHMARKS section from
those files alone. Each test here commits synthetic runs (5 seeds) to a temporary results folder, runs the bench's
`--report-only` against it with an output folder that does not exist (so nothing can come from runs/), and checks
the rows, the per-seed numbers and that the claims table is bench/claims.py's rebuild of the same files; the keep
step of each bench (a finished run's files -> committed scores) is checked against the scores computed by hand."""
from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from claims import claim_tables, rebuild, rebuild_table  # noqa: E402
from evidence import claim_interval, load_runs, load_scores, save_scores  # noqa: E402

SEEDS = [0, 1, 2, 3, 4]


def report_only(module, tmp_path: Path, *extra: str) -> str:
    """The section `module`'s --report-only writes from tmp_path/results, with no output folder on disk."""
    out = tmp_path / "BENCHMARKS.md"
    module.main(["--report-only", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "absent"),
                 "--seeds", *map(str, SEEDS), "--write", str(out), *extra])
    assert not (tmp_path / "absent").exists()
    return out.read_text()


def check_claims(text: str, root: Path, rows: int) -> list[str]:
    """The section's one claims table is claims.py's rebuild from root, over 5 seeds in every row; its rows."""
    ((heading, table),) = claim_tables(text)
    assert table == rebuild_table(heading, table, root) and rebuild(text, root) == text
    assert len(table) == 2 + rows and all(" over 5 seeds |" in line for line in table[2:])
    return table[2:]


# --- spri_mini ---

SPRI_LANGS = ["fr", "de", "sw", "tl"]


def spri_run(level: float, seconds: float) -> dict:
    return {"avg": {"bleu": level / 16, "chrf": level, "loss": 3.3}, "kl": 1.1, "diversity_init": None,
            "diversity": None, "directions": {lang: {"bleu": 1.0, "chrf": level} for lang in SPRI_LANGS},
            "params": {"total": 1000, "active": 500}, "seconds": seconds, "mean_kl": 1.05, "device": "test CPU"}


def test_spri_mini_section_comes_from_committed_results_alone(tmp_path):
    import spri_mini

    root, rng = tmp_path / "results", np.random.default_rng(0)
    for seed in SEEDS:
        for system, level in (("dense_ft", 17.0), ("naive", 15.0), ("spri", 16.8), ("spri_two_stage", 16.5)):
            chrf = level + rng.normal(0, 3, (12, len(SPRI_LANGS)))
            save_scores("spri_mini", system, seed, {"chrf": chrf.mean(1), **{f"chrf {lang}": chrf[:, j] for j, lang in
                                                                               enumerate(SPRI_LANGS)}}, root,
                        spri_run(level, 60.0 * (seed + 1)))
    text = report_only(spri_mini, tmp_path, "--only", "dense_ft", "naive", "spri", "spri_two_stage")
    assert "| spri (seed 3) | 1.05 | 16.80 | fr 1.0 / de 1.0 / sw 1.0 / tl 1.0 | fr 16.8 / de 16.8 / sw 16.8 / tl 16.8 | " \
           "3.300 | 1.1000 | 1.0500 | – → – | 1,000 | 500 | 4.0 |" in text
    assert "measured on test CPU" in text and "Incomplete" not in text
    scores = load_scores("spri_mini", root)
    d = scores[("naive", 0)]["chrf"] - scores[("dense_ft", 0)]["chrf"]
    assert f"| naive | {scores[('naive', 0)]['chrf'].mean():.2f} | {d.mean():+.2f} [" in text
    check_claims(text, root, 5)


def test_spri_mini_keeps_sentence_chrf_per_verse_and_direction(tmp_path, monkeypatch):
    import spri_mini
    from sacrebleu.metrics import CHRF

    refs = {"fr": ["le chat dort", "il pleut"], "sw": ["paka analala", "mvua inanyesha"]}
    hyps = {"fr": ["le chat dort", "il neige"], "sw": ["paka", "mvua inanyesha sana"]}
    folder = tmp_path / "runs" / "spri"
    folder.mkdir(parents=True)
    results = {**spri_run(16.0, 1.0), "translations": hyps, "usage": {"layer": [0.5, 0.5]}}
    results["directions"] = {lang: {"bleu": 1.0, "chrf": 16.0, "n": 2} for lang in refs}
    (folder / "results.json").write_text(json.dumps(results))
    monkeypatch.setattr(spri_mini, "references", lambda name, out, seed=0: refs)
    spri_mini.keep(tmp_path / "runs", "spri", 0, {"seconds": 1.0, "mean_kl": 1.05, "device": "x"}, "spri_mini",
                   tmp_path / "results")
    kept = load_scores("spri_mini", tmp_path / "results")[("spri", 0)]
    chrf = np.array([[CHRF().sentence_score(h, [r]).score for h, r in zip(hyps[lang], refs[lang])] for lang in refs]).T
    np.testing.assert_allclose(kept["chrf fr"], chrf[:, 0], rtol=1e-5)
    np.testing.assert_allclose(kept["chrf"], chrf.mean(1), rtol=1e-5)
    run = load_runs("spri_mini", tmp_path / "results")[("spri", 0)]
    assert "translations" not in run and "usage" not in run and run["directions"]["sw"] == {"bleu": 1.0, "chrf": 16.0}


# --- rise_mini ---

def rise_items(rng, level: float) -> dict:
    tokens = rng.integers(5, 30, 6)
    import rise_mini

    return {lang: {"nll": (level * tokens + rng.normal(0, 2, 6)).tolist(), "tokens": tokens.tolist()}
            for lang in rise_mini.LANGS}


def test_rise_mini_section_comes_from_committed_results_alone(tmp_path):
    import rise_mini

    root, rng = tmp_path / "results", np.random.default_rng(1)
    langs = list(rise_mini.LANGS)
    metrics = {"jaccard": np.eye(8).tolist(), "tokens_per_language": {lang: 10 for lang in langs},
               "cramers_v": [0.1, 0.2], "usage_entropy": [1.5, 2.0],
               "region_jaccard": {lang: {"shallow": 0.5, "middle": 0.4, "deep": 0.3} for lang in langs}}
    for seed in SEEDS:
        before = rise_items(rng, 3.0)
        result = {"seed": seed, "stage1_seconds": 600.0, "before": rise_mini.mean_losses(before), "before_items": before,
                  "metrics": {**metrics, "layers": [0, 3]}, "methods": {}}
        for method, level in (("rise", 2.5), ("esft", 2.6), ("topk", 2.6), ("random", 2.7)):
            result["methods"][method] = {"count": 16, "omega": {lang: 0.25 for lang in langs},
                                         "omega_mass": {lang: 4.0 for lang in langs}, "ft": [level - 3.0, 0.01],
                                         "prune": [0.2, 0.0], "ft_items": rise_items(rng, level),
                                         "prune_items": rise_items(rng, 3.2), "ft_seconds": 1.0}
        rise_mini.keep(result, tmp_path / "absent", root)
    assert load_runs("rise_mini", root)[("base", 0)]["metrics"] == metrics  # only what the report shows
    text = report_only(rise_mini, tmp_path)
    assert "| rise (seed 4) | 16 | 0.250 | 4.00 | 0.250 | 4.00 | -0.5000 | +0.0100 | +0.2000 | +0.0000 |" in text
    assert "(10.0 min)" in text and "Seeds 0, 1, 2, 3, 4" in text
    from report import device_name

    assert f"measured on {device_name()}. SmolLM2-135M" in text  # the machine the runs recorded
    check_claims(text, root, 3)
    # the committed per-verse losses weight back to the corpus loss the run reported
    kept = load_scores("rise_mini", root)[("base", 0)]
    before = load_runs("rise_mini", root)[("base", 0)]["before"]
    assert np.average(kept["target"], weights=kept["target tokens"]) == pytest.approx(before["sw"], rel=1e-5)


# --- omni_ctc ---

OMNI_LANGS = ["en", "fr"]


def omni_run(cer: float) -> dict:
    routing = {"cramers_v": [0.2, 0.3], "usage_entropy": [1.3, 1.4], "token_entropy": [0.8],
               "wer_change": {"0.1": -0.1, "0.5": 0.2}, "permutation": {"deltas": {"0.1": 0.004, "0.5": 0.02}}}
    return {"languages": {lang: {"wer": 0.99, "cer": cer / 100} for lang in OMNI_LANGS},
            "avg": {"wer": 0.99, "cer": cer / 100},
            "routing": routing, "params": {"total": 4.56e6, "active": 1.56e6},
            "loss": [[s, 3.0 - s / 400] for s in range(10, 410, 10)], "seconds": 480.0, "corpus_hours": 2.5,
            "device": "test CPU"}


def test_omni_ctc_section_comes_from_committed_results_alone(tmp_path):
    import omni_ctc

    root, rng = tmp_path / "results", np.random.default_rng(2)
    w = np.full(10, 0.2)  # 5 utterances per language: each language's corpus rate counts equally
    for seed in SEEDS:
        for system, cer in (("dense", 65.0), ("switch-4", 66.0), ("omni-4", 62.0)):
            save_scores("omni_ctc", system, seed, {"cer": cer + rng.normal(0, 8, 10), "wer": 99 + rng.normal(0, 1, 10),
                                                   "cer weight": w, "wer weight": w}, root, omni_run(cer))
    text = report_only(omni_ctc, tmp_path, "--systems", "dense", "switch-4", "omni-4")
    assert "| omni-4 (seed 2) | 99.0 | en 99.0 / fr 99.0 | 62.0 | en 62.0 / fr 62.0 | 2.025 | 0.25 | 1.35 | 0.80 | " \
           "-0.1 | +0.2 | +0.004 | +0.020 | 4.56M | 1.56M | 8.0 |" in text
    assert "(2.50 h in all)" in text and "measured on test CPU." in text and "Δ WER in points, same interval: omni-4 − switch-4 " in text
    check_claims(text, root, 2)


def test_omni_ctc_keeps_error_rates_in_percent_weighted_to_the_average(tmp_path):
    import omni_ctc
    from moekit.speech.text import error_rates

    transcripts = {"en": [{"ref": "in the beginning", "hyp": "in the begin"}, {"ref": "god", "hyp": "good"}],
                   "fr": [{"ref": "au commencement dieu", "hyp": "au commencement"}]}
    folder = tmp_path / "runs" / "dense"
    folder.mkdir(parents=True)
    run = omni_run(50.0)
    (folder / "results.json").write_text(json.dumps({**run, "transcripts": transcripts, "routing": None}))
    omni_ctc.keep("dense", 0, tmp_path / "runs", {"loss": run["loss"], "seconds": 1.0}, 2.5, tmp_path / "results")
    kept = load_scores("omni_ctc", tmp_path / "results")[("dense", 0)]
    cers = [error_rates([t["ref"]], [t["hyp"]], lang)["cer"] for lang, ts in transcripts.items() for t in ts]
    np.testing.assert_allclose(kept["cer"], 100 * np.array(cers), rtol=1e-5)
    # weights: within a language proportional to reference characters, each language summing to 1
    assert kept["cer weight"][2] == 1.0 and kept["cer weight"][:2].sum() == pytest.approx(1.0)
    assert load_runs("omni_ctc", tmp_path / "results")[("dense", 0)]["routing"] is None


# --- ume_whisper ---

def ume_run(wer: float) -> dict:
    return {"families": {f: {"wer": wer / 100, "cer": wer / 300} for f in ("espeak-ng", "flite")},
            "params": {"total": 37.8e6, "active": 37.8e6}, "rtf": 0.2, "loss": [[80, 0.5]], "seconds": 1200.0,
            "corpus_hours": 1.25, "device": "test CPU"}


def test_ume_whisper_section_comes_from_committed_results_alone(tmp_path):
    import ume_whisper

    root, rng = tmp_path / "results", np.random.default_rng(3)
    words = rng.integers(5, 25, 8).astype(float)
    save_scores("ume_whisper", "pretrained", 0, {"wer espeak-ng": np.full(8, 40.0), "words espeak-ng": words,
                                                 "wer flite": np.full(8, 18.0), "words flite": words},
                root, {**ume_run(40.0), "loss": []})
    for seed in SEEDS:
        for system, wer in (("fmft", 6.0), ("ume", 6.5)):
            save_scores("ume_whisper", system, seed, {"wer espeak-ng": wer + rng.normal(0, 5, 8), "words espeak-ng": words,
                                                      "wer flite": 14 + rng.normal(0, 5, 8), "words flite": words},
                        root, ume_run(wer))
    text = report_only(ume_whisper, tmp_path, "--systems", "pretrained", "fmft", "ume")
    assert "| pretrained | 40.0 | 40.0 | 13.3 | 13.3 | – | 37.8M | 37.8M | 0.200 | 20.0 |" in text
    assert "| ume (seed 4) | 6.5 | 6.5 | 2.2 | 2.2 | 0.500 | 37.8M | 37.8M | 0.200 | 20.0 |" in text
    assert "1.25 h of audio" in text and "measured on test CPU." in text and "Incomplete" not in text
    check_claims(text, root, 2)


def test_rise_ablations_section_comes_from_committed_results_alone(tmp_path):
    import rise_ablations
    import rise_mini

    root, rng = tmp_path / "results", np.random.default_rng(4)
    langs = list(rise_mini.LANGS)
    before = rise_items(rng, 3.0)
    rise_ablations.keep("base", {"ft_items": before, "before": rise_mini.mean_losses(before), "stage1_from": "runs/x"}, root)
    row = {"count": 16, "per_region": {"shallow": 6, "middle": 4, "deep": 6}, "groups": None, "ft_seconds": 1.0,
           "omega": {lang: 0.25 for lang in langs}, "omega_mass": {lang: 4.0 for lang in langs}, "ft": [-0.5, 0.01]}
    items = {"rise": rise_items(rng, 2.5), "rise K=8": rise_items(rng, 2.6)}
    rise_ablations.keep("rise", {**row, "ft_items": items["rise"], "prune": [0.2, 0.0], "prune_items": before}, root)
    rise_ablations.keep("rise K=8", {**row, "count": 8, "ft_items": items["rise K=8"], "prune": None}, root)
    out = tmp_path / "BENCHMARKS.md"
    rise_ablations.main(["--report-only", "--results", str(root), "--out", str(tmp_path / "absent"), "--write", str(out)])
    assert not (tmp_path / "absent").exists()
    text = out.read_text()
    a, w = rise_mini.verse_losses(items["rise K=8"], ["sw"])
    b, _ = rise_mini.verse_losses(items["rise"], ["sw"])
    s = rise_ablations.paired_bootstrap(a[None], b[None], weights=w[None])
    assert (f"| rise K=8 | 8 (6/4/6) | 0.250 | 4.00 | 0.250 | -0.5000 | {s['mean']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}] "
            "| +0.0100 | – | – |") in text
    assert "stage 1 copied from runs/x" in text
    assert f"Loss before fine-tuning: sw {rise_mini.mean_losses(before)['sw']:.3f}" in text


def simoe_run(rouge: float, simoe: bool) -> dict:
    run = {"groups": {"seen": {"rougeL": rouge, "chrf": 30.0}, "unseen": {"rougeL": rouge / 2, "chrf": 15.0}},
           "directions": {"t1": {"rougeL": rouge}, "u1": {"rougeL": rouge / 2}}, "params": {"total": 2000, "active": 1000},
           "tau": 0.75 if simoe else None, "seconds": 600.0, "peak_rss": 2 ** 31, "sparsity": 0.6 if simoe else None,
           "lambda": [0.1, 0.3, 0.2] if simoe else [], "device": "test CPU"}
    if simoe:
        run.update(nonzero={"by_type": {"gate": 0.5}, "by_depth": {"0": 0.5, "1": 0.4}, "overall": 0.45}, overlap=0.7,
                   pruned_params=1500, unpruned_params=2000)
    return run


def test_simoe_mini_section_comes_from_committed_results_alone(tmp_path):
    import simoe_mini

    root, rng = tmp_path / "results", np.random.default_rng(5)
    systems = {"SIMoE (common optimizer)": 32.0, "SIMoE w/o ortho (b) (common optimizer)": 31.5,
               "SIMoE real masks (c) (common optimizer)": 31.4, "full FT": 30.0, "sparse upcycling": 31.0}
    for seed in SEEDS:
        for label, rouge in systems.items():
            save_scores("simoe_mini", label, seed, {"seen": rouge + rng.normal(0, 10, 8),
                                                    "unseen": rouge / 2 + rng.normal(0, 10, 8)},
                        root, simoe_run(rouge, "SIMoE" in label))
    text = report_only(simoe_mini, tmp_path, "--common")
    assert "| SIMoE (common optimizer) (seed 2) | 32.0 | 30.0 | 16.0 | 15.0 | 0.600 (below τ) | 0.3 / 0.2 | 2,000 | " \
           "1,000 | 1,500 (0.750×) | 2.00 | 10.0 |" in text
    assert "measured on test CPU, fp32." in text
    assert "| t1 | 32.0 | 31.5 | 31.4 | 30.0 | 31.0 |" in text and "overall 0.450; by depth 0.50 0.40" in text
    scores = load_scores("simoe_mini", root)
    c = [claim_interval(np.stack([scores[("sparse upcycling", s)][g] for s in SEEDS]),
                        np.stack([scores[("full FT", s)][g] for s in SEEDS])) for g in ("seen", "unseen")]
    cells = " | ".join(f"{x['mean']:+.1f} [{x['lo']:+.1f}, {x['hi']:+.1f}]" for x in c)
    assert f"| sparse upcycling | 5 | {cells} |" in text
    assert "ROUGE-L per task (mean over seeds 0, 1, 2, 3, 4):" in text
    rows = check_claims(text, root, 4)
    assert rows[0].startswith("| SIMoE beats full fine-tuning (unseen tasks) (A > B) | SIMoE (common optimizer) − full FT |")


def test_simoe_mini_per_task_and_mask_figures_are_means_over_seeds():
    import simoe_mini

    runs = {"SIMoE": [simoe_run(30.0, True), simoe_run(20.0, True)], "full FT": [simoe_run(10.0, False)] * 2}
    runs["SIMoE"][1]["nonzero"] = {"by_type": {"gate": 0.2}, "by_depth": {"0": 0.1, "1": 0.3}, "overall": 0.15}
    runs["SIMoE"][1]["overlap"] = 0.5
    assert simoe_mini.per_task(runs) == ["| task | SIMoE | full FT |", "|---|---|---|", "| t1 | 25.0 | 10.0 |",
                                         "| u1 | 12.5 | 5.0 |"]
    assert simoe_mini.masks("SIMoE", runs["SIMoE"]) == (
        "SIMoE: non-zero expert parameters (Fig. 4, median gates) gate 0.35; overall 0.300; by depth 0.30 0.35; "
        "mean mask overlap between experts (Fig. 5) 0.600.\n")


def test_simoe_mini_seed_n_seeds_the_trainer_and_the_masks():
    from report import seed_overrides

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    assert seed_overrides(recipes / "simoe_instruct.yaml", 0) == []
    assert seed_overrides(recipes / "simoe_instruct.yaml", 3) == ["train.seed=3", "simoe.seed=3"]
    assert seed_overrides(recipes / "instruct_upcycle.yaml", 2) == ["train.seed=2", "moe.seed=2"]
    assert seed_overrides(recipes / "instruct_ft.yaml", 2) == ["train.seed=2"]


def test_ume_whisper_keeps_wer_per_voice_family_with_its_reference_words(tmp_path, monkeypatch):
    import types

    import moekit.speech.corpus
    import ume_whisper
    from moekit.speech.text import error_rates

    items = [{"id": "a", "ref": "in the beginning god", "hyp": "in the beginning"},
             {"id": "b", "ref": "light", "hyp": "night"}, {"id": "c", "ref": "and the earth", "hyp": "and the earth"}]
    families = (("a", "espeak-ng"), ("b", "flite"), ("c", "flite"))
    monkeypatch.setattr(moekit.speech.corpus, "read_manifest",
                        lambda _: [types.SimpleNamespace(id=i, family=f) for i, f in families])
    corpus_dir, folder = tmp_path / "corpus", tmp_path / "runs" / "ume"
    corpus_dir.mkdir()
    folder.mkdir(parents=True)
    (corpus_dir / "corpus.json").write_text(json.dumps({"hours": 1.25}))
    run = ume_run(6.0)
    (folder / "results.json").write_text(json.dumps({**run, "transcripts": {"en": items}}))
    ume_whisper.keep("ume", 0, tmp_path / "runs", corpus_dir, {"loss": [[10, 0.9], [80, 0.5]], "seconds": 1200.0,
                                                                      "device": "test CPU"},
                     "ume_whisper", tmp_path / "results")
    kept = load_scores("ume_whisper", tmp_path / "results")[("ume", 0)]
    flite = [error_rates([t["ref"]], [t["hyp"]], "en") for t in items[1:]]
    np.testing.assert_allclose(kept["wer flite"], [100 * e["wer"] for e in flite], rtol=1e-5)
    assert kept["words flite"].tolist() == [1.0, 3.0] and kept["words espeak-ng"].tolist() == [4.0]
    assert load_runs("ume_whisper", tmp_path / "results")[("ume", 0)] == {**run, "loss": [[80, 0.5]],
                                                                          "date": str(date.today())}


def test_omni_ctc_commits_each_run_it_finishes_and_reports_it(tmp_path, monkeypatch):
    """The run path: every (system, seed) the bench finishes is committed (keep) before the report reads the
    committed files; training stubbed by a run that writes its results.json."""
    import omni_ctc

    corpus_dir = tmp_path / "runs" / "corpus"
    corpus_dir.mkdir(parents=True)
    (corpus_dir / "corpus.json").write_text(json.dumps({"hours": 2.5}))
    transcripts = {"en": [{"ref": "god said", "hyp": "god sad"}], "fr": [{"ref": "dieu dit", "hyp": "dieu"}]}

    def run_system(name, out, corpus, steps, seed):
        folder = omni_ctc.seed_folder(out, name, seed)
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({**omni_run(50.0), "transcripts": transcripts}))
        return {"loss": omni_run(50.0)["loss"], "seconds": 60.0}

    monkeypatch.setattr(omni_ctc, "corpus", lambda out, **cfg: corpus_dir)
    monkeypatch.setattr(omni_ctc, "run_system", run_system)
    out = tmp_path / "BENCHMARKS.md"
    omni_ctc.main(["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results"), "--steps", "10",
                   "--systems", "dense", "omni-4", "--seeds", "0", "1", "--write", str(out)])
    assert set(load_scores("omni_ctc", tmp_path / "results")) == {(n, s) for n in ("dense", "omni-4") for s in (0, 1)}
    assert "| omni-4 (seed 1) | 99.0 |" in out.read_text()
    ((_, table),) = claim_tables(out.read_text())
    assert table[2].startswith("| Omni-router beats dense (A < B) | omni-4 − dense | CER % | 0, 1 |")


# --- spri_s2tt ---

S2TT_LANGS = ["fr", "de", "es", "sw"]


def s2tt_run(bleu: float, steps: int = 300) -> dict:
    return {"directions": {lang: {"n": 6, "bleu": bleu + j, "chrf": 4 * bleu, "loss": 2.5} for j, lang in
                           enumerate(S2TT_LANGS)},
            "avg": {"bleu": bleu + 1.5, "chrf": 4 * bleu, "loss": 2.5}, "params": {"total": 332.0e6, "active": 220.5e6},
            "device": "test GPU", "steps": steps, "seconds": 90.0, "hours": {"train": 1.31, "test": 0.08}}


def test_spri_s2tt_section_comes_from_committed_results_alone(tmp_path):
    import spri_s2tt

    root, rng = tmp_path / "results", np.random.default_rng(6)
    stage0 = {"directions": {"en": {"n": 6, "wer": 0.4, "cer": 0.2, "loss": 1.5}}, "avg": {},
              "params": {"total": 1.0e6, "active": 1.0e6}, "device": "test GPU", "steps": 600, "seconds": 600.0,
              "hours": {"train": 1.31, "test": 0.08}}
    save_scores("spri_s2tt", "stage0", 0, {"wer": rng.uniform(0, 1, 6), "cer": rng.uniform(0, 1, 6)}, root, stage0)
    levels = {"dense_ft": 10.0, "naive": 9.0, "noise": 9.5, "drop": 8.0, "spri": 11.0, "spri_two_stage": 11.5}
    for seed in SEEDS:
        for system, bleu in levels.items():
            save_scores("spri_s2tt", system, seed, {"bleu": bleu + rng.normal(0, 4, 24),
                                                    "chrf": 4 * bleu + rng.normal(0, 8, 24)},
                        root, s2tt_run(bleu + seed / 10))
    text = report_only(spri_s2tt, tmp_path)
    assert "(1.31 h of training speech, 0.08 h of test speech)" in text and "Not finished" not in text
    assert "| before |" not in text and "| after | 600 | 0.400 | 0.200 | 1.500 | 10.0 |" in text
    lines = text.splitlines()
    head = lines.index("| system | seed | BLEU avg | chrF avg | BLEU fr / de / es / sw | chrF fr / de / es / sw | "
                       "target loss avg | total / active params | steps | wall (min) |")
    expected = [f"| {n} | {s} | {b + s / 10 + 1.5:.2f} | {4 * (b + s / 10):.2f} | "
                + " / ".join(f"{b + s / 10 + j:.1f}" for j in range(4)) + " | "
                + " / ".join([f"{4 * (b + s / 10):.1f}"] * 4) + " | 2.500 | 332.0 M / 220.5 M | 300 | 1.5 |"
                for s in SEEDS for n, b in levels.items()]
    assert lines[head + 2:head + 2 + len(expected) + 1] == [*expected, ""]
    rows = check_claims(text, root, 6)
    scores = load_scores("spri_s2tt", root)
    best = max(("naive", "noise", "drop"), key=lambda n: np.mean([scores[(n, s)]["chrf"] for s in SEEDS]))
    assert best == "noise" and [r.split(" | ")[1:3] for r in rows] == [
        [f"spri_two_stage − {b}", f"sentence {m}, 4 directions"] for b in ("dense_ft", best, "spri")
        for m in ("BLEU", "chrF")]
    d = np.mean([scores[("spri_two_stage", s)]["chrf"] - scores[("dense_ft", s)]["chrf"] for s in SEEDS])
    assert f"| {d:+.2f} [" in rows[1]


def test_spri_s2tt_keeps_the_evaluations_per_item_scores_and_its_row(tmp_path):
    import spri_s2tt

    folder = tmp_path / "runs" / "seed1" / "spri"
    folder.mkdir(parents=True)
    per_item = {"fr": {"bleu": [10.0, 20.0], "chrf": [30.0, 40.0]}, "de": {"bleu": [1.0, 2.0], "chrf": [3.0, 4.0]}}
    results = {"directions": {lang: {"n": 2, "loss": 2.0, "bleu": 5.0, "chrf": 6.0, "comet": "not computed"}
                              for lang in per_item},
               "avg": {"bleu": 5.0, "chrf": 6.0, "loss": 2.0, "comet": "not computed"}, "usage": {"layer": [0.5, 0.5]},
               "params": {"total": 10, "active": 5}, "outputs": {"fr": ["a", "b"], "de": ["c", "d"]},
               "per_item": per_item}
    (folder / "results.json").write_text(json.dumps(results))
    spri_s2tt.keep("spri", 1, folder, {"device": "x", "steps": 3, "seconds": 1.0}, {"train": 1.0, "test": 0.1},
                   tmp_path / "results")
    kept = load_scores("spri_s2tt", tmp_path / "results")[("spri", 1)]
    assert kept["bleu"].tolist() == [10.0, 20.0, 1.0, 2.0] and kept["chrf"].tolist() == [30.0, 40.0, 3.0, 4.0]
    assert load_runs("spri_s2tt", tmp_path / "results")[("spri", 1)] == {
        "directions": {lang: {"n": 2, "bleu": 5.0, "chrf": 6.0, "loss": 2.0} for lang in per_item},
        "avg": {"bleu": 5.0, "chrf": 6.0, "loss": 2.0}, "params": {"total": 10, "active": 5}, "device": "x",
        "steps": 3, "seconds": 1.0, "hours": {"train": 1.0, "test": 0.1}, "date": str(date.today())}


def test_spri_s2tt_commits_each_run_it_finishes_and_reports_it(tmp_path, monkeypatch):
    """The run path: stage 0 (before and after, as seed 0) and every (system, seed) the bench finishes are committed
    (keep) before the report reads the committed files; training stubbed by a run that writes its results.json."""
    import spri_s2tt

    def run(name, folder, overrides, steps):
        langs = ["en"] if name == "stage0" else S2TT_LANGS
        metrics = ("wer", "cer") if name == "stage0" else ("bleu", "chrf")
        folder.mkdir(parents=True)
        results = {"directions": {lang: {"n": 2, "loss": 2.0, **{m: 0.5 for m in metrics}} for lang in langs},
                   "avg": {} if name == "stage0" else {"bleu": 0.5, "chrf": 0.5, "loss": 2.0},
                   "params": {"total": 10, "active": 5},
                   "per_item": {lang: {m: [0.25, 0.75] for m in metrics} for lang in langs}}
        (folder / "results.json").write_text(json.dumps(results))
        return {"device": "stub", "steps": steps, "seconds": 60.0}

    monkeypatch.setattr(spri_s2tt, "run", run)
    monkeypatch.setattr(spri_s2tt, "corpus", lambda data, **cfg: data)
    monkeypatch.setattr(spri_s2tt, "speech_hours", lambda data: {"train": 1.0, "test": 0.5})
    out = tmp_path / "BENCHMARKS.md"
    spri_s2tt.main(["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results"), "--seeds", "0", "1",
                    "--only", "dense_ft", "spri_two_stage", "--steps", "3", "--stage0-steps", "4", "--write", str(out)])
    assert set(load_scores("spri_s2tt", tmp_path / "results")) == {
        ("stage0_untrained", 0), ("stage0", 0), *((n, s) for n in ("dense_ft", "spri_two_stage") for s in (0, 1))}
    text = out.read_text()
    assert "| before | 1 | 0.500 | 0.500 | 2.000 | 1.0 |" in text and "| after | 4 | 0.500 |" in text
    assert "| spri_two_stage | 1 | 0.50 | 0.50 |" in text and "(1.00 h of training speech, 0.50 h of test speech)" in text
    ((_, table),) = claim_tables(text)
    assert table[2].startswith("| SPRI (two-stage) beats dense fine-tuning (A > B) | spri_two_stage − dense_ft | "
                               "sentence BLEU, 4 directions | 0, 1 |")
