"""`moekit select`, run in-process on a saved synthetic trace."""
import numpy as np
import pytest

from moekit.routing.trace import RoutingTrace
from moekit.selection import Selection


@pytest.fixture
def trace_file(tmp_path):
    """8 layers of 4 experts: sw tokens route to (0, 1), en tokens to (1, 2) (see test_select.isolated_trace)."""
    ids = np.array([[(1, 2), (1, 2), (0, 1), (0, 1)]] * 8, dtype=np.int16)  # (L, N, k)
    trace = RoutingTrace([f"model.layers.{i}.mlp" for i in range(8)], np.full(8, 4), ["en", "sw"], ids,
                         np.full(ids.shape, 0.5, np.float32), np.zeros(4, np.int32), np.arange(4, dtype=np.int32),
                         np.zeros(4, np.int32), np.array([0, 0, 1, 1], np.int16))
    return trace.save(tmp_path / "trace.npz")


def test_rise_writes_the_selection_and_prints_a_table(run, trace_file, tmp_path):
    out = tmp_path / "sel" / "rise.json"
    rc, stdout, err = run("select", "rise", trace_file, "--target", "sw", "--budget", 8, "--out", out)
    assert rc == 0, err
    sel = Selection.load(out)
    assert sel.method == "rise" and sel.target == "sw" and sel.count == 8
    assert sel.experts["model.layers.0.mlp"] == [0] and sel.experts["model.layers.3.mlp"] == [1]
    assert "model.layers.5.mlp  deep     2/4  0 1" in stdout
    assert f"rise: 8 experts for sw -> {out}" in stdout


def test_existing_output_needs_overwrite(run, trace_file, tmp_path):
    out = tmp_path / "sel.json"
    args = ("select", "topk", trace_file, "--target", "sw", "--budget", 2, "--out", out)
    assert run(*args)[0] == 0
    out.write_text("keep me")
    rc, _, err = run(*args)
    assert rc == 2 and "--overwrite" in err and out.read_text() == "keep me"
    assert run(*args, "--overwrite")[0] == 0
    assert Selection.load(out).count == 2


def test_settings_reach_the_method(run, trace_file, tmp_path):
    out = tmp_path / "rise.json"
    rc, _, err = run("select", "rise", trace_file, "--target", "sw", "--budget", 8, "--out", out,
                     "--alpha", 2, "--ratios", "0.5,0.25,0.25", "--regions", "0.25,0.5,0.25")
    assert rc == 0, err
    params = Selection.load(out).params
    assert params["alpha"] == 2 and params["ratios"] == [0.5, 0.25, 0.25]
    assert params["region_budgets"] == {"shallow": 4, "middle": 2, "deep": 2}
    assert params["layer_regions"] == ["shallow"] * 2 + ["middle"] * 4 + ["deep"] * 2


def test_esft_chooses_its_own_number_of_experts(run, trace_file, tmp_path):
    out = tmp_path / "esft.json"
    rc, stdout, err = run("select", "esft", trace_file, "--target", "sw", "--score", "gate", "--top-p", 0.5,
                          "--out", out)
    assert rc == 0, err
    sel = Selection.load(out)
    assert sel.count == sel.budget == 8  # per layer, expert 0 alone reaches 0.5 of the gate mass
    assert "(top_p 0.5)" in stdout


def test_random_is_reproducible_from_the_command_line(run, trace_file, tmp_path):
    outs = [tmp_path / f"r{i}.json" for i in range(2)]
    for out in outs:
        assert run("select", "random", trace_file, "--target", "sw", "--budget", 5, "--seed", 3, "--out", out)[0] == 0
    assert Selection.load(outs[0]) == Selection.load(outs[1])


@pytest.mark.parametrize("args, message", [
    (("rise", "--target", "sw"), "the following arguments are required: --budget"),
    (("rise", "--target", "xx", "--budget", 4), "'xx' is not in the trace"),
    (("topk", "--target", "sw", "--budget", 33), "between 1 and the 32 experts"),
    (("topk", "--target", "sw", "--budget", 4, "--alpha", 1),
     "moekit select topk: unrecognized arguments: --alpha 1 (see `moekit select topk --help`)"),
    (("esft", "--target", "sw", "--budget", 4, "--top-p", 0.3), "not both"),
    (("rise", "--target", "sw", "--budget", 4, "--ratios", "0.5,0.5,0.5"), "summing to 1"),
])
def test_errors_are_one_message_and_exit_code_2(run, trace_file, tmp_path, args, message):
    method, *rest = args
    out = tmp_path / "x.json"
    rc, _, err = run("select", method, trace_file, *rest, "--out", out)
    assert rc == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_not_a_trace_and_bad_ratios_syntax(run, tmp_path):
    bogus = tmp_path / "bogus.npz"
    bogus.write_text("no")
    rc, _, err = run("select", "topk", bogus, "--target", "sw", "--budget", 1, "--out", tmp_path / "s.json")
    assert rc == 2 and "not a moekit routing trace" in err
    rc, _, err = run("select", "rise", bogus, "--target", "sw", "--budget", 1, "--ratios", "0.5,0.5",
                     "--out", tmp_path / "s.json")
    assert rc == 2 and "three comma-separated numbers" in err
