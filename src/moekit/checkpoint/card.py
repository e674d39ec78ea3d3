"""Provenance: the README.md model card every moekit output directory gets, in the Hugging Face Hub's conventions
(YAML header: `base_model` the Hub id(s) of the source(s), never a local path, omitted when there is none;
`library_name: transformers` for native formats, `moekit` for moekit's own; `pipeline_tag` from the architecture;
`tags: [moe, upcycling, METHOD]`), and a body with the method and its paper, the spec, seed, dtype, version, the
command, parameter counts and what was checked."""
from __future__ import annotations

import json
import os
import re
import shlex
import stat
import sys
from importlib import metadata
from pathlib import Path

from huggingface_hub import ModelCardData

from moekit.checkpoint.dense import architecture
from moekit.config import parse_yaml
from moekit.errors import ConfigError
from moekit.moe.diversity import init_diversity
from moekit.routing.sites import param_counts
from moekit.moe.state import spec_of


def moekit_version() -> str:
    try:
        return metadata.version("moekit")
    except metadata.PackageNotFoundError:
        return "unknown"


def command_line() -> str:
    """The command that is running, as a user would type it (`moekit ...` for the CLI), each absolute path in it
    shortened to its last component: a card never publishes where files lie on the machine that wrote it."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("moekit", "__main__.py"):
        argv[0] = "moekit"
    return shlex.join(ABSOLUTE.sub(lambda m: Path(m.group()).name or m.group(), a) for a in argv)


ABSOLUTE = re.compile(r"(?<![\w.:/~-])~?/[^\s,;\[\]\"'=]*")  # /a/b or ~/a/b, not org/name nor a URL's //host


def paper_of(method: str) -> str:
    """The first line of the init method's docstring (it names the paper and equations)."""
    from moekit.init import EXPERT_INITS

    if method not in EXPERT_INITS:
        return ""
    return " ".join((EXPERT_INITS.get(method).__doc__ or "").strip().split("\n\n")[0].split())


def pipeline_tag(architecture: str | None) -> str | None:
    """The Hub's pipeline tag of a model class: text generation for causal LMs, speech recognition for Whisper and
    CTC encoders; None where moekit cannot tell."""
    if architecture is None:
        return None
    if architecture.endswith("ForCausalLM"):
        return "text-generation"
    if architecture.endswith(("ForCTC", "ForSpeechSeq2Seq")) or architecture == "WhisperForConditionalGeneration":
        return "automatic-speech-recognition"
    return None


CARD_HEADER_BYTES = 64 << 10  # how much of a README.md is read for its YAML header (a card's is a few hundred bytes)


def card_data(folder: Path) -> ModelCardData | None:
    """The YAML header of the model card (README.md) in `folder`, within its first CARD_HEADER_BYTES (the rest of
    the file is never read; aliases bounded by moekit.config.parse_yaml), as huggingface_hub's ModelCardData; None
    without one."""
    try:
        fd = os.open(Path(folder) / "README.md", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            head = os.read(fd, CARD_HEADER_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        finally:
            os.close(fd)
        parts = head.decode("utf-8", errors="replace").split("---")
        header = parse_yaml(parts[1], "README.md") if parts[0] == "" and len(parts) > 2 else None
    except (OSError, ConfigError):
        return None
    if not isinstance(header, dict):
        return None
    return ModelCardData(ignore_metadata_errors=True, **{k: v for k, v in header.items() if isinstance(k, str)})


def card_base_model(folder: Path) -> str | list[str] | None:
    """`base_model` of the card in `folder` (README.md's YAML header), if any: what a model moekit wrote came from."""
    value = getattr(card_data(folder), "base_model", None)
    ok = isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))
    return value if ok else None


LICENSE_KEYS = ("license", "license_name", "license_link")


def licenses(folders: list[Path], names: list[str]) -> tuple[dict, dict]:
    """(card header fields, card facts) for the licenses the cards of the source models `folders` (published as
    `names`) declare: the fields (license, and license_name / license_link of a `license: other`) when every
    declared one agrees; else none, and a fact listing each source's, since the output is bound by all of them."""
    found = {}
    for folder, name in zip(folders, names):
        data = card_data(folder)
        fields = {k: data.get(k) for k in LICENSE_KEYS if data is not None and isinstance(data.get(k), str)}
        if not fields.get("license_link", "https://").startswith(("https://", "http://")):
            del fields["license_link"]  # a file of the source repository, not of the output
        if "license" in fields:
            found[name] = fields
    kinds = {tuple(f.items()) for f in found.values()}
    if len(kinds) <= 1:
        return (dict(kinds.pop()) if kinds else {}), {}
    listed = "; ".join(f"{n}: {', '.join(f.values())}" for n, f in found.items())
    return {}, {"licenses": f"the source models differ ({listed}); the model is bound by each"}


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")  # org/name[@revision]


def hub_id(name_or_path: str | Path | None) -> str | list[str] | None:
    """The Hugging Face Hub repository a model comes from, for the card's `base_model`: `org/name` for a Hub id (the
    revision dropped) or a snapshot folder of the Hugging Face cache; for a directory with a model card, that card's
    base_model (str or list: a moekit output, a converted built-in asset); None for any other local directory,
    whose path is never published. (moekit.assets.hub_id also knows the built-in asset names.)"""
    if name_or_path is None:
        return None
    name, path = str(name_or_path), Path(name_or_path)
    if not path.exists():
        return name.split("@")[0] if HUB_ID.match(name) else None
    snapshot = hub_snapshot(path)
    return snapshot[0] if snapshot else card_base_model(path)


def hub_snapshot(path: str | Path) -> tuple[str, str] | None:
    """(repository id, commit) of a snapshot folder of the Hugging Face cache (models--ORG--NAME/snapshots/COMMIT);
    None for any other path."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent.name.removeprefix("models--").replace("--", "/"), real.name
    return None


def public_names(folders: list[str | Path]) -> list[str]:
    """What an output publishes for the model folders it read (its card, spec and moekit_spec.json), never a path of
    this machine: `org/name@COMMIT` for a snapshot of the Hugging Face cache (the Hub id and the revision read, which
    moekit resolves again); for a local directory its name, with as many parent folders as tell apart different
    directories of one name."""
    snapshots = [hub_snapshot(f) for f in folders]
    parts = [Path(os.path.abspath(f)).parts[1:] for f in folders]  # without the root
    for depth in range(1, max(map(len, parts)) + 1):
        names = [f"{s[0]}@{s[1]}" if s else "/".join(p[-depth:]) for s, p in zip(snapshots, parts)]
        if len(set(names)) == len(set(parts)):
            break
    return names


def _base_models(base_model: str | list[str] | None) -> str | list[str] | None:
    """One Hub id as a string, several as a list (order kept, repeats dropped), none as None."""
    ids = [base_model] if isinstance(base_model, str) else list(dict.fromkeys(base_model or []))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def write_card(folder: Path, *, title: str, base_model: str | list[str] | None, method: str | None,
               spec: dict | None = None, fmt: str, dtype: str, params: tuple[int, int] | None = None,
               checked: list[str] = (), extra: dict | None = None, architecture: str | None = None,
               license: dict | None = None) -> Path:
    """Write `folder`/README.md, its header by huggingface_hub's ModelCardData. `base_model`: the Hub id(s) the
    model comes from (moekit.assets.hub_id), never a local path; `fmt` starting with "moekit" marks moekit's own
    format (library_name moekit), any other a transformers one; `license`: the sources' fields (`licenses`)."""
    tags = ["moe", *(["upcycling", method] if method else [])]
    header = ModelCardData(library_name="moekit" if fmt.startswith("moekit") else "transformers",
                           pipeline_tag=pipeline_tag(architecture), tags=tags, base_model=_base_models(base_model),
                           **(license or {}))
    lines = ["---", header.to_yaml(), "---", "", f"# {title}", ""]
    facts = {"format": fmt, "dtype": dtype, "moekit version": moekit_version(), "command": f"`{command_line()}`"}
    if method:
        facts = {"method": f"`{method}`: {paper_of(method)}", **facts}
    if spec is not None:
        facts["seed"] = spec.get("seed")
    if params is not None:
        facts["parameters"] = f"{params[0]:,} total, {params[1]:,} active per token"
    facts.update(extra or {})
    lines += [f"- **{k}**: {v}" for k, v in facts.items()]
    if spec is not None:
        lines += ["", "## MoE spec", "", "```json", json.dumps(spec, indent=2), "```"]
    if checked:
        lines += ["", "## Checked when written", "", *[f"- {c}" for c in checked]]
    path = folder / "README.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def diversity_fact(mean: float | None) -> dict[str, str]:
    if mean is None:
        return {}
    return {"expert diversity at init": f"{mean:.4f} (SPRI A.1: 1 − the mean pairwise cosine similarity of the "
                                        "routed experts' down-projections, averaged over MoE layers: 0 for identical "
                                        "copies, 1 for orthogonal experts, above 1 when pairs point partly opposite "
                                        "(a negative cosine))"}


def write_model_card(model, folder: Path, title: str | None = None, extra: dict | None = None,
                     base_model: str | list[str] | None = None) -> Path:
    """The card of an in-memory model being saved (moekit or SIMoE format, or a plain HF model): method and
    spec from the model, parameter counts, dtype; `base_model` (Hub ids) by default `hub_id` of where the model was
    loaded from."""
    spec = spec_of(model)
    if spec is not None:
        extra = {**diversity_fact(init_diversity(model)), **(extra or {})}
    simoe = getattr(getattr(model, "simoe", None), "cfg", None)
    fmt = "moekit (SIMoE)" if simoe is not None else "moekit" if spec is not None else "transformers"
    base = base_model or hub_id(getattr(model.config, "_name_or_path", None) or None)
    arch = architecture(model)
    return write_card(folder, title=title or f"{arch} ({fmt})", base_model=base, architecture=arch,
                      method=None if spec is None else spec.init.method,
                      spec=(spec.model_dump(mode="json") if spec is not None else
                            None if simoe is None else simoe.model_dump(mode="json")),
                      fmt=fmt, dtype=str(model.dtype).removeprefix("torch."), params=param_counts(model),
                      extra=extra)
