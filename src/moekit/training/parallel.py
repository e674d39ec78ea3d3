"""Training beyond one device: which engine a run uses, and what moekit does so that its recipes run on it unchanged.

One engine per run, chosen by the recipe (docs/guides/distributed.md):

- ddp: a distributed launch (torchrun, accelerate launch) without a sharding option: accelerate's DDP (gloo on CPU).
- deepspeed: `train.trainer_args.deepspeed`, a DeepSpeed config as DeepSpeed's docs write it (a JSON path or a
  mapping). moekit owns the keys it sets from the recipe (batch sizes, clipping, precision: they must be "auto" or
  agree), gathers the full weights for every save (stage3_gather_16bit_weights_on_model_save, whatever the config
  says) and, for stage 3, declares every MoE block (moekit's MoELayer with its router, routed and shared experts;
  transformers' MoE blocks; the units a method names, e.g. SIMoE's interpolated layers) a ZeRO-3 leaf module, so
  that its parameters are gathered once for the whole block, whichever experts the tokens pick.
- fsdp: `train.fsdp`, FSDP2 full shard through transformers' DistributedConfig(fsdp_size=world): whole decoder
  layers are the units (the model's FSDP plan), extra units a method names get their own.
- ep: `train.expert_parallel: N`, transformers' expert parallelism (DistributedConfig(ep_size=N, fsdp_size=world)):
  every MoE layer's experts split by expert over N ranks, tokens exchanged with all-to-all; the rest FSDP2-sharded.

Under the sharded engines (ZeRO-3, FSDP2, EP) no rank holds the whole model: whatever runs during training on the
model (evaluation callbacks) runs on every rank, and the evaluation after training runs on the main process from the
saved model (`sharded`). transformers' own functions used here: DistributedMixin.prepare_distribute_model and
maybe_distribute_model (apply a DistributedConfig to a model built in memory), gather_full_state_dict; the version is
pinned (transformers==5.23.0) and tests/test_parallel.py runs them.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn

from moekit.errors import ConfigError, MoekitError, UnsupportedModelError

ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed keys the Trainer fills from TrainingArguments -> the recipe key that sets them
OWNED = {"train_micro_batch_size_per_gpu": "train.batch_size", "gradient_accumulation_steps": "train.grad_accum",
         "train_batch_size": "train.batch_size × train.grad_accum × processes", "gradient_clipping": "optim.max_grad_norm",
         "optimizer.params.lr": "optim.lr", "optimizer.params.weight_decay": "optim.weight_decay",
         "scheduler.params.warmup_max_lr": "optim.lr", "fp16.enabled": "train.precision",
         "bf16.enabled": "train.precision", "optimizer.params.betas": "train.trainer_args.adam_beta1/adam_beta2",
         "optimizer.params.eps": "train.trainer_args.adam_epsilon"}


def is_main() -> bool:
    """Whether this is the main process (rank 0) of the launch, the one that writes."""
    return int(os.environ.get("RANK", "0")) == 0


_left_launch = False  # set by leave_launch: this process took part in a distributed launch, now over


def leave_launch() -> None:
    """This process's part of a distributed launch is done: its process group is shut down now (a non-main rank ends
    while the main one still evaluates). destroy_process_group does not stop gloo's worker threads while anything
    still references the group, and DeepSpeed does (its ZeRO optimizer, engine and groups module), so the process
    is also marked to end without the interpreter's teardown (moekit.cli.main.end_process)."""
    global _left_launch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _left_launch = True


def left_launch() -> bool:
    """Whether `leave_launch` shut down this process's distributed launch."""
    return _left_launch


def world_size() -> int:
    """Processes of this launch (torchrun and accelerate set WORLD_SIZE); 1 without a distributed launch."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_launch() -> None:
    """`accelerate launch` asked for several processes without an accelerate config (or its multi_gpu mode) on a
    machine without GPUs runs its simple launcher: one process, given MASTER_ADDR/MASTER_PORT but no WORLD_SIZE
    (it leaves several CPU processes to MPI, which would set the world size). Refused before any work, rather than
    training on one process."""
    env = os.environ
    mpi = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env and not any(k in env for k in mpi):
        raise ConfigError("accelerate launch started one process where several were asked for: without an "
                          "accelerate config on a machine without GPUs it starts one unless MPI starts them; start "
                          "them with accelerate launch's multi_gpu option (it runs torchrun; gloo on the CPU) or with "
                          "torchrun's nproc-per-node")


@contextlib.contextmanager
def lost_process(work: Path, last_checkpoint) -> Iterator[None]:
    """A collective that fails because another process of the launch ended (killed, out of memory: gloo's "Connection
    reset/closed by peer", NCCL's errors) becomes one MoekitError naming the process that ended (in a launch of 2,
    the other one) and what is left of the run: its last checkpoint, kept in `work` to resume from, or nothing
    (`last_checkpoint(work)`: the checkpoint or None; the main process removes a run without one)."""
    import torch.distributed as dist

    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        gloo = re.search(r"Connection (?:reset|closed) by peer(?: \[[^\]]*\](?::\d+)?)?", str(e))
        if world_size() < 2 or not (gloo or isinstance(e, dist.DistBackendError)):
            raise
        rank, n = int(os.environ.get("RANK", "0")), world_size()
        who = f"process {1 - rank}" if n == 2 else "another process"
        last = last_checkpoint(work)
        left = (f"{work} keeps {last.name}: resume=True continues it" if last is not None else
                "no checkpoint was saved, the run is removed" if is_main() else f"no checkpoint in {work}")
        raise MoekitError(f"process {rank} of {n}: {who} of this launch ended during training "
                          f"({gloo.group(0) if gloo else str(e).splitlines()[0][:160]}); {left}") from None


# ---------------------------------------------------------------------------------------------- DeepSpeed config


def read_deepspeed(value) -> dict:
    """The DeepSpeed config of `train.trainer_args.deepspeed` (a JSON file or a mapping), as a fresh dict."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"train.trainer_args.deepspeed must be a JSON file or a mapping, got {type(value).__name__}")
    from moekit._fs import read_small

    text = read_small(Path(value), "DeepSpeed config", ConfigError)
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"DeepSpeed config {value} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config {value} must hold a JSON object")
    return config


def zero_stage(config: dict) -> int:
    """The config's ZeRO stage (0 without a zero_optimization section); an unknown stage is a ConfigError."""
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError("DeepSpeed config: zero_optimization must be a mapping")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ConfigError(f"DeepSpeed config: zero_optimization.stage {stage!r} is no ZeRO stage "
                          f"(DeepSpeed has {', '.join(map(str, ZERO_STAGES))})")
    return stage


def check_zero_keys(config: dict) -> None:
    """The zero_optimization section against DeepSpeed's own schema, before any work: a mistyped key
    (stage3_param_persistance_threshold) is one line naming it, not DeepSpeed's ValidationError after the model
    is built."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError
    except ImportError:  # DeepSpeed not installed: train refuses the config elsewhere
        return
    try:
        DeepSpeedZeroConfig(**{k: v for k, v in zero.items() if v != "auto"})
    except ValidationError as e:
        problems = [f"zero_optimization.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ConfigError("DeepSpeed config: " + "; ".join(problems)) from None


def deepspeed_config(value) -> dict:
    """The config moekit hands to DeepSpeed: the user's, checked (stage), with the full weights gathered for every
    save under stage 3 (moekit writes its checkpoints from them)."""
    config = read_deepspeed(value)
    for key, what in (("optimizer", "an `optimizer` section would replace the optimizer"),
                      ("scheduler", "a `scheduler` section would replace the learning-rate schedule")):
        if key in config:  # DeepSpeed would silently replace the recipe's own (issue 37: warm-up lost)
            raise ConfigError(f"DeepSpeed config: {what} moekit builds from the recipe (optim.lr, its warm-up and "
                              "schedule); leave it out")
    check_zero_keys(config)
    if zero_stage(config) == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def check_deepspeed(args, owned: dict[str, str] = OWNED) -> None:
    """What DeepSpeed would only find after the model is built: a key moekit sets from the recipe that the config
    contradicts (instead of "auto"). Optimizer and scheduler sections are refused earlier (deepspeed_config)."""
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is None:
        return
    for line in ds.mismatches:  # "- ds KEY=VALUE vs hf ARG=VALUE"
        found = re.match(r"- ds (\S+)=(.*) vs hf \S+=(.*)$", line)
        if found:
            key, theirs, ours = found.groups()
            raise ConfigError(f"DeepSpeed config: {key} is {theirs}, but moekit sets it from {owned.get(key, 'the recipe')}"
                              f" ({ours}): write \"auto\" or leave it out")
        raise ConfigError(f"DeepSpeed config contradicts the recipe: {line.lstrip('- ')}")


# ---------------------------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Engine:
    kind: str  # "single", "ddp", "deepspeed", "fsdp", "ep"
    zero: int | None = None  # DeepSpeed's ZeRO stage
    expert_parallel: int = 1

    @property
    def sharded(self) -> bool:
        """No rank holds the whole model: evaluation runs on every rank or from the saved model."""
        return self.kind in ("fsdp", "ep") or self.zero == 3

    @property
    def by_transformers(self) -> bool:
        """Sharded through transformers' DistributedConfig (FSDP2, EP)."""
        return self.kind in ("fsdp", "ep")

    def describe(self) -> str:
        return {"single": "one process", "ddp": "DDP", "deepspeed": f"DeepSpeed ZeRO-{self.zero}", "fsdp": "FSDP2",
                "ep": f"expert parallelism over {self.expert_parallel} ranks + FSDP2"}[self.kind]


def engine_of(trainer_args: dict, fsdp: bool = False, expert_parallel: int = 1) -> Engine:
    """The engine of a run's settings (see the module docstring); contradictory settings are a ConfigError."""
    ds = trainer_args.get("deepspeed")
    stage = None if ds is None else zero_stage(read_deepspeed(ds))
    if ds is not None and (expert_parallel > 1 or fsdp):
        what = "train.expert_parallel" if expert_parallel > 1 else "train.fsdp"
        extra = "transformers' expert parallelism splits the experts into DTensors" if expert_parallel > 1 \
            else "FSDP2 shards the parameters itself"
        raise ConfigError(f"{what} cannot run under DeepSpeed ZeRO-{stage} (train.trainer_args.deepspeed): {extra}, "
                          "which DeepSpeed cannot partition; use one of them")
    if trainer_args.get("fsdp") and (expert_parallel > 1 or fsdp):
        raise ConfigError("train.trainer_args.fsdp (accelerate's FSDP) cannot be combined with train.fsdp or "
                          "train.expert_parallel (transformers' FSDP2): use one")
    if expert_parallel > 1:
        return Engine("ep", expert_parallel=expert_parallel)
    if fsdp:
        return Engine("fsdp")
    if ds is not None:
        return Engine("deepspeed", zero=stage)
    return Engine("ddp" if world_size() > 1 else "single")


def check_engine(engine: Engine, expert_counts: list[int] | None = None) -> None:
    """Refuse what the engine cannot do in this launch: FSDP2 or EP without a distributed launch, an EP size larger
    than the launch or not dividing every MoE layer's expert count, EP on a model without MoE layers.
    `expert_counts`: the experts of each MoE layer (None: not known yet)."""
    world = world_size()
    if engine.kind == "fsdp" and world < 2:
        raise ConfigError("train.fsdp shards the model over the processes of a distributed launch; run it under torchrun "
                          "or accelerate launch with at least 2 processes")
    if engine.kind != "ep":
        return
    n = engine.expert_parallel
    if world < 2:
        raise ConfigError(f"expert parallelism over {n} ranks needs a distributed launch of at least {n} processes "
                          f"(torchrun or accelerate launch); this is a single process")
    if n > world or world % n:
        raise ConfigError(f"expert parallelism over {n} ranks needs a process count it divides; this launch has {world}")
    if expert_counts is not None and not expert_counts:
        raise ConfigError(f"expert parallelism over {n} ranks needs MoE layers; this model has none")
    bad = sorted({e for e in expert_counts or [] if e % n})
    if bad:
        raise ConfigError(f"expert parallelism over {n} ranks must divide every MoE layer's expert count; this "
                          f"model's layers have {', '.join(map(str, bad))} experts")


def held(model: nn.Module) -> tuple[int, int]:
    """(parameter elements this process holds, elements of the whole model): a ZeRO-3 parameter counts its partition
    (ds_tensor), a DTensor (FSDP2, EP) its local shard, anything else whole."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel
        elif isinstance(p, DTensor):
            local, total = local + p.to_local().numel(), total + p.numel()
        else:
            local, total = local + p.numel(), total + p.numel()
    return local, total


def engine_record(engine: Engine, model: nn.Module) -> dict:
    """What the run's engine did with the parameters (engine.json of a run): the engine, its communication backend
    (gloo, nccl; None in one process), the processes and the elements each one holds, of how many. A collective
    under a distributed launch (every rank calls it)."""
    import torch.distributed as dist

    local, total = held(model)
    experts = [m.num_experts for m in model.modules() if m in _EXPERTS]  # EP: this rank's share of each layer's
    counts, backend = [(local, experts)], None
    if dist.is_available() and dist.is_initialized():
        counts, backend = [None] * dist.get_world_size(), dist.get_backend()
        dist.all_gather_object(counts, (local, experts))
    record = {"engine": engine.describe(), "backend": backend, "processes": len(counts), "parameters": total,
              "held_per_process": [c[0] for c in counts]}
    if engine.kind == "ep":
        record["experts_per_process"] = [c[1] for c in counts]  # per MoE layer, of `experts_per_layer`
        record["experts_per_layer"] = [_EXPERTS[m] for m in model.modules() if m in _EXPERTS]
    return record


# ---------------------------------------------------------------------------------------------- the model


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Every MoE block: moekit's MoE layers (router, routed and shared experts) or transformers' MoE blocks."""
    from moekit.routing.sites import moe_sites

    return [s.block for s in moe_sites(model)]


def zero3_leaves(model: nn.Module, extra: list[nn.Module] = ()) -> list[nn.Module]:
    """Declare the MoE blocks, the attention indexers (and `extra` units) ZeRO-3 leaf modules
    (deepspeed.utils.set_z3_leaf_modules, by instance): DeepSpeed gathers a leaf's parameters all at once when it runs
    and reduces their gradients after its backward, instead of tracing the submodules, whose order changes with the
    routing. An indexer (sparse attention's token selection: DeepSeek-V3.2's, Qwen4-exp's `indexer`) may run a
    submodule a number of times that depends on the tokens (Qwen4-exp's QSA indexer: its key norm once per query with
    a complete block), so that each rank would gather it a different number of times and the ranks would wait on each
    other for ever. Returns the leaves."""
    from deepspeed.utils import set_z3_leaf_modules_by_name

    names = {id(m): n for n, m in model.named_modules()}
    indexers = [m for n, m in model.named_modules()
                if n.rpartition(".")[2] == "indexer" and next(m.parameters(), None) is not None]
    units = [m for m in [*moe_blocks(model), *indexers, *extra] if id(m) in names]
    if units:
        set_z3_leaf_modules_by_name(model, [names[id(m)] for m in units])
        share_across_leaves(units)
    for unit in units:
        unit.register_forward_pre_hook(input_requires_grad)
    return units


def share_across_leaves(units: list[nn.Module]) -> None:
    """Parameters in several leaves (Omni-router: one router in every MoE block) are reduced as DeepSpeed reduces any
    parameter outside a leaf: once their gradient is accumulated (a post-accumulate-grad hook), i.e. once per backward
    with every use summed. DeepSpeed files a leaf parameter under the last leaf that holds it and reduces it when that
    leaf's backward ends, the first MoE layer of the backward, before the other layers' shares arrive (a zero
    gradient then, the real one left in .grad). DeepSpeed tells leaf parameters by a `ds_z3_leaf_module` attribute,
    set before it makes its reduce hooks: it is removed from these in between."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    seen: dict[int, int] = {}
    for unit in units:
        for p in unit.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    for unit in units:
        for p in unit.parameters():
            if seen[id(p)] > 1:
                p.moekit_shared_leaf = True
    make_hooks = Stage3.create_reduce_and_remove_grad_hooks
    if getattr(make_hooks, "moekit", False):
        return

    def create_reduce_and_remove_grad_hooks(self):
        for group in self.fp16_groups:
            for p in group:
                if getattr(p, "moekit_shared_leaf", False) and hasattr(p, "ds_z3_leaf_module"):
                    del p.ds_z3_leaf_module
        return make_hooks(self)

    create_reduce_and_remove_grad_hooks.moekit = True
    Stage3.create_reduce_and_remove_grad_hooks = create_reduce_and_remove_grad_hooks


def input_requires_grad(module: nn.Module, args: tuple):
    """A forward pre-hook: the module's input as a detached copy that requires grad (costs one input gradient, changes
    no value) where it needs none (everything before it frozen: UME, SPRI's first stage, selective fine-tuning).
    ZeRO-3 reduces a leaf's gradients in a full backward hook, which fires once the gradient of the leaf's input is
    computed, so before the leaf's own backward without it; under EP it makes every rank run the backward of the
    all-to-all, also a rank with nothing of its own to train in that layer."""
    if not args or not isinstance(args[0], Tensor) or args[0].requires_grad or not torch.is_grad_enabled():
        return None
    return (args[0].detach().requires_grad_(), *args[1:])


def _wildcard(name: str) -> str:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    return replace_layer_number_by_wildcard(name)


def ep_plan(model: nn.Module, prefix: str = "") -> dict[str, str]:
    """transformers' EP plan for every MoE layer of `model` (moekit's or transformers'): the experts module reached
    by all-to-all token dispatch, each of its tensors with the expert dimension first split by expert."""
    from moekit.routing.sites import expert_rows, moe_sites

    plan = {}
    for site in moe_sites(model):
        if expert_rows(site.experts, site.num_experts):
            raise UnsupportedModelError(f"{site.name}: its experts hold every expert's rows in 2-D (E·n, ...) "
                                        "parameters (DBRX's), which expert parallelism cannot split by expert; train "
                                        "it without expert parallelism")
        if not any(m is site.experts for m in site.block.children()):
            raise UnsupportedModelError(f"{site.name}: its experts are two modules of its block (JetMoE's input_linear "
                                        "and output_linear), not one that expert parallelism can dispatch tokens to; "
                                        "train it without expert parallelism")
        path = _wildcard(f"{prefix}{site.name}.{_child_name(site.block, site.experts)}")
        plan[path] = "ep_dispatch_experts"
        for name, p in site.experts.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == site.num_experts:
                plan[f"{path}.{name}"] = "grouped_gemm"
    return plan


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    return next(n for n, m in parent.named_children() if m is child)


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside `model` (a PEFT wrapper's base model), whose parallel plans apply."""
    from transformers import PreTrainedModel

    for m in (model, getattr(getattr(model, "base_model", None), "model", None)):
        if isinstance(m, PreTrainedModel):
            return m
    raise ConfigError(f"{type(model).__name__} is no transformers model: train.fsdp and train.expert_parallel "
                      "shard transformers models")


def distribute(model: nn.Module, engine: Engine, units: list[str] = (), between=None):
    """Shard `model` in place with transformers' DistributedConfig (FSDP2, or EP + FSDP2) over every process of the
    launch; returns transformers' device meshes. `units`: module paths (relative to the transformers model) to give
    FSDP2 units of their own, e.g. a module called outside any decoder layer. `between(model, ep_mesh)` runs after
    the experts are split and before FSDP2 wraps the model (selective fine-tuning parametrizes each rank's share
    there); tied input and output embeddings (one Parameter) become one FSDP2 unit there too (transformers, which
    ties them only after loading, would shard them apart). Both hook transformers' private
    apply_fully_sharded_data_parallelism, which maybe_distribute_model calls last (transformers==5.23.0 is
    pinned)."""
    from transformers.distributed import DistributedConfig

    from moekit.routing.sites import moe_sites

    hf = hf_model(model)
    world = world_size()
    for site in moe_sites(hf):
        _EXPERTS[site.experts] = site.num_experts
    fsdp_plan = {_wildcard(u): "free_full_weight" for u in units}
    tied = tied_embeddings(hf)
    if tied:  # transformers shards them apart (it ties them only after loading): one unit of their own, made below
        hf.fsdp_plan = {k: v for k, v in hf.fsdp_plan.items() if k not in tied}
    kwargs = {"fsdp_size": world, "fsdp_plan": fsdp_plan or None}
    if engine.kind == "ep":
        # moekit's plan replaces the model's, which transformers would extend with it: Gemma 4's also splits the dense
        # MLP beside its experts (tensor parallel, over the ranks FSDP2 then shards it over: overlapping meshes)
        hf.ep_plan = ep_plan(hf)
        kwargs.update(ep_size=engine.expert_parallel, ep_plan=hf.ep_plan, ep_implementation="all_to_all")
    config = DistributedConfig(**kwargs)
    config, _, mesh = type(hf).prepare_distribute_model(config)

    def before_fsdp(m: nn.Module) -> None:
        if between is not None:
            between(m, mesh.get_mesh("ep"))
        if tied:
            from torch.distributed.fsdp import fully_shard

            fully_shard([hf.get_submodule(p) for p in tied], mesh=mesh.get_mesh("fsdp"), reshard_after_forward=False)

    with _before_fsdp(before_fsdp if between is not None or tied else None):
        type(hf).maybe_distribute_model(hf, config, mesh)
    return mesh


def tied_embeddings(model: nn.Module) -> list[str]:
    """The paths of the input embedding and the output head when they share one Parameter, else [] (also for a model
    without input embeddings: a CTC encoder reads audio, and transformers raises for it)."""
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except NotImplementedError:
        return []
    if inp is None or out is None or getattr(out, "weight", None) is not inp.weight:
        return []
    names = {m: n for n, m in model.named_modules()}
    return [names[inp], names[out]]


@contextlib.contextmanager
def _before_fsdp(hook) -> Iterator[None]:
    if hook is None:
        yield
        return
    from transformers.distributed import mixin

    apply = mixin.apply_fully_sharded_data_parallelism

    def hooked(model, *args, **kwargs):
        hook(model)
        return apply(model, *args, **kwargs)

    mixin.apply_fully_sharded_data_parallelism = hooked
    try:
        yield
    finally:
        mixin.apply_fully_sharded_data_parallelism = apply


_EXPERTS: WeakKeyDictionary = WeakKeyDictionary()  # experts module -> its layer's expert count, before EP


@contextlib.contextmanager
def global_expert_counts(model: nn.Module) -> Iterator[None]:
    """Expert parallelism sets each experts module's num_experts to its rank's share; while writing a checkpoint (of
    every expert) the count is the layer's own again."""
    changed = []
    for experts in model.modules():
        full = _EXPERTS.get(experts)
        if full is not None and experts.num_experts != full:
            changed.append((experts, experts.num_experts))
            experts.num_experts = full
    try:
        yield
    finally:
        for experts, local in changed:
            experts.num_experts = local


@contextlib.contextmanager
def materialized(model: nn.Module, full: dict) -> Iterator[None]:
    """The model's parameters replaced by the full tensors gathered from their shards (ZeRO-3 partitions, FSDP2 or EP
    DTensors), for code that reads the model as a whole on one process (a checkpoint writer, its model card's
    counts) without a collective; a parameter registered in several modules (tied embeddings, a shared router) stays
    one tensor. No copy: the parameters are views of `full`. Put back afterwards."""
    swapped, fresh = [], {}
    for fqn, param in list(model.named_parameters(remove_duplicate=False)):  # listed first: a shared module's
        # parameter is met once per path, and must be swapped (and put back) as the original each time
        if fqn not in full:
            continue
        owner, _, name = fqn.rpartition(".")
        module = model.get_submodule(owner)
        new = fresh.setdefault(id(param), nn.Parameter(full[fqn], requires_grad=param.requires_grad))
        swapped.append((module, name, param))
        module._parameters[name] = new
    try:
        yield
    finally:
        for module, name, param in reversed(swapped):
            module._parameters[name] = param


def full_state_dict(model: nn.Module) -> dict:
    """The full state dict of a model sharded by transformers (FSDP2, EP), gathered from every rank (a collective:
    every rank calls it); the tensors on the main process, {} elsewhere."""
    from transformers.distributed import gather_full_state_dict

    return gather_full_state_dict(model)


@contextlib.contextmanager
def no_zero_init() -> Iterator[None]:
    """Build models normally while a ZeRO-3 Trainer exists: transformers would otherwise construct every model under
    deepspeed.zero.Init, partitioned over the processes (a collective the other ranks do not join)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def is_sharded_by_transformers(model: nn.Module) -> bool:
    try:
        return bool(getattr(hf_model(model), "is_distributed_loading_by_transformers", False))
    except ConfigError:
        return False
