"""`moekit upcycle`: dense checkpoint (directory or built-in asset) -> moekit MoE checkpoint.

Everything that can be checked without the weights (recipe, spec, output directory, model and
branch paths) is checked before the model is loaded; nothing is written unless upcycling succeeds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from moekit.cli.common import device_arg, err_console, human, out_console
from moekit.cli.progress import progress
from moekit.errors import ConfigError
from moekit.registry import declared

if TYPE_CHECKING:
    from moekit.checkpoint.upcycle import UpcycleRecipe

FORMATS = ("auto", "moekit", *declared("moekit.checkpoint.export", "EXPORTERS"))
DTYPES = ("float32", "bfloat16", "float16")
LAYOUTS = ("classic", "fused")  # moekit.checkpoint.export.base.LAYOUTS, without importing torch for --help
LAYOUT_HELP = ("how a native format stores the routed experts: classic = one tensor per expert, the Hub's own "
               "names, read by transformers 4 and 5, llama.cpp and vLLM; fused = transformers 5's stacked tensors, "
               "read by transformers >= 5 only (default: classic)")


def size_arg(text: str) -> int:
    from moekit.checkpoint.writer import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block indices, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "upcycle", help="turn a dense model into an MoE model",
        description="Upcycle a dense model from flags (--model ... --out ...) or from a YAML recipe "
                    "{model, out, spec} with optional KEY=VALUE overrides (e.g. spec.top_k=1). "
                    "Flags given with a recipe override it. A mergekit-moe config runs as is: "
                    "moekit upcycle mergekit.yml OUT.")
    p.add_argument("recipe", nargs="?", help="YAML recipe file, or a mergekit-moe config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of the recipe")
    p.add_argument("--model", help="model directory, built-in asset name (e.g. smollm2-135m), or Hugging Face Hub id "
                                   "org/name[@revision] (looked up in the Hugging Face cache, downloaded when online)")
    p.add_argument("--out", help="output directory")
    p.add_argument("--method", choices=list(declared("moekit.init", "EXPERT_INITS")),
                   help="expert-init method; its parameters: `moekit list methods` (default: naive)")
    p.add_argument("--experts", type=int, help="experts per MoE layer (default: 8)")
    p.add_argument("--top-k", type=int, help="experts per token (default: 2)")
    p.add_argument("--granularity", type=int, metavar="G",
                   help="cut each FFN into G shards: experts x G experts of 1/G the width, top-k x G per token "
                        "(He et al. 2024; with --method scaled_copy) (default: 1)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--every", type=int, help="block i becomes MoE when (i + 1) %% N == 0 (default: all layers)")
    which.add_argument("--layers", type=int_list, help="comma-separated block indices, e.g. 0,4,8 (default: all layers)")
    p.add_argument("--target", help="regular expression the FFN module path must match (default: every FFN)")
    p.add_argument("--shared-expert", action=argparse.BooleanOptionalAction, default=None,
                   help="add an always-on shared expert, a copy of the dense FFN (default: no)")
    p.add_argument("--scoring", choices=["softmax_topk", "topk_softmax"],
                   help="router scoring (default: the init method's)")
    p.add_argument("--router-sharing", choices=["none", "all"], help="one router for all MoE layers (default: none)")
    p.add_argument("--seed", type=int, help="seed of the experts' and routers' random init (default: 0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. init.rho=1e-3 or router.jitter=0.01 (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept pickle (.bin) weights: they are converted to safetensors first (pickle runs code)")
    p.add_argument("--format", choices=FORMATS,
                   help="output format (default: moekit; for a mergekit-moe config, its architecture's); "
                        "auto: a native transformers format when one represents the MoE exactly, else moekit")
    p.add_argument("--layout", choices=LAYOUTS, help=LAYOUT_HELP)
    p.add_argument("--dtype", choices=["auto", *DTYPES],
                   help="output dtype (default: the mergekit-moe config's dtype, else auto = the checkpoint's own); "
                        "init math runs in float32")
    p.add_argument("--allow-same-experts", "--i-understand-this-is-not-useful-without-training",
                   dest="allow_same_experts", action="store_true",
                   help="build a mergekit-moe config whose experts all come from one model (e.g. to train it)")
    p.add_argument("--device", default="cpu", type=device_arg,
                   help="where the init math runs: auto, cpu, cuda or cuda:N")
    p.add_argument("--max-shard-size", default="5GB", type=size_arg, help="largest output shard")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow models whose directory ships its own Python code (auto_map); it will run")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="proceed although the dense weights or the initialized experts hold NaN or Inf")
    p.add_argument("--force", action="store_true",
                   help="proceed although the estimated memory exceeds what this machine has available")
    add_mergekit_flags(p)
    p.epilog = "The checkpoint is read and written tensor by tensor (safetensors only)."
    p.set_defaults(run=run)


LABELS = {"same": "as in mergekit", "no-op": "accepted, nothing to do", "refused": "refused"}


def add_mergekit_flags(p: argparse.ArgumentParser) -> None:
    """mergekit-moe's own flags, with mergekit's meaning where moekit has one (moekit.cli.mergekit_flags). Their
    --no- forms ask for mergekit's defaults, which moekit keeps, except the few it cannot do without."""
    from moekit.cli.mergekit_flags import MERGEKIT_FLAGS

    g = p.add_argument_group("mergekit-moe's flags", "accepted as mergekit-moe 0.1.5 spells them; the documentation's "
                             "mergekit-moe page (docs/guides/mergekit.md) has the table")
    taken = {o for a in p._actions for o in a.option_strings}
    for flag, (kind, takes_value, what) in MERGEKIT_FLAGS.items():
        if flag in taken:
            continue
        names = [flag, *{"--num-threads": ["-j"], "--verbose": ["-v"]}.get(flag, [])]
        dest = "mergekit_" + flag[2:].replace("-", "_")
        if takes_value:
            g.add_argument(*names, dest=dest, metavar="N" if flag != "--transformers-cache" else "DIR",
                           help=f"{LABELS[kind]}: {what}")
        else:
            g.add_argument(*names, dest=dest, action="count" if flag == "--verbose" else "store_true",
                           help=f"{LABELS[kind]}: {what}")
            no = f"--no-{flag[2:]}"
            if no not in taken:
                g.add_argument(no, dest="mergekit_refused_negation", action="append_const", const=no,
                               help=argparse.SUPPRESS)


def apply_mergekit_flags(args: argparse.Namespace) -> None:
    """mergekit-moe's flags turned into moekit's options, or one ConfigError for a flag moekit has no equivalent
    for (before any work)."""
    from moekit.cli.mergekit_flags import MERGEKIT_FLAGS, MERGEKIT_REFUSED_NEGATIONS, parse_kmb

    given = {flag: getattr(args, "mergekit_" + flag[2:].replace("-", "_"), None) for flag in MERGEKIT_FLAGS}
    given = {f: v for f, v in given.items() if v not in (None, False, 0)}
    refused = [f for f in given if MERGEKIT_FLAGS[f][0] == "refused"]
    refused += [n for n in getattr(args, "mergekit_refused_negation", None) or [] if n in MERGEKIT_REFUSED_NEGATIONS]
    if refused:
        f = refused[0]
        why = MERGEKIT_FLAGS[f][2] if f in MERGEKIT_FLAGS else MERGEKIT_REFUSED_NEGATIONS[f]
        raise ConfigError(f"{f} (mergekit-moe) has no equivalent in moekit: {why}")
    if "--cuda" in given or "--gpu-rich" in given:
        args.device = device_arg("cuda")
    if "--random-seed" in given:
        seed = _count(given["--random-seed"], "--random-seed", minimum=0)
        if args.seed is not None and args.seed != seed:
            raise ConfigError(f"--seed {args.seed} and --random-seed {seed} disagree; give one")
        args.seed = seed
    if "--num-threads" in given:
        import torch

        torch.set_num_threads(_count(given["--num-threads"], "--num-threads"))
    if "--transformers-cache" in given:
        os.environ["HF_HUB_CACHE"] = str(given["--transformers-cache"])
    args.shard_parameters = parse_kmb(given["--out-shard-size"]) if "--out-shard-size" in given else None
    args.quiet = "--quiet" in given
    args.mergekit_given = list(given)  # read_recipe refuses them without a mergekit-moe config


def _count(text: str, flag: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"{flag} takes a whole number of at least {minimum}, not {text!r}")
    return value


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The recipe fields set by flags, as `key=<JSON>` overrides (JSON is valid YAML, so values
    such as regular expressions reach the recipe unchanged)."""
    given = {"model": args.model, "out": args.out, "spec.num_experts": args.experts, "spec.top_k": args.top_k,
             "spec.granularity": args.granularity, "spec.target": args.target, "spec.shared_expert": args.shared_expert,
             "spec.router.scoring": args.scoring, "spec.router_sharing": args.router_sharing,
             "spec.seed": args.seed, "spec.init": None if args.method is None else {"method": args.method}}
    values = {k: v for k, v in given.items() if v is not None}
    if args.every is not None:  # the flag replaces the recipe's layer selection
        values.update({"spec.every": args.every, "spec.layers": None})
    if args.layers is not None:
        values.update({"spec.layers": args.layers, "spec.every": None})
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def read_recipe(args: argparse.Namespace) -> tuple[UpcycleRecipe, str, str]:
    """(recipe, output format, output dtype): the recipe file (or flags) with KEY=VALUE overrides, flags and
    `--set KEY=VALUE` (spec fields, e.g. init.rho, on top of the chosen method's defaults) applied in that order,
    then validated once; or a mergekit-moe config (`mergekit_recipe`)."""
    from moekit.checkpoint.upcycle import UpcycleRecipe
    from moekit.config import apply_overrides, read_yaml, validate
    from moekit.checkpoint.mergekit import is_mergekit

    if args.recipe is not None and "=" in args.recipe and not Path(args.recipe).exists():
        args.recipe, args.overrides = None, [args.recipe, *args.overrides]  # no recipe, only overrides
    if args.recipe is None:
        if args.overrides:
            raise ConfigError("KEY=VALUE overrides need a recipe file; use --set KEY=VALUE to set spec fields")
        if args.model is None or args.out is None:
            raise ConfigError("give a recipe file, or --model and --out")
    data = read_yaml(args.recipe) if args.recipe else {"spec": {}}
    if is_mergekit(data):
        return mergekit_recipe(args, data)
    if getattr(args, "mergekit_given", None):
        flag = args.mergekit_given[0]
        raise ConfigError(f"{flag} is a mergekit-moe flag: it applies to a mergekit-moe config (moekit upcycle "
                          "CONFIG OUT), not to this upcycle; leave it out (moekit's own options are in --help)")
    data = apply_overrides(data, [*args.overrides, *flag_overrides(args)])
    spec = data.get("spec")
    if isinstance(spec, dict) and isinstance(spec.get("init", "naive"), str):  # --set init.x needs a mapping
        spec["init"] = {"method": spec.get("init", "naive")}
    data = apply_overrides(data, [f"spec.{s}" for s in args.set])
    return validate(UpcycleRecipe, data, source=str(args.recipe or "command line")), args.format or "moekit", \
        args.dtype or "auto"


SPEC_FLAGS = ("model", "method", "experts", "top_k", "granularity", "every", "layers", "target", "shared_expert",
              "scoring", "router_sharing")


def mergekit_recipe(args: argparse.Namespace, data: dict) -> tuple[UpcycleRecipe, str, str]:
    """A mergekit-moe config as `moekit upcycle CONFIG OUT` takes it (moekit.checkpoint.mergekit): flags that would change the
    MoE are refused (the config says it all); --format and --dtype replace what `architecture` and `dtype` choose."""
    from moekit.checkpoint.upcycle import UpcycleRecipe
    from moekit.checkpoint.mergekit import output_dtype, output_format, read_mergekit, to_spec

    source = str(args.recipe)
    given = [f"--{f.replace('_', '-')}" for f in SPEC_FLAGS if getattr(args, f) is not None] + ["--set"] * bool(args.set)
    if given:
        raise ConfigError(f"{source} is a mergekit-moe config, which says what {', '.join(given)} would set: edit it")
    outs = [*args.overrides, *([args.out] if args.out else [])]
    if len(outs) != 1 or "=" in outs[0]:
        raise ConfigError(f"{source} is a mergekit-moe config: give one output directory, moekit upcycle {source} OUT")
    cfg = read_mergekit(data, source)
    spec = to_spec(cfg, source, allow_same_experts=args.allow_same_experts, seed=args.seed or 0)
    args.from_mergekit = True
    return (UpcycleRecipe(model=cfg.base_model, out=outs[0], spec=spec), args.format or output_format(cfg),
            args.dtype or output_dtype(cfg))


def check_mergekit_architectures(args: argparse.Namespace, model_dir: Path, branches: list[Path]) -> None:
    """A mergekit-moe config's models share one architecture (config.json's model_type), as mergekit-moe requires,
    unless --allow-crimes."""
    if not (args.recipe and branches and getattr(args, "from_mergekit", False)):
        return
    from moekit.checkpoint.dense import load_config
    from moekit.checkpoint.mergekit import check_architectures

    kinds = {str(m): load_config(m, args.trust_remote_code).model_type for m in (model_dir, *branches)}
    check_architectures(kinds, args.mergekit_allow_crimes)


def shard_bytes(args: argparse.Namespace, source: Path, dtype: str) -> int:
    """--max-shard-size, or mergekit's --out-shard-size (parameters) in bytes of the output dtype."""
    if args.shard_parameters is None:
        return args.max_shard_size
    import torch

    from moekit.checkpoint.files import ShardReader
    from moekit.checkpoint.upcycle import output_dtype

    with ShardReader(source) as reader:
        return args.shard_parameters * output_dtype(dtype, reader).itemsize if dtype == "auto" else \
            args.shard_parameters * getattr(torch, dtype).itemsize


def inputs_of(args: argparse.Namespace, recipe: UpcycleRecipe) -> list[Path]:
    """Everything the command reads: the output may not be, or contain, any of it."""
    from moekit.assets import model_inputs

    branches = recipe.spec.init.source_models()
    paths = [*model_inputs(recipe.model), *(p for b in branches for p in model_inputs(b))]
    return paths + ([Path(args.recipe)] if args.recipe else [])


@contextlib.contextmanager
def safetensors_of(model_dir: Path, args: argparse.Namespace, out: Path):
    """The model directory itself, or (--allow-pickle, pickle weights only) a temporary safetensors copy
    beside the output, removed afterwards: upcycling streams safetensors."""
    from moekit._fs import TMP
    from moekit.checkpoint.dense import has_safetensors, load_dense

    if has_safetensors(model_dir, args.allow_pickle):
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix=f".{out.name}{TMP}{os.getpid()}-pickle", dir=out.parent) as tmp:
        with err_console().status(f"converting the pickle weights of {model_dir} to safetensors"):
            load_dense(model_dir, allow_pickle=True, trust_remote_code=args.trust_remote_code,
                       allow_nonfinite=args.allow_nonfinite).save_pretrained(tmp)
        for f in model_dir.iterdir():  # tokenizer and generation files
            if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja") and not (Path(tmp) / f.name).exists():
                shutil.copyfile(f, Path(tmp) / f.name)
        yield Path(tmp)


def run(args: argparse.Namespace) -> None:
    from moekit._fs import guard, reserve
    from moekit.assets import hub_id, resolve_model
    from moekit.checkpoint.upcycle import upcycle_checkpoint

    apply_mergekit_flags(args)
    recipe, fmt, dtype = read_recipe(args)
    if args.layout is not None and fmt == "moekit":
        raise ConfigError(f"--layout {args.layout}: the moekit format has no expert layout to choose; --layout applies "
                          "to --format mixtral, qwen2_moe, qwen3_moe or auto")
    spec, inputs = recipe.spec, inputs_of(args, recipe)
    guard(recipe.out, inputs, args.overwrite)  # before resolving (possibly fetching) any model
    console = err_console()
    with reserve(recipe.out, inputs, args.overwrite) as out:
        model_dir = resolve_model(recipe.model, log=console.print)
        branches = [resolve_model(b, log=console.print) for b in spec.init.source_models()]
        if branches:
            spec = spec.model_copy(update={"init": spec.init.with_source_models(list(map(str, branches)))})
        check_mergekit_architectures(args, model_dir, branches)
        with safetensors_of(model_dir, args, out) as source, progress() if not args.quiet else contextlib.nullcontext():
            w = upcycle_checkpoint(source, out, spec, format=fmt, dtype=dtype, device=args.device,
                                   max_shard_size=shard_bytes(args, source, dtype), overwrite=args.overwrite,
                                   trust_remote_code=args.trust_remote_code, allow_nonfinite=args.allow_nonfinite,
                                   force=args.force, inputs=inputs, layout=args.layout,
                                   base_model=[hub_id(m) for m in (recipe.model, *recipe.spec.init.source_models())])
    show = out_console().print
    show(f"upcycled {w.layers} FFNs of {model_dir} into MoE layers: {spec.summary}, "
         f"init {spec.init.method}{', shared expert' if spec.shared_expert else ''}")
    show(f"parameters: total {human(w.params[0])}, active {human(w.params[1])}")
    show(f"format {w.format}: {w.why}")
    show(f"wrote {recipe.out}: {w.format}, {w.dtype}, {w.bytes / 1e9:.2f} GB in {w.seconds:.1f} s, "
         f"peak RSS {w.peak_rss / 2**30:.2f} GiB{w.note}")
