"""The layer benchmarks' own code paths on tiny shapes, so an API change cannot silently break them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_moe_layer_bench_implementations_agree():
    import moe_layer

    rows = moe_layer.run_shape("tiny", 4, 2, 16, 32, 96, repeats=2, decode_repeats=2)  # checks equality first
    assert [(r[1], r[2]) for r in rows] == [(96, "fwd+bwd"), (96, "fwd"), (1, "fwd"), (8, "fwd"), (64, "fwd")]
    for _, _, _, limit, times, router, _, graphs in rows:
        assert limit > 0 and set(times) == set(moe_layer.IMPLS) and 0 < router < 1 and graphs == {}  # CPU: no graphs
    # the GPU table, from these rows: every line has the header's cells; a capture that failed is said in its cell
    # a baseline timed at some rows only (Liger dropped where it disagrees) gets "—" in the others
    rows = [r[:4] + ({**r[4], "liger": 1e-3} if r[1] == 1 else r[4],) + r[5:7]
            + ({"moekit": 2e-5, "hf_grouped_mm": "capture fails: boom"} if r[1] == 8 else r[7],) for r in rows]
    table = moe_layer.render(rows, 96, 2, 2, "cmd", "0 → 0", torch.device("cpu"), torch.float32, moe_layer.MARK_CUDA,
                             {"flops": 1e12, "bandwidth": 1e12})
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in lines}) == 1 and len(lines) == 2 + len(rows) and "Liger" in lines[0]
    row8 = next(ln for ln in lines if ln.startswith("| tiny | 8 "))
    assert "capture fails: boom" in row8 and "(0.02 ms)" in row8 and row8.count(" — ") == 2
    assert "(1 ms)" in next(ln for ln in lines if ln.startswith("| tiny | 1 "))


def test_liger_baseline_computes_what_moekit_does():
    """The GPU table's Liger column (bench/moe_layer.LigerExperts around Liger-Kernel's fused MoE), run here under
    Triton's interpreter in float32: output and every gradient equal moekit's (check_equal, 1e-4), and a wrong
    down projection is caught."""
    pytest.importorskip("liger_kernel")
    import moe_layer

    from moekit.moe import triton_experts

    if not triton_experts.available(torch.device("cpu")):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    E, k, H, I = 4, 2, 32, 64
    x, ids, w, gate_up, down, grad = moe_layer.make_inputs(E, k, H, I, 9)
    mods = {n: moe_layer.build(n, E, k, H, I, gate_up, down) for n in ("moekit", "liger")}
    moe_layer.check_equal(mods, ["moekit", "liger"], x, ids, w, grad)
    with torch.no_grad():
        mods["liger"].down[1] *= 1.01
    with pytest.raises(AssertionError):
        moe_layer.check_equal(mods, ["moekit", "liger"], x, ids, w, grad)


@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_simoe_layer_bench_times_every_mode(shape):
    import simoe_layer

    t = simoe_layer.forward_times(*shape, (2, 8), repeats=2)
    assert set(t) == {"plain", "simoe_train", "simoe_sampled", "simoe_eval"}
    assert all(median > 0 and noise >= 0 for median, noise in t.values())


def test_routing_capture_bench_times_plain_and_captured():
    import routing_capture

    model = routing_capture.MODELS["moekit (Llama upcycled) E=8 top-2"]()
    ids, mask = routing_capture.batch(2, 16, routing_capture.DIMS["vocab_size"])
    (plain, n_plain), (captured, n_captured) = routing_capture.measure(model, ids, mask, repeats=2)
    assert plain > 0 and captured > 0 and n_plain >= 0 and n_captured >= 0


def test_device_speed_bench_upcycles_and_collects_on_each_device(tmp_path, monkeypatch):
    """bench/device_speed.py on a tiny model with the CPU as both devices: the same checkpoint and trace, so its
    checks pass and say so exactly; the table has a row per step."""
    import device_speed

    runs = device_speed.run_all(tmp_path, device_speed.TINY, ["cpu", "cpu"], 1, 4, 32)
    assert {step for step, _ in runs} == {"upcycle", "routes collect"}
    (line,) = device_speed.checks(tmp_path, ["cpu", "cpu"])
    assert "max |Δ| / max |w| 0.0e+00" in line and "same top-k ids 100.00 %" in line
    table = device_speed.render(runs, ["cpu", "cpu"], "cmd", "tiny", 1, [line])
    assert table.count("\n| upcycle | ") == 1 and table.count("\n| routes collect | ") == 1
    import upcycle_scale

    monkeypatch.setattr(upcycle_scale, "TIME", tmp_path / "no-such-time")  # a machine without GNU time: no RSS
    bare = device_speed.timed([sys.executable, "-c", "pass"])
    assert bare["rss"] is None and bare["wall"] > 0
    runs = {key: [{**r[0], "rss": None}] for key, r in runs.items()}
    row = next(ln for ln in device_speed.render(runs, ["cpu"], "cmd", "tiny", 1, []).splitlines()
               if ln.startswith("| upcycle |"))
    assert row.endswith("| 1.00× | — |")


def test_model_throughput_profiles_a_generation_per_system(tmp_path):
    """bench/model_throughput.py --profile: one torch.profiler table of a batch-1 generation per system."""
    import model_throughput as mt

    model = mt.moekit_model(2, None, None)
    syss = mt.systems(model, None, None, ("grouped_mm",))
    mt.profile_generation(syss, torch.randint(0, model.config.vocab_size, (1, 8)), "tiny", tmp_path)
    text = (tmp_path / "generate_profile.txt").read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("###")] == [
        "### tiny, moekit: generate b=1, 8 new tokens", "### tiny, mixtral grouped_mm: generate b=1, 8 new tokens"]
    assert text.count("aten::") >= 10


def test_model_throughput_trains_with_each_sides_router_losses():
    """The "train step + router losses" task: moekit adds MoETrainer's losses (and logs them, per layer), the native
    class its own load_balancing_loss_func; each step changes the shared weights."""
    from collections import defaultdict
    from types import SimpleNamespace

    import model_throughput as mt

    model = mt.moekit_model(2, None, None)
    syss = mt.systems(model, None, None, ("grouped_mm",))
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged = []

    class Logs(defaultdict):
        def clear(self):
            logged.append(sorted(self))
            super().clear()

    trainer = SimpleNamespace(aux=mt.AuxConfig(), aux_logs=Logs(list))
    router = next(p for n, p in model.named_parameters() if "router" in n)
    for name, (m, impl) in syss.items():
        before = router.detach().clone()
        mt.train_step(mt.select(m, impl), opt, ids, trainer)
        assert not torch.equal(before, router), name
    assert logged == [sorted(["moe/lb", "moe/z", *(f"moe/model.layers.{i}.mlp/{k}" for i in (0, 1)
                                                   for k in ("lb", "z", "usage_entropy", "max_load"))])]


@pytest.mark.parametrize("fmt,out", [("fp8", "/work/big_layer"), ("int4", "/work/big_layer_int4")])
def test_big_layer_section_is_rebuilt_from_its_committed_results(fmt, out):
    """BENCHMARKS.md's "A decoder layer bigger than memory" sections (FP8; INT4) are what bench/big_layer.py writes
    from the results.json committed under bench/results/big_layer (every number in them comes from that file)."""
    import json

    import big_layer

    root = Path(__file__).resolve().parents[1]
    results = json.loads((root / big_layer.FORMATS[fmt][1]).read_text())
    text = big_layer.section(results, Path(out), fmt)
    assert text in (root / "BENCHMARKS.md").read_text()
