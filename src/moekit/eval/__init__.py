"""Evaluation: BLEU/chrF, ROUGE-L, WER/CER, KL to the dense model, expert usage, plots."""
