import json

import pytest
import torch
from transformers import TrainerCallback

from moekit._fs import PARTIAL
from moekit.config import validate
from moekit.errors import CheckpointError, ConfigError, OutputExistsError
from moekit.checkpoint.format import load_weights
from moekit.moe.layer import moe_layers
from moekit.testing import tiny_llama, tiny_tokenizer
from moekit.training.recipe import TranslationRecipe
from moekit.training.run import train

WORDS = "the light of the world is good and the day was long".split()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tiny_llama().save_pretrained(root / "dense")
    tiny_tokenizer().save_pretrained(root / "dense")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 32), ("test", 4)):
        lines = []
        for i in range(n):
            src = " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (4,), generator=g).tolist())
            lines.append(json.dumps({"src": src, "tgt": src[::-1], "tgt_lang": "fr" if i % 2 else "de"}))
        (root / f"{split}.jsonl").write_text("\n".join(lines))
    return root


def recipe(assets, out, **over) -> TranslationRecipe:
    data = {"name": "t", "out": str(out), "model": {"path": str(assets / "dense")},
            "moe": {"num_experts": 4, "top_k": 2, "every": 2, "shared_expert": True, "init": "spri"},
            "data": {"source": "jsonl", "directions": ["fr", "de"], "train_files": [str(assets / "train.jsonl")],
                     "test_files": [str(assets / "test.jsonl")], "max_length": 160},
            "optim": {"lr": 1e-2, "warmup_ratio": 0.0, "weight_decay": 0.1},
            "train": {"steps": 4, "batch_size": 4, "logging_steps": 1}}
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) and k != "moe" else v
    return validate(TranslationRecipe, data)


class Snapshots(TrainerCallback):
    """state_dict copies after given optimizer steps."""

    def __init__(self, model_ref, steps):
        self.model_ref, self.steps, self.at = model_ref, steps, {}

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step in self.steps:
            self.at[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}


def changed(a, b, pred):
    keys = [k for k in a if pred(k)]
    assert keys
    return {k: not torch.equal(a[k], b[k]) for k in keys}


def initial_state(assets, r):
    from moekit.training.common import build_model

    torch.manual_seed(0)
    return {k: v.clone() for k, v in build_model(r, assets / "dense").state_dict().items()}


def test_spri_two_stage(assets, tmp_path):
    r = recipe(assets, tmp_path / "run", freeze={"schedule": "spri_two_stage", "tau": 0.5},
               train={"eval_every": 2}, eval={"kl_examples": 4, "max_new_tokens": 8})
    snap = Snapshots(None, {2, 4})
    trainer = train(r, callbacks=[snap])
    start = initial_state(assets, r)
    s1, s2 = snap.at[2], snap.at[4]
    assert not any(changed(start, s1, lambda k: "experts.gate_up" in k).values())  # frozen in stage 1
    assert not any(changed(start, s1, lambda k: "self_attn" in k or "shared" in k).values())
    assert all(changed(start, s1, lambda k: "experts.down" in k or "router" in k).values())
    assert all(changed(s1, s2, lambda k: "experts.gate_up" in k).values())  # stage 2: all train
    assert all(changed(s1, s2, lambda k: "self_attn.q_proj" in k).values())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all("moe/lb" in h and "moe/z" in h for h in logs)
    assert any(k.endswith("/usage_entropy") for k in logs[0]) and any(k.endswith("/max_load") for k in logs[0])
    evals = [h for h in trainer.state.log_history if "eval_kl" in h]
    assert [h["step"] for h in evals] == [2, 4] and all("eval_fr_loss" in h and "eval_de_loss" in h for h in evals)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert set(results["directions"]) == {"fr", "de"} and results["kl"] == pytest.approx(evals[-1]["eval_kl"], rel=1e-4)
    for png in ("loss.png", "kl.png", "usage.png"):
        assert (tmp_path / "run" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ume_trains_only_moe_layers_and_no_weight_decay_leaks(assets, tmp_path):
    r = recipe(assets, tmp_path / "run", moe={"num_experts": 4, "top_k": 2, "init": "ume"},
               freeze={"schedule": "ume"})
    snap = Snapshots(None, {4})
    train(r, callbacks=[snap])
    start, end = initial_state(assets, r), snap.at[4]
    moe = changed(start, end, lambda k: ".mlp." in k)
    assert all(moe.values())
    assert not any(changed(start, end, lambda k: ".mlp." not in k).values())  # attention, norms, embeddings


def test_dense_and_lora_baselines(assets, tmp_path):
    r = recipe(assets, tmp_path / "dense", moe=None, method="dense")
    snap = Snapshots(None, {4})
    train(r, callbacks=[snap])
    assert all(changed(initial_state(assets, r), snap.at[4], lambda k: "q_proj" in k).values())
    r = recipe(assets, tmp_path / "lora", moe=None, method="lora", lora={"r": 2})
    snap = Snapshots(None, {4})
    train(r, callbacks=[snap])
    start, end = initial_state(assets, r), snap.at[4]
    assert all(changed(start, end, lambda k: "lora_B" in k).values())
    assert not any(changed(start, end, lambda k: "base_layer" in k).values())


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_gives_the_same_losses(assets, tmp_path):
    over = {"train": {"steps": 4, "batch_size": 4, "logging_steps": 1, "save_every": 2},
            "moe": {"num_experts": 4, "top_k": 2, "every": 2, "router_sharing": "all", "init": "drop"}}
    full = train(recipe(assets, tmp_path / "a", **over))
    ref = [h["loss"] for h in full.state.log_history if "loss" in h]
    train(recipe(assets, tmp_path / "b", **over), callbacks=[StopAt(2)])  # "killed" after the step-2 checkpoint
    with pytest.raises(OutputExistsError):
        train(recipe(assets, tmp_path / "b", **over))
    resumed = train(recipe(assets, tmp_path / "b", **over), resume=True)
    losses = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    assert losses[-2:] == pytest.approx(ref[-2:], rel=1e-6, abs=1e-7)
    routers = {id(m.router) for _, m in moe_layers(resumed.model)}
    assert len(routers) == 1  # the shared router survived the checkpoint round trip


def test_resume_after_a_stop_during_the_final_evaluation(assets, tmp_path, monkeypatch):
    """Stopped after the final model was saved (during evaluation): resume replaces that model folder."""
    import moekit.training.run as run_mod

    over = {"train": {"steps": 2, "batch_size": 4, "save_every": 2}, "moe": {"num_experts": 4, "top_k": 2}}
    r = recipe(assets, tmp_path / "run", **over)
    report = run_mod.report

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "report", stop)
    with pytest.raises(KeyboardInterrupt):
        train(r)
    partial = tmp_path / f".run{PARTIAL}"
    assert (partial / "model" / "moekit.json").is_file() and not (tmp_path / "run").exists()
    monkeypatch.setattr(run_mod, "report", report)
    done = train(r, resume=True)
    assert (tmp_path / "run" / "results.json").is_file() and not partial.exists()
    saved = load_weights(tmp_path / "run" / "model")
    state = done.model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in saved.items() if k in state) and saved


def test_resume_with_overwrite_starts_over_when_stopped_before_the_first_checkpoint(assets, tmp_path):
    """A run killed before its first save leaves a partial directory without a checkpoint: resume alone
    refuses it; resume + overwrite trains from scratch, as a fresh run would."""
    over = {"train": {"steps": 2, "batch_size": 4, "logging_steps": 1, "save_every": 2},
            "moe": {"num_experts": 4, "top_k": 2}}
    ref = [h["loss"] for h in train(recipe(assets, tmp_path / "a", **over)).state.log_history if "loss" in h]
    partial = tmp_path / f".b{PARTIAL}"
    (partial / "checkpoints" / "checkpoint-1").mkdir(parents=True)  # no trainer_state.json: incomplete
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train(recipe(assets, tmp_path / "b", **over), resume=True)
    again = train(recipe(assets, tmp_path / "b", **over), resume=True, overwrite=True)
    assert [h["loss"] for h in again.state.log_history if "loss" in h] == pytest.approx(ref, rel=1e-6, abs=1e-7)
    assert (tmp_path / "b" / "results.json").is_file() and not partial.exists()


def test_examples_without_target_tokens_are_refused(assets, tmp_path):
    with pytest.raises(ConfigError, match="max_length"):
        train(recipe(assets, tmp_path / "run", data={"max_length": 16}))


def test_recipe_errors():
    with pytest.raises(ConfigError, match="method=moe needs"):
        validate(TranslationRecipe, {"method": "moe"})
    with pytest.raises(ConfigError, match="applies to MoE"):
        validate(TranslationRecipe, {"method": "dense", "freeze": {"schedule": "ume"}})
    with pytest.raises(ConfigError, match="optimizer: Extra inputs are not permitted"):
        validate(TranslationRecipe, {"method": "dense", "optimizer": {}})


def test_cli_train_then_evaluate(tmp_path, tiny_recipe_overrides, capsys):
    from moekit.cli.main import main

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("method: moe\nmoe: {num_experts: 4, top_k: 2, init: ume}\nfreeze: {schedule: ume}\n")
    out = tmp_path / "run"
    assert main(["train", str(recipe_file), *tiny_recipe_overrides(out)]) == 0
    trained = capsys.readouterr().out
    first = json.loads((out / "results.json").read_text())
    (out / "results.json").unlink()
    assert main(["evaluate", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["directions"] == first["directions"] and again["kl"] == pytest.approx(first["kl"], abs=1e-6)
    assert "avg" in trained and "avg" in capsys.readouterr().out
    assert main(["evaluate", str(tmp_path)]) == 2  # not a run directory


def test_overwrite_starts_clean(tmp_path, tiny_recipe_overrides, run):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("method: dense\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    rc, _, err = run("train", recipe_file, *tiny_recipe_overrides(out))
    assert rc == 2 and "--overwrite" in err and (out / "stale.txt").is_file()
    rc, _, err = run("train", recipe_file, "--overwrite", *tiny_recipe_overrides(out))
    assert rc == 0, err
    assert not (out / "stale.txt").exists() and (out / "results.json").is_file()
