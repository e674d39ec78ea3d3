"""Local data through `datasets` (moekit.data.hf, moekit.data.chat) and `task: text` recipes."""
import csv
import json
import math

import pytest
import yaml

from moekit.config import validate
from moekit.data.hf import (ALPACA, ALPACA_NO_INPUT, TextDataConfig, builder_of, encode_records, load_text_data,
                            read_records)
from moekit.errors import ConfigError
from moekit.eval.translation import examples_loss
from moekit.checkpoint.format import load
from moekit.testing import CHATML, tiny_chat_tokenizer, tiny_llama, tiny_tokenizer
from moekit.training.recipe import load_recipe
from moekit.training.common import load_tokenizer

DOCS = ["the light of the world", "is good and the day was long", "a", "we walk to school at dawn"]
ALPACA_RECORDS = [{"instruction": "reverse the words", "input": "day long", "output": "long day"},
                  {"instruction": "say hello", "input": "", "output": "hello there"},
                  {"instruction": "count", "input": "a b c", "output": "three"}]
CHATS = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "what day is it"},
          {"role": "assistant", "content": "a good day"}],
         [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "green"}]]


def cfg(tmp_path, **kw) -> TextDataConfig:
    return validate(TextDataConfig, {"train_files": [str(tmp_path / "none.jsonl")], "test_fraction": 0.5, **kw})


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_csv(path, records):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records)
    return str(path)


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def spans(example) -> list[list[int]]:
    """The runs of consecutive labelled tokens."""
    runs, run = [], []
    for label in example["labels"]:
        if label == -100:
            runs, run = (runs + [run] if run else runs), []
        else:
            run.append(label)
    return runs + [run] if run else runs


def test_builders_and_local_files_only(tmp_path):
    files = {ext: tmp_path / f"d{ext}" for ext in (".jsonl", ".json", ".csv", ".parquet", ".txt")}
    for f in files.values():
        f.write_text("")
    assert [builder_of([str(f)], None) for f in files.values()] == ["json", "json", "csv", "parquet", "text"]
    assert builder_of([str(tmp_path / "d.csv")], "json") == "json"
    with pytest.raises(ConfigError, match=r"^data file not found: tatsu-lab/alpaca \(data.source=datasets reads "
                                          r"local files only, never a dataset from the Hub\)$"):
        builder_of(["tatsu-lab/alpaca"], None)
    with pytest.raises(ConfigError, match="is a URL: data.source=datasets reads local files only"):
        builder_of(["hf://datasets/tatsu-lab/alpaca/data.parquet"], None)
    with pytest.raises(ConfigError, match="cannot tell one builder from the extensions .* set data.builder"):
        builder_of([str(files[".csv"]), str(files[".txt"])], None)


def test_jsonl_csv_parquet_read_alike(tmp_path):
    paths = [write_jsonl(tmp_path / "a.jsonl", ALPACA_RECORDS), write_csv(tmp_path / "a.csv", ALPACA_RECORDS),
             write_parquet(tmp_path / "a.parquet", ALPACA_RECORDS)]
    for path in paths:
        records = read_records([path], None)
        assert [{**r, "input": r["input"] or ""} for r in records] == ALPACA_RECORDS, path  # CSV: "" reads as None
    (tmp_path / "d.txt").write_text("\n".join(DOCS) + "\n")
    assert read_records([str(tmp_path / "d.txt")], None) == [{"text": d} for d in DOCS]


def test_text_packing_is_the_token_stream(tmp_path):
    tok = tiny_tokenizer()
    c = cfg(tmp_path, format="text", max_length=12)
    blocks = encode_records([{"text": d} for d in DOCS], tok, c)
    stream = [i for d in DOCS for i in tok(d)["input_ids"] + [tok.eos_token_id]]
    assert len(stream) == 80 and [i for b in blocks for i in b["input_ids"]] == stream
    assert [len(b["input_ids"]) for b in blocks] == [12] * 6 + [8]  # the tail kept as a shorter block
    assert all(b["labels"] == b["input_ids"] for b in blocks)


def test_alpaca_labels_are_the_output_tokens(tmp_path):
    tok = tiny_tokenizer()
    examples = encode_records(ALPACA_RECORDS, tok, cfg(tmp_path, format="alpaca"))
    for r, e in zip(ALPACA_RECORDS, examples, strict=True):
        target = tok(r["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prompt = (ALPACA.format(**r) if r["input"] else ALPACA_NO_INPUT.format(instruction=r["instruction"]))
        n = len(e["input_ids"]) - len(target)
        assert spans(e) == [target] and e["input_ids"][n:] == target
        assert e["labels"][:n] == [-100] * n and tok.decode(e["input_ids"][:n]) == tok.decode(
            tok(prompt, add_special_tokens=False)["input_ids"])


def test_chat_labels_are_the_assistant_turns(tmp_path):
    tok = tiny_chat_tokenizer()
    examples = encode_records([{"messages": m} for m in CHATS], tok, cfg(tmp_path, format="chat"))
    for messages, e in zip(CHATS, examples, strict=True):
        assert tok.decode(e["input_ids"]) == tok.apply_chat_template(messages, tokenize=False)
        answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert [tok.decode(s) for s in spans(e)] == answers


def sharegpt(messages: list[dict]) -> dict:
    """The same conversation in ShareGPT's form, as LLaMA-Factory writes it (system prompt as its own column)."""
    role = {"user": "human", "assistant": "gpt"}
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [{"from": role[m["role"]], "value": m["content"]} for m in messages if m["role"] != "system"]
    return {"conversations": turns, **({"system": system[0]} if system else {})}


def test_sharegpt_conversations_encode_as_their_messages(tmp_path):
    """ShareGPT records ({conversations: [{from, value}]}, system) give exactly the examples of the same
    conversations as messages, read from a JSON Lines file through `datasets` too."""
    tok, c = tiny_chat_tokenizer(), cfg(tmp_path, format="chat")
    want = encode_records([{"messages": m} for m in CHATS], tok, c)
    assert encode_records([sharegpt(m) for m in CHATS], tok, c) == want
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt(m) for m in CHATS])
    assert encode_records(read_records([path], None), tok, c) == want
    with pytest.raises(ConfigError, match="^record 0: ShareGPT turns from 'function_call' .* are not supported"):
        encode_records([{"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{}"}]}],
                       tok, c)
    with pytest.raises(ConfigError, match="^record 0: expected a column 'conversations' holding"):
        encode_records([{"conversations": [{"from": "human"}]}], tok, c)


def test_chat_refusals(tmp_path):
    c = cfg(tmp_path, format="chat")
    with pytest.raises(ConfigError, match="^data.format=chat needs a tokenizer with a chat template"):
        encode_records([{"messages": CHATS[1]}], tiny_tokenizer(), c)
    tok = tiny_chat_tokenizer()
    tok.chat_template = "{{ messages | length }}" + CHATML  # every prefix renders differently
    with pytest.raises(ConfigError, match="^record 0: the tokenizer's chat template does not render this "
                                          "conversation incrementally"):
        encode_records([{"messages": CHATS[1]}], tok, c)
    with pytest.raises(ConfigError, match="^record 0: expected a column 'messages' holding"):
        encode_records([{"messages": "hi"}], tiny_chat_tokenizer(), c)


def test_test_fraction_holds_out_records(tmp_path):
    tok = tiny_tokenizer()
    records = [{"instruction": f"task {i}", "input": "", "output": f"answer {i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "a.jsonl", records)
    c = validate(TextDataConfig, {"format": "alpaca", "train_files": [path], "test_fraction": 0.3, "seed": 1})
    train_ex, test_ex = load_text_data(c, tok)
    assert (len(train_ex), len(test_ex)) == (7, 3)
    all_ex = encode_records(records, tok, c)
    assert sorted(map(str, train_ex + test_ex)) == sorted(map(str, all_ex))  # a partition of the records
    assert load_text_data(c, tok) == (train_ex, test_ex)  # the same draw for the same seed
    with pytest.raises(ConfigError, match="give either data.test_files or data.test_fraction"):
        validate(TextDataConfig, {"train_files": [path]})


@pytest.fixture(scope="module")
def text_assets(tmp_path_factory):
    """A tiny Llama with the chat tokenizer, and train/test files of every format (each in another file type)."""
    root = tmp_path_factory.mktemp("text")
    tiny_llama().save_pretrained(root / "dense")
    tiny_chat_tokenizer().save_pretrained(root / "dense")
    (root / "train.txt").write_text("\n".join(DOCS * 8) + "\n")
    (root / "test.txt").write_text("\n".join(DOCS) + "\n")
    write_csv(root / "alpaca_train.csv", ALPACA_RECORDS * 4)
    write_csv(root / "alpaca_test.csv", ALPACA_RECORDS)
    write_jsonl(root / "chat_train.jsonl", [{"messages": m} for m in CHATS * 4])
    write_jsonl(root / "chat_test.jsonl", [{"messages": m} for m in CHATS])
    pairs = [{"src": d, "tgt": d[::-1], "tgt_lang": "fr"} for d in DOCS]
    write_parquet(root / "pairs_train.parquet", pairs * 2)
    write_parquet(root / "pairs_test.parquet", pairs)
    return root


# the tiny model has 64 positions: Alpaca's own prompt (~170 characters) does not fit
SHORT = {"alpaca": {"template": "{instruction}: {input} =", "template_no_input": "{instruction} ="}}
FILES = {"text": ("train.txt", "test.txt"), "alpaca": ("alpaca_train.csv", "alpaca_test.csv"),
         "chat": ("chat_train.jsonl", "chat_test.jsonl"), "translation": ("pairs_train.parquet", "pairs_test.parquet")}


@pytest.mark.parametrize("fmt", list(FILES))
def test_text_recipe_trains_two_steps(fmt, text_assets, tmp_path, run):
    train_file, test_file = FILES[fmt]
    out = tmp_path / "run"
    recipe = {"task": "text", "name": f"text_{fmt}", "out": str(out), "model": {"path": str(text_assets / "dense")},
              "method": "moe", "moe": {"num_experts": 4, "top_k": 2, "every": 2, "shared_expert": True, "init": "spri"},
              "data": {"source": "datasets", "format": fmt, "train_files": [str(text_assets / train_file)],
                       "test_files": [str(text_assets / test_file)], "max_length": 64, **SHORT.get(fmt, {})},
              "train": {"steps": 2, "batch_size": 2, "logging_steps": 1, "eval_every": 1},
              "eval": {"batch_size": 2}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rc, stdout, stderr = run("train", tmp_path / "recipe.yaml")  # the CLI: load_recipe, train, results table
    assert rc == 0, stderr
    assert f"trained text_{fmt}: 2 steps" in stdout
    history = json.loads((out / "log_history.json").read_text())
    assert [h["step"] for h in history if "loss" in h] == [1, 2] == [h["step"] for h in history if "eval_loss" in h]
    results = json.loads((out / "results.json").read_text())
    row = results["directions"]["test"]
    assert row["perplexity"] == pytest.approx(math.exp(row["loss"]), rel=1e-12)
    r = load_recipe(out / "recipe.yaml")
    test = load_text_data(r.data, load_tokenizer(out / "model"))[1]
    assert row["n"] == len(test) and row["loss"] == pytest.approx(examples_loss(load(out / "model"), test, 2), rel=1e-5)
    assert len(results["usage"]) == 2 and all(sum(u) == pytest.approx(1.0) for u in results["usage"].values())
    assert r.data.format == fmt and r.task == "text"
    (out / "results.json").unlink()
    rc, stdout, stderr = run("evaluate", out)  # `moekit evaluate` reproduces the run's own evaluation
    assert rc == 0, stderr
    again = json.loads((out / "results.json").read_text())["directions"]["test"]
    assert again["n"] == row["n"] and again["loss"] == pytest.approx(row["loss"], rel=1e-6)
