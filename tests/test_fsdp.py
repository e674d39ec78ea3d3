"""A moekit checkpoint of an FSDP-sharded MoE model (2 CPU processes, gloo, torch FSDP2 full shard).

Why not through the Trainer: accelerate 1.15 selects FSDP only for GPU-type devices (AcceleratorState sets
DistributedType.FSDP for MULTI_GPU/XPU/NPU/..., never for MULTI_CPU), so on the CPU a `fsdp` Trainer run
is plain DDP, and without use_cpu the Trainer refuses it ("Using fsdp only works in distributed training.");
moekit refuses it on the CPU (tests/test_train_args.py). What the Trainer does under FSDP with
FULL_STATE_DICT is gather the full state dict on every rank (accelerate's get_state_dict: for FSDP2
get_model_state_dict(full_state_dict=True, cpu_offload=True), the tensors on rank 0 only) and hand it to
MoETrainer._save, which writes it on the main process with moekit.checkpoint.format.write_checkpoint(model, folder, full).
This test runs exactly that gather and write on a really sharded model, trained 2 steps, and compares the
checkpoint with the same 2 steps trained in one process.
"""
import json
import sys

import pytest
import torch

from moekit.checkpoint.format import load

SCRIPT = r'''
import json, os, sys
from pathlib import Path

import torch

from moekit import MoESpec, upcycle
from moekit.errors import CheckpointError
from moekit.checkpoint.format import write_checkpoint
from moekit.testing import tiny_llama


def save(model, folder, full=None):  # write_checkpoint writes into an existing folder
    folder.mkdir()
    write_checkpoint(model, folder, full)


def build():
    torch.manual_seed(0)
    model = upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=2, shared_expert=True, init="spri"))
    return model.train()


def global_batches():  # 2 steps, 4 sequences of 12 tokens each (no padding: per-rank means average exactly)
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (4, 12), generator=g) for _ in range(2)]


def train(model, rows):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for ids in global_batches():
        model(input_ids=ids[rows], labels=ids[rows]).loss.backward()
        opt.step()
        opt.zero_grad()


out = Path(sys.argv[2])
if sys.argv[1] == "single":
    model = build()
    save(model, out.parent / "initial")
    train(model, slice(None))
    save(model, out)
    sys.exit()

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

dist.init_process_group("gloo")
rank = dist.get_rank()
model = build()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
train(model, slice(2 * rank, 2 * rank + 2))  # FSDP averages the two ranks' gradients: the global batch mean
sharded = {k: isinstance(v, DTensor) for k, v in model.state_dict().items()}
try:  # the shards themselves are refused
    save(model, out.parent / f"shards{rank}")
except CheckpointError as e:
    refused = str(e)
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:  # MoETrainer._save: only the main process writes
    save(model, out, full)
(out.parent / f"rank{rank}.json").write_text(json.dumps({"sharded": sharded, "gathered": len(full),
                                                               "refused": refused}))
dist.destroy_process_group()
'''


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="needs torch.distributed with gloo")
def test_fsdp_sharded_checkpoint_equals_unsharded_training(tmp_path, run_command):
    script = tmp_path / "fsdp_train.py"
    script.write_text(SCRIPT)
    run_command([sys.executable, str(script), "single", str(tmp_path / "single")])
    (tmp_path / "fsdp").mkdir()
    run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         "fsdp", str(tmp_path / "fsdp" / "model")])
    ranks = [json.loads((tmp_path / "fsdp" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(all(r["sharded"].values()) for r in ranks)  # every parameter really was a shard
    assert [r["gathered"] for r in ranks] == [len(ranks[0]["sharded"]), 0]  # the full tensors: rank 0 only
    assert all(r["refused"].startswith("the model's parameters are FSDP shards") for r in ranks)
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == ["model", "rank0.json", "rank1.json", "shards0",
                                                                      "shards1"]
    assert [list(tmp_path.glob(f"fsdp/shards{r}/*")) for r in (0, 1)] == [[], []]  # nothing written
    single, sharded = load(tmp_path / "single").state_dict(), load(tmp_path / "fsdp" / "model").state_dict()
    initial = load(tmp_path / "initial").state_dict()
    assert single.keys() == sharded.keys() == initial.keys()
    assert all(not torch.equal(single[k], initial[k]) for k in single if "experts" in k or "router" in k)
    for k in single:  # float32; the two ranks' partial gradients are summed in another order than one batch's
        torch.testing.assert_close(sharded[k], single[k], rtol=1e-5, atol=1e-6, msg=k)
    meta = [json.loads((tmp_path / d / "moekit.json").read_text()) for d in ("single", "fsdp/model")]
    assert meta[0] == meta[1]
