"""Every recipe in recipes/ (found by glob, so a new file is covered without touching this test):
it validates, `moekit validate` accepts it, and it trains 2 steps on a tiny model."""
import json
import math
from pathlib import Path

import pytest
import yaml

from moekit.config import read_yaml
from moekit.training.recipe import load_recipe
from moekit.training.run import train

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
ids = [p.stem for p in RECIPES]


def test_recipes_exist():
    assert {"spri_two_stage", "spri", "naive", "noise", "drop", "ume", "dense_ft", "lora", "simoe_instruct",
            "instruct_ft", "instruct_upcycle", "instruct_btx"} <= set(ids)


@pytest.mark.parametrize("path", RECIPES, ids=ids)
def test_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem and recipe.out == f"runs/{path.stem}"
    assert path.read_text().startswith("#")  # says what it is and which paper section it follows


@pytest.mark.parametrize("path", RECIPES, ids=ids)
def test_recipe_trains_two_steps(path, tiny_recipe_overrides, tmp_path):
    out = tmp_path / "run"
    data = read_yaml(path)
    extra = {}
    if data.get("moe", {}).get("init", {}).get("method") == "btx":  # branches: copies of the tiny model
        extra["moe.init.branches"] = [str(tiny_recipe_overrides.dense)] * len(data["moe"]["init"]["branches"])
    recipe = load_recipe(path, tiny_recipe_overrides(out, data.get("task", "translation"), **extra))
    trainer = train(recipe)
    assert trainer.state.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    model = out / "model"
    marker = {"moe": "moekit.json", "lora": "adapter_config.json", "dense": "config.json",
              "simoe": "simoe.json"}[recipe.method]
    assert (model / marker).is_file() and (model / "tokenizer.json").is_file()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["name"] == path.stem
    history = json.loads((out / "log_history.json").read_text())
    assert [h["loss"] for h in history if "loss" in h] == losses
    if recipe.method == "moe":
        assert all(math.isfinite(h["moe/lb"]) and math.isfinite(h["moe/z"]) for h in history if "loss" in h)
        init = json.loads((out / "results.json").read_text())["diversity_init"]  # SPRI A.1, at upcycling
        m = recipe.moe
        if m.init.method == "naive":  # copies: every cosine is 1
            assert init == pytest.approx(0.0, abs=1e-9)
        elif m.init.method == "spri" and m.init.dense_as == "shared":  # 1 − (same-group pairs / all pairs)/(1 + eps²)
            E, k = m.num_experts, m.top_k
            share = (E // k) * k * (k - 1) / (E * (E - 1))
            assert init == pytest.approx(1 - share / (1 + m.init.noise_scale(m) ** 2), abs=2e-3)
    if recipe.method == "simoe":
        assert all(0 < h["simoe/sparsity"] < 1 and h["simoe/lambda"] >= 0 for h in history if "loss" in h)
    if recipe.task == "instruct":  # ROUGE-L per task, seen and unseen means
        results = json.loads((out / "results.json").read_text())
        assert set(results["groups"]) == {"seen", "unseen"} and "rougeL" in results["directions"]["c"]


@pytest.mark.parametrize("path", RECIPES, ids=ids)
def test_cli_validate(path, run):
    rc, out, err = run("validate", path)
    assert rc == 0 and "valid" in out and not err


def test_cli_validate_rejects_an_unknown_key(tmp_path, run):
    bad = tmp_path / "bad.yaml"
    bad.write_text(RECIPES[0].read_text() + "optimizer: {lr: 0.1}\n")
    for args in ([bad], [RECIPES[0], "train.epochs=3"]):
        rc, out, err = run("validate", *args)
        key = "optimizer" if args[0] == bad else "train.epochs"
        assert rc == 2 and not out
        assert err.count("moekit: error:") == 1 and "Traceback" not in err
        assert f"{key}: Extra inputs are not permitted" in err
