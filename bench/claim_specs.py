"""The headline claims each benchmark judges (bench/evidence.py Claim), in one light module: the benchmarks compute
their verdicts from them, and bench/claims.py rebuilds every claims table of BENCHMARKS.md from them and the per-item
scores committed under bench/results/<bench>/ (or, for a table measured before those were committed, from its
printed per-seed columns). WEIGHTS: per bench, the per-item scores that weight a metric's items (corpus rates). BEST:
per bench, the metric and the systems among which "{best}" in a claim is the one of highest mean over its committed
runs (SPRI's "best upcycling baseline")."""
from __future__ import annotations

from evidence import Claim

RISE_MARGIN = ("margin: RISE §5.2 Obs. 2 and Table 4, every general-ability score shifts by less than 1 % after RISE "
               "training")

SIMOE = "SIMoE (common optimizer)"  # bench/simoe_mini.py's SIMoE at the baselines' optimizer and budget
S2TT = [("SPRI (two-stage) beats dense fine-tuning", "dense_ft"),
        ("SPRI (two-stage) beats the best upcycling baseline (highest mean sentence chrF)", "{best}"),
        ("two-stage training beats one-stage", "spri")]  # SPRI Table 2 in speech: (claim, B); A is spri_two_stage
SPECS: dict[str, list[Claim]] = {
    "spri_mini": [Claim("SPRI (two-stage) beats dense fine-tuning", "spri_two_stage", "dense_ft", "chrf", "sentence chrF", 1),
                  Claim("SPRI one-stage beats dense fine-tuning", "spri", "dense_ft", "chrf", "sentence chrF", 1),
                  Claim("SPRI (two-stage) beats naive upcycling", "spri_two_stage", "naive", "chrf", "sentence chrF", 1),
                  Claim("SPRI one-stage beats naive upcycling", "spri", "naive", "chrf", "sentence chrF", 1),
                  Claim("two-stage training beats one-stage", "spri_two_stage", "spri", "chrf", "sentence chrF", 1)],
    "rise_mini": [Claim("RISE adapts the target more than random experts", "rise", "random", "target", "loss sw", -1),
                  Claim("RISE adapts the target more than ESFT", "rise", "esft", "target", "loss sw", -1),
                  Claim("RISE keeps the other languages' loss within 1 % of the model before it (minimal cross-lingual "
                        "degradation)", "rise", "base", "others", "loss, other 7 languages", -1, 0.01, True, RISE_MARGIN)],
    "omni_ctc": [Claim("Omni-router beats Switch", "omni-{e}", "switch-{e}", "cer", "CER %", -1),
                 Claim("Omni-router beats dense", "omni-{e}", "dense", "cer", "CER %", -1)],
    "ume_whisper": [Claim("UME beats full fine-tuning (in-domain voices)", "ume", "fmft", "wer espeak-ng",
                          "WER % (espeak-ng)", -1),
                    Claim("UME forgets less than full fine-tuning (unseen voice family)", "ume", "fmft", "wer flite",
                          "WER % (flite)", -1)],
    "simoe_mini": [Claim("SIMoE beats full fine-tuning (unseen tasks)", SIMOE, "full FT", "unseen", "ROUGE-L unseen", 1),
                   Claim("SIMoE beats sparse upcycling (unseen tasks)", SIMOE, "sparse upcycling", "unseen",
                         "ROUGE-L unseen", 1),
                   Claim("the orthogonality penalty helps (Table 4, ablation (b))", SIMOE,
                         "SIMoE w/o ortho (b) (common optimizer)", "unseen", "ROUGE-L unseen", 1),
                   Claim("structured sparse masks help (Table 4, ablation (c))", SIMOE,
                         "SIMoE real masks (c) (common optimizer)", "unseen", "ROUGE-L unseen", 1)],
}
SPECS["spri_s2tt"] = [Claim(text, "spri_two_stage", b, key, f"sentence {name}, 4 directions", 1)
                      for text, b in S2TT for key, name in (("bleu", "BLEU"), ("chrf", "chrF"))]
BEST: dict[str, tuple[str, tuple[str, ...]]] = {"spri_s2tt": ("chrf", ("naive", "noise", "drop"))}
WEIGHTS: dict[str, dict[str, str]] = {
    "rise_mini": {"target": "target tokens", "others": "others tokens"},
    "omni_ctc": {"cer": "cer weight", "wer": "wer weight"},
    "ume_whisper": {"wer espeak-ng": "words espeak-ng", "wer flite": "words flite"},
}
NDIGITS = {"spri_mini": 2, "rise_mini": 3, "omni_ctc": 1, "ume_whisper": 1, "simoe_mini": 1, "spri_s2tt": 2}


def specs(bench: str, experts: int = 4, best: str = "{best}") -> list[Claim]:
    """A bench's claims with their system names filled in (omni_ctc: at `experts` experts; "{best}": `best`)."""
    return [Claim(**{**c.__dict__, "a": c.a.format(e=experts, best=best), "b": c.b.format(e=experts, best=best)})
            for c in SPECS[bench]]
