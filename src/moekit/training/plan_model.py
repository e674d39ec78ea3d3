"""The model a run would train, on the meta device, and what moekit.training.memory needs to know about it: where its
config comes from (a local directory, a built-in asset, or a Hub id's config.json alone), its shapes checked against
the safetensors headers, the freeze stages, the routed experts, and the decoder geometry of the activation
estimate."""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from moekit.errors import AssetError, ConfigError, UnsupportedModelError
from moekit.training.memory import Ffn, Geometry, Layer, Lora

Predicate = Callable[[str], bool]


class Mask:
    """A freeze schedule's stage (moekit.methods.freeze.apply_mask): it sets requires_grad of every parameter, so
    what trains is the predicate alone, whatever the model set before (e.g. Whisper's fixed positions)."""

    def __init__(self, trains: Predicate):
        self.trains = trains

    def __call__(self, name: str) -> bool:
        return self.trains(name)


def trains_now(p: nn.Parameter, name: str, trains: Predicate) -> bool:
    return trains(name) if isinstance(trains, Mask) else p.requires_grad and trains(name)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FROM_META = "moekit.json and config.json, checked against every tensor header (no tensor data read)"


# ---------------------------------------------------------------------------------------------- sources


def model_folder(name: str, log=None) -> Path:
    """A local model directory, a built-in asset's (moekit.assets.resolve_model), or a Hub id's snapshot in the
    Hugging Face cache; a Hub id not in the cache gets its config.json only (no weights)."""
    from moekit.assets import MODELS, resolve_model
    from moekit.checkpoint.card import HUB_ID

    if Path(name).exists() or name in MODELS or not HUB_ID.match(name):
        return resolve_model(name, log)
    return hub_config(name, log)


def hub_config(repo: str, log=None) -> Path:
    """The cached snapshot of Hub repository `org/name[@revision]`, else its config.json fetched into the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from moekit.checkpoint.hub import HUB_FILES, hub_cache, resolve_hub

    repo_id, _, revision = repo.partition("@")
    if revision and any(part in ("", ".", "..") for part in revision.split("/")):
        return resolve_hub(repo, log)  # refuses it, in its words
    cache = hub_cache()
    if log:
        log(f"looking up {repo} in the Hugging Face cache {cache}")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache, allow_patterns=HUB_FILES,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return resolve_hub(repo, log)  # the cache miss, explained
    if log:
        log(f"fetching {repo} in the Hugging Face cache {cache}")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache,
                                      allow_patterns=["config.json"]))
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise AssetError(f"cannot fetch {repo}'s config.json from the Hugging Face Hub: "
                         f"{' '.join(str(e).split())[:300]}") from None


def has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()


def check_weights(model: nn.Module, folder: Path) -> str:
    """Where the shapes come from: config.json, checked against every safetensors header where the weights are
    there (a config that disagrees with its weights is refused); no tensor data is read. Where transformers renames
    the stored tensors on load (e.g. per-expert tensors fused), the totals are compared instead."""
    from moekit.checkpoint.files import ShardReader
    from moekit.checkpoint.upcycle import check_shapes

    if not has_weights(folder):
        return "config.json alone (no safetensors weights there to check it against)"
    with ShardReader(folder) as reader:
        n = len(reader.headers)
        try:
            check_shapes(model, reader, folder)
        except ConfigError:  # names transformers rewrites on load
            stored = sum(math.prod(h.shape) for h in reader.headers.values())
            built = sum(p.numel() for _, p in unique_params(model))
            if stored != built:
                return (f"config.json ({built:,} parameters; the {n} stored tensors, named otherwise, hold "
                        f"{stored:,}: shapes unchecked)")
            return f"config.json, checked against the total size of {n} tensor headers (no tensor data read)"
        return f"config.json, checked against the headers of {n} tensors (no tensor data read)"


# ---------------------------------------------------------------------------------------------- models


def recipe_model(recipe, log=None) -> tuple[nn.Module, Path, str]:
    """(the model `recipe` trains, on the meta device; its base model's directory; where the shapes came from).
    An upcycled moekit checkpoint the recipe trains as it is (TrainingMethod.prepared) is built from its moekit.json;
    an MoE is built from the spec's layout (moekit.checkpoint.stream.meta_moe_model: the same parameters as the
    in-memory upcycle, without its init math); LoRA and SIMoE by their method's own `adapt`."""
    from moekit.checkpoint.dense import meta_model
    from moekit.checkpoint.format import build_from_meta
    from moekit.methods import method

    m = recipe.model
    if recipe.task == "asr" and m.kind == "ctc":
        raise ConfigError("a dry run plans pretrained base models; a CTC model's vocabulary comes from its corpus, "
                          "so its size is known only once training reads the data")
    folder = model_folder(m.path, log)
    dtype = DTYPES[getattr(m, "dtype", "float32")]
    if method(recipe.method).prepared(recipe, folder):  # an upcycled checkpoint, trained as it is
        return build_from_meta(folder)[0].to(dtype), folder, FROM_META
    dense = meta_model(folder, m.trust_remote_code).to(dtype)
    shapes = check_weights(dense, folder)
    if getattr(recipe, "moe", None) is None:
        return method(recipe.method).adapt(recipe, dense, None), folder, shapes
    from moekit.checkpoint.stream import meta_moe_model
    from moekit.checkpoint.upcycle_model import router_groups, selected_slots

    spec = recipe.moe
    for branch in spec.init.source_models():  # BTX / sources: their FFNs must have the base's shapes
        where = model_folder(branch, log)
        check_weights(meta_model(where, m.trust_remote_code), where)
    slots = selected_slots(dense, spec)
    model, _ = meta_moe_model(dense, slots, router_groups(slots, spec), spec, dtype)
    return model, folder, shapes


def finetune_model(name: str, trust_remote_code: bool = False, log=None) -> tuple[nn.Module, Path, str]:
    """(the MoE model `moekit finetune` loads, on the meta device, in the dtype it would load in; its directory;
    where the shapes came from): a moekit checkpoint in its own dtype, checked against its headers; a transformers
    directory in float32 (load_model's default)."""
    from moekit.checkpoint.codecs import own_format
    from moekit.checkpoint.dense import meta_model
    from moekit.checkpoint.format import build_from_meta

    folder = model_folder(name, log)
    codec = own_format(folder)
    if codec is not None:
        raise UnsupportedModelError(f"{folder} is a {codec.file} checkpoint, not an MoE model whose experts "
                                    "finetune trains")
    if (folder / "moekit.json").is_file():
        model, _ = build_from_meta(folder)
        return model, folder, FROM_META
    model = meta_model(folder, trust_remote_code).to(torch.float32)
    return model, folder, check_weights(model, folder)


def stages_of(recipe, model: nn.Module) -> list[tuple[str, Predicate]]:
    """[(name, trains(parameter name))] of the recipe's freeze schedule and freeze.frozen (moekit.methods.freeze),
    evaluated at each step where a schedule can change (step 0 and τ·T)."""
    from moekit.methods import method
    from moekit.methods.freeze import stage_predicate

    cfg, total = recipe.freeze, recipe.train.steps
    if (not method(recipe.method).freezes or cfg.schedule == "none") and not cfg.frozen:
        return [("all steps", lambda name: True)]
    names = [n for n, _ in unique_params(model)]
    stages: list[tuple[int, int, Predicate, set[str]]] = []
    for start in sorted({s for s in (0, round(cfg.tau * total)) if s < total}):
        trains = Mask(stage_predicate(model, cfg, start, total))
        chosen = {n for n in names if trains(n)}
        if stages and stages[-1][3] == chosen:  # the schedule does not change here
            continue
        if stages:
            stages[-1] = (stages[-1][0], start, *stages[-1][2:])
        stages.append((start, total, trains, chosen))
    name = cfg.schedule if cfg.schedule != "none" else "freeze.frozen"
    return [(f"{name}, steps {a + 1}-{b}", trains) for a, b, trains, _ in stages]


# ---------------------------------------------------------------------------------------------- counts


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())  # tied and shared tensors once


def routed_names(model: nn.Module) -> set[str]:
    """Names of the routed experts' parameters (every MoE layer's stacked expert tensors)."""
    from moekit.routing.sites import moe_sites

    routed = {id(p) for s in moe_sites(model) for p in s.experts.parameters()}  # JetMoE's: two modules of its block
    return {n for n, p in unique_params(model) if id(p) in routed}


def decoder_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of decoder layers: as many as config.num_hidden_layers (LongCat-Flash: num_layers), the one with
    the most parameters."""
    from moekit.routing.streamed import stack_lengths

    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    lengths = stack_lengths(text)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) in lengths]
    if not lists:
        return None
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def largest_layer(model: nn.Module) -> int:
    """Elements of the largest decoder layer (ZeRO-3 / FSDP2 gather one at a time); 0 if none is found."""
    stack = decoder_stack(model)
    return 0 if stack is None else max(sum(p.numel() for p in layer.parameters()) for layer in stack[1])


def linear_params(model: nn.Module) -> int:
    """Elements of nn.Linear weights: what bf16 autocast copies (moekit's stacked experts run outside it)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


# ---------------------------------------------------------------------------------------------- geometry


def geometry(model: nn.Module, trains: Predicate, aux_losses: bool, lora_dropout: bool) -> Geometry | None:
    """The decoder's shapes and, per layer, what trains in the stage `trains` (None where the estimate does not
    apply: encoder-decoder and SIMoE models, or no decoder stack found)."""
    from moekit.moe.state import model_state

    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    stack = decoder_stack(model)
    if (stack is None or getattr(cfg, "is_encoder_decoder", False) or model_state(model).simoe is not None
            or not all(hasattr(text, k) for k in ("hidden_size", "num_attention_heads", "vocab_size"))):
        return None
    h, heads = text.hidden_size, text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    trained = {n for n, p in unique_params(model) if trains_now(p, n, trains)}
    name, layers = stack
    inside = f"{name}."
    outside = {n for n in trained if not n.startswith(inside)}
    before = any("embed" in n for n in outside)  # gradients flow from the first trainable parameter on
    ffns = _ffns(model, name, trained, getattr(text, "intermediate_size", 0))
    out, notes = [], ["activations: SDPA attention assumed (eager attention keeps heads × length more per token and "
                      "layer); every example at the maximum length"]
    for i, layer in enumerate(layers):
        mine = {n for n in trained if n.startswith(f"{inside}{i}.")}
        own = {n for n in mine if "lora_" not in n}
        attention = {n for n in own if "attn" in n or "attention" in n}
        out.append(Layer(ffns.get(i, Ffn(0, trained=False)), attention_trained=bool(attention),
                         norms_trained=any("norm" in n for n in own), active=before,
                         lora=_lora(layer) if len(own) < len(mine) else ()))
        before = before or bool(mine)
    if any(f.experts and not _moekit_site(model, name, i) for i, f in ffns.items()):
        notes.append("activations: transformers' own experts estimated as moekit's grouped experts")
    if lora_dropout and any(layer.lora for layer in out):
        notes.append("activations: LoRA dropout masks as CUDA keeps them (1 byte; the CPU keeps a float)")
    return Geometry(h, heads, kv, head_dim, text.vocab_size, tuple(out), head_trained=bool(outside),
                    aux_losses=aux_losses, lora_dropout=lora_dropout, notes=tuple(notes))


def _moekit_site(model: nn.Module, stack: str, i: int) -> bool:
    from moekit.moe.layer import moe_layers

    return any(path.startswith(f"{stack}.{i}.") for path, _ in moe_layers(model))


def _ffns(model: nn.Module, stack: str, trained: set[str], intermediate: int) -> dict[int, Ffn]:
    """{decoder layer index: its FFN}: MoE layers (moekit's or transformers'), else the dense FFN slots, else (e.g.
    Linears wrapped by LoRA) a gated `mlp` of the config's intermediate size."""
    from moekit.routing.sites import moe_sites
    from moekit.surgery import find_slots

    full, out = {id(p): n for n, p in unique_params(model)}, {}
    prefix = f"{stack}."

    def trains(module: nn.Module | None, part: Callable[[str], bool] = lambda n: True) -> bool:
        """Whether a parameter of `module` whose name in it passes `part` trains (by identity: JetMoE's experts module
        is not in the model's tree)."""
        return module is not None and any(full.get(id(p)) in trained and part(n) for n, p in module.named_parameters())

    for site in moe_sites(model):
        if site.name.startswith(prefix):
            i = int(site.name[len(prefix):].split(".")[0])
            inter, gated = _expert_shape(site.experts, site.num_experts)
            shared = _shared(site.block)
            out[i] = Ffn(inter, gated, site.num_experts, site.top_k,
                         0 if shared is None else shared.up_proj.out_features,
                         trains(site.experts, lambda n: not _down(n)), trains(site.experts, _down),
                         trains(site.router), trains(shared))
    try:
        slots = find_slots(model)
    except UnsupportedModelError:
        slots = []
    for slot in slots:
        if slot.stack == stack and slot.index not in out:
            w = slot.read()
            out[slot.index] = Ffn(w.intermediate_size, w.gated, trained=trains(model.get_submodule(slot.path)))
    def own(n: str) -> bool:
        return "lora_" not in n

    for i, layer in enumerate(model.get_submodule(stack)):
        mlp = getattr(layer, "mlp", None)
        if i not in out and isinstance(mlp, nn.Module):
            out[i] = Ffn(intermediate, hasattr(mlp, "gate_proj"), trained=trains(mlp, own))
    return out


def _expert_shape(experts: nn.Module, n: int) -> tuple[int, bool]:
    """(one expert's intermediate size, gated) from the stacked tensors: down (E, H, I), gate_up (E, 2I, H) or up
    (E, I, H); DBRX's rows (E·I, H)."""
    from moekit.routing.sites import expert_rows, stacked_tensors

    inter = getattr(experts, "intermediate_size", None)
    gated = getattr(experts, "gated", None)
    tensors = stacked_tensors(experts)
    if expert_rows(experts, n):  # DBRX's (E·I, H) rows: w1 and v1 (gate, up), w2 (down, transposed)
        return tensors["mlp.w1"].shape[0] // n, "mlp.v1" in tensors
    stacked = {name: p for name, p in tensors.items() if p.dim() == 3 and p.shape[0] == n}
    down = next((p for name, p in stacked.items() if _down(name)), None)
    if inter is None and down is not None:
        inter = down.shape[2]
    if gated is None:  # gate and up stacked: 2I rows (or GPT-OSS's (E, H, 2I) columns)
        gated = any(2 * inter in p.shape[1:] for name, p in stacked.items() if not _down(name))
    return int(inter or 0), bool(gated)


def _down(name: str) -> bool:
    """Whether an experts module's tensor is its down projection (JetMoE's: output_linear; DBRX's: mlp.w2)."""
    return "down" in name or "output_linear" in name or "w2" in name.split(".")


def _shared(block: nn.Module) -> nn.Module | None:
    for attr in ("shared", "shared_expert", "shared_experts"):
        m = getattr(block, attr, None)
        if isinstance(m, nn.Module) and isinstance(getattr(m, "up_proj", None), nn.Linear):
            return m
    return None


def _lora(layer: nn.Module) -> tuple[Lora, ...]:
    """Every LoRA-wrapped Linear of a decoder layer (peft's LoraLayer), by the input it reads: the attention's
    (q/k/v), its output's (o), the FFN's (gate/up) or its intermediate (down)."""
    out = []
    for name, m in layer.named_modules():
        a = getattr(m, "lora_A", None)
        if isinstance(a, nn.ModuleDict) and len(a):
            lin, last = next(iter(a.values())), name.rsplit(".", 1)[-1]
            if "attn" in name or "attention" in name:
                role = "o" if last in ("o_proj", "out_proj", "dense", "c_proj") else "qkv"
            else:
                role = "down" if last in ("down_proj", "fc2", "c_proj", "w2") else "in"
            out.append(Lora(role, lin.in_features, lin.out_features))
    return tuple(out)


def model_expert_counts(path, trust_remote_code: bool = False) -> list[int]:
    """The experts of each MoE layer of a model directory (moekit's or transformers'), from its config on the meta
    device (no weight read)."""
    from moekit.routing.sites import moe_sites

    model, _, _ = finetune_model(str(path), trust_remote_code)
    return [s.num_experts for s in moe_sites(model)]
