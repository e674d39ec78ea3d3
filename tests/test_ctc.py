"""The CTC encoder ASR model (moekit.speech.ctc): CTC closed forms, padding invariance, surgery, save/load."""
from __future__ import annotations

import math

import pytest
import torch

import moekit.checkpoint.format as mio
from moekit.checkpoint.dense import load_dense
from moekit.config import validate
from moekit.moe import MoESpec, moe_layers
from moekit.speech.ctc import CTCConfig, CTCEncoderForASR, ctc_loss
from moekit.checkpoint.upcycle_model import upcycle


def tiny_ctc(seed: int = 0, **kw) -> CTCEncoderForASR:
    torch.manual_seed(seed)
    cfg = CTCConfig(**{**dict(input_dim=12, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                              intermediate_size=32, vocab_size=6, dropout=0.0), **kw})
    return CTCEncoderForASR(cfg).eval()


def feats(B=2, T=10, D=12, seed=0):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def test_ctc_loss_closed_form_two_frames():
    """Label [c] over 2 frames: p = p1(c)p2(c) + p1(c)p2(∅) + p1(∅)p2(c); reduction divides by target length 1."""
    logp = torch.randn(1, 2, 4).log_softmax(-1)
    p = logp.exp()[0]
    c, blank = 2, 0
    expected = -math.log(p[0, c] * p[1, c] + p[0, c] * p[1, blank] + p[0, blank] * p[1, c])
    got = ctc_loss(logp, torch.tensor([2]), torch.tensor([[c, -100, -100]]), blank)
    assert abs(float(got) - expected) < 1e-5


def test_ctc_loss_divides_by_target_length_and_averages_utterances():
    logp = torch.randn(2, 6, 5).log_softmax(-1)
    labels = torch.tensor([[1, 2, -100], [3, 3, 4]])
    per = [float(ctc_loss(logp[i:i + 1], torch.tensor([6]), labels[i:i + 1, :n], 0)) * n
           for i, n in ((0, 2), (1, 3))]
    assert abs(float(ctc_loss(logp, torch.tensor([6, 6]), labels, 0)) - (per[0] / 2 + per[1] / 3) / 2) < 1e-5


def test_padding_does_not_change_valid_frames():
    model = tiny_ctc()
    x = feats(1, 7)
    alone = model(x).logits
    padded = torch.cat([x, torch.randn(1, 5, 12)], dim=1)
    mask = torch.tensor([[1] * 7 + [0] * 5])
    torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, :7], alone, rtol=1e-5, atol=1e-5)


def test_loss_backward_and_a_few_steps_learn():
    model = tiny_ctc(dropout=0.0).train()
    x, mask = feats(4, 10), torch.ones(4, 10, dtype=torch.long)
    labels = torch.tensor([[1, 2, 3], [2, 2, -100], [4, 5, 1], [5, -100, -100]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss = model(x, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]  # it memorizes the four utterances


def spec(**kw) -> MoESpec:
    return validate(MoESpec, {"num_experts": 4, "top_k": 2, **kw})


def test_surgery_finds_every_mlp_and_ume_equals_dense():
    model = tiny_ctc()
    x, mask = feats(), torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    dense = model(x, attention_mask=mask).logits
    moe = upcycle(model, spec(init="ume"))
    assert [p for p, _ in moe_layers(moe)] == [f"layers.{i}.mlp" for i in range(3)]
    torch.testing.assert_close(moe(x, attention_mask=mask).logits, dense, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sharing", ["none", "all"])
def test_moe_ctc_save_load_bit_identical(tmp_path, sharing):
    model = upcycle(tiny_ctc(), spec(top_k=1, init="scratch", router_sharing=sharing))
    x = feats()
    before = model(x).logits
    loaded = mio.load(mio.save(model, tmp_path / "m"))
    assert isinstance(loaded, CTCEncoderForASR) and type(loaded).__name__ == "CTCEncoderForASR"
    assert len({id(m.router) for _, m in moe_layers(loaded)}) == (1 if sharing == "all" else 3)
    assert torch.equal(loaded(x).logits, before)


def test_dense_ctc_loads_with_load_dense(tmp_path):
    model = tiny_ctc()
    model.save_pretrained(tmp_path / "d")
    loaded = load_dense(tmp_path / "d")
    assert isinstance(loaded, CTCEncoderForASR) and type(loaded).__name__ == "CTCEncoderForASR"
    assert torch.equal(loaded(feats()).logits, model(feats()).logits)
