"""Multi-task instruction data from the verse-aligned Bible, for SNI-style cross-task generalization.

Every task turns one verse id (book, chapter, verse) into an (input, output) pair; a task belongs to
a category (translation, reverse_translation, language_id, continuation, book_id, paraphrase,
cloze). Models train on `train_tasks` and are evaluated on held-out verses of those tasks and on
`unseen_tasks`, which never appear in training (Super-NaturalInstructions, Wang et al. 2022).
Prompts follow SNI: "Instruction: ...\\nInput: ...\\nOutput:"; only " " + output + eos is scored.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from moekit.config import Config
from moekit.data.parallel import BIBLE_CODE, LANG_NAMES, Pair, read_jsonl
from moekit.errors import ConfigError

PROMPT = "Instruction: {instruction}\nInput: {input}\nOutput:"
TEMPLATE = "{src}"  # see to_pair
KJV, BBE, WEB = "k", "3", "4"  # English: King James, Bible in Basic English, World English Bible
LANGID_LANGS = ("en", "fr", "de", "es", "it", "pt", "sw", "id", "tr", "pl")
BOOK_NAMES = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "1 Samuel",
    "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations", "Ezekiel",
    "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah",
    "Haggai", "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter",
    "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)
BLANK = "____"

Key = tuple[int, int, int]  # (book, chapter, verse)
Texts = dict[str, dict[Key, str]]  # Bible translation code -> verse id -> text
Build = Callable[[Key, Texts, random.Random], tuple[str | None, str | None]]


@dataclass(frozen=True)
class Example:
    prompt: str
    target: str
    task: str
    category: str
    id: str  # verse id "book:chapter:verse" of the input


@dataclass(frozen=True)
class Task:
    category: str
    instruction: str
    codes: tuple[str, ...]  # Bible translations the builder reads
    build: Build  # (input, output); None where the verse does not yield an example


def _translate(src: str, tgt: str) -> Build:
    return lambda k, t, rng: (t[BIBLE_CODE[src]].get(k), t[BIBLE_CODE[tgt]].get(k))


def _neighbour(offset: int) -> Build:
    return lambda k, t, rng: (t[KJV].get(k), t[KJV].get((k[0], k[1], k[2] + offset)))


def _language(k: Key, t: Texts, rng: random.Random) -> tuple[str | None, str]:
    lang = rng.choice(LANGID_LANGS)
    return t[BIBLE_CODE[lang]].get(k), LANG_NAMES[lang]


def _cloze(k: Key, t: Texts, rng: random.Random) -> tuple[str | None, str | None]:
    """One alphabetic word of >= 4 letters of the KJV verse replaced by BLANK; output that word."""
    words = (t[KJV].get(k) or "").split()
    slots = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 4]
    if not slots:
        return None, None
    i = rng.choice(slots)
    return " ".join(words[:i] + [BLANK] + words[i + 1:]), words[i]


def _registry() -> dict[str, Task]:
    tasks = {}
    for lang in (lang for lang in BIBLE_CODE if lang != "en"):
        name, codes = LANG_NAMES[lang], (KJV, BIBLE_CODE[lang])
        tasks[f"translate_en_{lang}"] = Task("translation", f"Translate the English text into {name}.",
                                             codes, _translate("en", lang))
        tasks[f"translate_{lang}_en"] = Task("reverse_translation", f"Translate the {name} text into English.",
                                             codes, _translate(lang, "en"))
    return tasks | {
        "identify_language": Task("language_id", "Which language is this text written in? Answer with the "
                                  "name of the language in English.",
                                  tuple(BIBLE_CODE[lang] for lang in LANGID_LANGS), _language),
        "next_verse": Task("continuation", "Give the Bible verse that comes right after this one.", (KJV,),
                           _neighbour(1)),
        "previous_verse": Task("continuation", "Give the Bible verse that comes right before this one.", (KJV,),
                               _neighbour(-1)),
        "book_name": Task("book_id", "Which book of the Bible is this verse from?", (KJV,),
                          lambda k, t, rng: (t[KJV].get(k), BOOK_NAMES[k[0] - 1])),
        "testament": Task("book_id", "Is this Bible verse from the Old Testament or the New Testament?", (KJV,),
                          lambda k, t, rng: (t[KJV].get(k), "Old Testament" if k[0] <= 39 else "New Testament")),
        "simplify_kjv": Task("paraphrase", "Rewrite this King James Bible verse in simple, plain English.",
                             (KJV, BBE), lambda k, t, rng: (t[KJV].get(k), t[BBE].get(k))),
        "modernize_kjv": Task("paraphrase", "Rewrite this King James Bible verse in modern English.",
                              (KJV, WEB), lambda k, t, rng: (t[KJV].get(k), t[WEB].get(k))),
        "fill_blank": Task("cloze", f"Give the word that was replaced by {BLANK} in the text.", (KJV,), _cloze),
    }


TASKS: dict[str, Task] = _registry()
CATEGORIES: dict[str, list[str]] = {
    c: [n for n, t in TASKS.items() if t.category == c] for c in dict.fromkeys(t.category for t in TASKS.values())}


def resolve_tasks(names: Iterable[str]) -> list[str]:
    """Task names, with a category name standing for all its tasks; order kept, duplicates dropped."""
    out: dict[str, None] = {}
    for n in names:
        if n not in TASKS and n not in CATEGORIES:
            raise ConfigError(f"unknown task or category {n!r}; categories: {', '.join(CATEGORIES)}; "
                              f"tasks: {', '.join(TASKS)}")
        out.update(dict.fromkeys(CATEGORIES.get(n, [n])))
    return list(out)


class InstructConfig(Config):
    """Tasks to train on and unseen tasks to evaluate only; names may be tasks or whole categories."""

    train_tasks: list[str] = Field(default_factory=lambda: [
        "translate_en_fr", "translate_en_de", "translate_en_es", "identify_language", "next_verse"])
    unseen_tasks: list[str] = Field(default_factory=lambda: [
        "translate_fr_en", "translate_de_en", "book_name", "simplify_kjv"])
    train_per_task: int = Field(200, ge=1)
    test_per_task: int = Field(32, ge=1)
    max_chars: int = Field(200, ge=10)  # skip examples whose input or output is longer
    max_length: int = Field(128, ge=8)  # tokens (prompt + target + eos)
    seed: int = 0
    books: list[int] | None = None  # Bible books to draw verses from (1-66); None = all
    source: Literal["bible", "jsonl"] = "bible"  # jsonl: your own tasks, any names
    train_files: list[str] = Field(default_factory=list)  # jsonl: {task, instruction, input, output} per line
    test_files: list[str] = Field(default_factory=list)

    def task_names(self) -> tuple[list[str], list[str]]:
        """(trained tasks, unseen tasks), categories expanded for the Bible mix."""
        if self.source == "jsonl":
            return list(self.train_tasks), list(self.unseen_tasks)
        return resolve_tasks(self.train_tasks), resolve_tasks(self.unseen_tasks)

    @property
    def template(self) -> str:
        return TEMPLATE

    @model_validator(mode="after")
    def _check(self) -> InstructConfig:
        if not self.train_tasks:
            raise ValueError("train_tasks is empty")
        if self.source == "jsonl" and not (self.train_files and self.test_files):
            raise ValueError("source=jsonl needs train_files and test_files")
        try:
            train, unseen = self.task_names()
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if overlap := sorted(set(train) & set(unseen)):
            raise ValueError(f"tasks both trained on and held out as unseen: {', '.join(overlap)}")
        if self.books is not None and not (self.books and all(1 <= b <= 66 for b in self.books)):
            raise ValueError("books must be a non-empty list of book numbers 1-66")
        return self


def _load_texts(codes: Iterable[str], books: list[int] | None) -> Texts:
    from moekit.assets import bible_verses

    return {c: {(v.book, v.chapter, v.verse): t for v in bible_verses(c, books) if (t := v.text)}
            for c in sorted(set(codes))}


def _example(name: str, key: Key, texts: Texts, cfg: InstructConfig) -> Example | None:
    task, vid = TASKS[name], ":".join(map(str, key))
    inp, out = task.build(key, texts, random.Random(f"{cfg.seed}:{name}:{vid}"))
    if not inp or not out or max(len(inp), len(out)) > cfg.max_chars:
        return None
    prompt = PROMPT.format(instruction=task.instruction, input=inp)
    return Example(prompt, out, name, task.category, vid)


def _take(name: str, keys: list[Key], n: int, texts: Texts, cfg: InstructConfig) -> list[Example]:
    """The first `n` examples of a task, in the order of `keys`."""
    made: Iterator[Example | None] = (_example(name, k, texts, cfg) for k in keys)
    return list(itertools.islice((ex for ex in made if ex is not None), n))


def _margin(examples: Iterable[Example]) -> set[Key]:
    """The verse ids of `examples` and their neighbours (the targets of next/previous_verse)."""
    keys = [tuple(map(int, ex.id.split(":"))) for ex in examples]
    return {(b, c, v + d) for b, c, v in keys for d in (-1, 0, 1)}


def load_instruct(cfg: InstructConfig) -> tuple[list[Example], dict[str, list[Example]]]:
    """(train examples of the train tasks shuffled together, {task: test examples}) for train and
    unseen tasks. Verse ids are shuffled with `seed`; each task's test examples are its first
    `test_per_task` usable verses, and training never uses a test verse or its neighbours."""
    train_names, unseen_names = cfg.task_names()
    names = train_names + unseen_names
    if cfg.source == "jsonl":
        return _jsonl_split(cfg, train_names, names)
    texts = _load_texts([KJV, *(c for n in names for c in TASKS[n].codes)], cfg.books)
    rng = random.Random(cfg.seed)
    keys = sorted(texts[KJV])
    rng.shuffle(keys)
    test = {n: _take(n, keys, cfg.test_per_task, texts, cfg) for n in names}
    blocked = _margin(ex for exs in test.values() for ex in exs)
    pool = [k for k in keys if k not in blocked]
    train = [ex for n in train_names for ex in _take(n, pool, cfg.train_per_task, texts, cfg)]
    rng.shuffle(train)
    return train, test


def _jsonl_example(d: dict, default_id: str) -> Example:
    prompt = PROMPT.format(instruction=d["instruction"], input=d["input"])
    return Example(prompt, d["output"], d["task"], d.get("category", d["task"]), default_id)


def _jsonl_examples(files: list[str]) -> list[Example]:
    return read_jsonl(files, "task, instruction, input, output", _jsonl_example)


def _jsonl_split(cfg: InstructConfig, train_names: list[str], names: list[str]):
    """Your own files: the first train_per_task / test_per_task examples of each task."""
    train_all, test_all = _jsonl_examples(cfg.train_files), _jsonl_examples(cfg.test_files)
    train = [e for t in train_names for e in [e for e in train_all if e.task == t][: cfg.train_per_task]]
    test = {t: [e for e in test_all if e.task == t][: cfg.test_per_task] for t in names}
    if empty := [t for t in names if not test[t]] + [t for t in train_names if not any(e.task == t for e in train)]:
        raise ConfigError(f"no examples for tasks {', '.join(sorted(set(empty)))} in the jsonl files")
    random.Random(cfg.seed).shuffle(train)
    return train, test


def to_pair(ex: Example) -> Pair:
    """An example as a `Pair` for the shared encoding and evaluation code: src is the whole prompt and
    the template is TEMPLATE, so `encode_pair` gives prompt + " " + target + eos, prompt unscored."""
    return Pair(ex.prompt, ex.target, "en", f"{ex.task}:{ex.id}")


def load_instruct_pairs(cfg: InstructConfig) -> tuple[list[Pair], dict[str, list[Pair]]]:
    """`load_instruct` as Pairs: (training pairs, {task: test pairs})."""
    train, test = load_instruct(cfg)
    return [to_pair(e) for e in train], {t: [to_pair(e) for e in exs] for t, exs in test.items()}
