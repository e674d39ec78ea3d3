"""Routing report (figures, report.md, metrics.json; atomic) and the `moekit routes collect|report` CLI."""
import json

import numpy as np
import pytest

from moekit.errors import ConfigError, OutputExistsError
from moekit.routing.report import routing_metrics, write_report
from moekit.routing.stats import activation_frequency, global_expert_sets, jaccard
from moekit.routing.trace import RoutingTrace, TraceError
from moekit.testing import TINY_HF_MOE, tiny_tokenizer

FIGURES = {"jaccard.png", "layerwise_similarity.png", "expert_usage.png", "cramers_v.png"}


def isolated_trace(L=8):
    """en and fr route token j to experts (j, j+1) mod 4; sw the same shifted to 4..7, except in the middle
    layers where it routes like en. Every used expert has activation frequency exactly 1/2."""
    n = 40
    pattern = np.stack([np.arange(n) % 4, (np.arange(n) + 1) % 4], -1)  # (n, 2)
    ids = np.tile(np.concatenate([pattern, pattern, pattern + 4]), (L, 1, 1)).astype(np.int16)  # (L, 3n, 2)
    ids[L // 2 - 1:L // 2 + 1, 2 * n:] -= 4
    token = np.arange(3 * n, dtype=np.int32) % 6
    return RoutingTrace([f"model.layers.{i}.mlp" for i in range(L)], np.full(L, 8), ["en", "fr", "sw"], ids,
                        np.tile(np.float32([0.6, 0.4]), (L, 3 * n, 1)), token, np.arange(3 * n, dtype=np.int32),
                        np.zeros(3 * n, np.int32), np.repeat(np.int16([0, 1, 2]), n))


def test_metrics_match_the_statistics():
    trace = isolated_trace()
    m = routing_metrics(trace, top_k_set=16, selection={trace.layers[0]: [4, 5, 6, 7]})
    assert m["reference"] == "en" and m["tokens_per_language"] == {"en": 40, "fr": 40, "sw": 40}
    expected = jaccard(global_expert_sets(activation_frequency(trace), 16))
    np.testing.assert_allclose(m["jaccard"], expected)
    # global top-16: en = fr = layers 0-3 x experts 0..3 (ties in (layer, expert) order); sw shares layer 3 only
    assert m["jaccard"][0][1] == 1 and m["jaccard"][0][2] == pytest.approx(4 / 28)
    assert m["layerwise_jaccard"]["sw"] == [0, 0, 0, 1, 1, 0, 0, 0]
    assert m["regions"] == ["shallow"] * 3 + ["middle"] * 2 + ["deep"] * 3
    assert m["region_jaccard"]["sw"] == {"shallow": 0, "middle": 1, "deep": 0}
    # sw's layer-0 assignments all go to 4..7: 1 of its 8 layers -> Ω = 1/8; en and fr never reach them
    assert m["selection"]["overlap_share"] == {"en": 0, "fr": 0, "sw": 0.125}
    assert m["selection"]["overlap_mass"]["sw"] == pytest.approx(0.125 * len(m["layers"]) * m["top_k"])
    json.dumps(m, allow_nan=False)  # plain JSON types only
    with pytest.raises(TraceError, match="not in trace"):
        routing_metrics(trace, reference="de")
    with pytest.raises(ConfigError, match="≥ 1"):
        routing_metrics(trace, top_k_set=0)


def test_write_report(tmp_path):
    trace = isolated_trace()
    out = write_report(trace, tmp_path / "rep", reference="fr", selection={trace.layers[1]: [0, 1]}, target="sw")
    names = {p.name for p in out.iterdir()}
    assert names == FIGURES | {"selection.png", "report.md", "metrics.json"}
    for name in FIGURES | {"selection.png"}:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = json.loads((out / "metrics.json").read_text())
    assert m["reference"] == "fr" and len(m["cramers_v"]) == 7 and len(m["usage_entropy"]) == 8
    md = (out / "report.md").read_text()
    for name in FIGURES | {"selection.png"}:
        assert f"]({name})" in md
    assert "| sw | 0.000 | 1.000 | 0.000 |" in md  # region means vs fr
    assert "routing overlap mass Ω" in md


def test_report_refuses_existing_output_and_leaves_nothing_on_error(tmp_path):
    trace = isolated_trace()
    out = tmp_path / "rep"
    write_report(trace, out)
    assert "selection.png" not in {p.name for p in out.iterdir()}
    with pytest.raises(OutputExistsError):
        write_report(trace, out)
    write_report(trace, out, overwrite=True, selection={})
    assert (out / "selection.png").is_file()
    with pytest.raises(ConfigError, match="not an MoE layer"):
        write_report(trace, tmp_path / "bad", selection={"nope": [1]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]  # no half-written or temp directory


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A tiny Qwen3-MoE saved with save_pretrained (safetensors) plus the character tokenizer, and texts."""
    root = tmp_path_factory.mktemp("routes")
    TINY_HF_MOE["qwen3_moe"]().save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    (root / "en.txt").write_text("the light of the world\n\nand the day was long\nin the beginning\n")
    (root / "sw.txt").write_text("mwanzo wa neno\nnuru ya ulimwengu\n")
    return root


def test_cli_collect_matches_library_capture(hf_moe, tmp_path, run):
    out = tmp_path / "trace.npz"
    rc, stdout, err = run("routes", "collect", "--model", hf_moe / "model", "--texts", f"en={hf_moe / 'en.txt'}",
                          f"sw={hf_moe / 'sw.txt'}", "--out", out, "--batch-size", 2, "--max-length", 12)
    assert rc == 0, err
    trace = RoutingTrace.load(out)
    assert trace.languages == ["en", "sw"] and trace.num_layers == 3 and trace.meta["max_length"] == 12
    assert f"{trace.num_tokens} tokens" in stdout

    from moekit.checkpoint.format import load_model
    from moekit.routing.capture import RoutingCapture

    tok, model = tiny_tokenizer(), load_model(hf_moe / "model")
    texts = {"en": ["the light of the world", "and the day was long", "in the beginning"],
             "sw": ["mwanzo wa neno", "nuru ya ulimwengu"]}
    with RoutingCapture(model) as cap:
        for lang, lines in texts.items():
            for i in range(0, len(lines), 2):
                enc = tok(lines[i:i + 2], return_tensors="pt", padding=True, truncation=True, max_length=12)
                cap.run(enc["input_ids"], enc["attention_mask"], language=lang)
    ref = cap.trace()
    assert trace.num_tokens == ref.num_tokens == sum(min(len(t), 12) for v in texts.values() for t in v)
    for key in ("ids", "weights", "token", "sample", "lang"):
        np.testing.assert_array_equal(getattr(trace, key), getattr(ref, key))
    rc, _, err = run("routes", "collect", "--model", hf_moe / "model", "--texts", f"en={hf_moe / 'en.txt'}",
                     "--out", out)
    assert rc == 2 and "exists" in err


def test_cli_report_with_selection(hf_moe, tmp_path, run):
    from moekit.selection.selection import Selection

    trace_path = tmp_path / "trace.npz"
    rc, _, err = run("routes", "collect", "--model", hf_moe / "model", "--texts", f"en={hf_moe / 'en.txt'}",
                     f"sw={hf_moe / 'sw.txt'}", "--out", trace_path, "--max-texts", 2)
    assert rc == 0, err
    layers = RoutingTrace.load(trace_path).layers
    sel = Selection(method="random", target="sw", budget=3, experts={layers[0]: [0, 1], layers[2]: [5]})
    sel.save(tmp_path / "sel.json")
    out = tmp_path / "report"
    rc, stdout, err = run("routes", "report", trace_path, "--out", out, "--reference", "sw",
                          "--selection", tmp_path / "sel.json")
    assert rc == 0, err
    assert {p.name for p in out.iterdir()} == FIGURES | {"selection.png", "report.md", "metrics.json"}
    m = json.loads((out / "metrics.json").read_text())
    assert m["reference"] == "sw" and m["selection"]["count"] == 3
    assert 0 <= m["selection"]["overlap_mass"]["en"] <= 1
    rc, _, err = run("routes", "report", trace_path, "--out", out)
    assert rc == 2 and "--overwrite" in err
    rc, _, err = run("routes", "report", trace_path, "--out", tmp_path / "r2", "--reference", "de")
    assert rc == 2 and "'de' not in trace" in err


def test_cli_input_errors(hf_moe, tmp_path, run):
    rc, _, err = run("routes", "collect", "--model", hf_moe / "model", "--texts", "en", "--out", tmp_path / "t.npz")
    assert rc == 2 and "LANG=FILE" in err
    (tmp_path / "empty.txt").write_text("\n\n")
    rc, _, err = run("routes", "collect", "--model", hf_moe / "model", "--texts", f"en={tmp_path / 'empty.txt'}",
                     "--out", tmp_path / "t.npz")
    assert rc == 2 and "has no texts" in err
    TINY_HF_MOE["mixtral"]().save_pretrained(tmp_path / "notok")
    rc, _, err = run("routes", "collect", "--model", tmp_path / "notok", "--texts", f"en={hf_moe / 'en.txt'}",
                     "--out", tmp_path / "t.npz")
    assert rc == 2 and "no tokenizer" in err and not (tmp_path / "t.npz").exists()
