"""`moekit train` under torchrun: 2 CPU processes (gloo), DDP.

Each rank runs `python -m moekit train RECIPE ...` (through runpy, in a small probe script that
records, per rank, the steps done, a digest of the trained weights and the folders that models
and tokenizers were saved to). Checks: both ranks finish the same number of steps with identical weights, only
rank 0 writes (the final model and checkpoints), the log history with the MoE aux metrics is written.
"""
import hashlib
import inspect
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from moekit.checkpoint.format import load

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def digest(model) -> str:
    """sha256 over the state dict (names and float32 values)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


PROBE = "import hashlib\n" + inspect.getsource(digest) + r'''
import json, os, runpy
from pathlib import Path

import peft
import transformers

import moekit.cli.main as cli
import moekit.training.run as run
import moekit.checkpoint.format as io_module

rank = int(os.environ["RANK"])
record = {"rank": rank, "writes": []}
train = run.train


def probed_train(*args, **kwargs):
    import torch.distributed as dist

    trainer = train(*args, **kwargs)
    record.update(global_step=trainer.state.global_step, world_size=dist.get_world_size(),
                  digest=digest(trainer.accelerator.unwrap_model(trainer.model)))
    return trainer


def probe(owner, name, folder_arg):
    """Record the folder of every call of owner.name (folder_arg: its index among the positional args)."""
    method = getattr(owner, name)

    def probed(*args, **kwargs):
        record["writes"].append(str(args[folder_arg]))
        return method(*args, **kwargs)

    setattr(owner, name, probed)


def probed_end(code):
    """Every command ends through end_process (on success and on error); a rank whose launch is over ends inside it
    (os._exit), so nothing after the command runs: the record is written here."""
    (Path(os.environ["PROBE_DIR"]) / f"rank{rank}.json").write_text(json.dumps(record))
    return end_process(code)


run.train = probed_train
end_process, cli.end_process = cli.end_process, probed_end
probe(io_module, "write_checkpoint", 1)  # moekit-format MoE models
probe(transformers.PreTrainedModel, "save_pretrained", 1)  # dense models
probe(peft.PeftModel, "save_pretrained", 1)  # LoRA adapters
probe(transformers.PreTrainedTokenizerBase, "save_pretrained", 1)
runpy.run_module("moekit", run_name="__main__", alter_sys=True)  # = python -m moekit
'''


def torchrun(tmp_path, recipe, overrides, timeout=120):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "probe.py").write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_DIR": str(probe), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(probe / "probe.py"), "train", str(recipe), *overrides]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a hung run is killed whole
    try:
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    ranks = [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]
    return proc, ranks


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("name", ["spri_two_stage", "lora"])
def test_torchrun_two_processes(name, tiny_recipe_overrides, tmp_path):
    out = tmp_path / "run"
    # 4 steps, global batch 2 x 2; spri_two_stage switches from stage 1 to stage 2 after step 2
    overrides = tiny_recipe_overrides(out, **{"train.steps": 4, "train.save_every": 2, "train.save_total_limit": 2})
    if name == "spri_two_stage":
        overrides.append("freeze.tau=0.5")
    proc, ranks = torchrun(tmp_path, RECIPES / f"{name}.yaml", overrides)
    assert proc.returncode == 0, proc.stdout_text[-3000:] + proc.stderr_text[-3000:]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["global_step"] == 4 for r in ranks)
    assert ranks[0]["digest"] == ranks[1]["digest"]  # DDP kept the replicas identical
    assert ranks[1]["writes"] == []  # only the main process writes
    work = out.parent / f".{out.name}.moekit-partial"  # the run is built here, then renamed to `out`
    assert ranks[0]["writes"][-2:] == [str(work / "model")] * 2  # the final model, then the tokenizer
    assert not work.exists() and (out / "model" / "moekit.json" if name != "lora" else out / "model").exists()
    assert (out / "checkpoints" / "checkpoint-2").is_dir() and (out / "checkpoints" / "checkpoint-4").is_dir()
    assert f"trained {name}: 4 steps" in proc.stdout_text and proc.stdout_text.count("trained ") == 1
    history = json.loads((out / "log_history.json").read_text())
    logs = [h for h in history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4] and all(math.isfinite(h["loss"]) for h in logs)
    assert logs[-1]["epoch"] == 1.0  # 4 steps x 2 ranks x 2 = the 16 examples once: the ranks split the data
    if name == "spri_two_stage":
        assert all(math.isfinite(h["moe/lb"]) and math.isfinite(h["moe/z"]) for h in logs)
        per_layer = [k for k in logs[0] if k.startswith("moe/") and k.count("/") == 2]
        assert per_layer and not any("module." in k for k in per_layer)  # paths of the unwrapped model
        assert digest(load(out / "model")) == ranks[0]["digest"]  # the trained weights
        # stage 1 (steps 1-2) under DDP: all but the routed experts and routers kept their initial values
        dense = AutoModelForCausalLM.from_pretrained(tiny_recipe_overrides.dense).state_dict()
        stage1, final = load(out / "checkpoints" / "checkpoint-2").state_dict(), load(out / "model").state_dict()
        frozen = [k for k in dense if k in stage1]  # everything outside the MoE layer's MLP
        assert frozen and all(torch.equal(stage1[k], dense[k]) for k in frozen)
        shared = {k: k.replace(".shared.", ".") for k in stage1 if ".mlp.shared." in k}  # the dense FFN copy
        assert shared and all(torch.equal(stage1[k], dense[d]) for k, d in shared.items())
        assert not any(torch.equal(stage1[k], final[k]) for k in frozen)  # stage 2: all train
        moe = [k for k in stage1 if ".mlp." in k and k not in dense]
        moved = {k: not torch.equal(stage1[k], final[k]) for k in moe}
        assert all(moved.values()), moved
