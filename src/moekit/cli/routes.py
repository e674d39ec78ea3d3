"""`moekit routes collect|report`: record routing traces of per-language text, and report on them."""
from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli.common import device_arg, err_console, lang_file, lang_files, out_console
from moekit.cli.progress import progress
from moekit.errors import CheckpointError, ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("routes", help="record and analyze MoE routing",
                       description="Record which experts an MoE model routes each token of per-language texts "
                                   "to (collect), and write figures and metrics about it (report).")
    rsub = p.add_subparsers(dest="routes_command", required=True, metavar="SUBCOMMAND")
    c = rsub.add_parser("collect", help="record a routing trace (.npz) of per-language text files",
                        description="Run the model on every line of each FILE (one text per line) and save the "
                                    "top-k experts and weights of every MoE layer for every token.")
    c.add_argument("--model", required=True, help="moekit checkpoint or HF MoE model directory (with tokenizer), or a "
                                                 "Hugging Face Hub id org/name[@revision]")
    c.add_argument("--texts", required=True, nargs="+", action="extend", type=lang_file, metavar="LANG=FILE",
                   help="one text per line per language; several per flag or one flag per language")
    c.add_argument("--out", required=True, help="trace file (.npz)")
    c.add_argument("--max-length", type=int, default=256, help="truncate texts to this many tokens")
    c.add_argument("--batch-size", type=int, default=8, help="texts per forward pass")
    c.add_argument("--max-texts", type=int, help="use at most this many texts per language")
    c.add_argument("--layers", help="regular expression on the MoE layer paths to record")
    c.add_argument("--overwrite", action="store_true", help="replace an existing trace file")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model directory that ships its own Python code (auto_map); it will run")
    c.add_argument("--device", default="cpu", type=device_arg, help="auto, cpu, cuda or cuda:N")
    c.add_argument("--stream", choices=["auto", "on", "off"], default="auto",
                   help="on: one decoder layer in memory at a time, read from the checkpoint (a model larger than "
                        "memory); off: the whole model loaded; auto: off when the whole model's load would peak "
                        f"under {round(100 * IN_MEMORY_SHARE)} %% of the memory available ({LOAD_PEAK}x its weights in --dtype), "
                        "else on. Both give the same trace")
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the weights' dtype while recording, in either --stream mode; the trace "
                        "records it")
    c.set_defaults(run=run_collect)
    r = rsub.add_parser("report", help="figures, report.md and metrics.json of a trace",
                        description="Language routing isolation (RISE), layer-wise similarity, expert usage, "
                                    "Cramér's V of adjacent layers and routing entropy (Omni-router).")
    r.add_argument("trace", help="trace file from `moekit routes collect`")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--reference", help="reference language of the layer-wise similarity (default: most tokens)")
    r.add_argument("--top-k-set", type=int, help="K of the global expert sets (default: layers × top-k)")
    r.add_argument("--selection", help="selection JSON (`moekit select ...`): adds Ω and the selected-expert map")
    r.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    r.set_defaults(run=run_report)


def read_texts(path: Path, limit: int | None) -> list[str]:
    from moekit._fs import read_small

    lines = [line.strip() for line in read_small(path, "text file", ConfigError, limit=4 << 30).splitlines()]
    texts = [t for t in lines if t][:limit]
    if not texts:
        raise ConfigError(f"{path} has no texts (one per line)")
    return texts


def run_collect(args: argparse.Namespace) -> None:
    import time

    import torch

    from moekit._fs import peak_memory, reserve
    from moekit.assets import model_inputs, resolve_model
    from moekit.checkpoint.dense import load_tokenizer
    from moekit.routing.streamed import batches_of

    if args.max_length < 1 or args.batch_size < 1 or (args.max_texts is not None and args.max_texts < 1):
        raise ConfigError("--max-length, --batch-size and --max-texts must be ≥ 1")
    files = lang_files(args.texts, "--texts")
    start = time.perf_counter()
    with reserve(args.out, [*model_inputs(args.model), *files.values()], args.overwrite, what="trace", kind="file"):
        args.model = resolve_model(args.model, log=err_console().print)  # a directory, built-in asset or Hub id
        texts = {lang: read_texts(path, args.max_texts) for lang, path in files.items()}
        tok = load_tokenizer(args.model, args.trust_remote_code)
        if tok is None:
            raise CheckpointError(f"{args.model} has no tokenizer files")
        if tok.pad_token is None:  # batches need padding; the attention mask keeps pads out of the trace
            if tok.eos_token is None:
                raise CheckpointError(f"the tokenizer of {args.model} has neither a pad nor an eos token")
            tok.pad_token = tok.eos_token
        batches = batches_of(tok, texts, args.max_length, args.batch_size)
        dtype = getattr(torch, args.dtype)
        streamed = streaming(args, dtype)
        with progress():
            trace = collect(args, batches, dtype, streamed)
        trace.meta.update(model=str(args.model), max_length=args.max_length, streamed=streamed, dtype=args.dtype)
        trace.save(args.out, overwrite=args.overwrite)
    counts = ", ".join(f"{lang} {int(trace.language_mask(lang).sum())}" for lang in trace.languages)
    out_console().print(f"{args.out}: {trace.num_tokens} tokens ({counts}), {trace.num_layers} MoE layers, "
                        f"top-{trace.top_k} of {int(trace.num_experts.max())} experts; "
                        f"{'one layer at a time' if streamed else 'whole model'}, "
                        f"{time.perf_counter() - start:.1f} s, peak RSS {peak_memory() / 2**30:.2f} GiB")


# the whole-model path's peak over its weights in the compute dtype: loading holds the checkpoint's tensors and the
# model at once (measured 2.3x on a 1.26 GB bf16 Qwen3-MoE cut loaded in float32: 5.7 GiB), plus activations
LOAD_PEAK = 2.5
IN_MEMORY_SHARE = 0.8


def in_memory_peak(model: str, dtype) -> int:
    """Predicted peak bytes of `routes collect --stream off` on `model` in `dtype`."""
    import math

    from moekit.checkpoint.files import read_headers

    return int(LOAD_PEAK * sum(math.prod(i.shape) for i in read_headers(model).values()) * dtype.itemsize)


def streaming(args: argparse.Namespace, dtype) -> bool:
    """--stream: on, off, or (auto) on unless the whole model's predicted peak (in_memory_peak) fits in
    IN_MEMORY_SHARE of the memory available now. Either way the trace is the same (same dtype, same layers)."""
    if args.stream != "auto":
        return args.stream == "on"
    from moekit._fs import available_memory

    return in_memory_peak(args.model, dtype) > IN_MEMORY_SHARE * available_memory()


def collect(args: argparse.Namespace, batches, dtype, streamed: bool):
    """The trace of `batches`, streamed from the checkpoint or through the loaded model."""
    from moekit.routing.streamed import collect_in_memory, collect_streamed

    if streamed:
        return collect_streamed(args.model, batches, args.layers, dtype, args.device,
                                trust_remote_code=args.trust_remote_code)
    from moekit.checkpoint.format import load_model

    model = load_model(args.model, trust_remote_code=args.trust_remote_code, dtype=dtype).to(args.device)
    return collect_in_memory(model, batches, args.layers)


def run_report(args: argparse.Namespace) -> None:
    from moekit._fs import reserve
    from moekit.routing.report import write_report
    from moekit.routing.trace import RoutingTrace

    inputs = [args.trace, *([args.selection] if args.selection else [])]
    with reserve(args.out, inputs, args.overwrite):
        trace = RoutingTrace.load(args.trace)
        experts = target = None
        if args.selection is not None:
            from moekit.selection.selection import Selection

            sel = Selection.load(args.selection)
            experts, target = sel.experts, sel.target if sel.target in trace.languages else None
        out = write_report(trace, args.out, args.reference, args.top_k_set, experts, target, overwrite=args.overwrite)
    out_console().print(f"wrote {out}/report.md, metrics.json and figures")
