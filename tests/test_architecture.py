"""The package layout is the architecture: each layer imports only the layers below it, and no cycle.

Layers, bottom to top (docs/architecture.md): validation · rope · ops · functional · fused · distributed · config ·
checkpoints · nn · integrations · lab · cli. ``ropekit.files`` (atomic writes) is a leaf any tool
layer may use, ``ropekit._deprecation`` (the aliases of renamed names) a leaf every layer may use;
``ropekit/__init__.py``, ``ropekit/scaling.py``, ``ropekit/multiaxis.py`` and ``ropekit/__main__.py``
are the public entry points above everything. Every import counts, those inside functions too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "ropekit"
LAYERS = ["validation", "rope", "ops", "functional", "fused", "distributed", "config", "checkpoints", "nn",
          "integrations", "lab", "cli"]
LEAVES = {"files": "checkpoints", "_deprecation": "validation"}  # a leaf module and the lowest layer allowed to use it
ENTRY_POINTS = {"ropekit", "ropekit.scaling", "ropekit.multiaxis", "ropekit.__main__"}


def module_name(path: Path) -> str:
    parts = ("ropekit",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every ropekit module ``path`` imports (absolute names; submodules named in ``from x import y`` too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "ropekit"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "ropekit":
                continue
            submodules = {f"{module}.{alias.name}" for alias in node.names
                          if (PACKAGE.parent / f"{module}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE.parent / f"{module}.{alias.name}".replace(".", "/")).is_dir()}
            found |= submodules if len(submodules) == len(node.names) else submodules | {module}
    return found


def layer_of(module: str) -> int | None:
    """Index in LAYERS (leaves take their lowest user's layer); None for the public entry points."""
    if module in ENTRY_POINTS:
        return None
    top = module.split(".")[1]
    top = LEAVES.get(top, top)
    return LAYERS.index(top)


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_layer():
    unknown = [module_name(p) for p in SOURCES if module_name(p) not in ENTRY_POINTS
               and LEAVES.get(module_name(p).split(".")[1], module_name(p).split(".")[1]) not in LAYERS]
    assert unknown == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_go_down_the_layers(path):
    here = layer_of(module_name(path))
    if here is None:
        return
    upward = [m for m in imports_of(path) if m != "ropekit" and layer_of(m) is not None and layer_of(m) > here]
    upward += [m for m in imports_of(path) if m in ENTRY_POINTS and not module_name(path).startswith("ropekit.cli")]
    assert upward == [], f"{module_name(path)} ({LAYERS[here]}) imports a layer above it: {upward}"


def test_no_import_cycle_between_modules():
    graph = {module_name(p): {m for m in imports_of(p) if m in {module_name(q) for q in SOURCES}} for p in SOURCES}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if nxt == node or nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own submodules
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def private_imports(path: Path) -> list[str]:
    """``from module import _name`` statements of ``path`` (dunder names such as ``__version__`` are public)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found += [f"from {module} import {alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


#: The lab becomes its own distribution on ropekit's public API; its internal imports are its own business.
LIBRARY = [p for p in SOURCES if module_name(p).split(".")[:2] != ["ropekit", "lab"]]


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: module_name(p))
def test_no_module_imports_a_private_name_of_another(path):
    """A helper another module needs is public where it lives (shared argument checks in ``validation``)."""
    assert private_imports(path) == [], f"{module_name(path)} imports private names of other modules"


def test_the_private_import_check_sees_one(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from ..functional import _check_tables, apply_rotary\nfrom . import __version__\n")
    assert private_imports(sample) == ["from ..functional import _check_tables"]
