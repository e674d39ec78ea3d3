"""Beyond one device (issue 31): moekit's recipes on the engines that shard the model itself, against plain DDP on
the same data. 2 processes (torchrun): on the CPU with gloo, or on 2 GPUs with NCCL where torch sees two or more
(tests/test_gpu.py runs this module there, marked `gpu`), the tiny Llama upcycled by each recipe, 4 steps of global batch
2 × 2 (SPRI's two stages switch after step 2).

- ZeRO-3 with `stage3_param_persistence_threshold: 0` (every parameter really partitioned; DeepSpeed's default of
  1e5 would partition nothing of a tiny model) and no `stage3_gather_16bit_weights_on_model_save`;
- FSDP2 full shard (`train.fsdp: true`, transformers' DistributedConfig(fsdp_size=2));
- expert parallelism over 2 ranks (`train.expert_parallel: 2`, transformers' EP with all-to-all dispatch).

Each run against DDP's: per-step loss and grad norm within 1e-5 relative, the saved model within rtol 1e-4 /
atol 1e-5 (every tensor), the evaluation after training written."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_checked

from moekit.checkpoint.format import load

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto"}
ENGINES = {"zero3": lambda t: {"train.trainer_args": {"deepspeed": str(t)}},
           "fsdp2": lambda t: {"train.fsdp": True},
           "ep2": lambda t: {"train.expert_parallel": 2}}
# name -> (recipe, task, extra keys); every MoE's expert count is even
OMNI = {"moe.every": 1, "moe.router_sharing": "all", "moe.top_k": 1, "moe.shared_expert": False,
        "aux.balance_variant": "omni"}  # one router for all 4 MoE layers (Omni-router), Switch top-1
METHODS = {"spri_two_stage": ("spri_two_stage", "translation", {"freeze.tau": 0.5}),  # stage 2 from step 3
           "ume": ("ume", "translation", {}), "naive": ("naive", "translation", {}),
           "omni": ("naive", "translation", OMNI), "simoe": ("simoe_instruct", "instruct", {}),
           "lora": ("lora", "translation", {})}
gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                          reason="needs torch.distributed with gloo")


GPUS = torch.cuda.device_count() >= 2  # then NCCL on 2 GPUs (tests/test_gpu.py runs this module there); else CPU
BACKEND = "nccl" if GPUS else "gloo"


def torchrun(args: list[str], cwd: Path, timeout: int = 300) -> str:
    """The stdout of `python -m moekit ARGS` on 2 processes (torchrun), which must succeed; a launch that is no
    `--resume` runs once more with `--overwrite` where a rank crashed in native code (conftest.run_checked)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moekit",
           *args]  # one GPU cannot hold 2 NCCL ranks: CPU processes then
    return run_checked(cmd, timeout, cwd, {} if GPUS else {"CUDA_VISIBLE_DEVICES": ""},
                       rerun=None if "--resume" in args else [*cmd, "--overwrite"])


def steps(out: Path) -> list[dict]:
    return [h for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]


def model_of(out: Path) -> dict:
    """The saved model's tensors: a moekit checkpoint loaded, SIMoE's tensors (masks included) or LoRA's adapter."""
    from safetensors.torch import load_file

    folder = out / "model"
    if (folder / "moekit.json").exists():
        return load(folder).state_dict()
    adapter = folder / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else folder / "model.safetensors")


@pytest.fixture(scope="module")
def ddp(tiny_recipe_overrides, tmp_path_factory):
    """{method: the DDP run's folder}, run once per method."""
    runs = {}

    def get(method: str) -> Path:
        if method not in runs:
            out = tmp_path_factory.mktemp(f"ddp_{method}") / "run"
            torchrun(["train", recipe_of(method), *overrides(tiny_recipe_overrides, out, method)], out.parent)
            runs[method] = out
        return runs[method]

    return get


def recipe_of(method: str) -> str:
    return str(RECIPES / f"{METHODS[method][0]}.yaml")


def overrides(tiny, out: Path, method: str, **extra) -> list[str]:
    _, task, keys = METHODS[method]
    # lr 1e-3: Adam moves an element whose gradient is near 0 by up to lr whatever its rounding, and the engines sum
    # in other orders (at lr 1e-2 one element in 10^4 of Omni-router's experts under EP is 4e-5 off DDP's)
    # a checkpoint at step 2 (under FSDP2 and EP: the model only), evaluation: KL and greedy decoding
    common = {"train.steps": 4, "train.save_every": 2, "optim.warmup_ratio": 0.0, "optim.lr": 1e-3}
    return tiny(out, task, **common, **keys, **extra)


@gloo
@pytest.mark.parametrize("engine", ["zero3", "fsdp2", "ep2"])
@pytest.mark.parametrize("method", list(METHODS))
def test_sharded_engine_equals_ddp(method, engine, ddp, tiny_recipe_overrides, tmp_path):
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    if engine == "ep2" and method in ("lora", "simoe"):
        pytest.skip(f"{method} has no MoE layer whose experts could be split")
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    out = tmp_path / "run"
    stdout = torchrun(["train", recipe_of(method),
                     *overrides(tiny_recipe_overrides, out, method, **ENGINES[engine](tmp_path / "zero3.json"))],
                    tmp_path)
    assert f"trained {METHODS[method][0]}: 4 steps" in stdout
    base = ddp(method)
    record, replicated = (json.loads((o / "engine.json").read_text()) for o in (out, base))
    assert replicated["engine"] == "DDP" and replicated["held_per_process"] == [replicated["parameters"]] * 2
    assert record["parameters"] == replicated["parameters"] and record["processes"] == 2
    assert record["backend"] == replicated["backend"] == BACKEND
    assert max(record["held_per_process"]) < 0.6 * record["parameters"], record  # really partitioned
    if engine == "ep2":  # each rank holds half of every MoE layer's experts
        layers = record["experts_per_layer"]
        assert layers and record["experts_per_process"] == [[e // 2 for e in layers]] * 2, record
    ours, theirs = steps(out), steps(base)
    assert [h["step"] for h in ours] == [h["step"] for h in theirs] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    sharded, reference = model_of(out), model_of(base)
    assert sharded.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(sharded[k], reference[k], rtol=1e-4, atol=1e-5, msg=k)
    assert (out / "checkpoints" / "checkpoint-4").is_dir()
    results, expected = (leaves(json.loads((o / "results.json").read_text())) for o in (out, base))
    assert results.keys() == expected.keys()
    numbers = {k for k, v in expected.items() if isinstance(v, float)}
    assert {k: results[k] for k in numbers} == pytest.approx({k: expected[k] for k in numbers}, rel=1e-4, abs=1e-6)
    assert all(results[k] == expected[k] for k in expected.keys() - numbers)


@gloo
@pytest.mark.parametrize("bucket", [2e4, "auto"])
def test_omni_router_under_zero3_with_a_small_reduce_bucket_equals_ddp(bucket, ddp, tiny_recipe_overrides, tmp_path):
    """One router shared by the 4 MoE layers, reduce buckets smaller than the model ("auto": hidden² = 1,024
    elements): DeepSpeed flushes buckets during the backward, before the router's gradient is complete (its 4 uses
    summed); the router must reach the optimizer whole, once per step. Same tolerances as test_sharded_engine_equals_ddp
    (float32, the same data, only the order of the sums differs)."""
    pytest.importorskip("deepspeed")
    config = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "reduce_bucket_size": bucket}}
    (tmp_path / "zero3.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    torchrun(["train", recipe_of("omni"), *overrides(tiny_recipe_overrides, out, "omni",
                                                     **ENGINES["zero3"](tmp_path / "zero3.json"))], tmp_path)
    base = ddp("omni")
    for a, b in zip(steps(out), steps(base), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    sharded, reference = model_of(out), model_of(base)
    assert sharded.keys() == reference.keys() and any("router" in k for k in reference)
    for k in reference:
        torch.testing.assert_close(sharded[k], reference[k], rtol=1e-4, atol=1e-5, msg=k)


@gloo
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_run_resumed_equals_the_uninterrupted_run(stage, tiny_recipe_overrides, tmp_path):
    """A ZeRO-2/3 run interrupted after its checkpoint at step 2 (its partial directory holding that checkpoint:
    DeepSpeed's global_step2/ with each rank's partition, no optimizer.pt) and resumed ends with the uninterrupted
    run's steps 3-4 and weights, bit for bit (same data order, same reductions); a finished run resumed keeps its
    weights."""
    import shutil

    pytest.importorskip("deepspeed")
    config = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "stage": stage}}
    if stage == 2:
        del config["zero_optimization"]["stage3_param_persistence_threshold"]
    (tmp_path / "ds.json").write_text(json.dumps(config))
    keys = {"train.trainer_args": {"deepspeed": str(tmp_path / "ds.json")}, "train.save_total_limit": 2}

    def launch(out: Path, *flags: str) -> str:
        return torchrun(["train", recipe_of("naive"), *overrides(tiny_recipe_overrides, out, "naive", **keys),
                         *flags], tmp_path)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    launch(whole)
    checkpoint = resumed.parent / f".{resumed.name}.moekit-partial" / "checkpoints" / "checkpoint-2"
    shutil.copytree(whole / "checkpoints" / "checkpoint-2", checkpoint)
    assert not (checkpoint / "optimizer.pt").exists() and (checkpoint / "global_step2").is_dir()
    assert "trained naive: 4 steps" in launch(resumed, "--resume")
    assert [(h["step"], h["loss"], h["grad_norm"]) for h in steps(resumed)] == \
        [(h["step"], h["loss"], h["grad_norm"]) for h in steps(whole)]
    reference = model_of(whole)
    assert all(torch.equal(model_of(resumed)[k], reference[k]) for k in reference)
    if stage == 3:  # the finished run resumed: loaded from its last checkpoint, nothing trained, saved again
        launch(whole, "--resume")
        assert all(torch.equal(model_of(whole)[k], reference[k]) for k in reference)


def rank_process(launcher: int, rank: int) -> int:
    """The pid of `rank` among torchrun's workers (its children with RANK=rank in their environment)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(stat.parent.name)
    raise AssertionError(f"no worker of rank {rank}")


@gloo
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker of rank 1 through /proc")
def test_a_rank_killed_under_zero3_ends_the_other_with_one_line(tiny_recipe_overrides, tmp_path):
    """Rank 1 SIGKILLed after the run's first checkpoint: rank 0's collective fails (gloo: the connection reset by
    its peer) and it ends with one line naming the process that ended and the checkpoint kept to resume from; the
    launch fails. torchrun's --monitor-interval 5 (default 0.1 s) lets rank 0 end on its own before torchrun would
    SIGTERM it (which ends it with "interrupted (SIGTERM)"); with the default, rank 0 met the error first in both runs
    tried."""
    import signal
    import time

    from moekit.training.common import check_checkpoint, last_checkpoint

    pytest.importorskip("deepspeed")
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    out = tmp_path / "run"
    args = [*overrides(tiny_recipe_overrides, out, "naive", **ENGINES["zero3"](tmp_path / "zero3.json")),
            "train.steps=200", "train.save_every=1"]  # the later key wins
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "5", "-m", "moekit", "train", recipe_of("naive"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    partial = tmp_path / ".run.moekit-partial"
    try:
        deadline = time.monotonic() + 240
        while last_checkpoint(partial) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(rank_process(proc.pid, 1), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in (stdout + stderr).splitlines() if line.startswith("moekit:")]
    assert proc.returncode != 0 and len(lines) == 1, stderr[-3000:]
    assert re.fullmatch(r"moekit: error: process 0 of 2: process 1 of this launch ended during training \(Connection "
                        r"(reset|closed) by peer.*\); .*\.run\.moekit-partial keeps checkpoint-\d+: --resume "
                        r"continues it", lines[0]), lines[0]
    os.environ["WORLD_SIZE"], world = "2", os.environ.get("WORLD_SIZE")
    try:
        check_checkpoint(last_checkpoint(partial))  # complete: what --resume on 2 processes continues from
    finally:
        os.environ.pop("WORLD_SIZE") if world is None else os.environ.update(WORLD_SIZE=world)
    assert not out.exists()


def test_resume_is_refused_where_transformers_shards(tiny_recipe_overrides, tmp_path):
    """transformers checkpoints a model it shards (FSDP2, EP) without its optimizer state: no resuming from them."""
    from moekit.errors import ConfigError
    from moekit.training.common import run_directory
    from moekit.training.recipe import load_recipe

    for key in ("train.fsdp", "train.expert_parallel"):
        recipe = load_recipe(recipe_of("naive"), tiny_recipe_overrides(tmp_path / "run", **{key: 2 if "expert" in key
                                                                                             else True}))
        with pytest.raises(ConfigError, match="cannot resume: transformers checkpoints a model it shards without"):
            with run_directory(recipe, overwrite=False, resume=True, inputs=[]):
                pass
    assert list(tmp_path.iterdir()) == []  # nothing written


def leaves(tree, prefix: str = "") -> dict:
    """{path: value} of every number or string in a JSON tree."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{prefix}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in leaves(sub, f"{prefix}/{i}").items()}
    return {prefix: tree}


# ------------------------------------------------------------------------------------------- selective fine-tuning
# `moekit finetune` (RISE / ESFT: only the selected experts train) of native MoE checkpoints and of a moekit model,
# each engine against DDP: per-step loss and grad norm, every tensor of the written model, untouched tensors equal to
# the input's bit for bit.
FINETUNE = [("mixtral", "zero3"), ("mixtral", "zero2"), ("mixtral", "fsdp2"), ("mixtral", "ep2"), ("qwen2_moe", "ep2"),
            ("qwen3_moe", "ep2"), ("moekit", "zero3"), ("moekit", "fsdp2"), ("moekit", "ep2"),
            # layouts of their own (zero-computation experts; experts in two modules; I rows per expert; a dense MLP
            # beside the experts in the model's EP plan; an attention indexer that runs its key norm a number of times
            # that depends on the tokens); every family was swept by hand (docs/guides/distributed.md)
            ("longcat_flash", "zero3"), ("jetmoe", "zero3"), ("jetmoe", "fsdp2"), ("dbrx", "zero3"), ("dbrx", "fsdp2"),
            ("gemma4_text", "ep2"), ("qwen4_exp_text", "zero3")]
FINETUNE_FLAGS = {"zero3": lambda t: ["--deepspeed", str(t / "zero3.json")],
                  "zero2": lambda t: ["--deepspeed", str(t / "zero2.json")], "fsdp2": lambda t: ["--fsdp"],
                  "ep2": lambda t: ["--expert-parallel", "2"], "ddp": lambda t: []}


@pytest.fixture(scope="module")
def finetune_inputs(tmp_path_factory):
    """{family: (model folder, selection, text)}: tiny random checkpoints with the character tokenizer."""
    from moekit.checkpoint.format import save
    from moekit.moe.spec import MoESpec
    from moekit.routing.sites import find_sites
    from moekit.selection.selection import Selection
    from moekit.testing import TINY_HF_MOE, tiny_llama, tiny_tokenizer
    from moekit.testing.families import tiny_family_model
    from moekit.checkpoint.upcycle_model import upcycle

    root = tmp_path_factory.mktemp("finetune")
    text = root / "sw.txt"
    text.write_text("habari ya asubuhi\nnakupenda sana\nasante sana rafiki\nkaribu nyumbani\n" * 4)
    inputs = {}
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "moekit", "longcat_flash", "jetmoe", "dbrx", "gemma4_text",
                   "qwen4_exp_text"):
        folder = root / family
        if family == "moekit":
            spec = MoESpec(num_experts=4, top_k=2, every=1, init={"method": "noise", "std": 0.02},
                           router={"init": "normal"})
            model = upcycle(tiny_llama(tie_word_embeddings=True), spec)  # tied, as SmolLM2's
            save(model, folder, tokenizer=tiny_tokenizer())
        else:  # LongCat-Flash's zero-computation experts, JetMoE's experts split in two modules
            model = TINY_HF_MOE[family]() if family in TINY_HF_MOE else tiny_family_model(family, perturb=0.05)
            model.save_pretrained(folder)
            tiny_tokenizer().save_pretrained(folder)
        sites = find_sites(model)  # EP = 2: rows on both ranks' halves, and a layer with rows on rank 1 only
        e, sel = sites[0].num_experts, root / f"{family}.json"
        # (one MoE layer, LongCat's: its first three; e - 1 there is a zero-computation expert, which has no weights)
        Selection(method="manual", budget=4, experts={sites[-1].name: [e - 2], sites[0].name: [0, e - 1, 1]}).save(sel)
        inputs[family] = (folder, sel, text)
    return inputs


def finetune(inputs, family: str, engine: str, tmp_path: Path) -> Path:
    folder, sel, text = inputs[family]
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    (tmp_path / "zero2.json").write_text(json.dumps({**ZERO3, "zero_optimization": {"stage": 2}}))
    out = tmp_path / f"{family}_{engine}"
    torchrun(["finetune", "--model", str(folder), "--experts", str(sel), "--data", f"sw={text}", "--out", str(out),
              "--steps", "4", "--batch-size", "2", "--lr", "1e-3", "--max-length", "16",
              *FINETUNE_FLAGS[engine](tmp_path)], tmp_path)
    return out


@gloo
@pytest.mark.parametrize("family,engine", FINETUNE)
def test_finetune_sharded_equals_ddp(family, engine, finetune_inputs, tmp_path_factory, tmp_path):
    from moekit.checkpoint.format import load_model

    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    if family not in DDP_FINETUNE:  # one DDP run per family
        DDP_FINETUNE[family] = finetune(finetune_inputs, family, "ddp", tmp_path_factory.mktemp(f"ddp_ft_{family}"))
    base = DDP_FINETUNE[family]
    out = finetune(finetune_inputs, family, engine, tmp_path)
    ours, theirs = (json.loads((o / "finetune.json").read_text()) for o in (out, base))
    assert ours["engine"] != theirs["engine"] == "DDP"
    mine, ref = ([h for h in r["log_history"] if "loss" in h] for r in (ours, theirs))
    assert [h["step"] for h in mine] == [h["step"] for h in ref] == [1, 2, 3, 4]
    for a, b in zip(mine, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    original = load_model(finetune_inputs[family][0]).state_dict()
    tuned, reference = load_model(out).state_dict(), load_model(base).state_dict()
    assert tuned.keys() == reference.keys() == original.keys()
    changed = {k for k in original if not torch.equal(reference[k], original[k])}
    # only the selected experts trained (JetMoE's are its FFN block's input_linear and output_linear)
    assert changed and all(re.search(r"\.experts\.|\.mlp\.(input|output)_linear\.", k) for k in changed)
    for k in original:
        if k in changed:
            torch.testing.assert_close(tuned[k], reference[k], rtol=1e-4, atol=1e-5, msg=k)
        else:
            assert torch.equal(tuned[k], original[k]), k


DDP_FINETUNE: dict[str, Path] = {}


END = """
import atexit
import torch.distributed as dist
from moekit.cli.main import end_process
from moekit.training.parallel import leave_launch
atexit.register(print, "teardown ran")
print("outside a launch", end_process(3))  # the code is returned
dist.init_process_group("gloo", init_method="file://{rendezvous}", rank=0, world_size=1)
held = dist.group.WORLD  # kept past destroy_process_group, as DeepSpeed keeps its groups (and their threads)
leave_launch()
print("trained")  # stdout is a pipe: block-buffered until flushed
end_process(3)
print("not reached")
"""


@gloo
def test_a_process_whose_launch_is_over_ends_with_its_code_its_output_and_no_teardown(tmp_path):
    """moekit.cli.main.end_process: after leave_launch the process ends at once with the command's exit code, its
    buffered output flushed, no teardown run (atexit, interpreter finalization); before, it only returns the code."""
    proc = subprocess.run([sys.executable, "-c", END.format(rendezvous=tmp_path / "rendezvous")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "outside a launch 3\ntrained\n"


@gloo
def test_a_pretrained_ctc_encoder_trains_under_fsdp2_and_expert_parallelism_as_under_ddp(tiny_speech, tmp_path):
    """model.kind=pretrained_ctc (recipes/asr/ume_wav2vec2.yaml) on the tiny wav2vec 2.0 CTC checkpoint, its dropouts,
    LayerDrop and time masking set to 0 (the engines draw random numbers in other orders, so a stochastic run differs
    after a few steps): FSDP2 and EP over 2 ranks equal DDP per step (loss and grad norm, 1e-5) and in the saved
    model. Both crashed before (transformers raises on a CTC encoder's get_input_embeddings)."""
    import shutil

    checkpoint = tmp_path / "wav2vec2"
    shutil.copytree(tiny_speech["wav2vec2"], checkpoint)
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg.update({k: 0.0 for k, v in cfg.items() if isinstance(v, float) and ("drop" in k or k == "mask_time_prob")})
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    runs = {}
    for engine, keys in {"ddp": {}, "fsdp2": {"train.fsdp": True}, "ep2": {"train.expert_parallel": 2}}.items():
        out = runs[engine] = tmp_path / engine
        keys = {"out": str(out), "data.corpus": str(tiny_speech["corpus"]), "data.langs": ["en", "fr"],
                "model.path": str(checkpoint), "train.steps": 3, "train.batch_size": 2, "train.logging_steps": 1,
                "train.eval_every": 0, "train.save_every": 0, "eval.batch_size": 2, "eval.loss_per_lang": 2,
                "eval.routing_batches": 1, **keys}
        recipe = str(RECIPES / "asr" / "ume_wav2vec2.yaml")
        torchrun(["train", recipe, *[f"{k}={json.dumps(v)}" for k, v in keys.items()]], tmp_path)
    reference = model_of(runs["ddp"])
    for engine in ("fsdp2", "ep2"):
        record = json.loads((runs[engine] / "engine.json").read_text())
        assert record["processes"] == 2 and max(record["held_per_process"]) < 0.6 * record["parameters"], record
        ours, theirs = steps(runs[engine]), steps(runs["ddp"])
        assert [h["step"] for h in ours] == [h["step"] for h in theirs] == [1, 2, 3]
        for a, b in zip(ours, theirs):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(
                b["grad_norm"], rel=1e-5), (engine, a, b)
        sharded = model_of(runs[engine])
        assert sharded.keys() == reference.keys()
        for k in reference:
            torch.testing.assert_close(sharded[k], reference[k], rtol=1e-4, atol=1e-5, msg=k)


def test_expert_parallelism_refuses_experts_it_cannot_split_by_expert():
    """transformers' EP plan splits tensors stacked by expert (E, ...) into shares of whole experts: Mixtral's fused
    experts get one entry each; DBRX's hold every expert's rows in 2-D (E·I, H) tensors, and JetMoE's are two modules
    of its block: both refused in one line, naming the layer, before any rank trains."""
    from moekit.errors import UnsupportedModelError
    from moekit.testing.families import tiny_family_model
    from moekit.training.parallel import ep_plan

    plan = ep_plan(tiny_family_model("mixtral"))
    assert plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert plan["model.layers.*.mlp.experts.gate_up_proj"] == "grouped_gemm"
    with pytest.raises(UnsupportedModelError, match=r"transformer\.blocks\.0\.ffn: .*DBRX's.*without expert") as e:
        ep_plan(tiny_family_model("dbrx"))
    assert "\n" not in str(e.value)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp: .*JetMoE's.*without expert") as e:
        ep_plan(tiny_family_model("jetmoe"))
    assert "\n" not in str(e.value)
