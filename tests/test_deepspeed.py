"""`train.trainer_args.deepspeed` on the CPU: 2 processes (torchrun, gloo) train a tiny upcycled MoE 2 steps
with DeepSpeed ZeRO-2 through the Trainer; the saved moekit checkpoint equals the same run under plain DDP.
ZeRO-3 (with every parameter partitioned), FSDP2 and expert parallelism against DDP, for every recipe: tests/test_parallel.py."""
import json
import sys
from pathlib import Path

import pytest
import torch

from moekit.checkpoint.format import load
from moekit.training.recipe import load_recipe
from moekit.training.common import build_model

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


def torchrun_train(run_command, tmp_path, overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moekit",
           "train", str(RECIPES / "spri.yaml"), *overrides]
    return run_command(cmd, timeout=240, cwd=tmp_path, rerun=[*cmd, "--overwrite"])  # once, after a native crash


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_deepspeed_zero2_equals_ddp(tiny_recipe_overrides, tmp_path, run_command):
    pytest.importorskip("deepspeed")
    (tmp_path / "zero2.json").write_text(json.dumps(ZERO2))
    keys = {"eval.kl_examples": 0, "eval.generate": False, "optim.warmup_ratio": 0.0, "optim.lr": 1e-2}
    torchrun_train(run_command, tmp_path, tiny_recipe_overrides(tmp_path / "ddp", **keys))
    out = torchrun_train(run_command, tmp_path, tiny_recipe_overrides(
        tmp_path / "zero2", **keys, **{"train.trainer_args": {"deepspeed": str(tmp_path / "zero2.json")},
                                       "train.save_every": 2}))
    assert "trained spri: 2 steps" in out
    shards = sorted(p.name for p in (tmp_path / "zero2" / "checkpoints" / "checkpoint-2" / "global_step2").iterdir())
    assert [s for s in shards if s.startswith("zero_pp_rank_")] == [  # DeepSpeed's engine ran, ZeRO-sharded
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], shards
    ddp, zero2 = load(tmp_path / "ddp" / "model").state_dict(), load(tmp_path / "zero2" / "model").state_dict()
    recipe = load_recipe(RECIPES / "spri.yaml", tiny_recipe_overrides(tmp_path / "x", **keys))
    initial = build_model(recipe, tiny_recipe_overrides.dense).state_dict()
    assert ddp.keys() == zero2.keys() == initial.keys()
    assert all(not torch.equal(ddp[k], initial[k]) for k in ddp if "experts" in k or "router" in k)
    for k in ddp:  # same data, same global batch (2 ranks x 2), AdamW: only the reduction order differs
        torch.testing.assert_close(zero2[k], ddp[k], rtol=1e-4, atol=1e-6, msg=k)
    history = [h for h in json.loads((tmp_path / "zero2" / "log_history.json").read_text()) if "loss" in h]
    assert [h["step"] for h in history] == [1, 2] and all("moe/lb" in h for h in history)
