"""The worked examples of docs/architecture.md ("Adding a rule, a backend, a model family, a verb") run as written."""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from pathlib import Path

import pytest

from ropekit.ops import dispatch, prepared
from ropekit.rope.scaling import registry

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def examples() -> list[str]:
    """The python code blocks of the "Adding ..." section, in order: rule, backend, verb."""
    text = DOC.read_text()
    section = text[text.index("## Adding a rule, a backend, a model family, a verb"):]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run_example(index: int, monkeypatch) -> dict:
    """Execute one example as the body of a fresh module (dataclasses look their module up)."""
    module = types.ModuleType(f"architecture_example_{index}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(examples()[index], f"docs/architecture.md example {index}", "exec"), module.__dict__)
    return module.__dict__


@pytest.fixture
def restore_registries():
    """Undo the example's registrations (rule registry and backends)."""
    rules, aliases, backends = dict(registry.RULES), dict(registry.ALIASES), dict(dispatch._BACKENDS)
    yield
    registry.RULES.clear()
    registry.RULES.update(rules)
    registry.ALIASES.clear()
    registry.ALIASES.update(aliases)
    dispatch._BACKENDS.clear()
    dispatch._BACKENDS.update(backends)
    prepared.clear()


def test_the_section_has_the_rule_backend_and_verb_examples():
    blocks = examples()
    assert len(blocks) == 3
    assert "@register_rule" in blocks[0] and "ropekit.ops.register(" in blocks[1] and "def add_parser" in blocks[2]


def test_the_rule_example_runs_and_registers_its_rule(restore_registries, monkeypatch):
    assert "halved" not in registry.RULES
    run_example(0, monkeypatch)
    assert registry.RULES["halved"].__name__ == "Halved"


def test_the_backend_example_runs_and_registers_its_backend(restore_registries, monkeypatch):
    run_example(1, monkeypatch)
    assert "doubling" in dispatch.available()


def test_the_verb_example_parses_and_runs(tmp_path, capsys, monkeypatch):
    namespace = run_example(2, monkeypatch)
    verbs = argparse.ArgumentParser(prog="ropekit").add_subparsers(dest="verb")
    namespace["add_parser"](verbs)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}))
    args = verbs.choices["wavelengths"].parse_args(["--config", str(config)])
    assert namespace["run"](args) == 0
    assert len(capsys.readouterr().out.split()) == 8  # head_dim 16: eight pairs
