"""Beyond one device (issue 31): the same training run on each engine, 2 CPU processes (torchrun, gloo).

SmolLM2-135M (the built-in checkpoint) upcycled by recipes/naive.yaml to 8 experts top-2 in every 4th layer
(7 MoE layers with a shared expert, 283M parameters), trained STEPS steps of batch 2 per rank on the Bible translation data, under DDP,
DeepSpeed ZeRO-2, ZeRO-3 (stage3_param_persistence_threshold 0: every parameter partitioned) and expert parallelism
over 2 ranks (train.expert_parallel: 2, FSDP2 for the rest). Per engine: training tokens/s (the Trainer's tokens
seen over its train_runtime; both ranks together), peak RSS per rank over Trainer.train alone and over the whole
command (which includes building the model whole before sharding it: moekit builds every upcycled model in memory)
and the parameters each rank held while training (engine.json). Evaluation is off; the model is saved once at the end.

Each engine's result is cached in OUT/results.json, so an interrupted run resumes. CPU ratios say little about GPUs:
gloo on one machine moves tensors through shared memory, and 2 cores run both ranks.

    .venv/bin/python bench/distributed.py --out /work/bench-distributed --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

from report import write_section  # bench/report.py

MARK = ("<!-- distributed -->", "<!-- /distributed -->")
ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto"}
ENGINES = {"DDP": {}, "ZeRO-2": {"zero_optimization": {"stage": 2}},
           "ZeRO-3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
           "EP = 2": None}
# each rank writes its peak RSS over the whole command, and over Trainer.train alone (the peak reset as it starts:
# the engine's own state, after the model was built)
PROBE = r'''
import json, os, runpy
from pathlib import Path

import transformers

import moekit.cli.main as cli

record = {}


def status(key):
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line.split()[1] for line in lines if line.startswith(key + ":"))) / 2**20  # GiB


def save():  # the whole command's peak: before Trainer.train, or since (training, saving, evaluating)
    record["peak_rss_gib"] = max(record.get("build_peak_gib", 0), status("VmHWM"))
    Path(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


train = transformers.Trainer.train


def probed(self, *args, **kwargs):
    record["build_peak_gib"] = status("VmHWM")  # so far: building the model
    record["rss_before_train_gib"] = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from what is resident now
    try:
        return train(self, *args, **kwargs)
    finally:
        record["train_peak_gib"] = status("VmHWM")
        record["rss_after_train_gib"] = status("VmRSS")  # what the engine keeps once training runs


def probed_end(code):
    save()  # a rank whose launch is over ends inside end_process (os._exit): no atexit runs
    return end_process(code)


transformers.Trainer.train = probed
end_process, cli.end_process = cli.end_process, probed_end
runpy.run_module("moekit", run_name="__main__", alter_sys=True)
'''


def overrides(out: Path, engine: str) -> list[str]:
    keys = {"out": str(out), "train.steps": STEPS, "train.batch_size": 2, "train.grad_accum": 1, "train.logging_steps": 1,
            "train.eval_every": 0, "train.save_every": 0, "data.train_per_direction": 16, "data.test_per_direction": 1,
            "data.max_length": 128, "eval.kl_examples": 0, "eval.generate": False,
            "train.trainer_args": {"include_num_input_tokens_seen": True}}
    config = ENGINES[engine]
    if config is None:
        keys["train.expert_parallel"] = 2
    elif config:
        path = out.parent / f"{engine}.json"
        path.write_text(json.dumps({**ZERO, **config}))
        keys["train.trainer_args"] = {**keys["train.trainer_args"], "deepspeed": str(path)}
    return [f"{k}={json.dumps(v)}" for k, v in keys.items()]


def run_engine(work: Path, engine: str) -> dict:
    tag = engine.replace(" ", "").replace("=", "")
    out, probe = work / f"run-{tag}", work / f"probe-{tag}"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "probe.py").write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PROBE_DIR": str(probe)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(probe / "probe.py"),
           "train", str(ROOT / "recipes" / "naive.yaml"), *overrides(out, engine), "--overwrite"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    if proc.returncode:
        raise SystemExit(f"{engine} failed:\n{proc.stderr[-4000:]}")
    history = json.loads((out / "log_history.json").read_text())
    summary = next(h for h in history if "train_runtime" in h)
    tokens = max(h.get("num_input_tokens_seen", 0) for h in history)
    record = json.loads((out / "engine.json").read_text())
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {"engine": record["engine"], "backend": record["backend"], "tokens": tokens,
            "runtime_s": summary["train_runtime"], "tokens_per_s": tokens / summary["train_runtime"],
            "peak_rss_gib": [r["peak_rss_gib"] for r in ranks], "train_peak_gib": [r["train_peak_gib"] for r in ranks],
            "before_train_gib": [r["rss_before_train_gib"] for r in ranks],
            "after_train_gib": [r["rss_after_train_gib"] for r in ranks],
            "held": record["held_per_process"], "parameters": record["parameters"],
            "losses": [h["loss"] for h in history if "loss" in h]}


def section(results: dict) -> str:
    ddp = results["DDP"]
    rows = ["| engine | tokens/s (2 ranks) | × DDP | peak RSS in training, rank 0 / 1 (GiB) | × DDP | RSS when training "
            "starts / ends (GiB) | whole command's peak (GiB) | parameters held per rank | loss at step 1 / last |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        held = " / ".join(f"{h / r['parameters']:.0%}" for h in r["held"])
        rows.append(f"| {name} ({r['engine']}, {r['backend']}) | {r['tokens_per_s']:.0f} | "
                    f"{r['tokens_per_s'] / ddp['tokens_per_s']:.2f} | "
                    f"{r['train_peak_gib'][0]:.2f} / {r['train_peak_gib'][1]:.2f} | "
                    f"{max(r['train_peak_gib']) / max(ddp['train_peak_gib']):.2f} | "
                    f"{' / '.join(f'{g:.2f}' for g in r['before_train_gib'])} → "
                    f"{' / '.join(f'{g:.2f}' for g in r['after_train_gib'])} | "
                    f"{' / '.join(f'{g:.2f}' for g in r['peak_rss_gib'])} | {held} of {r['parameters'] / 1e6:.0f}M | "
                    f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |")
    return "\n".join([
        MARK[0], "## Training beyond one device (bench/distributed.py)", "",
        f"Measured {date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, 2 processes (torchrun, "
        f"OMP_NUM_THREADS=1): SmolLM2-135M upcycled by recipes/naive.yaml (8 experts, top-2, every 4th layer, a "
        f"shared expert), {STEPS} steps of batch 2 per rank, fp32, no evaluation.", "",
        "    .venv/bin/python bench/distributed.py --out /work/bench-distributed --write BENCHMARKS.md", "",
        *rows, "",
        "Peak RSS in training is each rank's VmHWM over Trainer.train alone (reset as it starts, through "
        "/proc/self/clear_refs): the engine's setup, the weights it keeps, gradients, AdamW state and activations. "
        "Each process first builds the upcycled model whole (moekit upcycles in memory), which the whole command's "
        "peak includes, and memory the engine frees when it partitions may stay with the process (glibc), which the "
        "RSS when training starts shows; the RSS when it ends is what the engine keeps resident while it trains. CPU ratios say little about GPUs: both ranks share 2 cores and gloo "
        "moves tensors through shared memory.", MARK[1]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--write", type=Path, help="BENCHMARKS.md to update")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "results.json"
    results = json.loads(cache.read_text()) if cache.exists() else {}
    for engine in ENGINES:
        if engine not in results:
            print(f"running {engine}", flush=True)
            results[engine] = run_engine(args.out, engine)
            cache.write_text(json.dumps(results, indent=1))
        print(engine, json.dumps(results[engine]), flush=True)
    if args.write:
        write_section(args.write, section(results), MARK)


if __name__ == "__main__":
    main()
