"""Local training data read through `datasets` (JSON/JSONL, CSV, Parquet, plain text), for `task: text`.

Formats, each encoded as {input_ids, labels} (labels -100 where no loss is taken; the examples batch with
moekit.data.parallel.TranslationCollator):
  text         raw text for causal LM: every document tokenized, followed by eos, concatenated and cut into
               max_length blocks (the last one may be shorter); every token is a label. Blocks span document
               boundaries, as in HF's run_clm.
  alpaca       {instruction, input, output}: prompt template + output + eos; loss on output + eos only.
  chat         {messages: [{role, content}, ...]}, or ShareGPT's {conversations: [{from, value}, ...], system}
               (LLaMA-Factory's other format), rendered by the tokenizer's chat template; loss on the
               assistant turns only (their content and the template's end-of-turn text).
  translation  moekit's parallel-text records {src, tgt, tgt_lang} (moekit.data.parallel.encode_pair).
Only local files are read, with datasets' packaged builders (no dataset scripts, nothing from the Hub).
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moekit.config import Config
from moekit.data.parallel import DEFAULT_TEMPLATE, LANG_NAMES, TEMPLATE_FIELDS, Pair, check_template, encode_pair, \
    parse_line
from moekit.errors import ConfigError

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
Example = dict[str, list[int]]


class TextDataConfig(Config):
    source: Literal["datasets"] = "datasets"
    format: Literal["text", "alpaca", "chat", "translation"] = "text"
    train_files: list[str]  # local files (no Hub ids, no URLs)
    test_files: list[str] = Field(default_factory=list)  # held-out split; or test_fraction of train_files
    test_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    builder: Literal["json", "csv", "parquet", "text"] | None = None  # None: from the files' extension
    text_field: str = "text"  # format text: the column holding the documents
    template: str | None = None  # prompt: alpaca's ({instruction}, {input}) or translation's; None: the default
    template_no_input: str = ALPACA_NO_INPUT  # format alpaca, for records with an empty input
    max_length: int = Field(512, ge=8)
    seed: int = 0  # test_fraction's draw

    @model_validator(mode="after")
    def _check(self) -> TextDataConfig:
        if not self.train_files:
            raise ValueError("data.train_files is empty")
        if bool(self.test_files) == (self.test_fraction > 0):
            raise ValueError("give either data.test_files or data.test_fraction > 0 (the held-out split)")
        if self.format == "alpaca":
            check_template(self.prompt, ("instruction", "input"), required=("instruction", "input"))
            check_template(self.template_no_input, ("instruction",), required=("instruction",))
        if self.format == "translation":
            check_template(self.prompt, TEMPLATE_FIELDS, required=("src", "tgt_name"))
        return self

    @property
    def prompt(self) -> str:
        return self.template or (DEFAULT_TEMPLATE if self.format == "translation" else ALPACA)


def builder_of(files: list[str], builder: str | None) -> str:
    """The packaged `datasets` builder for local `files`; ConfigError for a Hub id, a URL, a missing file or
    an extension with no builder."""
    for f in files:
        if "://" in f:
            raise ConfigError(f"data file {f!r} is a URL: data.source=datasets reads local files only")
        try:
            mode = os.stat(f).st_mode
        except OSError:
            raise ConfigError(f"data file not found: {f} (data.source=datasets reads local files only, "
                              "never a dataset from the Hub)") from None
        if not stat.S_ISREG(mode):
            raise ConfigError(f"data file {f} is not a regular file (a directory, FIFO or device)")
    if builder is not None:
        return builder
    kinds = {BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(f"cannot tell one builder from the extensions of {files} (known: "
                          f"{', '.join(BUILDERS)}); set data.builder")
    return kinds.pop()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars or error log lines from `datasets` (only moekit.cli draws and prints)."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    log = logging.getLogger("datasets")
    level, log.level = log.level, logging.CRITICAL
    try:
        yield
    finally:
        log.setLevel(level)
        if enabled:
            datasets.enable_progress_bars()


def read_records(files: list[str], builder: str | None) -> list[dict]:
    """The rows of local `files` as dicts (see read_located)."""
    return [r for _, r in read_located(files, builder)]


def read_located(files: list[str], builder: str | None) -> list[tuple[str, dict]]:
    """(where, row) for every row of local `files`, where = "FILE: record N" (N from 0 in each file), read
    through datasets.load_dataset with a packaged builder; its Arrow cache lives in a temporary folder (nothing
    is kept under ~/.cache). A malformed file is one ConfigError naming the file and, where it can be found,
    the line."""
    import datasets

    name = builder_of(files, builder)
    out = []
    for f in files:
        if name == "json":
            _check_first_record(f)
        with tempfile.TemporaryDirectory(prefix="moekit-datasets-") as cache, _quiet():
            try:
                rows = datasets.load_dataset(name, data_files=[str(Path(f).resolve())], split="train",
                                             cache_dir=cache, keep_in_memory=True).to_list()  # decodes the text
            except Exception as e:  # noqa: BLE001  (pyarrow and datasets raise many types for a malformed file)
                raise ConfigError(f"cannot read {f} as {name}: {_malformed(f, name, e)}") from None
        out += [(f"{f}: record {n}", r) for n, r in enumerate(rows)]
    return out


def _check_first_record(f: str) -> None:
    """The first non-blank line of a JSON data file opens a record (`{`) or a list of them (`[`): pyarrow's JSON
    reader (inside `datasets`) crashes the process (SIGSEGV, pyarrow 22) on a file that starts with `null`."""
    with open(f, "rb") as fh:
        for n, line in enumerate(fh, 1):
            start = line.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
            if start:
                if start not in (b"{", b"["):
                    raise ConfigError(f"{f}: line {n} is not a JSON object (each record of a JSON data file is one)")
                return


def _malformed(f: str, builder: str, e: BaseException) -> str:
    """What is wrong with a file datasets could not read: its first line that is not UTF-8 (text formats) or, in
    JSON Lines, not JSON; else the innermost error's message (pyarrow / pandas name the row or line)."""
    if builder != "parquet":
        as_json = builder == "json" and Path(f).suffix.lower() == ".jsonl"
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    raw.strip() and parse_line(raw, as_json)
                except ValueError as err:
                    return f"line {n} is {err}"
    while e.__cause__ is not None:
        e = e.__cause__
    return " ".join(str(e).split()) or type(e).__name__


def field(record: dict, key: str, where: str, kind: type = str):
    """record[key] if it is a `kind`; else one ConfigError naming the record and the column."""
    if key not in record:
        raise ConfigError(f"{where}: has no column {key!r} (its columns: {', '.join(map(str, record)) or 'none'})")
    value = record[key]
    if not isinstance(value, kind):
        got = "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
        raise ConfigError(f"{where}: column {key!r} must hold {'text' if kind is str else kind.__name__}, got {got}")
    return value


def pack_text(records: list[dict], tok, cfg: TextDataConfig, where: list[str]) -> list[Example]:
    """Documents tokenized (with the tokenizer's special tokens) + eos, concatenated, cut into max_length
    blocks; labels = input_ids."""
    stream: list[int] = []
    for r, at in zip(records, where):
        stream += tok(field(r, cfg.text_field, at))["input_ids"] + [tok.eos_token_id]
    L = cfg.max_length
    return [{"input_ids": stream[i:i + L], "labels": stream[i:i + L]} for i in range(0, len(stream), L)]


def prompted(prompt: str, target: str, tok, max_length: int) -> Example:
    """prompt tokens (label -100) + target tokens + eos, cut to max_length."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    t = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return {"input_ids": (p + t)[:max_length], "labels": ([-100] * len(p) + t)[:max_length]}


def encode_alpaca(record: dict, tok, cfg: TextDataConfig, where: str) -> Example:
    instruction, output = field(record, "instruction", where), field(record, "output", where)
    extra = record.get("input") or ""
    prompt = (cfg.prompt.format(instruction=instruction, input=extra) if extra else
              cfg.template_no_input.format(instruction=instruction))
    return prompted(prompt, output, tok, cfg.max_length)


def encode_translation(record: dict, tok, cfg: TextDataConfig, where: str) -> Example:
    lang = field(record, "tgt_lang", where)
    if lang not in LANG_NAMES:
        raise ConfigError(f"{where}: unknown tgt_lang {lang!r}; known: {', '.join(sorted(LANG_NAMES))}")
    pair = Pair(field(record, "src", where), field(record, "tgt", where), lang)
    return encode_pair(pair, tok, cfg.prompt, cfg.max_length)


def encode_records(records: list[dict], tok, cfg: TextDataConfig, where: list[str] | None = None) -> list[Example]:
    """The records in `cfg.format`, encoded; examples left with no label within max_length dropped. `where`
    names each record in errors (default: "record N")."""
    where = where or [f"record {n}" for n in range(len(records))]
    if cfg.format == "text":
        return pack_text(records, tok, cfg, where)
    if cfg.format == "chat":
        from moekit.data.chat import encode_chat as encode
    else:
        encode = encode_alpaca if cfg.format == "alpaca" else encode_translation
    examples = [encode(r, tok, cfg, at) for r, at in zip(records, where)]
    return [e for e in examples if any(label != -100 for label in e["labels"])]


def load_text_data(cfg: TextDataConfig, tok) -> tuple[list[Example], list[Example]]:
    """(train examples, test examples): test_files, or a `test_fraction` of the train records drawn with
    `seed` (the split is over records, before packing)."""
    records = read_located(cfg.train_files, cfg.builder)
    if cfg.test_files:
        test_records = read_located(cfg.test_files, cfg.builder)
    else:
        random.Random(cfg.seed).shuffle(records)
        n = max(1, round(len(records) * cfg.test_fraction))
        if n >= len(records):
            raise ConfigError(f"data.test_fraction={cfg.test_fraction} leaves no training record of {len(records)}")
        test_records, records = records[:n], records[n:]
    train, test = (encode_records([r for _, r in split], tok, cfg, [w for w, _ in split])
                   for split in (records, test_records))
    for split, examples in (("training", train), ("test", test)):
        if not examples:
            raise ConfigError(f"no {split} example keeps a label token within data.max_length={cfg.max_length}")
    return train, test
