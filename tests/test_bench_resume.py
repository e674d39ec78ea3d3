"""bench/rise_mini.py's stage 1 resumes mid-way: stopped after a checkpoint and run again, it ends with exactly
the weights of a run that was never stopped (on the stand-in assets, so in seconds)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.fixture
def rise_mini(tmp_path, monkeypatch):
    from moekit.testing.standins import standin_cache

    monkeypatch.setenv("MOEKIT_CACHE", str(standin_cache(tmp_path / "cache")))
    import rise_mini as R

    monkeypatch.setattr(R, "STAGE1_STEPS", 4)
    monkeypatch.setattr(R, "STAGE1_SAVE_EVERY", 2)
    return R


def test_stage1_stopped_after_a_checkpoint_resumes_to_the_uninterrupted_weights(rise_mini, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from moekit.assets import resolve_model
    from moekit.training.common import load_tokenizer

    R = rise_mini
    data, tok = R.corpus(), load_tokenizer(resolve_model("smollm2-135m"))
    R.stage1(tmp_path / "straight", data, tok, 0)

    class Killed(Exception):
        pass

    class Kill(TrainerCallback):  # the process dies right after step 2's checkpoint is saved
        def on_save(self, args, state, control, **kw):
            if state.global_step == 2:
                raise Killed

    class Stopped(R.MoETrainer):
        def __init__(self, *a, callbacks=(), **kw):
            super().__init__(*a, callbacks=[*callbacks, Kill()], **kw)

    stopped = tmp_path / "resumed"
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(R, "MoETrainer", Stopped)
        R.stage1(stopped, data, tok, 0)
    assert not (stopped / "stage1.json").exists() and not (stopped / "base").exists()
    assert [p.name for p in (stopped / "stage1_tmp" / "checkpoints").iterdir()] == ["checkpoint-2"]
    steps = []

    class Counting(R.MoETrainer):  # a restart from step 0 would give the same weights: count the steps taken
        def training_step(self, *a, **kw):
            steps.append(self.state.global_step)
            return super().training_step(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(R, "MoETrainer", Counting)
        R.stage1(stopped, data, tok, 0)
    assert steps == [2, 3]  # steps 3 and 4 only

    def weights(run: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted((run / "base").glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = weights(tmp_path / "straight"), weights(stopped)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (stopped / "stage1_tmp").exists()  # the finished stage keeps its cached model, not its checkpoints
