"""Routing capture: the recorded ids are the ids the experts actually received, padding excluded."""
import numpy as np
import pytest
import torch

from moekit.errors import UnsupportedModelError
from moekit.moe.spec import MoESpec
from moekit.routing.capture import RoutingCapture
from moekit.routing.sites import find_sites
from moekit.routing.trace import RoutingTrace, TraceError
from moekit.testing import TINY_HF_MOE, tiny_llama
from moekit.checkpoint.upcycle_model import upcycle


def moekit_model(sharing="none"):
    return upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=1, init={"method": "noise"},
                                         router_sharing=sharing)).eval()


MODELS = {**TINY_HF_MOE, "moekit": moekit_model, "moekit_omni": lambda: moekit_model("all")}


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(MODELS))
def test_recorded_ids_are_the_ids_the_experts_used(family):
    model = MODELS[family]()
    sites = find_sites(model)
    used = {}
    handles = [s.experts.register_forward_hook(lambda m, args, out, n=s.name: used.__setitem__(n, args[1].clone()))
               for s in sites]
    ids, mask = batch()
    with RoutingCapture(model) as cap:
        cap.run(ids, mask, language="en")
    for h in handles:
        h.remove()
    trace = cap.trace()
    keep = mask.reshape(-1).bool()
    assert trace.num_tokens == int(mask.sum()) == 3 * 9 - 3 - 6
    assert trace.layers == [s.name for s in sites]
    for li, s in enumerate(sites):
        np.testing.assert_array_equal(trace.ids[li], used[s.name][keep].numpy())
    np.testing.assert_array_equal(trace.token, ids[mask.bool()].numpy())
    np.testing.assert_array_equal(trace.sample, np.repeat([0, 1, 2], [9, 6, 3]))
    # hooks are gone after the context: a second forward records nothing
    model(input_ids=ids, attention_mask=mask)
    assert cap._decisions == {}


def test_moekit_weights_match_routing_info():
    model = moekit_model()
    ids, mask = batch()
    with RoutingCapture(model) as cap:
        cap.run(ids, mask, language="en")
    info = find_sites(model)[0].block.last_routing
    keep = mask.reshape(-1).bool()
    np.testing.assert_array_equal(cap.trace().weights[0], info.topk_weights[keep].float().numpy())


def test_save_load_merge_roundtrip(tmp_path):
    model = TINY_HF_MOE["mixtral"]()
    traces = []
    for lang, seed in (("en", 0), ("sw", 1)):
        with RoutingCapture(model) as cap:
            cap.run(*batch(seed), language=lang)
        traces.append(cap.trace(model="tiny"))
    merged = RoutingTrace.merge(traces)
    path = merged.save(tmp_path / "t.npz")
    back = RoutingTrace.load(path)
    assert back.languages == ["en", "sw"] and back.meta == {"model": "tiny"}
    for key in ("ids", "weights", "token", "sample", "position", "lang", "num_experts"):
        np.testing.assert_array_equal(getattr(back, key), getattr(merged, key))
    assert back.num_tokens == 2 * traces[0].num_tokens
    assert len(np.unique(back.sample)) == 6  # sample ids offset on merge
    assert back.language_mask("sw").sum() == traces[1].num_tokens
    other = RoutingCapture(TINY_HF_MOE["olmoe"](num_hidden_layers=2))
    with other:
        other.run(*batch(), language="en")
    with pytest.raises(TraceError, match="different models"):
        RoutingTrace.merge([traces[0], other.trace()])
    same_layers = RoutingTrace(**{**vars(traces[1]), "meta": {"config_sha256": "0" * 64}})  # another config
    with pytest.raises(TraceError, match=r"different models \(layers, experts, top-k or config differ\)"):
        RoutingTrace.merge([traces[0], same_layers])


def test_errors(tmp_path):
    with pytest.raises(UnsupportedModelError, match="Mixtral"):
        find_sites(tiny_llama())
    with pytest.raises(UnsupportedModelError, match="matches"):
        find_sites(moekit_model(), layers="nothing")
    (tmp_path / "bad.npz").write_bytes(b"not a trace")
    with pytest.raises(TraceError, match="not a moekit routing trace"):
        RoutingTrace.load(tmp_path / "bad.npz")
    with pytest.raises(TraceError, match="nothing recorded"):
        RoutingCapture(moekit_model()).trace()


def test_speech_encoder_frames_without_token_ids():
    """A CTC encoder routes frames, not tokens: record(None, frame_mask) files them with token id -1."""
    from moekit.speech.ctc import CTCConfig, CTCEncoderForASR

    torch.manual_seed(0)
    cfg = CTCConfig(input_dim=12, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                    vocab_size=6, dropout=0.0)
    model = upcycle(CTCEncoderForASR(cfg), MoESpec(num_experts=4, top_k=1, init={"method": "scratch"})).eval()
    feats, mask = torch.randn(2, 5, 12), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    with RoutingCapture(model) as cap:
        model(input_features=feats, attention_mask=mask)
        cap.record(None, mask, language="sw")
    trace = cap.trace()
    assert trace.num_tokens == 7 and set(trace.token.tolist()) == {-1}
    info = find_sites(model)[1].block.last_routing
    np.testing.assert_array_equal(trace.ids[1], info.topk_ids[mask.reshape(-1).bool()].numpy())
    with pytest.raises(TraceError, match="needs input_ids or an attention_mask"):
        with RoutingCapture(model) as cap:
            model(input_features=feats)
            cap.record(None, None, language="sw")


def test_llama4_router_scores_are_read_and_rerouted():
    """Llama 4's router returns (scores (T, E), logits); its decision is the top-k of the scores."""
    import transformers as tf

    from moekit.routing.permutation import permutation_test

    cfg = tf.Llama4TextConfig(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100,
                              num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=1)
    torch.manual_seed(0)
    model = tf.Llama4ForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 7))
    seen = []
    router = model.model.layers[0].feed_forward.router
    hook = router.register_forward_hook(lambda m, args, out: seen.append(out[1].detach()))
    with RoutingCapture(model) as cap:
        cap.run(ids, torch.ones_like(ids), language="en")
    hook.remove()
    trace = cap.trace()
    assert trace.num_layers == 2 and trace.top_k == 2 and trace.num_tokens == 14
    top = seen[0].topk(2, dim=-1)  # the router's own top-k; weights are sigmoid of the kept logits
    assert np.array_equal(np.sort(trace.ids[0], -1), top.indices.sort(-1).values.numpy())
    np.testing.assert_allclose(np.sort(trace.weights[0], -1), torch.sigmoid(top.values).sort(-1).values.numpy(),
                               rtol=1e-6)
    result = permutation_test(model, [{"input_ids": ids, "labels": ids}], [1.0])
    assert result.losses[1.0] != result.base  # rerouting changed the experts used
