"""UME's "MoE = dense at init" on a real checkpoint: max |Δlogits| between SmolLM2-135M and its UME upcycle
(every block, several E/top-k) on two verses, and whether greedy generations are identical. In exact
arithmetic the gap is 0 (UME eq. 1); in float32 the experts' batched matmuls sum in another order than the
dense Linear, so it is rounding amplified over the layers.

    .venv/bin/python bench/ume_gap.py
"""
from __future__ import annotations

import copy

import torch

from moekit.assets import resolve_model
from moekit.config import validate
from moekit.checkpoint.dense import load_dense, load_tokenizer
from moekit.moe.spec import MoESpec
from moekit.checkpoint.upcycle_model import upcycle

TEXTS = ["In the beginning God created the heaven and the earth.",
         "And the earth was without form, and void; and darkness was upon the face of the deep."]


def main(name: str = "smollm2-135m") -> None:
    path = resolve_model(name)
    dense, tok = load_dense(path).eval(), load_tokenizer(path)
    tok.padding_side = "left"
    x = tok(TEXTS, return_tensors="pt", padding=True)
    mask = x["attention_mask"].bool()
    with torch.no_grad():
        ref, greedy = dense(**x).logits, dense.generate(**x, max_new_tokens=20, do_sample=False)
        for E, k in ((8, 2), (4, 1), (16, 4)):
            spec = validate(MoESpec, {"num_experts": E, "top_k": k, "init": "ume", "every": 1})
            moe = upcycle(copy.deepcopy(dense), spec).eval()
            gap = float((moe(**x).logits - ref)[mask].abs().max())
            same = torch.equal(moe.generate(**x, max_new_tokens=20, do_sample=False), greedy)
            print(f"{name} E={E} top-{k}: max |Δlogits| {gap:.2e}, greedy outputs identical: {same}")


if __name__ == "__main__":
    main()
