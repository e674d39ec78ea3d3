"""The readers of untrusted input that moekit.testing.fuzz runs: for each, a valid seed from a tiny fixture, its
structure-aware mutators and the library call that reads it (module docstring of moekit.testing.fuzz)."""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

from moekit.testing.fuzz import Reader, copy_seed, json_bytes, mutate_bytes, mutate_text, yaml_bytes
from moekit.testing.fuzz_binary import BINARY

# ---------------------------------------------------------------------------------------------- checkpoints


def _build_moe(seed: Path) -> None:
    from moekit.checkpoint.format import save
    from moekit.moe.spec import MoESpec
    from moekit.testing import tiny_llama
    from moekit.checkpoint.upcycle_model import upcycle

    save(upcycle(tiny_llama(num_hidden_layers=2), MoESpec(num_experts=4, top_k=2, every=1)), seed / "model")


def _mutate_file(name: str, encode) -> Callable:
    """A mutator that copies the seed and rewrites `name` (a JSON or YAML tree) with `encode(rng, tree)`."""
    def mutate(rng: random.Random, seed: Path, case: Path) -> None:
        copy_seed(seed, case)
        f = case / name
        f.write_bytes(encode(rng, _load_tree(f)))
    return mutate


def _load_tree(f: Path):
    if f.suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(f.read_text())
    return json.loads(f.read_text())


def _read_moe(case: Path) -> None:
    from moekit.checkpoint.format import build_from_meta

    build_from_meta(case / "model")


def _build_dense(seed: Path) -> None:
    from moekit.testing import tiny_llama

    tiny_llama(num_hidden_layers=2).save_pretrained(seed / "model")


def _read_config(case: Path) -> None:
    from moekit.checkpoint.dense import load_dense, meta_model

    meta_model(case / "model")
    load_dense(case / "model")


# ---------------------------------------------------------------------------------------------- Hugging Face cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _build_hub(seed: Path) -> None:
    """A Hugging Face cache holding org/tiny as huggingface_hub lays it out: blobs named by content, the snapshot's
    files relative links into ../../blobs, refs/main holding the commit."""
    import hashlib

    _build_dense(seed / "src")
    repo = seed / "hub" / "models--org--tiny"
    for d in ("blobs", f"snapshots/{COMMIT}", "refs"):
        (repo / d).mkdir(parents=True)
    for f in sorted((seed / "src" / "model").iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        (repo / "snapshots" / COMMIT / f.name).symlink_to(f"../../blobs/{blob}")
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.rmtree(seed / "src")
    (seed / "outside.json").write_text("{}")


def _clear(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def _hub_damage(rng: random.Random, repo: Path) -> None:
    ref, snap = repo / "refs" / "main", repo / "snapshots" / COMMIT
    link = snap / rng.choice(sorted(p.name for p in snap.iterdir() if p.is_symlink()) or ["config.json"])
    op = rng.randrange(10)
    if op <= 1:
        _clear(ref)
    if op == 0:
        ref.write_bytes(mutate_text(rng, COMMIT))
    elif op == 1:
        ref.write_text(rng.choice(["f" * 40, "../../../outside", COMMIT + "\n" + COMMIT, "", " " * 300, "main",
                                   f"snapshots/{COMMIT}", COMMIT.upper(), "\x00" * 40]))
    elif op == 2:
        _clear(ref)
        ref.symlink_to(rng.choice(["/dev/zero", "missing", f"../snapshots/{COMMIT}", "../../../outside.json", "main"]))
    elif op == 3:
        _clear(ref)
        rng.choice([ref.mkdir, lambda: os.mkfifo(ref), lambda: None])()
    elif op == 4:
        _clear(link)
        link.symlink_to(rng.choice(["../../blobs/missing", "/dev/zero", "../../../../outside.json", ".",
                                    link.name, str(repo / "blobs"), "../../refs/main"]))
    elif op == 5:
        blob = Path(os.path.realpath(link))
        data = blob.read_bytes() if blob.is_file() else b""
        blob.is_file() and blob.write_bytes(mutate_text(rng, data.decode()) if link.suffix == ".json" else mutate_bytes(rng, data))
    elif op == 6:
        shutil.rmtree(snap)
        rng.choice([lambda: None, lambda: snap.write_text("x"), lambda: snap.symlink_to("../../..")])()
    elif op == 7 and not os.path.lexists(snap / "model.safetensors.index.json"):  # op 6 may leave a file there
        (snap / "model.safetensors.index.json").symlink_to("../../../../outside.json")
    elif op == 8:
        (snap / rng.choice(["model.safetensors.index.json", "tokenizer_config.json", "extra.json"])).write_bytes(
            json_bytes(rng, {"weight_map": {"lm_head.weight": "../../blobs/x"}, "auto_map": {}}))
    else:
        shutil.rmtree(repo / "blobs")


def _mutate_hub(rng: random.Random, seed: Path, case: Path) -> None:
    copy_seed(seed, case)
    repo = case / "hub" / "models--org--tiny"
    for _ in range(rng.choice([1, 1, 2])):
        snap = repo / "snapshots" / COMMIT
        if snap.is_symlink() or not snap.is_dir() or not (repo / "blobs").is_dir():
            break
        _hub_damage(rng, repo)


def _read_hub(case: Path) -> None:
    from moekit.assets import resolve_hub
    from moekit.checkpoint.dense import load_config
    from moekit.checkpoint.files import read_headers

    saved = {k: os.environ.get(k) for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HUB_CACHE=str(case / "hub"), HF_HUB_OFFLINE="1")
    try:
        found = resolve_hub("org/tiny")
        load_config(found)
        read_headers(found)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


# ---------------------------------------------------------------------------------------------- JSON and YAML files


def _writer(name: str, tree) -> Callable:
    def build(seed: Path) -> None:
        (seed / name).write_text(json.dumps(tree) if name.endswith(".json") else _yaml(tree))
    return build


def _yaml(tree) -> str:
    import yaml

    return yaml.safe_dump(tree, sort_keys=False)


SELECTION = {"method": "rise", "target": "fr", "budget": 3, "experts": {"model.layers.0.mlp": [0, 2],
             "model.layers.1.mlp": [1]}, "scores": {"model.layers.0.mlp": [0.5, 0.1, 0.3, 0.1]},
             "params": {"alpha": 0.5, "seed": 0}}


def _read_selection(case: Path) -> None:
    from moekit.selection.selection import Selection

    Selection.load(case / "sel.json")


MERGEKIT = {"base_model": "org/base", "gate_mode": "hidden", "dtype": "bfloat16", "experts_per_token": 2,
            "architecture": "qwen", "experts": [
                {"source_model": "org/math", "positive_prompts": ["solve", "add"], "negative_prompts": ["poem"],
                 "noise_scale": 0.01},
                {"source_model": "org/code", "positive_prompts": ["def", "class"], "residual_scale": 0.5}],
            "shared_experts": [{"source_model": "org/base", "positive_prompts": ["hello"]}]}


def _read_mergekit(case: Path) -> None:
    from moekit.config import read_yaml
    from moekit.checkpoint.mergekit import output_dtype, output_format, read_mergekit, to_spec

    source = str(case / "moe.yaml")
    cfg = read_mergekit(read_yaml(source), source)
    output_format(cfg)
    output_dtype(cfg)
    to_spec(cfg, source)


RECIPES = [
    {"name": "naive", "out": "runs/naive", "model": {"path": "smollm2-135m", "dtype": "float32"}, "method": "moe",
     "moe": {"num_experts": 8, "top_k": 2, "every": 4, "shared_expert": True, "init": {"method": "naive"}},
     "aux": {"load_balance": 0.01, "balance_variant": "topk"}, "data": {"source": "bible", "directions": ["fr", "sw"],
     "train_per_direction": 256}, "optim": {"lr": 1e-4, "schedule": "linear"},
     "train": {"steps": 160, "batch_size": 8, "trainer_args": {"dataloader_num_workers": 0}},
     "eval": {"kl_examples": 32, "generate": True}},
    {"task": "text", "method": "lora", "lora": {"r": 8, "alpha": 16}, "model": {"path": "m"},
     "data": {"format": "chat", "train_files": ["a.jsonl"], "test_fraction": 0.1, "max_length": 64}},
    {"task": "asr", "method": "moe", "model": {"kind": "ctc", "ctc": {"hidden_size": 64, "num_layers": 2}},
     "moe": {"num_experts": 4, "top_k": 1, "router": {"shared": True}}, "data": {"corpus": "c", "langs": ["en"]}},
]


def _build_recipe(seed: Path) -> None:
    for i, r in enumerate(RECIPES):
        (seed / f"recipe{i}.yaml").write_text(_yaml(r))


def _mutate_recipe(rng: random.Random, seed: Path, case: Path) -> None:
    import yaml

    src = seed / f"recipe{rng.randrange(len(RECIPES))}.yaml"
    (case / "recipe.yaml").write_bytes(yaml_bytes(rng, yaml.safe_load(src.read_text())))


def _read_recipe(case: Path) -> None:
    from moekit.training.recipe import load_recipe

    load_recipe(case / "recipe.yaml")


DEEPSPEED = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
             "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                   "stage3_param_persistence_threshold": 1000, "reduce_bucket_size": "auto",
                                   "offload_param": {"device": "cpu", "pin_memory": True}}}


def _read_deepspeed(case: Path) -> None:
    from moekit.training.parallel import deepspeed_config, zero_stage

    zero_stage(deepspeed_config(str(case / "ds.json")))


# ---------------------------------------------------------------------------------------------- data files


def _jsonl_case(rng: random.Random, records: list[dict]) -> bytes:
    """JSON Lines with one record mutated as a tree (or a line replaced by another JSON value), or damaged as text."""
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in records]
    r = rng.random()
    if r < 0.2:
        return mutate_text(rng, b"\n".join(lines).decode() + "\n")
    i = rng.randrange(len(lines))
    if r < 0.3:
        lines[i] = rng.choice([b"[]", b"\"x\"", b"{}", b"null", b"1", b"{\"src\": \"a\"", b"\xff\xfe", b"{" * 10**5,
                               b"{\"src\": \"" + b"x" * 10**6 + b"\"}"])
    else:
        lines[i] = json_bytes(rng, records[i], text_rate=0.1).replace(b"\n", b" ")
    return b"\n".join(lines) + b"\n"


PAIRS = [{"src": "the day was long", "tgt": "le jour", "tgt_lang": "fr"},
         {"src": "we walk home", "tgt": "tunatembea", "tgt_lang": "sw", "id": "x:1"},
         {"src": "the light", "tgt": "la lumière", "tgt_lang": "fr"}]
INSTRUCT = [{"task": t, "instruction": f"do {t}", "input": "the day", "output": "long", "category": "c"}
            for t in ("a", "b", "c")]
ALPACA_RECORDS = [{"instruction": "add the numbers", "input": "2 and 3", "output": "5"},
                  {"instruction": "say hi", "input": "", "output": "hi"}]
CHAT_RECORDS = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
                {"conversations": [{"from": "human", "value": "what is 2+2"}, {"from": "gpt", "value": "4"},
                                   {"from": "human", "value": "and 3+3"}, {"from": "gpt", "value": "6"}],
                 "system": "you add numbers"}]
MANIFEST = [{"id": "en-1", "audio": "audio/en/en-1.wav", "text": "the day", "text_id": "1:1:1", "lang": "en",
             "voice": "en+m1", "family": "espeak-ng", "split": "train", "seconds": 1.5},
            {"id": "fr-1", "audio": "audio/fr/fr-1.wav", "text": "le jour", "text_id": "1:1:1", "lang": "fr",
             "voice": "fr+f2", "family": "flite", "split": "test", "seconds": 2}]


def _jsonl_reader(name: str, file: str, records: list[dict], read) -> Reader:
    def build(seed: Path) -> None:
        (seed / file).write_text("".join(json.dumps(r) + "\n" for r in records))

    def mutate(rng: random.Random, seed: Path, case: Path) -> None:
        (case / file).write_bytes(_jsonl_case(rng, records))

    return Reader(name, build, mutate, lambda case: read(case / file))


def _read_pairs(f: Path) -> None:
    from moekit.data.parallel import DataConfig, load_pairs

    load_pairs(DataConfig(source="jsonl", directions=["fr", "sw"], train_files=[str(f)], test_files=[str(f)],
                          test_per_direction=1))


def _read_instruct(f: Path) -> None:
    from moekit.data.instruct import InstructConfig, load_instruct

    load_instruct(InstructConfig(source="jsonl", train_tasks=["a", "b"], unseen_tasks=["c"], train_files=[str(f)],
                                 test_files=[str(f)], test_per_task=1))


@functools.cache
def _chat_tokenizer():
    from moekit.testing import tiny_chat_tokenizer

    return tiny_chat_tokenizer()


def _records(f: Path, fmt: str) -> None:
    """Local data read through `datasets` and encoded in `fmt` with the tiny (chat) tokenizer, as `task: text`
    does (moekit.data.hf)."""
    from moekit.data.hf import TextDataConfig, encode_records, read_located
    tok = _chat_tokenizer()
    located = read_located([str(f)], None)
    cfg = TextDataConfig(format=fmt, train_files=[str(f)], test_fraction=0.5, max_length=64)
    encode_records([r for _, r in located], tok, cfg, [w for w, _ in located])


def _read_manifest(f: Path) -> None:
    from moekit.speech.corpus import read_manifest

    read_manifest(f)


COVOST_TSV = "covost/covost_v2.en_de.train.tsv"
TSV_CELLS = ["", "../../etc/passwd", "/dev/zero", "c0.wav", "missing.wav", "x" * 10**5, "\x00", "a\"b", "\u00e9", "-1"]


def _build_covost(seed: Path) -> None:
    from moekit.testing.speech_llm import save_tiny_covost

    save_tiny_covost(seed / "covost", directions=("de",), train=3, test=1, seconds=0.2)


def _mutate_covost(rng: random.Random, seed: Path, case: Path) -> None:
    """CoVoST 2's split file with cells replaced (paths that leave the clips folder, devices, empty or huge text),
    columns dropped, renamed, repeated or reordered, rows of the wrong width; or damaged as bytes."""
    copy_seed(seed, case)
    f = case / COVOST_TSV
    rows = [line.split("\t") for line in f.read_text().splitlines()]
    for _ in range(rng.randint(1, 4)):
        r, op = rng.randrange(len(rows)), rng.randrange(4)
        c = rng.randrange(len(rows[r]))
        if op == 0:
            rows[r][c] = rng.choice(TSV_CELLS)
        elif op == 1:
            del rows[r][c]
        elif op == 2:
            rows[r].insert(c, rng.choice(rows[0]))
        else:
            rows[r] = rows[r][::-1]
    text = "\n".join("\t".join(row) for row in rows) + "\n"
    f.write_bytes(mutate_text(rng, text) if rng.random() < 0.3 else text.encode("utf-8", "surrogatepass"))


def _read_covost(case: Path) -> None:
    from moekit.speech.s2tt import S2TTDataConfig, load_s2tt

    load_s2tt(S2TTDataConfig(path=str(case / "covost"), directions=["de"], test_split="train"), lambda e: 1)


# ---------------------------------------------------------------------------------------------- the readers

READERS: dict[str, Reader] = {r.name: r for r in [
    *BINARY,
    Reader("moekit-json", _build_moe, _mutate_file("model/moekit.json", json_bytes), _read_moe),
    Reader("config-json", _build_dense, _mutate_file("model/config.json", json_bytes), _read_config),
    Reader("hf-cache", _build_hub, _mutate_hub, _read_hub),
    Reader("selection", _writer("sel.json", SELECTION), _mutate_file("sel.json", json_bytes), _read_selection),
    Reader("mergekit-yaml", _writer("moe.yaml", MERGEKIT), _mutate_file("moe.yaml", yaml_bytes), _read_mergekit),
    Reader("recipe", _build_recipe, _mutate_recipe, _read_recipe),
    Reader("deepspeed", _writer("ds.json", DEEPSPEED), _mutate_file("ds.json", json_bytes), _read_deepspeed),
    _jsonl_reader("jsonl-pairs", "pairs.jsonl", PAIRS, _read_pairs),
    _jsonl_reader("jsonl-instruct", "instruct.jsonl", INSTRUCT, _read_instruct),
    _jsonl_reader("alpaca", "alpaca.jsonl", ALPACA_RECORDS, lambda f: _records(f, "alpaca")),
    _jsonl_reader("sharegpt", "chat.jsonl", CHAT_RECORDS, lambda f: _records(f, "chat")),
    _jsonl_reader("speech-manifest", "manifest.jsonl", MANIFEST, _read_manifest),
    Reader("covost-tsv", _build_covost, _mutate_covost, _read_covost),
]}
