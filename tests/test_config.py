"""MoESpec validation, YAML loading and dotted overrides."""
from __future__ import annotations

import pydantic
import pytest

from moekit.config import apply_overrides, load_yaml, validate
from moekit.errors import ConfigError
from moekit.init import EXPERT_INITS
from moekit.moe import MoESpec

YAML = """\
num_experts: 8
top_k: 2
every: 2
router:
  scoring: softmax_topk
  init_std: 0.01
init:
  method: drop
  ratio: 0.5
seed: 3
"""


def _write(tmp_path, text=YAML):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_load_yaml(tmp_path):
    spec = load_yaml(_write(tmp_path), MoESpec)
    assert (spec.num_experts, spec.top_k, spec.every, spec.seed) == (8, 2, 2, 3)
    assert spec.router.scoring == "softmax_topk" and spec.router.init_std == 0.01
    assert spec.init.method == "drop" and spec.init.ratio == 0.5
    assert spec.scoring == "softmax_topk" and spec.router_init == "normal"


def test_load_yaml_with_dotted_overrides(tmp_path):
    spec = load_yaml(_write(tmp_path), MoESpec, ["init.ratio=0.25", "router.jitter=0.01", "num_experts=4",
                                                 "every=null", "layers=[0, 2]", "router.init=zeros",
                                                 "target=decoder"])
    assert spec.init.ratio == 0.25 and spec.router.jitter == 0.01 and spec.num_experts == 4
    assert spec.every is None and spec.layers == [0, 2] and spec.router.init == "zeros"
    assert spec.target == "decoder"
    assert spec.router.scoring == "softmax_topk"  # untouched siblings are kept
    # replacing the init method validates against the new method's fields
    spec = load_yaml(_write(tmp_path), MoESpec, ["init={method: noise, std: 0.02}"])
    assert spec.init.method == "noise" and spec.init.std == 0.02 and spec.init.ratio == 0.5


def test_apply_overrides_is_pure_and_creates_mappings():
    data = {"a": {"b": 1}, "c": [1, 2]}
    out = apply_overrides(data, ["a.b=2", "x.y.z=true", "c=[3]", "s='07'"])
    assert out == {"a": {"b": 2}, "c": [3], "x": {"y": {"z": True}}, "s": "07"}
    assert data == {"a": {"b": 1}, "c": [1, 2]}
    assert apply_overrides({}, []) == {}


@pytest.mark.parametrize("bad", ["novalue", "=3"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, [bad])


def test_override_through_a_scalar(tmp_path):
    with pytest.raises(ConfigError, match="not a mapping"):
        load_yaml(_write(tmp_path, "init: drop\n"), MoESpec, ["init.ratio=0.3"])


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "nope.yaml", MoESpec)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(_write(tmp_path, "a: [1, 2\n"), MoESpec)
    with pytest.raises(ConfigError, match="mapping"):
        load_yaml(_write(tmp_path, "- 1\n- 2\n"), MoESpec)
    assert load_yaml(_write(tmp_path, ""), MoESpec) == MoESpec()  # empty file: all defaults


@pytest.mark.parametrize("data,where", [
    ({"num_expert": 8}, "num_expert"),
    ({"router": {"scoring": "topk_softmax", "temperature": 2}}, "router.temperature"),
    ({"init": {"method": "drop", "ratio": 0.5, "rate": 0.1}}, "rate"),
])
def test_extra_keys_rejected(data, where):
    with pytest.raises(ConfigError, match="Extra inputs are not permitted") as info:
        validate(MoESpec, data)
    assert where in str(info.value)


def test_extra_key_in_yaml_names_the_file(tmp_path):
    path = _write(tmp_path, YAML + "num_expert: 4\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(path, MoESpec)
    assert str(path) in str(info.value) and "num_expert" in str(info.value)


def test_top_k_above_num_experts_rejected():
    with pytest.raises(ConfigError, match=r"top_k \(9\) cannot exceed num_experts \(8\)"):
        validate(MoESpec, {"num_experts": 8, "top_k": 9})
    assert validate(MoESpec, {"num_experts": 8, "top_k": 8}).top_k == 8


def test_every_and_layers_rejected():
    with pytest.raises(ConfigError, match="either every or layers"):
        validate(MoESpec, {"every": 2, "layers": [1]})


@pytest.mark.parametrize("data", [{"num_experts": 0}, {"top_k": 0}, {"every": 0}, {"layers": [-1]},
                                  {"router": {"jitter": 1.0}}, {"router": {"init_std": 0}},
                                  {"router": {"scoring": "sigmoid"}}, {"router_sharing": "some"},
                                  {"init": {"ratio": 0.5}}, {"init": 3}, {"init": {"method": "drop", "ratio": 2}}])
def test_invalid_values_rejected(data):
    with pytest.raises(ConfigError, match="invalid config"):
        validate(MoESpec, data)


def test_unknown_init_method_lists_the_methods():
    with pytest.raises(ConfigError) as info:
        validate(MoESpec, {"init": "sparse_magic"})
    msg = str(info.value)
    assert "sparse_magic" in msg
    assert f"choose one of: {', '.join(EXPERT_INITS.names())}" in msg
    with pytest.raises(ConfigError, match="choose one of"):
        EXPERT_INITS.get("sparse_magic")


def test_defaults_come_from_the_init_method():
    assert validate(MoESpec, {}).init.method == "naive"
    sc = validate(MoESpec, {"init": "scaled_copy"})
    assert sc.scoring == "softmax_topk" and sc.router_init == "zeros"
    ume = validate(MoESpec, {"init": "ume"})
    assert ume.scoring == "topk_softmax" and ume.router_init == "normal"
    explicit = validate(MoESpec, {"init": "naive", "router": {"scoring": "softmax_topk", "init": "zeros"}})
    assert explicit.scoring == "softmax_topk" and explicit.router_init == "zeros"


@pytest.mark.parametrize("init", [m for m in EXPERT_INITS.names() if not EXPERT_INITS.get(m).needs_branches]
                         + [{"method": "btx", "branches": ["a", "b", "c"]},
                            {"method": "sources", "branches": ["a", "b", "c", "d"], "scaling": [{"noise_scale": 0.1}] * 4},
                            {"method": "spri", "rho": 0.1, "placement": "gate"}])
def test_spec_json_roundtrip(init):
    shared = isinstance(init, dict) and init["method"] == "spri" or init == "spri"
    spec = validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": init, "shared_expert": shared,
                              "layers": [0, 3], "target": "model"})
    dumped = spec.model_dump(mode="json")
    again = validate(MoESpec, dumped)
    assert again == spec and again.model_dump(mode="json") == dumped
    assert type(again.init) is type(spec.init)


def test_spec_is_frozen():
    spec = validate(MoESpec, {})
    with pytest.raises(pydantic.ValidationError):
        spec.num_experts = 3
