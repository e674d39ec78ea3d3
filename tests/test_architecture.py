"""The package's layering, checked on the import graph built from the code's own imports (every `import` and
`from ... import` of a moekit module anywhere in a file: module level, inside functions, under TYPE_CHECKING).

Layers, lowest first (docs/architecture.md); a module may import its own layer and the ones below, never one
above, and the graph has no circle. cli/ is the only importer of rich; nothing below the entry points imports
cli/.
"""
from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "moekit"

LAYERS = [  # (name, module prefixes): a prefix names a module or a package and everything in it
    ("foundation", ["moekit.errors", "moekit._fs", "moekit.registry", "moekit.config", "moekit.progress",
                    "moekit._version"]),
    ("model", ["moekit.moe", "moekit.init", "moekit.surgery", "moekit.routing.sites"]),
    ("checkpoint", ["moekit.checkpoint"]),
    ("sources and analysis", ["moekit.assets", "moekit.data", "moekit.speech", "moekit.routing", "moekit.eval"]),
    ("methods' state", ["moekit.selection", "moekit.simoe"]),
    ("training methods", ["moekit.methods"]),
    ("training", ["moekit.training"]),
    ("public modules", ["moekit.routes"]),  # moekit.routes: the routing commands as functions (routing + selection)
    ("entry points", ["moekit.cli", "moekit.__main__", "moekit._auto", "moekit.testing"]),
]
ROOT = "moekit"  # the package's __init__: the public API, imported lazily by name, above everything


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(module: str, path: Path) -> set[str]:
    """The moekit modules `module` imports (the longest existing prefix of each name)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            names.update(subs)
            if not subs <= MODULES.keys():  # `from package import module` imports that module, not the package's
                names.add(base)                 # other names (the package runs first either way, as for every import)
    out = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module and name.startswith("moekit"):
            out.add(name)
    return out


GRAPH = {m: imported(m, p) for m, p in MODULES.items()}


def layer_of(module: str) -> int:
    if module == ROOT:
        return len(LAYERS)
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]  # the longest prefix decides (moekit.routing.sites is below moekit.routing)


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_climbs_to_a_higher_layer():
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
                    for m, deps in GRAPH.items() for d in deps if d != ROOT and layer_of(d) > layer_of(m))
    assert not upward, "imports from a lower layer up to a higher one:\n" + "\n".join(upward)


def test_no_import_circles():
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_only_the_command_line_imports_rich_and_nothing_imports_it():
    rich, cli = [], []
    for module, path in MODULES.items():
        if module.startswith("moekit.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            rich += [module for n in names if n == "rich" or n.startswith("rich.")]
        if layer_of(module) < len(LAYERS) - 1:  # below the entry points (`python -m moekit` runs the CLI)
            cli += [module for d in GRAPH[module] if d.startswith("moekit.cli")]
    assert not rich, f"rich imported outside moekit.cli: {sorted(set(rich))}"
    assert not cli, f"moekit.cli imported by library modules: {sorted(set(cli))}"


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The checks are not vacuous: a made-up graph with a circle and a climb is caught."""
    global GRAPH
    saved = GRAPH
    try:
        GRAPH = {**saved, "moekit.errors": saved["moekit.errors"] | {"moekit.training.run"}}
        for test in (test_no_import_climbs_to_a_higher_layer, test_no_import_circles):
            try:
                test()
            except AssertionError:
                continue
            raise AssertionError(f"{test.__name__} missed the made-up import")
    finally:
        GRAPH = saved


# --- the API the documentation shows (docs/reference: mkdocstrings' `::: path` entries) ---

DOCS = SRC.parent / "docs"
ENTRY = re.compile(r"^::: ([\w.]+)\n((?:    .*\n)*)", re.M)  # the identifier and its indented options


def documented() -> list[tuple[str, list[str]]]:
    """(identifier, members listed under its options, if any) of every `::: identifier` of the site's pages."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for ident, options in ENTRY.findall(page.read_text()):
            members = re.search(r"members: \[([^\]]*)\]", options)
            found.append((ident, [m.strip() for m in members[1].split(",")] if members else []))
    return found


def resolve(path: str):
    """The object a dotted path names: the longest importable module prefix, then attributes; AssertionError where a
    part is missing."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            assert hasattr(obj, name), f"{path}: {'.'.join(parts[:cut])} has no {name}"
            obj = getattr(obj, name)
        return obj
    raise AssertionError(f"{path}: no module of it imports")


def test_every_name_the_docs_show_imports_from_its_path():
    entries = documented()
    assert len(entries) > 20
    for ident, members in entries:
        obj = resolve(ident)
        for member in members:
            assert hasattr(obj, member), f"docs show {ident}.{member}, which {ident} lacks"
        public = [m for m in members if not m.startswith("_")]
        assert public == members, f"docs show private names of {ident}: {sorted(set(members) - set(public))}"


def test_every_public_name_of_moekit_is_in_the_reference():
    import moekit

    shown = {id(resolve(ident)) for ident, _ in documented()}
    shown |= {id(getattr(resolve(ident), m)) for ident, members in documented() for m in members}
    shown |= {id(getattr(module, n)) for ident, members in documented() if not members
              and isinstance(module := resolve(ident), types.ModuleType) for n in dir(module) if not n.startswith("_")}
    missing = [name for name in moekit.__all__ if name != "__version__" and id(getattr(moekit, name)) not in shown]
    assert not missing, f"moekit.{missing} are in moekit.__all__ but in no `:::` entry of docs/reference"


def test_the_docs_check_sees_a_wrong_path():
    """The check is not vacuous: a path that does not import, and a member a module lacks, are caught."""
    for bad in ("moekit.nowhere.upcycle", "moekit.moe.NoSuchLayer"):
        try:
            resolve(bad)
        except AssertionError:
            continue
        raise AssertionError(f"{bad} resolved")
