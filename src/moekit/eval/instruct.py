"""Instruction-tuning evaluation (SIMoE §4): ROUGE-L per task and seen/unseen task means."""
from __future__ import annotations

from moekit.data.parallel import Pair
from moekit.errors import ConfigError


def add_rouge(results: dict, test: dict[str, list[Pair]], unseen: list[str]) -> dict:
    """Instruction runs: ROUGE-L per task (SNI's metric) and the unweighted means of every metric over the
    trained tasks ("seen") and the held-out ones ("unseen") in results["groups"]."""
    for task, row in results["directions"].items():
        row["rougeL"] = rouge_l(results["translations"][task], [p.tgt for p in test[task]])
    results["avg"]["rougeL"] = sum(r["rougeL"] for r in results["directions"].values()) / len(test)
    groups = {"seen": [t for t in test if t not in unseen], "unseen": [t for t in test if t in unseen]}
    rows = results["directions"]
    results["groups"] = {g: {"n": sum(rows[t]["n"] for t in ts),
                             **{k: sum(rows[t][k] for t in ts) / len(ts) for k in results["avg"]}}
                         for g, ts in groups.items() if ts}
    return results


class _WhitespaceTokenizer:
    """Lowercased whitespace tokens: rouge-score's default keeps only [a-z0-9], erasing most scripts."""

    def tokenize(self, text: str) -> list[str]:
        return text.lower().split()


def rouge_l(hyps: list[str], refs: list[str]) -> float:
    """Mean sentence-level ROUGE-L F-measure (Lin 2004) x 100, as in SNI; empty text scores 0."""
    from rouge_score.rouge_scorer import RougeScorer

    if len(hyps) != len(refs) or not refs:
        raise ConfigError(f"need as many hypotheses as references, at least one (got {len(hyps)}, {len(refs)})")
    scorer = RougeScorer(["rougeL"], tokenizer=_WhitespaceTokenizer())
    return 100 * sum(scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)) / len(refs)
