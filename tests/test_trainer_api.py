"""Issue 40 §2: training from Python keeps the method. `moekit.upcycle` + `moekit.MoETrainer`, and `moekit.upcycle` +
transformers' own Trainer with `moekit.MoECallback`, train what `moekit train` trains: the same per-step losses and
router logs (within 1e-6), the same parameters trainable at every step (SPRI's two stages) and the same weights."""
import pytest
import torch
import transformers as tf

import moekit
from moekit.data.parallel import TranslationCollator
from moekit.errors import ConfigError
from moekit.eval.translation import encode_pairs
from moekit.testing import tiny_llama
from moekit.training.common import load_tokenizer
from moekit.training.run import load_data, train

RECIPE = "recipes/spri_two_stage.yaml"


class Record(tf.TrainerCallback):
    """After every optimizer step: the names of the parameters that trained in it, and the weights."""

    def __init__(self):
        self.trained, self.weights = [], []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.trained.append({n for n, p in model.named_parameters() if p.requires_grad})
        self.weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def steps(history: list[dict]) -> list[dict]:
    """The training logs, without the timings."""
    return [{k: v for k, v in h.items() if k not in ("epoch",)} for h in history if "loss" in h]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and all(x.keys() == y.keys() for x, y in zip(a, b))
    assert all(x[k] == pytest.approx(y[k], abs=1e-6) for x, y in zip(a, b) for k in x), (a, b)


@pytest.fixture(scope="module")
def recipe(tiny_recipe_overrides, tmp_path_factory):
    """SPRI two-stage (τ = 1/2 of 4 steps) on the tiny model, with padding in every batch and grad accumulation."""
    out = tmp_path_factory.mktemp("api") / "cli"
    return moekit.load_recipe(RECIPE, tiny_recipe_overrides(out, **{
        "moe.num_experts": 4, "moe.every": 2, "freeze.tau": 0.5, "train.steps": 4, "train.grad_accum": 2,
        "optim.lr": 1e-2, "optim.warmup_ratio": 0.0, "eval.generate": False}))


@pytest.fixture(scope="module")
def cli(recipe):
    """`moekit train`'s run of the recipe (moekit.training.run.train, what the command calls)."""
    rec = Record()
    trainer = train(recipe, callbacks=[rec])
    return steps(trainer.state.log_history), rec


def python_path(recipe, tmp_path, own_trainer: bool):
    """What a notebook does: the recipe's model upcycled with moekit.upcycle, the recipe's data, and MoETrainer or
    transformers' Trainer with MoECallback."""
    dense = recipe.model.path
    model = moekit.upcycle(tf.AutoModelForCausalLM.from_pretrained(dense), recipe.moe)
    tok = load_tokenizer(dense)
    pairs, _ = load_data(recipe)
    data = encode_pairs(pairs, tok, recipe.data.template, recipe.data.max_length)
    rec = Record()
    kw = dict(model=model, args=moekit.training_args(recipe, tmp_path), train_dataset=data,
              data_collator=TranslationCollator(tok.pad_token_id))
    if own_trainer:
        moe = moekit.MoECallback(aux=recipe.aux, freeze=recipe.freeze)
        trainer = tf.Trainer(**kw, callbacks=[moe, rec], compute_loss_func=moe.compute_loss)
    else:
        trainer = moekit.MoETrainer(**kw, callbacks=[rec], aux=recipe.aux, freeze=recipe.freeze)
    trainer.train()
    return steps(trainer.state.log_history), rec


@pytest.mark.parametrize("own_trainer", [False, True], ids=["MoETrainer", "Trainer+MoECallback"])
def test_python_training_equals_moekit_train(recipe, cli, tmp_path, own_trainer):
    logs, rec = python_path(recipe, tmp_path, own_trainer)
    want_logs, want = cli
    assert len(logs) == 4 and all("moe/lb" in h and "moe/z" in h for h in logs)  # the router losses are there
    assert_same(logs, want_logs)
    assert rec.trained == want.trained
    moe_only = [n for n in want.trained[0] if ".experts.down" in n or ".router." in n]
    assert want.trained[0] == want.trained[1] == set(moe_only) != want.trained[2]  # SPRI's stage 1, then all
    for got, ref in zip(rec.weights, want.weights):
        assert all(torch.allclose(got[k], ref[k], rtol=0, atol=1e-6) for k in ref)
    frozen = [k for k in want.weights[0] if k not in want.trained[0]]
    dense = tf.AutoModelForCausalLM.from_pretrained(recipe.model.path).state_dict()
    assert all(torch.equal(rec.weights[1][k], dense[k]) for k in frozen if k in dense)  # untouched in stage 1


def test_a_model_without_moe_layers_is_refused_before_training(tmp_path):
    args = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match="MoECallback trains MoE models: the model has no MoE layers"):
        tf.Trainer(model=tiny_llama(), args=args, callbacks=[moekit.MoECallback()])
    with pytest.raises(ConfigError, match="freeze.schedule=ume applies to MoE models only"):
        moekit.MoETrainer(model=tiny_llama(), args=args, freeze=moekit.FreezeConfig(schedule="ume"))


def test_a_run_that_would_replace_an_earlier_runs_checkpoint_is_refused_before_training(tmp_path):
    """transformers' Trainer saves checkpoints with the model's save_pretrained, which in moekit's format writes no
    folder over another: a second run into the same output_dir is refused before its first step, not after it."""
    import hashlib

    spec = moekit.MoESpec(num_experts=4, top_k=2, every=2, init={"method": "noise"})
    model = moekit.upcycle(tiny_llama(), spec)
    data = [{"input_ids": [i % 7 + 1] * 6, "labels": [i % 7 + 1] * 6} for i in range(4)]
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, save_steps=1,
                                use_cpu=True, report_to=[])

    def trainer():
        moe = moekit.MoECallback()
        return tf.Trainer(model=model, args=args, train_dataset=data, data_collator=TranslationCollator(0),
                          callbacks=[moe], compute_loss_func=moe.compute_loss)

    trainer().train()
    files = {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in tmp_path.rglob("*") if f.is_file()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"checkpoint-1 holds a checkpoint of an earlier run"):
        trainer().train()
    assert files == {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in tmp_path.rglob("*") if f.is_file()}
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
