"""Every ```python block of the README and docs/*.md runs as written; docs/api.md lists every public name.

How the blocks run (tests/docs_harness.py does it):

- **One fresh interpreter per page**, one thread (``torch.set_num_threads(1)``); the blocks of a page
  run **in order, in one shared namespace**, so a block may use what an earlier block of the same
  page defined (a model loaded above, ``ids`` tokenized above), never what another page defined.
  Each block is one test, ``page:line`` (the line of its opening fence); a block's traceback
  names the page's own line numbers.
- **Hub names stay in the text.** ``from_pretrained("Qwen/Qwen3-0.6B")`` and the other names of
  ``docs_harness.HUB_STAND_INS`` load a tiny random model of the same family (no downloads);
  ``path/to/llama`` and ``path/to/llama-interleaved`` are tiny local folders the harness writes.
- **Process groups.** The pages of :data:`RANKS` run on that many gloo processes on the CPU, every
  block on every rank, and a block passes when it passes on each rank.
- **Illustrations.** A block that cannot run (pseudo-code, a GPU, a cluster) is marked on the line
  before its fence with ``<!-- illustration: why it cannot run -->``; the reason is required.
- A deprecated ropekit name or transformers' ``torch_dtype=`` fails the block.

Every ```python fence is counted apart from the collector, so a block it would miss (an indented
fence, ```py) fails the suite instead of going unrun.
"""

import ast
import functools
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

import ropekit
from docs_harness import ILLUSTRATION
from docs_harness import python_blocks as page_blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
#: pages whose blocks need a process group, and its size
RANKS = {"docs/guide.md": 2, "docs/distributed.md": 2}
HARNESS = Path(__file__).resolve().parent / "docs_harness.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
BLOCKS = [block for page in PAGES for block in page_blocks(page)]


@functools.cache
def page_results(page: str) -> list[dict] | str:
    """Each rank's ``{fence line: traceback or None}`` for ``page``, run by the harness in fresh processes; or,
    when a rank did not finish, what went wrong (kept, so that the page's other blocks do not run it again)."""
    world = RANKS.get(page, 1)
    with tempfile.TemporaryDirectory() as tmp:
        procs, workdirs = [], [Path(tmp) / f"rank{rank}" for rank in range(world)]  # each rank its own folder
        for rank, workdir in enumerate(workdirs):
            workdir.mkdir()
            with open(workdir.parent / f"rank{rank}.log", "w") as log:  # a file: no pipe fills up and blocks a rank
                procs.append(subprocess.Popen([sys.executable, str(HARNESS), page, str(workdir / "out.json"),
                                               str(rank), str(world)], cwd=workdir, env=ENV, stdout=log,
                                              stderr=subprocess.STDOUT))
        try:
            for proc in procs:
                proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pass  # reported below with the rank's log
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = []
        for rank, (proc, workdir) in enumerate(zip(procs, workdirs, strict=True)):
            out, log = workdir / "out.json", (workdir.parent / f"rank{rank}.log").read_text()
            if proc.returncode != 0 or not out.exists():
                how = "was killed after 300 s" if proc.returncode == -9 else f"exited with {proc.returncode}"
                return f"{page}: rank {rank} of {world} {how}:\n{log}"
            results.append({int(line): problem for line, problem in json.loads(out.read_text()).items()})
    return results


def placeholders(code: str) -> list[int]:
    """Offsets (from the block's first line, 1-based) of each ``...`` that stands for a value: every
    Ellipsis but an index (``x[..., :half]``). A syntax error is left to the run, which reports it."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    indexes = {id(node) for sub in ast.walk(tree) if isinstance(sub, ast.Subscript) for node in ast.walk(sub.slice)}
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value is Ellipsis and id(node) not in indexes)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_the_block_runs_as_written(block):
    if block.illustration is not None:
        assert block.illustration, f"{block.id} is marked as an illustration without saying why it cannot run"
        return
    assert "torch_dtype" not in block.code, f"{block.id}: transformers deprecated torch_dtype=; write dtype="
    assert not placeholders(block.code), f"{block.id}: `...` stands for a value at line(s) {placeholders(block.code)}"
    ranks = page_results(block.page)
    assert not isinstance(ranks, str), ranks
    for rank, results in enumerate(ranks):
        assert block.line in results, f"{block.id} did not run on rank {rank}"
        assert results[block.line] is None, f"{block.id} fails on rank {rank} of {len(ranks)}:\n{results[block.line]}"


#: a python fence as a reader's renderer sees one: any indent or quote, ``` or ~~~, python / py / pycon ...
FENCE = re.compile(r"^[ \t>]*(`{3,}|~{3,})[ \t]*(python3?|py|pycon|ipython)\b", re.M | re.I)


def misplaced_markers(text: str) -> list[int]:
    """Lines of ``text`` holding an illustration marker that is not alone on the line before a ```python fence."""
    lines = text.splitlines()
    return [number for number, line in enumerate(lines, 1) if ILLUSTRATION.search(line)
            and not (ILLUSTRATION.fullmatch(line.strip()) and number < len(lines)
                     and lines[number].startswith("```python"))]


def test_the_collector_finds_every_python_fence():
    """Fences counted by a pattern of their own: the collector must have them all."""
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        assert len(FENCE.findall(text)) == len(page_blocks(page)), f"{page}: a python block the test does not run"


def test_every_illustration_marker_precedes_a_python_block():
    for page in PAGES:
        assert not misplaced_markers((ROOT / page).read_text(encoding="utf-8")), \
            f"{page}: an illustration marker belongs alone on the line before a ```python fence"


SAMPLE = """Text.

```python
x = 1
```

<!-- illustration: needs a CUDA GPU -->
```python
y = x.cuda()
```

<!-- illustration -->
```python
pseudo code
```

```bash
echo "```python is not a fence here"
```

   ```python
   z = 3
   ```
"""


def test_the_checks_catch_what_they_are_for():
    """On a sample page: the reason of a marker is read, a marker without one is seen, an indented fence is missed
    by the collector and counted by the independent pattern."""
    blocks = page_blocks("sample.md", SAMPLE)
    assert [(b.line, b.code, b.illustration) for b in blocks] == [
        (3, "x = 1\n", None), (8, "y = x.cuda()\n", "needs a CUDA GPU"), (13, "pseudo code\n", "")]
    assert len(FENCE.findall(SAMPLE)) == len(blocks) + 1  # the indented block: the suite would fail
    assert misplaced_markers(SAMPLE) == [] and misplaced_markers("<!-- illustration: x -->\n\ntext\n") == [1]
    assert placeholders("f(...)\nx = ...\ny = x[..., :2]\ndef g():\n    ...\n") == [1, 2, 5]


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a Markdown text."""
    blocks, rest = [], text
    while "```python\n" in rest:
        rest = rest.split("```python\n", 1)[1]
        code, rest = rest.split("```", 1)
        blocks.append(code)
    return blocks


GUIDE = ROOT / "docs" / "guide.md"


def test_guide_api_example_runs():
    text = GUIDE.read_text(encoding="utf-8")
    api = text[text.index("## API"):]
    code = python_blocks(api)[0]
    namespace: dict = {}
    exec(compile(code, "docs/guide.md (API)", "exec"), namespace)  # noqa: S102 - our own documentation
    q_rot, k_rot = namespace["q_rot"], namespace["k_rot"]
    assert q_rot.shape == (300, 32, 128) and k_rot.shape == (300, 8, 128)
    assert torch.isfinite(q_rot).all() and not torch.equal(q_rot, namespace["packed_q"])


def test_guide_fused_example_runs_and_writes_the_slots():
    text = GUIDE.read_text(encoding="utf-8")
    code = python_blocks(text[text.index("## Fused"):])[0]
    namespace: dict = {}
    exec(compile(code, "docs/guide.md (Fused)", "exec"), namespace)  # noqa: S102 - our own documentation
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


def test_guide_multiaxis_example_runs():
    text = GUIDE.read_text(encoding="utf-8")
    code = python_blocks(text[text.index("## Multi-axis RoPE"):])[0]
    namespace: dict = {}
    exec(compile(code, "docs/guide.md (multi-axis)", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["q_rot"].shape == (2, 12, 257, 64)
    assert namespace["positions"][0, :, 0].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7]
    assert namespace["q"].shape == (1, 28, 11, 128) and namespace["k"].shape == (1, 4, 11, 128)


API = README.parent / "docs" / "api.md"
PUBLIC_MODULES = ("ropekit", "ropekit.scaling", "ropekit.multiaxis", "ropekit.nn", "ropekit.ops", "ropekit.distributed",
                  "ropekit.checkpoints", "ropekit.integrations.transformers", "ropekit.mla",
                  # building blocks for tools: what the lab imports besides the above
                  "ropekit.files", "ropekit.rope.analysis", "ropekit.rope.pairing", "ropekit.cli",
                  "ropekit.cli.inspect_json")


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
