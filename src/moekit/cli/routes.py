"""`moekit routes collect|report`: record routing traces of per-language text, and report on them."""
from __future__ import annotations

import argparse

from moekit.cli.common import device_arg, err_console, lang_file, lang_files, out_console
from moekit.cli.progress import progress
from moekit.errors import ConfigError
from moekit.routes import IN_MEMORY_SHARE, LOAD_PEAK


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
    c.add_argument("--experts-per-load", type=int, metavar="N",
                   help="streamed: read each MoE layer's experts N at a time (a layer bigger than memory); default: "
                        "all at once where they take at most a quarter of the memory available (of the GPU on "
                        "one), else as many as fit in it. The same decisions")
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


def run_collect(args: argparse.Namespace) -> None:
    import time

    from moekit._fs import peak_memory
    from moekit.routes import collect

    if args.max_length < 1 or args.batch_size < 1 or (args.max_texts is not None and args.max_texts < 1) or \
            (args.experts_per_load is not None and args.experts_per_load < 1):
        raise ConfigError("--max-length, --batch-size, --max-texts and --experts-per-load must be ≥ 1")
    start = time.perf_counter()
    with progress():
        trace = collect(args.model, lang_files(args.texts, "--texts"), args.out, max_length=args.max_length,
                        batch_size=args.batch_size, max_texts=args.max_texts, layers=args.layers,
                        overwrite=args.overwrite, trust_remote_code=args.trust_remote_code, device=args.device,
                        stream=args.stream, dtype=args.dtype, experts_per_load=args.experts_per_load,
                        log=err_console().print)
    counts = ", ".join(f"{lang} {int(trace.language_mask(lang).sum())}" for lang in trace.languages)
    out_console().print(f"{args.out}: {trace.num_tokens} tokens ({counts}), {trace.num_layers} MoE layers, "
                        f"top-{trace.top_k} of {int(trace.num_experts.max())} experts; "
                        f"{'one layer at a time' if trace.meta['streamed'] else 'whole model'}"
                        f"{parts(trace.meta.get('experts_per_load'))}, "
                        f"{time.perf_counter() - start:.1f} s, peak RSS {peak_memory() / 2**30:.2f} GiB")


def parts(n: int | None) -> str:
    return f" (experts {n} at a time)" if n else ""


def run_report(args: argparse.Namespace) -> None:
    from moekit.routes import report

    out = report(args.trace, args.out, reference=args.reference, top_k_set=args.top_k_set, selection=args.selection,
                 overwrite=args.overwrite)
    out_console().print(f"wrote {out}/report.md, metrics.json and figures")
