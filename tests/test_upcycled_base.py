"""A recipe that upcycles (method moe) trains from the dense model or from that model's checkpoint upcycled as its `moe`
section says (`moekit upcycle`, then model.path=<upcycled>): the same per-step losses under its freeze schedule and
aux losses, the same evaluation, `moekit evaluate` of the run as at its end; the dry run plans it. A checkpoint
upcycled otherwise is refused (tests/test_bad_inputs.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
LOGGED = ("loss", "grad_norm", "moe/lb", "moe/z")  # per optimizer step
OUTPUTS = {"translation": "translations", "speech_llm": "outputs"}  # the greedy outputs in results.json


def _logs(run_dir: Path) -> dict[str, list[float]]:
    history = json.loads((run_dir / "log_history.json").read_text())
    return {k: [h[k] for h in history if k in h] for k in LOGGED}


def _upcycle(run, recipe: Path, dense: Path, out: Path) -> Path:
    """`moekit upcycle` of `dense` with the recipe's own MoE spec (an upcycle recipe {model, out, spec})."""
    spec = yaml.safe_load(recipe.read_text())["moe"]
    rc, _, err = run("upcycle", write_yaml(out.parent / "up.yaml", {"model": str(dense), "out": str(out), "spec": spec}))
    assert rc == 0, err
    return out


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("task, name", [("translation", "spri_two_stage"), ("translation", "ume"),
                                        ("speech_llm", "spri_s2tt")])
def test_upcycled_checkpoint_trains_as_the_recipe_upcycling_it(task, name, tiny_recipe_overrides, tmp_path, run):
    recipe = RECIPES / f"{name}.yaml"
    steps = {"train.steps": 4, "freeze.tau": 0.5, "optim.lr": 1e-2, "optim.warmup_ratio": 0.0}
    keys = tiny_recipe_overrides(tmp_path / "from_dense", task, **steps)
    dense = Path(json.loads(next(k for k in keys if k.startswith("model.path="))[len("model.path="):]))
    upcycled = _upcycle(run, recipe, dense, tmp_path / "upcycled")
    rc, _, err = run("train", recipe, *keys)
    assert rc == 0, err
    rc, _, err = run("train", recipe, *tiny_recipe_overrides(tmp_path / "from_upcycled", task, **steps),
                     f"model.path={upcycled}")
    assert rc == 0, err
    a, b = _logs(tmp_path / "from_dense"), _logs(tmp_path / "from_upcycled")
    assert all(len(a[k]) == 4 for k in LOGGED) and len(set(a["loss"])) > 1
    for k in LOGGED:
        assert b[k] == pytest.approx(a[k], abs=1e-6), k
    results = [json.loads((tmp_path / r / "results.json").read_text()) for r in ("from_dense", "from_upcycled")]
    outputs = OUTPUTS[task]
    assert results[1][outputs] == results[0][outputs]
    spec = json.loads((tmp_path / "from_upcycled" / "model" / "moekit.json").read_text())["spec"]
    assert spec == json.loads((upcycled / "moekit.json").read_text())["spec"]
    rc, _, err = run("evaluate", tmp_path / "from_upcycled")
    assert rc == 0, err
    assert json.loads((tmp_path / "from_upcycled" / "results.json").read_text())[outputs] == results[1][outputs]


def test_dry_run_plans_the_upcycled_checkpoint_as_the_upcycle(tiny_recipe_overrides, tmp_path, run):
    from moekit.training.plan import plan_recipe
    from moekit.training.recipe import load_recipe

    recipe = RECIPES / "spri_two_stage.yaml"
    keys = tiny_recipe_overrides(tmp_path / "run", **{"train.steps": 10})
    upcycled = _upcycle(run, recipe, tiny_recipe_overrides.dense, tmp_path / "upcycled")
    planned = plan_recipe(load_recipe(recipe, keys))
    again = plan_recipe(load_recipe(recipe, [*keys, f"model.path={upcycled}"]))
    assert again.shapes.startswith("moekit.json")
    assert (again.params, again.routed, again.activations) == (planned.params, planned.routed, planned.activations)
    assert [(s.name, s.params) for s in again.stages] == [(s.name, s.params) for s in planned.stages]
    assert len(planned.stages) == 2 and planned.stages[0].params < planned.stages[1].params
