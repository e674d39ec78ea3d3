"""Evaluation of the En→XX translation recipes.

Per direction: greedy translations scored with sacreBLEU (BLEU, chrF) and the mean target-token
loss under teacher forcing. Per run: KL(dense ‖ model) per token on a fixed held-out subset
against a dense reference cached once (SPRI appendix A.1), inter-expert diversity, expert usage
per MoE layer, total / active parameters. Results go to results.json and results.csv.
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from sacrebleu.metrics import BLEU, CHRF
from torch import Tensor, nn

from moekit._fs import output, write_text_atomic
from moekit.data.parallel import Pair, TranslationCollator, encode_pair, prompt_of
from moekit.errors import CheckpointError, ConfigError
from moekit.moe.diversity import diversity, init_diversity
from moekit.routing.sites import param_counts
from moekit.eval.usage import fractions, inference, usage_counts
from moekit.moe.layer import moe_layers
from moekit.progress import report

# sacreBLEU's own per-language defaults: "13a" (mteval v13a) for space-delimited scripts; Chinese is
# split per character ("zh"); Japanese and Korean need MeCab (`pip install sacrebleu[ja]` / `[ko]`).
BLEU_TOKENIZE = {"zh": "zh", "ja": "ja-mecab", "ko": "ko-mecab"}
CSV_COLUMNS = ("direction", "n", "rougeL", "bleu", "chrf", "loss", "kl", "diversity_init", "diversity", "total_params",
               "active_params")





def _eos_pad(tokenizer) -> tuple[int, int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no eos token (translations end with eos)")
    pad = tokenizer.pad_token_id
    return eos, eos if pad is None else pad


def encode_pairs(pairs: list[Pair], tokenizer, template: str, max_length: int) -> list[dict[str, list[int]]]:
    """`encode_pair` for each pair (prompt labels -100, target + eos scored)."""
    return [encode_pair(p, tokenizer, template, max_length) for p in pairs]


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids (B, L), attention_mask (B, L)), padded on the left for decoder-only generation."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):], mask[i, n - len(s):] = torch.tensor(s), 1
    return ids, mask


def _hypothesis(tokenizer, new_ids: list[int], eos: int) -> str:
    """Generated ids up to the first eos, decoded; the first non-empty line only."""
    if eos in new_ids:
        new_ids = new_ids[: new_ids.index(eos)]
    lines = tokenizer.decode(new_ids, skip_special_tokens=True).strip().splitlines()
    return lines[0].strip() if lines else ""


def translate(model: nn.Module, tokenizer, pairs: list[Pair], template: str, max_new_tokens: int = 64,
              batch_size: int = 8) -> list[str]:
    """Greedy translations of `pairs` (one string each): prompt as in training, stop at eos. Progress:
    "generating" per batch (moekit.progress)."""
    eos, pad = _eos_pad(tokenizer)
    prompts = [tokenizer(prompt_of(p, template), add_special_tokens=False)["input_ids"] for p in pairs]
    out = []
    with inference(model):
        for i in range(0, len(prompts), batch_size):
            ids, mask = _left_pad(prompts[i:i + batch_size], pad)  # (B, L), (B, L)
            gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=pad)  # (B, L + new)
            out += [_hypothesis(tokenizer, row.tolist(), eos) for row in gen[:, ids.shape[1]:]]
            report("generating", len(out), len(prompts))
    return out


def bleu_tokenizer(lang: str) -> str:
    """sacreBLEU tokenizer for a target language (see BLEU_TOKENIZE); ConfigError if it is not installed."""
    name = BLEU_TOKENIZE.get(lang, "13a")
    try:
        BLEU(tokenize=name)
    except RuntimeError:  # sacrebleu raises it when MeCab or its dictionary is missing
        raise ConfigError(f"BLEU for target language {lang!r} needs sacreBLEU's {name} tokenizer: "
                          f"pip install 'moekit[cjk]' (or 'sacrebleu[{lang}]')") from None
    return name


def bleu_chrf(hyps: list[str], refs: list[str], lang: str = "") -> tuple[float, float]:
    """Corpus-level sacreBLEU (tokenizer `bleu_tokenizer(lang)`) and chrF (chrF2, character 6-grams), 0-100."""
    if len(hyps) != len(refs) or not refs:
        raise ConfigError(f"need as many hypotheses as references, at least one (got {len(hyps)}, {len(refs)})")
    bleu = BLEU(tokenize=bleu_tokenizer(lang)).corpus_score(hyps, [refs]).score
    return bleu, CHRF().corpus_score(hyps, [refs]).score


def sentence_bleu_chrf(hyps: list[str], refs: list[str], lang: str = "") -> dict[str, list[float]]:
    """Per sentence, in order: sacreBLEU's sentence BLEU (tokenizer `bleu_tokenizer(lang)`, effective n-gram order, as
    sacrebleu.sentence_bleu) and chrF (chrF2), 0-100: {"bleu": [...], "chrf": [...]}."""
    bleu, chrf = BLEU(tokenize=bleu_tokenizer(lang), effective_order=True), CHRF()
    return {"bleu": [bleu.sentence_score(h, [r]).score for h, r in zip(hyps, refs, strict=True)],
            "chrf": [chrf.sentence_score(h, [r]).score for h, r in zip(hyps, refs, strict=True)]}


def _scored_logits(model: nn.Module, examples: list[dict], batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Per batch: the logits (n, V) of the positions that predict a target token, and those tokens (n,).

    Rows come in example order, so they do not depend on `batch_size`. Call under `inference`."""
    collate = TranslationCollator(pad_id=0)  # padding is masked and never scored: its id does not matter
    for i in range(0, len(examples), batch_size):
        b = {k: v.to(model.device) for k, v in collate(examples[i:i + batch_size]).items()}
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, L, V)
        keep = b["labels"][:, 1:] != -100  # (B, L-1): position t predicts label t+1
        yield logits[:, :-1][keep].float(), b["labels"][:, 1:][keep]  # (n, V), (n,)


def direction_loss(model: nn.Module, tokenizer, pairs: list[Pair], template: str, max_length: int = 128,
                   batch_size: int = 8) -> float:
    """Mean NLL per target token (target + eos; prompt excluded) under teacher forcing, token-weighted."""
    return examples_loss(model, encode_pairs(pairs, tokenizer, template, max_length), batch_size)


def examples_loss(model: nn.Module, examples: list[dict], batch_size: int = 8) -> float:
    """Mean NLL per labelled token of encoded examples ({input_ids, labels}) under teacher forcing."""
    total, tokens = 0.0, 0
    with inference(model):
        for logits, targets in _scored_logits(model, examples, batch_size):
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
            tokens += targets.numel()
    if tokens == 0:
        raise ConfigError("no target tokens to score (empty pairs, or max_length cuts every target)")
    return total / tokens


class DenseReference:
    """The dense model's next-token log-probs on a fixed held-out subset, computed once (SPRI appendix A.1).

    Only the scored positions (those predicting a target token) are kept, as float16: the cache
    takes scored tokens × vocab × 2 bytes (e.g. 256 examples × 40 target tokens × 49,152 for
    SmolLM2 ≈ 1.0 GB). `kl(model)` re-runs `model` on the same examples.
    """

    FILE = "dense_reference.safetensors"

    def __init__(self, examples: list[dict[str, list[int]]], logprobs: Tensor):
        n = sum(sum(t != -100 for t in ex["labels"][1:]) for ex in examples)
        if logprobs.dim() != 2 or logprobs.shape[0] != n:
            raise CheckpointError(f"dense reference has {tuple(logprobs.shape)} log-probs for {n} scored tokens")
        self.examples, self.logprobs = examples, logprobs  # logprobs (N, V) float16

    @classmethod
    def compute(cls, dense: nn.Module, examples: list[dict[str, list[int]]], batch_size: int = 8) -> DenseReference:
        if not any(t != -100 for ex in examples for t in ex["labels"][1:]):
            raise ConfigError("the held-out subset for the dense reference has no target tokens")
        with inference(dense):
            rows = [lg.log_softmax(-1).half().cpu() for lg, _ in _scored_logits(dense, examples, batch_size)]
        return cls(examples, torch.cat(rows))  # (N, V)

    @property
    def nbytes(self) -> int:
        return self.logprobs.numel() * self.logprobs.element_size()

    def kl(self, model: nn.Module, batch_size: int = 8) -> float:
        """Mean per-token KL(dense ‖ model) over the cached positions, in float32. Rounding sets a noise
        floor of ~1e-5 (SmolLM2: -7e-6 for the dense model itself), so ~0 may print slightly negative."""
        total, start = 0.0, 0
        with inference(model):
            for logits, _ in _scored_logits(model, self.examples, batch_size):
                if logits.shape[-1] != self.logprobs.shape[1]:
                    raise ConfigError(f"model vocab {logits.shape[-1]} != dense vocab {self.logprobs.shape[1]}")
                logp = self.logprobs[start:start + len(logits)].to(logits.device).float()  # (n, V)
                logp = logp - logp.logsumexp(-1, keepdim=True)  # renormalize after fp16 rounding
                total += float((logp.exp() * (logp - logits.log_softmax(-1))).sum())
                start += len(logits)
        return total / max(start, 1)

    def save(self, folder: str | Path) -> Path:
        """Write `folder`/dense_reference.safetensors (log-probs, examples flattened with their lengths)."""
        path = Path(folder) / self.FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"logprobs": self.logprobs.contiguous(),
                   "lengths": torch.tensor([len(ex["input_ids"]) for ex in self.examples]),
                   "input_ids": torch.tensor([t for ex in self.examples for t in ex["input_ids"]]),
                   "labels": torch.tensor([t for ex in self.examples for t in ex["labels"]])}
        with output(path, overwrite=True, kind="file", what="dense reference") as tmp:
            save_file(tensors, tmp, metadata={"format": "moekit-dense-reference/1"})
        return path

    @classmethod
    def load(cls, folder: str | Path) -> DenseReference:
        path = Path(folder) / cls.FILE
        try:
            t = load_file(path)
            ids, labels = t["input_ids"].split(t["lengths"].tolist()), t["labels"].split(t["lengths"].tolist())
            examples = [{"input_ids": i.tolist(), "labels": lb.tolist()} for i, lb in zip(ids, labels)]
            return cls(examples, t["logprobs"])
        except (OSError, SafetensorError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"cannot read the dense reference {path}: {e}") from None


def _batches(examples: list[dict], batch_size: int) -> Iterator[dict[str, Tensor]]:
    collate = TranslationCollator(pad_id=0)  # padding is masked out: its id does not matter
    return (collate(examples[i:i + batch_size]) for i in range(0, len(examples), batch_size))


def _evaluate_direction(model, tokenizer, lang: str, pairs: list[Pair], template: str, max_length: int,
                        max_new_tokens: int, batch_size: int, generate: bool) -> tuple[dict, list[str], dict]:
    """(metrics row, greedy translations, expert-usage counts) for one direction."""
    if not pairs:
        raise ConfigError(f"direction {lang!r} has no test pairs")
    row: dict = {"n": len(pairs), "loss": direction_loss(model, tokenizer, pairs, template, max_length, batch_size)}
    hyps = translate(model, tokenizer, pairs, template, max_new_tokens, batch_size) if generate else []
    if generate:
        row["bleu"], row["chrf"] = bleu_chrf(hyps, [p.tgt for p in pairs], lang)
    examples = encode_pairs(pairs, tokenizer, template, max_length)
    return row, hyps, usage_counts(model, _batches(examples, batch_size))


def evaluate_run(model: nn.Module, tokenizer, test_pairs: dict[str, list[Pair]], template: str,
                 dense_ref: DenseReference | None = None, max_length: int = 128, max_new_tokens: int = 64,
                 batch_size: int = 8, generate: bool = True) -> dict:
    """Every metric of a run: per direction n, loss (and BLEU, chrF with `generate`) and their
    unweighted mean over directions ("avg"); KL(dense ‖ model) if `dense_ref`; diversity of an MoE
    model now and as upcycled (SPRI A.1; None where not recorded); expert usage overall and per direction; total / active params; the translations."""
    if not test_pairs:
        raise ConfigError("no test directions to evaluate")
    tokenize = {lang: bleu_tokenizer(lang) for lang in test_pairs} if generate else {}  # fail before the work
    directions, translations, counts = {}, {}, {}
    for lang, pairs in test_pairs.items():
        directions[lang], hyps, counts[lang] = _evaluate_direction(
            model, tokenizer, lang, pairs, template, max_length, max_new_tokens, batch_size, generate)
        if generate:
            translations[lang] = hyps
    keys = [k for k in ("bleu", "chrf", "loss") if all(k in row for row in directions.values())]
    return {
        "directions": directions,
        "avg": {k: sum(row[k] for row in directions.values()) / len(directions) for k in keys},
        "kl": None if dense_ref is None else dense_ref.kl(model, batch_size),
        **model_fields(model, counts, tokenize),
        "translations": translations,
    }


def model_fields(model: nn.Module, counts: dict[str, dict[str, Tensor]], tokenize: dict[str, str]) -> dict:
    """The model-level fields of a run's results (evaluate_run's, and the speech-LLM evaluation's in moekit.eval.s2tt):
    inter-expert diversity of an MoE model now and as upcycled (SPRI A.1; None where not recorded), expert usage
    overall and per direction (`counts`: {direction: moekit.eval.usage.usage_counts}), total / active parameters,
    and the sacreBLEU tokenizer of each direction (`tokenize`)."""
    total, active = param_counts(model)
    return {"diversity_init": init_diversity(model), "diversity": diversity(model) if moe_layers(model) else None,
            "usage": fractions({p: sum(c[p] for c in counts.values()) for p in next(iter(counts.values()))}),
            "usage_by_direction": {d: fractions(c) for d, c in counts.items()},
            "params": {"total": total, "active": active}, "bleu_tokenize": tokenize}


def result_rows(results: dict) -> list[dict]:
    """One row per direction and an "avg" row (which also holds the run-level KL, diversity, params)."""
    rows = [{"direction": lang, **row} for lang, row in results["directions"].items()]
    n = sum(r["n"] for r in rows)
    rows += [{"direction": g, **avg} for g, avg in results.get("groups", {}).items()]  # instruction runs
    rows.append({"direction": "avg", "n": n, **results["avg"], "kl": results["kl"],
                 "diversity_init": results.get("diversity_init"), "diversity": results["diversity"], "total_params": results["params"]["total"],
                 "active_params": results["params"]["active"]})
    return [{c: r.get(c) for c in CSV_COLUMNS} for r in rows]


def write_results(results: dict, folder: str | Path) -> tuple[Path, Path]:
    """Write `folder`/results.json (everything) and `folder`/results.csv (`result_rows`; None → empty)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = folder / "results.json", folder / "results.csv"
    write_text_atomic(json_path, json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows(result_rows(results))
    write_text_atomic(csv_path, table.getvalue())
    return json_path, csv_path
