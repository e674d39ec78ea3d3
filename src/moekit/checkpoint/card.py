"""Provenance: the README.md model card every moekit output directory gets (Hugging Face Hub's YAML header:
base_model, library_name, tags; a body with the method and its paper, the spec, seed, dtype, version, the
command, parameter counts and what was checked)."""
from __future__ import annotations

import json
import shlex
import sys
from importlib import metadata
from pathlib import Path

import yaml


def moekit_version() -> str:
    try:
        return metadata.version("moekit")
    except metadata.PackageNotFoundError:
        return "unknown"


def command_line() -> str:
    """The command that is running, as a user would type it (`moekit ...` for the CLI)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("moekit", "__main__.py"):
        argv[0] = "moekit"
    return shlex.join(argv)


def paper_of(method: str) -> str:
    """The first line of the init method's docstring (it names the paper and equations)."""
    from moekit.init import EXPERT_INITS

    if method not in EXPERT_INITS:
        return ""
    return " ".join((EXPERT_INITS.get(method).__doc__ or "").strip().split("\n\n")[0].split())


def write_card(folder: Path, *, title: str, base_model: str | None, method: str | None, spec: dict | None = None,
               fmt: str, dtype: str, params: tuple[int, int] | None = None, checked: list[str] = (),
               extra: dict | None = None) -> Path:
    """Write `folder`/README.md."""
    tags = ["moe", *(["upcycling", method] if method else [])]
    header = {"library_name": "moekit", "tags": tags, **({"base_model": base_model} if base_model else {})}
    lines = ["---", yaml.safe_dump(header, sort_keys=False).strip(), "---", "", f"# {title}", ""]
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
    return {"expert diversity at init": f"{mean:.4f} (SPRI A.1: 1 − mean pairwise cosine of the routed "
                                        "down-projections, averaged over MoE layers)"}


def write_model_card(model, folder: Path, title: str | None = None, extra: dict | None = None) -> Path:
    """The card of an in-memory model being saved (moekit or SIMoE format, or a plain HF model): method and
    spec from the model, parameter counts, dtype."""
    from moekit.eval.upcycling import init_diversity, param_counts
    from moekit.io import architecture
    from moekit.state import spec_of

    spec = spec_of(model)
    if spec is not None:
        extra = {**diversity_fact(init_diversity(model)), **(extra or {})}
    simoe = getattr(getattr(model, "simoe", None), "cfg", None)
    fmt = "moekit (SIMoE)" if simoe is not None else "moekit" if spec is not None else "transformers"
    base = getattr(model.config, "_name_or_path", None) or None
    return write_card(folder, title=title or f"{architecture(model)} ({fmt})", base_model=base,
                      method=None if spec is None else spec.init.method,
                      spec=(spec.model_dump(mode="json") if spec is not None else
                            None if simoe is None else simoe.model_dump(mode="json")),
                      fmt=fmt, dtype=str(model.dtype).removeprefix("torch."), params=param_counts(model),
                      extra=extra)
