"""The layer contract: each module imports only from its own layer or the layers below it (at module level or
inside a function; imports for type hints only, under `if TYPE_CHECKING:`, do not count), and no two modules
import each other. Layers, lowest first, as phalanx/__init__.py says."""

import ast
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "phalanx"
# Each layer is a list of module name patterns (fnmatch, below "phalanx."); a module belongs to the first layer
# one of whose patterns it matches.
LAYERS = [
    ["core", "core.*"],
    ["algorithms", "algorithms.*"],
    ["training", "training.*"],
    ["transport", "transport.*"],
    ["runtime", "runtime.*"],
    ["runs.config", "runs.attack_axes", "runs.presets", "runs.*.config", "runs.*.presets"],  # configs and presets
    ["runs", "runs.*"],  # every kind's runs: simulate, launch, report; the launcher
    ["benchmarks", "benchmarks.*"],
    ["runs.kinds", "api", "cli"],  # what users call
]
TOP = ["runs.kinds", "api", "cli"]


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in ROOT.rglob("*.py")}


def _imports(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a phalanx module, anywhere in the importer's code."""
    edges = set()
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module
                targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets = {a.name for a in node.names}
            else:
                continue
            edges |= {(name, t) for t in targets if t in modules and t != name}
    return edges


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (imports for type hints only)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for c in child.orelse for n in _runtime_nodes_and_self(c))
            continue
        yield from _runtime_nodes_and_self(child)


def _runtime_nodes_and_self(node: ast.AST):
    yield node
    yield from _runtime_nodes(node)


def _layer(module: str) -> int | None:
    if module == "phalanx":
        return None  # the package itself: its version and docstring
    name = module.removeprefix("phalanx.")
    if name in TOP:
        return len(LAYERS) - 1
    return next((i for i, patterns in enumerate(LAYERS) if any(fnmatch(name, p) for p in patterns)), None)


def test_every_module_is_in_a_layer_and_imports_only_downward():
    modules = _modules()
    unplaced = sorted(m for m in modules if m != "phalanx" and _layer(m) is None)
    assert unplaced == [], "place these modules in a layer of tests/test_layers.py and phalanx/__init__.py"
    upward = sorted((a, b) for a, b in _imports(modules) if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))
    assert upward == []


def test_no_two_modules_import_each_other():
    edges = _imports(_modules())
    assert sorted((a, b) for a, b in edges if a < b and (b, a) in edges) == []


def test_the_contract_catches_an_upward_import(tmp_path):
    """The walk sees a lazy import inside a function: a runtime module that imports runs is reported."""
    fake = {"phalanx.runtime.x": tmp_path / "x.py", "phalanx.runs.y": tmp_path / "y.py"}
    fake["phalanx.runtime.x"].write_text("def f():\n    from ..runs import y\n")
    fake["phalanx.runs.y"].write_text("")
    assert ("phalanx.runtime.x", "phalanx.runs.y") in _imports(fake)
