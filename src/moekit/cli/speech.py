"""`moekit speech corpus --langs en,fr --voices 4 --out corpus/`: synthesize a multilingual speech corpus."""
from __future__ import annotations

import argparse

from moekit.cli.common import lang_file, lang_files, out_console
from moekit.cli.progress import progress

OPTIONS = ("voices", "test_voices", "train_per_lang", "test_per_lang", "max_chars", "seed", "workers")


def langs(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated language codes, got {text!r}")
    return items


def numbers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("speech", help="speech data: synthetic multilingual corpora",
                       description="Speech data for speech MoE models.")
    ssub = p.add_subparsers(dest="speech_command", required=True, metavar="SUBCOMMAND")
    c = ssub.add_parser("corpus", help="synthesize a speech corpus with espeak-ng (and flite)",
                        description="Speak texts (verse-aligned Bible translations, or your own files) with several "
                                    "espeak-ng voices per language. Test utterances use held-out texts and held-out "
                                    "voices. Writes manifest.jsonl, audio/<lang>/*.wav (16 kHz) and corpus.json.")
    c.add_argument("--langs", required=True, type=langs, help="comma-separated languages, e.g. en,fr,de,sw")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--voices", type=int, help="training voices per language (default: 4)")
    c.add_argument("--test-voices", type=int, help="held-out test voices per language (default: 1)")
    c.add_argument("--train-per-lang", type=int, help="training utterances per language (default: 200)")
    c.add_argument("--test-per-lang", type=int, help="test utterances per language (default: 50)")
    c.add_argument("--max-chars", type=int, help="skip texts longer than this (default: 200)")
    c.add_argument("--flite-test", action="store_true",
                   help="also speak the English test texts with flite voices (a family unseen in training)")
    c.add_argument("--texts", nargs="+", action="extend", type=lang_file, metavar="LANG=FILE",
                   help="one sentence per line for each language, instead of the Bible")
    c.add_argument("--targets", type=langs, default=[],
                   help="speech translation: with --langs en, also write CoVoST 2-style covost_v2.en_XX.SPLIT.tsv files "
                        "pairing each English clip with the same verse in these languages, e.g. de,fr (default: none)")
    c.add_argument("--books", type=numbers,
                   help="Bible books to draw from, e.g. 40,41,42,43 (default: all)")
    c.add_argument("--seed", type=int, help="texts, voices and their pairing (default: 0)")
    c.add_argument("--workers", type=int, help="parallel synthesis processes (default: 2)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    c.set_defaults(run=run_corpus)


def config_of(args: argparse.Namespace):
    from moekit.config import validate
    from moekit.speech.corpus import CorpusConfig

    texts = {lang: str(path) for lang, path in lang_files(args.texts, "--texts").items()}
    data = {key: getattr(args, key) for key in OPTIONS if getattr(args, key) is not None}
    data.update(langs=args.langs, flite_test=args.flite_test, books=args.books, targets=args.targets,
                texts=texts)
    return validate(CorpusConfig, data, source="speech corpus options")


def run_corpus(args: argparse.Namespace) -> None:
    from moekit.speech.corpus import build_corpus, read_manifest

    cfg = config_of(args)
    with progress():
        out = build_corpus(cfg, args.out, overwrite=args.overwrite)
    utts = read_manifest(out)
    hours = sum(u.seconds for u in utts) / 3600
    voices = len({u.voice for u in utts})
    tests = sum(u.split == "test" for u in utts)
    out_console().print(f"{len(utts)} utterances ({len(utts) - tests} train, {tests} test), {hours:.2f} hours, "
                        f"{voices} voices, {len(cfg.langs)} languages -> {out}")
