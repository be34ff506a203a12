"""The README's examples run as written (a user's first copy-paste must work); docs/api.md lists every public name."""

import importlib
import re
import types
from pathlib import Path

import torch

import ropekit

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a Markdown text."""
    blocks, rest = [], text
    while "```python\n" in rest:
        rest = rest.split("```python\n", 1)[1]
        code, rest = rest.split("```", 1)
        blocks.append(code)
    return blocks


def test_readme_api_example_runs():
    text = README.read_text(encoding="utf-8")
    api = text[text.index("## API"):]
    code = python_blocks(api)[0]
    namespace: dict = {}
    exec(compile(code, "README.md (API)", "exec"), namespace)  # noqa: S102 - our own documentation
    q_rot, k_rot = namespace["q_rot"], namespace["k_rot"]
    assert q_rot.shape == (300, 32, 128) and k_rot.shape == (300, 8, 128)
    assert torch.isfinite(q_rot).all() and not torch.equal(q_rot, namespace["packed_q"])


def test_readme_fused_example_runs_and_writes_the_slots():
    text = README.read_text(encoding="utf-8")
    code = python_blocks(text[text.index("## Fused"):])[0]
    namespace: dict = {}
    exec(compile(code, "README.md (Fused)", "exec"), namespace)  # noqa: S102 - our own documentation
    k_cache, lengths, k_new = namespace["k_cache"], namespace["lengths"], namespace["k_new"]
    for row, length in enumerate(lengths.tolist()):
        assert k_cache[row, :, length].abs().sum() > 0 and not k_cache[row, :, length + 1:].any()
        assert torch.allclose(k_cache[row, :, length].norm(dim=-1), k_new[row, :, 0].norm(dim=-1), rtol=1e-5)
    assert namespace["q_out"].shape == (1, 512, 32, 128)
def test_ci_runs_the_readme_test_command():
    text = README.read_text(encoding="utf-8")
    command = next(line for line in text.splitlines() if line.startswith("python3 -m venv") and "pytest" in line)
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert command in ci, "the README's test command is not a line of .ci/run"
    assert "ROPEKIT_REQUIRE_NATIVE=1" in command, "the tests must fail where the C++ kernel does not build"


def test_readme_multiaxis_example_runs():
    text = README.read_text(encoding="utf-8")
    code = python_blocks(text[text.index("## Multi-axis RoPE"):])[0]
    namespace: dict = {}
    exec(compile(code, "README.md (multi-axis)", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["q_rot"].shape == (2, 12, 257, 64)
    assert namespace["positions"][0, :, 0].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7]
    assert namespace["q"].shape == (1, 28, 11, 128) and namespace["k"].shape == (1, 4, 11, 128)


API = README.parent / "docs" / "api.md"
PUBLIC_MODULES = ("ropekit", "ropekit.scaling", "ropekit.multiaxis", "ropekit.nn", "ropekit.ops", "ropekit.distributed",
                  "ropekit.checkpoints", "ropekit.integrations.transformers")


def api_sections() -> dict[str, list[str]]:
    """docs/api.md's module sections (``## `module` ``): the names in the first column of each table."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in API.read_text(encoding="utf-8").splitlines():
        heading = re.fullmatch(r"## `([\w.]+)`", line)
        if heading:
            current = sections.setdefault(heading.group(1), [])
        elif line.startswith("## "):
            current = None
        elif current is not None and line.startswith("| `"):
            current.append(re.match(r"\| `(\w+)` \|", line).group(1))
    return sections


def test_api_page_lists_every_public_name_and_no_other():
    sections = api_sections()
    assert set(sections) == set(PUBLIC_MODULES)
    for module in PUBLIC_MODULES:
        listed, exported = sections[module], importlib.import_module(module).__all__
        assert len(listed) == len(set(listed)), f"{module}: a name is listed twice"
        assert set(listed) == set(exported), (f"{module}: missing from docs/api.md {set(exported) - set(listed)}, "
                                              f"stale there {set(listed) - set(exported)}")
    documented = set().union(*sections.values())
    assert documented == set().union(*(importlib.import_module(m).__all__ for m in PUBLIC_MODULES))


def test_every_public_name_exists_and_every_exported_submodule_is_a_public_one():
    for module in PUBLIC_MODULES:
        namespace = importlib.import_module(module)
        for name in namespace.__all__:
            assert getattr(namespace, name) is not None, f"{module}.{name}"
    submodules = {name for name in ropekit.__all__ if isinstance(getattr(ropekit, name), types.ModuleType)}
    assert {f"ropekit.{name}" for name in submodules} - {"ropekit.integrations"} <= set(PUBLIC_MODULES)


def test_the_vocabulary_names_one_form_the_same_everywhere():
    """Each form's public function, operator (and its in-place twin) and Backend method share one name."""
    from ropekit.ops import Backend

    text = API.read_text(encoding="utf-8")
    table = text[text.index("## Vocabulary"):text.index("## `ropekit`")]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "`" in line][1:]
    assert len(rows) == 8  # the header row dropped
    for _, function, operators, method in rows:
        method = method.strip(" |`")
        for op in re.findall(r"`(\w+)`", operators):
            assert hasattr(torch.ops.ropekit, op), op
            assert op.rstrip("_") == method
        assert callable(getattr(Backend, method))
        if function.startswith("`"):
            assert function.strip("`") == method and callable(getattr(ropekit, method))
