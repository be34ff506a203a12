"""The package layout is the architecture: each layer imports only the layers below it, and no cycle.

Layers, bottom to top (docs/architecture.md): validation · rope · ops · functional · fused · distributed · config ·
checkpoints · nn · integrations · cli. ``ropekit.files`` (atomic writes) is a leaf any tool
layer may use, ``ropekit._deprecation`` (the aliases of renamed names) a leaf every layer may use;
``ropekit/__init__.py``, ``ropekit/scaling.py``, ``ropekit/multiaxis.py``, ``ropekit/mla.py`` and
``ropekit/__main__.py`` are the public entry points above everything. Every import counts, those inside functions too.

The lab is its own distribution (``lab/``, the package ``ropekit_lab``): nothing in ropekit imports
it, and it imports only ropekit's public names: from a module whose path has no component starting
with ``_`` and which declares ``__all__``, a name listed there (or a public submodule).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "ropekit"
LAB = ROOT / "lab" / "src" / "ropekit_lab"
LAYERS = ["validation", "rope", "ops", "functional", "fused", "distributed", "config", "checkpoints", "nn",
          "integrations", "cli"]
LEAVES = {"files": "checkpoints", "_deprecation": "validation"}  # a leaf module and the lowest layer allowed to use it
ENTRY_POINTS = {"ropekit", "ropekit.scaling", "ropekit.multiaxis", "ropekit.mla", "ropekit.__main__"}


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


LAB_SOURCES = sorted(LAB.rglob("*.py"))


def lab_module_name(path: Path) -> str:
    parts = ("ropekit_lab",) + path.relative_to(LAB).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", SOURCES + LAB_SOURCES,
                         ids=lambda p: module_name(p) if PACKAGE in p.parents else lab_module_name(p))
def test_no_module_imports_a_private_name_of_another(path):
    """A helper another module needs is public where it lives (shared argument checks in ``validation``)."""
    assert private_imports(path) == [], f"{path.name} imports private names of other modules"


# -- the lab: its own distribution, on ropekit's public API ------------------------------------------


def lab_imports(path: Path) -> list[str]:
    """Every import of ``ropekit_lab`` in ``path``: import statements and ``import_module("ropekit_lab...")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "ropekit_lab"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "ropekit_lab":
            found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            value = node.args[0].value
            if name in ("import_module", "__import__", "find_spec") and isinstance(value, str) and \
                    value.split(".")[0] == "ropekit_lab":
                found.append(f"{name}({value!r})")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_the_library_does_not_import_the_lab(path):
    assert lab_imports(path) == [], f"{module_name(path)} imports the lab"


def test_the_lab_import_check_sees_one(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import ropekit_lab.report\nfrom ropekit_lab import bench\nimport importlib\n"
                      "importlib.import_module('ropekit_lab.probe')\nfrom .lab import x\nimport ropekit\n")
    assert lab_imports(sample) == ["import ropekit_lab.report", "from ropekit_lab import bench",
                                   "import_module('ropekit_lab.probe')"]


def module_source(module: str, root: Path = PACKAGE.parent) -> Path | None:
    """The file of a ropekit module (``ropekit.nn`` -> ``src/ropekit/nn/__init__.py``), ``None`` if there is none."""
    base = root / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def declared_all(module: str, root: Path = PACKAGE.parent) -> set[str] | None:
    """The names of a module's ``__all__`` (a literal list or tuple), ``None`` if it declares none or is no module."""
    path = module_source(module, root)
    if path is None:
        return None
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and \
                isinstance(node.value, (ast.List, ast.Tuple)):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return None


def public_module(module: str, root: Path = PACKAGE.parent) -> bool:
    """No component starts with ``_`` and the module declares ``__all__``."""
    return not any(part.startswith("_") for part in module.split(".")) and declared_all(module, root) is not None


def private_ropekit_imports(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """The imports of ropekit names in ``path`` that are not public (the rule in the module docstring)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "ropekit"
                      and a.name != "ropekit" and not public_module(a.name, root)]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "ropekit":
            names = declared_all(node.module, root) if public_module(node.module, root) else set()
            private = [a.name for a in node.names
                       if a.name not in (names or set()) and not public_module(f"{node.module}.{a.name}", root)]
            if private:
                found.append(f"from {node.module} import {', '.join(private)}")
    return found


@pytest.mark.parametrize("path", LAB_SOURCES, ids=lab_module_name)
def test_the_lab_imports_only_public_names_of_ropekit(path):
    assert private_ropekit_imports(path) == [], f"{lab_module_name(path)} imports private names of ropekit"


def test_the_public_name_check_sees_each_kind_of_private_import(tmp_path):
    root = tmp_path / "src"
    (root / "ropekit" / "rope").mkdir(parents=True)
    (root / "ropekit" / "nn").mkdir()
    (root / "ropekit" / "__init__.py").write_text("__all__ = ['cos_sin', 'scaling']\n_EXPORTS = {}\n")
    (root / "ropekit" / "scaling.py").write_text("__all__ = ('YaRN',)\n")
    (root / "ropekit" / "nn" / "__init__.py").write_text("__all__ = ['RotaryEmbedding']\n")
    (root / "ropekit" / "rope" / "__init__.py").write_text("")
    (root / "ropekit" / "rope" / "frequencies.py").write_text("def cos_sin(): pass\n")
    (root / "ropekit" / "rope" / "_private.py").write_text("__all__ = ['helper']\n")
    sample = tmp_path / "sample.py"
    sample.write_text("import ropekit\nimport ropekit.scaling\nimport ropekit.rope.frequencies\n"
                      "from ropekit import cos_sin, nn, _EXPORTS\nfrom ropekit.scaling import YaRN, NTK\n"
                      "from ropekit.nn import RotaryEmbedding\nfrom ropekit.rope.frequencies import cos_sin\n"
                      "from ropekit.rope._private import helper\nfrom .figures import png_bytes\n")
    assert private_ropekit_imports(sample, root) == [
        "import ropekit.rope.frequencies", "from ropekit import _EXPORTS", "from ropekit.scaling import NTK",
        "from ropekit.rope.frequencies import cos_sin", "from ropekit.rope._private import helper"]


def test_the_private_import_check_sees_one(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from ..functional import _check_tables, apply_rotary\nfrom . import __version__\n")
    assert private_imports(sample) == ["from ..functional import _check_tables"]
