"""What an upcycle publishes (issue 37 §6): its card, spec and moekit_spec.json name Hub ids with the revision read and
local directories by name, never a path of this machine; the card's header is huggingface_hub's (ModelCard parses
it), with the sources' license and base_model; the mergekit-moe command line takes options between its positionals."""
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard, constants

from moekit.testing.fake_hub import commit_of, fake_hub
from moekit.testing.standins import save_tiny_chat_llama

CARD = "---\nlicense: {}\nlanguage: en\n---\n\n# A tiny model\n"


def model(folder: Path, seed: int, license: str | None = None) -> Path:
    save_tiny_chat_llama(folder, seed)
    if license:
        (folder / "README.md").write_text(CARD.format(license))
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hub on 127.0.0.1 serving org/tiny and org/tiny-b (Apache-2.0) and org/tiny-mit (MIT), and an empty
    Hugging Face cache in $HF_HOME/hub that huggingface_hub fills itself when moekit resolves them (online)."""
    served = tmp_path / "served"
    repos = {"org/tiny": model(served / "a", 0, "apache-2.0"), "org/tiny-b": model(served / "b", 1, "apache-2.0"),
             "org/tiny-mit": model(served / "c", 2, "mit")}
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with fake_hub(repos) as endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # both read from HF_ENDPOINT at import
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        yield tmp_path / "hf_home" / "hub"


def upcycle(run, monkeypatch, *args):
    """`moekit upcycle ARGS` with sys.argv as the console script sees it (the card records the command)."""
    args = ["upcycle", *map(str, args)]
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/moekit", *args])
    rc, _, err = run(*args)
    assert rc == 0, err


def header(folder: Path):
    """The card's YAML header as huggingface_hub's ModelCard reads it."""
    return ModelCard.load(folder / "README.md").data


def mergekit(path: Path, base: str, *experts: str) -> Path:
    path.write_text(yaml.safe_dump({"base_model": base, "gate_mode": "random", "experts_per_token": 1,
                                    "experts": [{"source_model": e} for e in experts]}))
    return path


def test_outputs_name_no_path_of_this_machine(hub, tmp_path, run, monkeypatch):
    """Every file of every output, upcycles and an export (configs, card, moekit.json / moekit_spec.json, the
    safetensors' metadata), is free of the temporary directory, $HOME and $HF_HOME: a Hub source is published as org/name@COMMIT (the revision read),
    a local directory by its name (with a parent folder where two share one); the title names the repository."""
    home = os.environ.get("HOME", "")
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):  # two local directories both called "dense"
        model(tmp_path / "local" / name / "dense", ord(name))
    a, b = str(tmp_path / "local" / "a" / "dense"), str(tmp_path / "local" / "b" / "dense")
    upcycle(run, monkeypatch, "--model", "org/tiny", "--experts", 2, "--top-k", 1, "--format", "mixtral",
            "--out", tmp_path / "out" / "hub")
    upcycle(run, monkeypatch, mergekit(tmp_path / "hub.yml", "org/tiny", "org/tiny", "org/tiny-b"),
            tmp_path / "out" / "merged")
    upcycle(run, monkeypatch, mergekit(tmp_path / "local.yml", a, a, b), tmp_path / "out" / "local", "--format",
            "moekit")
    upcycle(run, monkeypatch, "--model", a, "--experts", 2, "--out", tmp_path / "out" / "dir")
    rc, _, err = run("export", tmp_path / "out" / "local", "--format", "mixtral", "--out", tmp_path / "out" / "export")
    assert rc == 0, err
    ref = hub / "models--org--tiny" / "refs" / "main"
    assert ref.read_text() == commit_of("org/tiny")  # the cache has huggingface_hub's layout: links into blobs
    snapshot = hub / "models--org--tiny" / "snapshots" / commit_of("org/tiny")
    assert os.readlink(snapshot / "model.safetensors").startswith("../../blobs/")

    leaks = [str(tmp_path), os.path.realpath(tmp_path), os.environ["HF_HOME"], *([home] if len(home) > 1 else [])]
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(files) > 20 and any(p.suffix == ".safetensors" for p in files)
    assert [(str(p), s) for p in files for s in leaks if s.encode() in p.read_bytes()] == []

    tiny, tiny_b = f"org/tiny@{commit_of('org/tiny')}", f"org/tiny-b@{commit_of('org/tiny-b')}"
    assert json.loads((tmp_path / "out" / "hub" / "moekit_spec.json").read_text())["source"] == tiny
    merged = json.loads((tmp_path / "out" / "merged" / "moekit_spec.json").read_text())
    assert (merged["source"], merged["spec"]["init"]["branches"]) == (tiny, [tiny, tiny_b])
    local = json.loads((tmp_path / "out" / "local" / "moekit.json").read_text())["spec"]
    assert local["init"]["branches"] == ["a/dense", "b/dense"]
    exported = json.loads((tmp_path / "out" / "export" / "moekit_spec.json").read_text())
    assert (exported["source"], exported["spec"]["init"]["branches"]) == ("local", ["a/dense", "b/dense"])
    text = (tmp_path / "out" / "hub" / "README.md").read_text()
    assert "\n# org/tiny upcycled to an MoE (2 experts, top-1, naive)\n" in text
    assert "- **command**: `moekit upcycle --model org/tiny --experts 2 --top-k 1 --format mixtral --out hub`" in text
    assert "\n# dense upcycled to an MoE (2 experts, top-2, naive)\n" in \
        (tmp_path / "out" / "dir" / "README.md").read_text()
    assert header(tmp_path / "out" / "dir").base_model is None  # a local directory without a card: no Hub id

    from moekit.checkpoint.format import load
    from moekit.moe.state import spec_of

    assert spec_of(load(tmp_path / "out" / "local")).init.branches == ["a/dense", "b/dense"]  # it validates


def test_card_carries_the_license_and_names_the_base_model(hub, tmp_path, run, monkeypatch):
    """huggingface_hub's ModelCard parses the written card: base_model the Hub id(s) (HF's model tree), the license
    the sources' cards agree on; where they differ, no license field and a line naming each source's."""
    upcycle(run, monkeypatch, "--model", "org/tiny", "--experts", 2, "--out", tmp_path / "one")
    upcycle(run, monkeypatch, mergekit(tmp_path / "hub.yml", "org/tiny", "org/tiny", "org/tiny-b"), tmp_path / "two")
    upcycle(run, monkeypatch, mergekit(tmp_path / "mix.yml", "org/tiny", "org/tiny", "org/tiny-mit"), tmp_path / "mix")
    one, two, mix = header(tmp_path / "one"), header(tmp_path / "two"), header(tmp_path / "mix")
    assert (one.base_model, one.license, one.library_name) == ("org/tiny", "apache-2.0", "moekit")
    assert (two.base_model, two.license, two.pipeline_tag) == (["org/tiny", "org/tiny-b"], "apache-2.0",
                                                               "text-generation")
    assert (mix.base_model, mix.license) == (["org/tiny", "org/tiny-mit"], None)
    assert (f"- **licenses**: the source models differ (org/tiny@{commit_of('org/tiny')}: apache-2.0; "
            f"org/tiny-mit@{commit_of('org/tiny-mit')}: mit); the model is bound by each") in \
        (tmp_path / "mix" / "README.md").read_text()
    assert (hub / "models--org--tiny" / "snapshots" / commit_of("org/tiny") / "README.md").is_symlink()


def test_licenses_of_an_other_license(tmp_path):
    """`license: other` comes with its license_name; a license_link to a file of the source repository is dropped
    (the output does not hold it), a URL kept."""
    from moekit.checkpoint.card import licenses

    for name, link in (("rel", "LICENSE"), ("url", "https://example.org/l")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "README.md").write_text(f"---\nlicense: other\nlicense_name: tiny\nlicense_link: {link}\n"
                                                   "---\n")
    assert licenses([tmp_path / "rel"], ["r"]) == ({"license": "other", "license_name": "tiny"}, {})
    assert licenses([tmp_path / "url"], ["u"]) == ({"license": "other", "license_name": "tiny",
                                                    "license_link": "https://example.org/l"}, {})
    assert licenses([tmp_path / "none"], ["n"]) == ({}, {})


@pytest.mark.parametrize("words", [
    ["same.yml", "--i-understand-this-is-not-useful-without-training", "OUT"],
    ["--i-understand-this-is-not-useful-without-training", "same.yml", "OUT"],
    ["same.yml", "OUT", "--i-understand-this-is-not-useful-without-training"],
    ["same.yml", "--random-seed", "3", "OUT", "--quiet"],
    ["--quiet", "same.yml", "--random-seed", "3", "OUT"],
])
def test_options_stand_anywhere_between_the_positionals(words):
    """mergekit-moe's click command line takes options between CONFIG and OUT; so does moekit upcycle."""
    from moekit.cli.main import parse

    args = parse(["upcycle", *words])
    assert (args.recipe, args.overrides) == ("same.yml", ["OUT"])
    assert "--random-seed" not in words or args.mergekit_random_seed == "3"


def test_mergekit_same_experts_with_the_flag_between_config_and_out(tmp_path, run, monkeypatch):
    """The command of the issue runs: every expert the base model, the flag between CONFIG and OUT."""
    dense = str(model(tmp_path / "dense", 0))
    monkeypatch.chdir(tmp_path)
    upcycle(run, monkeypatch, mergekit(tmp_path / "same.yml", dense, dense, dense),
            "--i-understand-this-is-not-useful-without-training", "OUT")
    assert json.loads((tmp_path / "OUT" / "moekit_spec.json").read_text())["spec"]["init"]["branches"] == \
        ["dense", "dense"]
