"""Real clients of moekit's native exports: llama.cpp and transformers compute the same greedy tokens?

The built-in SmolLM2-135M (moekit.assets.resolve_model("smollm2-135m"), float32) is upcycled with naive, UME and
SPRI (4 experts, top-2) to each native format it has (Mixtral, Qwen2-MoE; Qwen3-MoE needs a Qwen3 source) in both
expert layouts where they differ for a reader; each export is converted by llama.cpp's own convert_hf_to_gguf.py
(f32, unpatched, in the transformers 4.57.6 environment of tests/clients_env.py) and run by llama.cpp built from the
same pinned tree (the llama-cpp-python 0.3.36 sdist: cmake, -j2, CPU only, cached under ~/.cache/moekit-bench); the
greedy continuations (16 tokens, 3 prompts, the same prompt ids) are compared with transformers 5's. mergekit-moe
0.1.5 (pip) is run on the same model for comparison. Each row also shows what moekit predicted for llama.cpp
(NativeFormat.reader_gaps; the final line of `moekit upcycle`).

    .venv/bin/python bench/clients.py --write BENCHMARKS.md      # ~40 min the first time (llama.cpp build ~8-15)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from report import cached, write_section  # bench/report.py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import clients_env  # noqa: E402  (tests/clients_env.py: the converter's environment and the sdist)

MARK = ("<!-- clients -->", "<!-- /clients -->")
CACHE = Path(os.environ.get("MOEKIT_BENCH_CACHE") or Path.home() / ".cache" / "moekit-bench")
BUILD = CACHE / f"build-{clients_env.LLAMA_CPP_PYTHON}"
CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
         "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
NEW = 16
SOFTMAX_TOPK = {"router": {"scoring": "softmax_topk"}}
SPRI = {"init": "spri", "shared_expert": True}
ROWS = {  # name: (method, spec, format, layout)
    "naive-mixtral": ("naive", {}, "mixtral", "classic"),
    "naive-mixtral-fused": ("naive", {}, "mixtral", "fused"),
    "naive-qwen2": ("naive", {}, "qwen2_moe", "classic"),
    "naive-qwen2-softmax_topk": ("naive", SOFTMAX_TOPK, "qwen2_moe", "classic"),
    "ume-mixtral": ("ume", {"init": "ume"}, "mixtral", "classic"),
    "ume-qwen2": ("ume", {"init": "ume"}, "qwen2_moe", "classic"),
    "spri-qwen2-softmax_topk": ("spri", {**SPRI, **SOFTMAX_TOPK}, "qwen2_moe", "classic"),
    "spri-qwen2-softmax_topk-fused": ("spri", {**SPRI, **SOFTMAX_TOPK}, "qwen2_moe", "fused"),
    "spri-qwen2-every4": ("spri", {**SPRI, "every": 4}, "qwen2_moe", "classic"),
}


def llama_cpp() -> tuple[Path, Path, float | None]:
    """(sdist folder, folder of libllama.so, build seconds or None when cached): llama.cpp from the pinned sdist."""
    src = CACHE / clients_env.SDIST
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(clients_env.sdist(CACHE)) as tar:
            tar.extractall(CACHE, filter="data")
    lib = BUILD / "bin"
    if (lib / "libllama.so").is_file():
        return src, lib, None
    t0 = time.perf_counter()
    subprocess.run(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(BUILD), *CMAKE], check=True)
    subprocess.run(["cmake", "--build", str(BUILD), "-j2", "--target", "llama"], check=True)
    return src, lib, time.perf_counter() - t0


def convert(folder: Path, gguf: Path) -> str | None:
    """llama.cpp's converter, as a user runs it (f32, offline); None, or its last error line."""
    conv = clients_env.llama_cpp()
    res = subprocess.run([str(clients_env.python()), str(conv / "convert_hf_to_gguf.py"), str(folder), "--outtype",
                          "f32", "--outfile", str(gguf)], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(conv / "gguf-py")})
    if res.returncode:
        return (res.stderr.strip().splitlines() or ["?"])[-1][:200]
    return None


def transformers_greedy(folder: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy continuations) of transformers 5 in float32, with its KV cache, no stop token."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(folder)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, outs = [tok(p)["input_ids"] for p in PROMPTS], []
    with torch.no_grad():
        for ids in prompts:
            x, past, new = torch.tensor([ids]), None, []
            for _ in range(NEW):
                res = model(input_ids=x, past_key_values=past, use_cache=True)
                past, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
                new.append(nxt)
                x = torch.tensor([[nxt]])
            outs.append(new)
    return prompts, outs


def llama_greedy(src: Path, lib: Path, gguf: Path, prompts: list[list[int]], work: Path) -> dict:
    (work / "job.json").write_text(json.dumps({"prompts": prompts, "texts": PROMPTS, "new": NEW}))
    res = subprocess.run([sys.executable, str(HERE / "llama_greedy.py"), str(src), str(gguf), str(work / "job.json")],
                         capture_output=True, text=True, env={**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)})
    if res.returncode:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(folder: Path, src: Path, lib: Path, work: Path, dense_tokens=None) -> dict:
    """Convert, run both, compare (the GGUF is removed afterwards)."""
    gguf = work / "model.gguf"
    t0 = time.perf_counter()
    error = convert(folder, gguf)
    out = {"convert_error": error, "convert_s": time.perf_counter() - t0}
    if error is None:
        prompts, hf = transformers_greedy(folder)
        ll = llama_greedy(src, lib, gguf, prompts, work)
        out.update(prompts=prompts, transformers=hf, llama=ll)
        if "tokens" in ll:
            out["agree"] = [agree(a, b) for a, b in zip(hf, ll["tokens"])]
            out["same_tokenization"] = ll["tokenized"] == prompts
        if dense_tokens is not None:
            out["agree_dense"] = [agree(a, b) for a, b in zip(hf, dense_tokens)]
    gguf.unlink(missing_ok=True)
    return out


def readable_copy(dense: Path, folder: Path) -> Path:
    """The dense asset as llama.cpp's converter reads it: its weights linked, its tokenizer class one that
    transformers 4.x has (moekit.checkpoint.export.write.legacy_tokenizer, as every export gets it)."""
    from moekit.checkpoint.export.write import legacy_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for f in dense.iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).unlink(missing_ok=True)
            (folder / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copyfile(f, folder / f.name)
    legacy_tokenizer(folder)
    return folder


def upcycled_row(name: str, dense: Path, out: Path, src: Path, lib: Path, dense_tokens) -> dict:
    from moekit.checkpoint.upcycle import upcycle_checkpoint
    from moekit.config import validate
    from moekit.moe.spec import MoESpec

    method, spec_kw, fmt, layout = ROWS[name]
    folder = out / name / "model"
    shutil.rmtree(folder, ignore_errors=True)
    spec = validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": method, **spec_kw})
    w = upcycle_checkpoint(dense, folder, spec, format=fmt, layout=layout)
    row = {"method": method, "format": fmt, "layout": layout, "spec": spec.summary, "scoring": spec.scoring,
           "readers": w.readers, **measure(folder, src, lib, out / name, dense_tokens)}
    shutil.rmtree(folder)
    return row


MERGEKIT = """base_model: {dense}
gate_mode: random
dtype: float32
experts:
""" + "".join(f"  - source_model: {{dense}}\n    positive_prompts: [\"{p}\"]\n" for p in PROMPTS + ["Hello"])


def mergekit_row(dense: Path, out: Path, src: Path, lib: Path) -> dict:
    """mergekit-moe 0.1.5 (pip, no dependencies beyond moekit's own and two small ones) on the same model."""
    target = CACHE / "mergekit-0.1.5"
    if not (target / "mergekit").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        "mergekit==0.1.5", "immutables==0.21", "sentencepiece==0.2.3"], check=True)
    work, folder = out / "mergekit", out / "mergekit" / "model"
    shutil.rmtree(folder, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.yml").write_text(MERGEKIT.format(dense=dense))
    res = subprocess.run([sys.executable, "-c", "from mergekit.scripts.moe import main; main()", str(work / "config.yml"),
                          str(folder), "--i-understand-this-is-not-useful-without-training"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"})
    if res.returncode:
        return {"method": "mergekit-moe 0.1.5", "error": (res.stderr.strip().splitlines() or ["?"])[-1][:200]}
    from safetensors import safe_open

    names = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            names += list(s.keys())
    row = {"method": "mergekit-moe 0.1.5 (gate_mode random)", "format": "mixtral",
           "layout": "fused" if any("gate_up_proj" in n for n in names) else "classic",
           "expert_names": sorted(n for n in names if "layers.0." in n and "expert" in n)[:3],
           **measure(folder, src, lib, work)}
    shutil.rmtree(folder)
    return row


def predicted(readers: str) -> str:
    """The llama.cpp part of moekit's readers note (moekit.checkpoint.export.write.readers_note)."""
    key = "llama.cpp cannot represent "
    rest = readers[readers.index(key) + len(key):] if key in readers else ""
    return "differs: " + rest.removesuffix(")") if rest else "same"  # the note's own closing parenthesis


def table(rows: dict, build_s: float | None, command: str) -> str:
    lines = [MARK[0], "## Real clients: llama.cpp vs transformers on upcycled SmolLM2 (bench/clients.py)", "",
             f"`{command}`. SmolLM2-135M (float32, the built-in asset) upcycled with 4 experts, top-2, every layer "
             "unless noted; llama.cpp from the llama-cpp-python 0.3.36 sdist (vendored llama.cpp 0c1e570), its own "
             "convert_hf_to_gguf.py (f32, unpatched, in the transformers 4.57.6 environment) and libllama built "
             "from that tree with cmake -j2, CPU only"
             + (f" ({build_s / 60:.1f} min to build on the 2 cores here, shared with other jobs)" if build_s else "")
             + f"; transformers 5 in float32. Greedy, {NEW} new tokens after each of {len(PROMPTS)} prompts "
             f"({'; '.join(repr(p) for p in PROMPTS)}; the same prompt ids for both): tokens equal before the first "
             "difference, per prompt; \"= dense\": transformers on the export vs on the dense model. \"moekit "
             "predicted\": what moekit said of the export for llama.cpp before any of this ran (`reader_gaps`, the "
             "final line of `moekit upcycle` and the model card).", "",
             "| method | MoE | format, layout | moekit predicted for llama.cpp | llama.cpp's converter "
             "| llama.cpp = transformers | = dense |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {r['method']} | | | | run failed: {r['error']} | | |")
            continue
        if name == "dense":
            guess, moe = "", "dense"
        elif name == "mergekit":
            guess, moe = f"(not moekit's: mergekit writes {r['expert_names'][0]}, ...)", "4 copies, random router"
        else:
            kw = ROWS[name][1]
            moe = ", ".join([r["spec"], *(["every 4th layer"] if kw.get("every") else []),
                             *(["shared expert"] if kw.get("shared_expert") else []), r["scoring"]])
            guess = predicted(r.get("readers", ""))
        conv = "ok" if r["convert_error"] is None else f"fails: `{r['convert_error']}`"
        ll = r.get("llama", {})
        same = "" if r["convert_error"] else (f"error: {ll['error']}" if "error" in ll else
                                              " ".join(f"{a}/{NEW}" for a in r["agree"]))
        dense = " ".join(f"{a}/{NEW}" for a in r.get("agree_dense") or [])
        where = f"{r.get('format', '')}, {r['layout']}" if r.get("layout") else r.get("format", "")
        lines.append(f"| {r['method']} | {moe} | {where} | {guess} | {conv} | {same} | {dense} |")
    toks = [r.get("same_tokenization") for r in rows.values() if "same_tokenization" in r]
    if toks:
        lines += ["", f"llama.cpp's own tokenization of the prompts equals transformers' in {sum(toks)} of "
                      f"{len(toks)} runs (its smollm pre-tokenizer, recognized by the converter)."]
    return "\n".join(lines + [MARK[1]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench_clients"))
    p.add_argument("--rows", type=lambda s: s.split(","), default=[*ROWS, "mergekit"])
    p.add_argument("--write", type=Path, help="markdown file to write the section into (e.g. BENCHMARKS.md)")
    args = p.parse_args()
    from moekit.assets import resolve_model

    dense = resolve_model("smollm2-135m", log=lambda s: print(s, file=sys.stderr))
    clients_env.ensure()
    src, lib, build_s = llama_cpp()
    if build_s is not None:
        (CACHE / "build_seconds.json").write_text(json.dumps({"seconds": build_s}))
    elif (CACHE / "build_seconds.json").is_file():
        build_s = json.loads((CACHE / "build_seconds.json").read_text())["seconds"]
    dense_run = cached(args.out / "dense", lambda: measure(readable_copy(dense, args.out / "dense" / "model"), src, lib,
                                                           args.out / "dense"))
    rows = {"dense": {"method": "dense SmolLM2 (reference)", "format": "llama", "layout": "", "readers": "",
                      **dense_run}}
    for name in args.rows:
        (args.out / name).mkdir(parents=True, exist_ok=True)
        print(f"{time.strftime('%H:%M:%S')} {name}", file=sys.stderr, flush=True)
        if name == "mergekit":
            rows[name] = cached(args.out / name, lambda: mergekit_row(dense, args.out, src, lib))
        else:
            rows[name] = cached(args.out / name, lambda n=name: upcycled_row(n, dense, args.out, src, lib,
                                                                              dense_run.get("transformers")))
    section = table(rows, build_s, "python bench/clients.py --write BENCHMARKS.md")
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
