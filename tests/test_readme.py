"""README.md and the documentation site's pages (docs/) as one tested walkthrough, so that none can drift from the
command line.

Every ```bash and ```python block of README.md, then of each page of the site in the order of its navigation
(mkdocs.yml), runs in document order in one temporary working directory that holds a copy of recipes/: bash blocks
with `bash -euo pipefail -c`, Python blocks with the venv's interpreter. One test per page runs its blocks; a page
builds on what the pages before it wrote (the README's quickstart upcycles the model that the getting-started page
inspects, ...), so each page's test first runs the pages before it that this process has not run (one pass under
`make test`, whose xdist scheduling keeps the group on one worker; several passes only where a page is selected
alone, e.g. with -k). The built-in assets are tiny stand-ins (MOEKIT_CACHE = moekit.testing.standins.standin_cache),
the Hub ids the pages name are tiny models in a stand-in Hugging Face cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1),
PIP_NO_INDEX=1 makes any attempt to fetch a real asset fail instead of downloading it, and the venv's bin comes
first on PATH with this checkout's sources first on PYTHONPATH. A command that exits non-zero fails the test; after
each block, the checks keyed by a command of that block assert a property of what it printed or wrote.

Skipped: the ```sh blocks, which hold only README's set-up commands `make demo` and `make test` (they install into
.venv from scratch, and `make test` runs this very suite). ```yaml blocks are configuration fragments, no
commands (they are parsed), and the unlabelled block is the source tree on the architecture page.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
RUN = {"bash": ["bash", "-euo", "pipefail", "-c"], "python": [sys.executable, "-c"]}
SETUP = "sh"  # skipped: see the module docstring
HUB_REPOS = ["meta-llama/Llama-3.1-8B", "HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct"]


def nav_pages(nav) -> list[str]:
    """The pages of mkdocs.yml's nav, in order."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return [p for item in nav for p in nav_pages(item)]


PAGES = ["README.md", *(f"docs/{p}" for p in nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))]


def blocks(page: str) -> list[tuple[str, str]]:
    """(language tag, body) of every fenced block of a page, in order."""
    return FENCE.findall((ROOT / page).read_text())


WALKED = [p for p in PAGES if any(lang in RUN for lang, _ in blocks(p))]  # the pages with blocks to run


def test_every_page_is_in_the_walkthrough():
    assert sorted(f"docs/{p.relative_to(ROOT / 'docs')}" for p in (ROOT / "docs").rglob("*.md")) == sorted(PAGES[1:])


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_run_parsed_or_setup(page):
    found = blocks(page)
    assert {lang for lang, _ in found} <= {*RUN, SETUP, "yaml", ""}
    setup = [line.split("#")[0].strip() for lang, body in found if lang == SETUP for line in body.splitlines()]
    assert setup == (["make demo", "make test"] if page == "README.md" else [])  # only the set-up commands are skipped
    for lang, body in found:
        if lang == "yaml":
            assert isinstance(yaml.safe_load(body), dict)
        if lang == "":
            assert body.startswith("src/moekit/")  # the source tree, no command


def config(work: Path, folder: str) -> dict:
    return json.loads((work / folder / "config.json").read_text())


def spec(work: Path, folder: str) -> dict:
    return json.loads((work / folder / "moekit.json").read_text())["spec"]


def selected(work: Path, name: str) -> int:
    return sum(len(ids) for ids in json.loads((work / name).read_text())["experts"].values())


def steps(work: Path, run: str) -> int:
    return json.loads((work / run / "log_history.json").read_text())[-1]["step"]


# (text of a command of a page, check of the block holding it: (working directory, the block's output) -> truth)
CHECKS: list[tuple[str, Callable[[Path, str], bool]]] = [
    ("moekit --version", lambda w, out: f"from {ROOT / 'src' / 'moekit'}" in out),  # this checkout's sources
    ("moekit list methods", lambda w, out: all(m in out for m in ("spri", "ume", "scaled_copy", "sources"))),
    ("moekit train recipes/spri_two_stage.yaml model.path=runs/smollm2-spri", lambda w, out: spec(
        w, "runs/smollm2-spri")["init"]["method"] == "spri" and steps(w, "runs/spri_two_stage") == 50
     and set(json.loads((w / "runs/spri_two_stage/results.json").read_text())["directions"]) >= {"fr", "sw", "tl"}
     and config(w, "runs/spri-qwen2moe")["model_type"] == "qwen2_moe"),  # README's quickstart
    ("moekit inspect runs/smollm2-spri ",  # 8 experts, top-2 in the table of `moekit inspect`
     lambda w, out: re.search(r"model\.layers\.3\.mlp\s*│\s*8\s*│\s*2\s*│", out)),
    ("moekit inspect runs/spri-qwen2moe", lambda w, out: "Qwen2MoeForCausalLM, native transformers MoE" in out),
    ("--out runs/llama-spri", lambda w, out: config(w, "runs/llama-spri")["model_type"] == "qwen2_moe"
     and config(w, "runs/llama-spri")["dtype"] == "bfloat16"  # bf16 in, bf16 out
     and "base_model: meta-llama/Llama-3.1-8B" in (w / "runs/llama-spri/README.md").read_text()),
    ("moekit upcycle noise.yaml", lambda w, out: (s := spec(w, "runs/smollm2-noise"))["top_k"] == 1
     and s["init"] == {**s["init"], "method": "noise", "std": 0.2, "ratio": 0.99}),
    ("moekit train text.yaml\n", lambda w, out: all(
        steps(w, f"runs/{r}") == 10 and yaml.safe_load((w / f"runs/{r}/recipe.yaml").read_text())["data"]["format"] == f
        for r, f in (("text", "text"), ("alpaca", "alpaca"), ("chat", "chat")))),
    ("runs/py-train-own/model", lambda w, out: spec(w, "runs/py-train-own/model")["init"]["method"] == "spri" and all(
        (w / f"runs/{r}/checkpoints/checkpoint-4/moekit.json").is_file() for r in ("py-train", "py-train-own"))),
    ("runs/py-spri-qwen2moe", lambda w, out: spec(w, "runs/py-spri")["num_experts"] == 8 and all(
        config(w, f"runs/{d}")["model_type"] == "qwen2_moe" for d in ("py-spri-auto", "py-spri-qwen2moe"))),
    ("summary = moekit.inspect(", lambda w, out: "('model.layers.3.mlp', 8, 2)" in out),  # README's Python API
    ("--out runs/smollm2-granular", lambda w, out: (c := config(w, "runs/smollm2-granular"))["model_type"] == "mixtral"
     and (c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]) == (32, 8, 64 // 4)),
    ("moekit upcycle mergekit.yml", lambda w, out: (c := config(w, "runs/smollm2-mergekit"))["num_local_experts"] == 2
     and c["dtype"] == "bfloat16" and c["architectures"] == ["MixtralForCausalLM"]),
    ("moekit routes report runs/trace.npz --out runs/routes\n", lambda w, out: re.search(
        r"runs/trace\.npz: \d+ tokens \(en \d+, sw \d+, fr \d+\)", out) and (w / "runs/routes/jaccard.png").is_file()),
    ("moekit select rise --help", lambda w, out: "--alpha" in out and all(
        selected(w, f"runs/sel-{m}.json") == 8 for m in ("rise", "esft-gate", "random", "topk"))
     and (w / "runs/routes-sw/selection.png").is_file()),
    ("--out runs/smollm2-spri-pruned", lambda w, out: json.loads(
        (w / "runs/smollm2-spri-pruned/pruned_experts.json").read_text())["experts"] == json.loads(
        (w / "runs/sel-rise.json").read_text())["experts"] and (w / "runs/smollm2-spri-sw/finetune.json").is_file()),
    ("--merge book_name", lambda w, out: steps(w, "runs/simoe_instruct") == 25 and (w / "runs/simoe_report/report.json")
     .is_file() and (w / "runs/simoe_pruned/simoe.json").is_file()
     and config(w, "runs/simoe_book_name")["model_type"] == "llama"),
    ("moekit evaluate runs/asr/omni_ctc", lambda w, out: json.loads((w / "corpus/multi/corpus.json").read_text())[
        "counts"]["sw"]["train"] == 48 and steps(w, "runs/asr/ume_whisper_tiny") == 10
     and set(json.loads((w / "runs/asr/omni_ctc/results.json").read_text())["languages"]) == {"en", "fr", "de", "sw"}),
]


def run_block(lang: str, body: str, work: Path, env: dict) -> str:
    """stdout + stderr of one block, which must succeed (its process group is killed if it hangs)."""
    proc = subprocess.Popen([*RUN[lang], body], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
    assert proc.returncode == 0, f"block failed (exit {proc.returncode}):\n{body}\n--- output ---\n{out[-4000:]}"
    return out


def test_each_check_keys_one_block():
    runnable = [body for page in WALKED for lang, body in blocks(page) if lang in RUN]
    matched = {key: sum(key in body for body in runnable) for key, _ in CHECKS}
    assert all(n == 1 for n in matched.values()), f"each check must match exactly one block: {matched}"


def run_page(page: str, work: Path, env: dict) -> None:
    for lang, body in blocks(page):
        if lang not in RUN:
            continue
        out = run_block(lang, body, work, env)
        for key, check in CHECKS:
            if key in body:
                assert check(work, out), f"{page}: check {key!r} failed on this block's results:\n{body}\n{out[-3000:]}"


@pytest.fixture(scope="session")
def walkthrough(tmp_path_factory):
    """run(page): the page's blocks, after the pages before it that this process has not run yet."""
    from moekit.testing.standins import standin_cache, standin_hub

    root = tmp_path_factory.mktemp("walkthrough")
    work = root / "work"
    shutil.copytree(ROOT / "recipes", work / "recipes")
    env = {**os.environ, "MOEKIT_CACHE": str(standin_cache(root / "cache")),
           "HF_HUB_CACHE": str(standin_hub(root / "hub", HUB_REPOS)), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(root / "hf_home"), "PIP_NO_INDEX": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done: dict[str, bool] = {}  # page -> it ran to its end

    def run(page: str) -> None:
        for before in WALKED[: WALKED.index(page)]:
            if before not in done:
                done[before] = False
                run_page(before, work, env)
                done[before] = True
            if not done[before]:
                pytest.fail(f"the walkthrough stopped at {before}, which {page} builds on")
        done[page] = False
        run_page(page, work, env)
        done[page] = True

    return run


@pytest.mark.slow
@pytest.mark.xdist_group("walkthrough")
@pytest.mark.parametrize("page", WALKED)
def test_walkthrough(page, walkthrough):
    walkthrough(page)
