"""The two distributions of the repository: ``ropekit`` (the library) and ``ropekit-lab`` (``lab/``) fit together.

The lab is released with the library it runs on (same version, pinned), registers exactly the verbs
the command line knows as the lab's, and the library's own requirements hold nothing the lab brings.
"""

import re
from pathlib import Path

from lab_source import lab_entry_points, lab_version
from ropekit.cli import entry

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
LAB = (ROOT / "lab" / "pyproject.toml").read_text(encoding="utf-8")


def dependencies(text: str) -> list[str]:
    """The ``dependencies`` list of a pyproject.toml's ``[project]`` table (without comments)."""
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", block))


def test_the_lab_is_released_with_the_library_it_runs_on():
    version = lab_version(LIBRARY)
    assert lab_version(LAB) == version
    assert f"ropekit=={version}" in dependencies(LAB)
    assert re.search(r'^name = "ropekit-lab"$', LAB, re.M)


def test_the_lab_registers_the_verbs_the_command_line_knows_as_its_own():
    points = lab_entry_points(LAB)
    assert list(points) == list(entry.LAB_VERBS)
    assert points == {verb: f"ropekit_lab.verbs.{verb}" for verb in entry.LAB_VERBS}
    assert not set(points) & set(entry.VERBS)  # a library verb is never the lab's


def test_the_library_needs_only_torch_ninja_and_numpy_and_the_lab_brings_the_rest():
    # numpy: torch warns on every import without it
    assert [re.split(r"[<>=;\s]", d)[0] for d in dependencies(LIBRARY)] == ["torch", "ninja", "numpy"]
    lab = {re.split(r"[<>=;\s]", d)[0] for d in dependencies(LAB)}
    assert {"ropekit", "matplotlib", "transformers", "safetensors", "gguf", "accelerate"} <= lab
    assert re.search(r'^where = \["src"\]$', LIBRARY, re.M)  # the library's wheel: src/ only, never lab/
    assert not (ROOT / "src" / "ropekit" / "lab").exists()
