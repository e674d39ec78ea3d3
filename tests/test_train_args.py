"""Trainer options of a recipe (moekit.training.args): train.trainer_args, report_to, gradient_checkpointing,
precision. Keys are checked when the recipe is validated, values before any work of a run."""
import json
from pathlib import Path

import pytest
import torch

from moekit.errors import ConfigError
from moekit.training.args import DOCS, has_accelerator, training_args
from moekit.training.recipe import load_recipe
from moekit.training.run import train

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
cpu_only = pytest.mark.skipif(has_accelerator(), reason="what a machine without an accelerator refuses")


def spri(tiny_recipe_overrides, out, **extra):
    """recipes/spri.yaml on the tiny model and data: 1 step, no generation, no KL reference by default."""
    keys = {"train.steps": 1, "eval.generate": False, "eval.kl_examples": 0, **extra}
    return load_recipe(RECIPES / "spri.yaml", tiny_recipe_overrides(out, **keys))


def test_training_arguments_carry_the_options(tiny_recipe_overrides, tmp_path):
    r = spri(tiny_recipe_overrides, tmp_path / "run", **{
        "train.report_to": ["tensorboard"], "train.gradient_checkpointing": True, "train.precision": "bf16",
        "train.trainer_args": {"adam_beta2": 0.95, "optim": "sgd", "dataloader_num_workers": 1}})
    args = training_args(r, tmp_path / "run")
    assert args.report_to == ["tensorboard"] and args.activation_checkpointing is True
    assert args.bf16 is True and args.fp16 is False
    assert (args.adam_beta2, args.optim.value, args.dataloader_num_workers) == (0.95, "sgd", 1)
    assert args.max_steps == 1 and args.output_dir == str(tmp_path / "run" / "checkpoints")
    plain = training_args(spri(tiny_recipe_overrides, tmp_path / "run"), tmp_path / "run")
    assert plain.report_to == [] and plain.activation_checkpointing is False and plain.dataloader_num_workers == 0


@pytest.mark.parametrize(("args", "message"), [
    ({"adam_beta3": 0.9}, f"'adam_beta3' is not a TrainingArguments field; did you mean adam_beta2, adam_beta1? "
                          f"(all fields: {DOCS})"),
    ({"learning_rate": 1e-3}, "learning_rate is set from the recipe: use optim.lr instead"),
    ({"max_steps": 3}, "max_steps is set from the recipe: use train.steps instead"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing is set from the recipe: use "
                                       "train.gradient_checkpointing instead"),
    ({"use_cpu": True}, "use_cpu cannot be set: moekit trains on the CPU exactly when torch sees no accelerator"),
])
def test_trainer_args_keys_refused_at_validation(args, message, tiny_recipe_overrides, tmp_path):
    with pytest.raises(ConfigError) as e:
        spri(tiny_recipe_overrides, tmp_path / "run", **{"train.trainer_args": args})
    assert str(e.value).endswith(f"train.trainer_args: Value error, {message}")
    assert str(e.value).count("\n") == 0


@pytest.mark.parametrize(("extra", "message"), [
    ({"train.trainer_args": {"optim": "adamw_nonexistent"}}, "train.trainer_args: "),
    pytest.param({"train.precision": "fp16"}, "train.precision=fp16 needs a GPU: on the CPU accelerate runs no "
                 "fp16 autocast or grad scaler, so the run would silently be fp32", marks=cpu_only),
    pytest.param({"train.trainer_args": {"fsdp": True}}, "train.trainer_args.fsdp needs GPUs: accelerate "
                 "selects FSDP only for GPU-type devices", marks=cpu_only),
    ({"train.trainer_args": {"fsdp": True, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}},
     "train.trainer_args.fsdp_config.state_dict_type must be FULL_STATE_DICT"),
])
def test_values_refused_before_any_work(extra, message, tiny_recipe_overrides, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        train(spri(tiny_recipe_overrides, out, **extra))
    assert list(tmp_path.iterdir()) == []  # no run directory, no partial one


def one_step(tiny_recipe_overrides, out, checkpointing: bool):
    """(recipe, trained model, loss) of one SGD step (its update is -lr x the clipped gradient: equal updates
    mean equal gradients)."""
    r = spri(tiny_recipe_overrides, out, **{"train.gradient_checkpointing": checkpointing, "optim.warmup_ratio": 0.0,
                                            "optim.lr": 0.1, "train.trainer_args": {"optim": "sgd"}})
    trainer = train(r)
    return r, trainer.model, next(h["loss"] for h in trainer.state.log_history if "loss" in h)


def test_gradient_checkpointing_gives_the_same_step(tiny_recipe_overrides, tmp_path):
    from moekit.training.common import build_model

    r, plain, loss = one_step(tiny_recipe_overrides, tmp_path / "plain", False)
    _, ckpt, loss_ckpt = one_step(tiny_recipe_overrides, tmp_path / "ckpt", True)
    assert ckpt.is_activation_checkpointing and not plain.is_activation_checkpointing
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    start = build_model(r, tiny_recipe_overrides.dense).state_dict()
    a, b = plain.state_dict(), ckpt.state_dict()
    assert a.keys() == b.keys() == start.keys()
    routers = [k for k in a if "router" in k]
    assert routers and all(not torch.equal(a[k], start[k]) for k in routers)
    for k in a:  # routers included: the aux losses get their gradient through the recomputed forward too
        torch.testing.assert_close(b[k] - start[k], a[k] - start[k], rtol=1e-4, atol=1e-7, msg=k)


def test_report_to_tensorboard_writes_the_logged_losses(tiny_recipe_overrides, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(spri(tiny_recipe_overrides, out, **{"train.steps": 2, "train.report_to": ["tensorboard"]}))
    (events,) = (out / "checkpoints" / "runs").glob("*/events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    logged = [h for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]
    scalars = acc.Scalars("train/loss")
    assert [s.step for s in scalars] == [1, 2]
    assert [s.value for s in scalars] == pytest.approx([h["loss"] for h in logged], rel=1e-6)
    assert "train/moe/lb" in acc.Tags()["scalars"]  # moekit's aux-loss logs reach TensorBoard too
