"""``ropekit probe --model DIR`` never runs Python from the model folder, and never asks whether to.

transformers, when not told ``trust_remote_code``, asks "run the custom code? [y/N]" on stdout
(which corrupts ``--json``) and imports the folder's own modules on ``y``. ropekit passes
``trust_remote_code=False`` to every transformers loader and refuses such a folder in one line
(exit 2) before loading anything.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from convert_helpers import ENV

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "src" / "ropekit", ROOT / "lab" / "src" / "ropekit_lab"]  # the library and the lab
LOADERS = ("from_pretrained", "from_config")


def custom_code_model(directory: Path, marker: Path) -> Path:
    """A model folder whose config.json maps AutoConfig to its own module; importing it creates ``marker``."""
    directory.mkdir()
    (directory / "configuration_custom.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('the folder ran its own code')\n"
        "from transformers import LlamaConfig\n\n\n"
        "class CustomConfig(LlamaConfig):\n"
        "    model_type = 'ropekit_custom'\n")
    config = {"model_type": "ropekit_custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"},
              "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 64}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_folder_with_custom_code_is_refused_in_one_line_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    model = custom_code_model(tmp_path / "model", marker)
    env = {**ENV, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "ropekit", "probe", "--model", str(model), "--prompt",
                           "a b c d e f", "--json", "--out", str(tmp_path / "out")],
                          input="y\n", capture_output=True, text=True, env=env, timeout=300)
    assert not marker.exists(), "the model folder's Python code ran"
    assert done.stdout == ""  # no prompt, no half document: --json's stdout stays clean
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model" in lines[0] and "auto_map" in lines[0], done.stderr


def test_an_unknown_model_type_is_refused_before_loading(tmp_path):
    pytest.importorskip("transformers")
    from ropekit_lab.probe_models import load_model_dir

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "ropekit_unknown"}))
    with pytest.raises(ValueError, match="--model .*does not know model_type 'ropekit_unknown'.*never runs"):
        load_model_dir(tmp_path / "model")


def _loader_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOADERS:
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name.startswith("Auto"):
                yield node


def _forbids_remote_code(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "trust_remote_code":
            return isinstance(keyword.value, ast.Constant) and keyword.value.value is False
        if keyword.arg is None and isinstance(keyword.value, ast.Name) and keyword.value.id == "NO_REMOTE_CODE":
            return True
    return False


def test_every_transformers_loader_in_ropekit_passes_trust_remote_code_false():
    calls = []
    for path in sorted(p for source in SOURCES for p in source.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for call in _loader_calls(tree):
            calls.append((f"{path.relative_to(ROOT)}:{call.lineno}", _forbids_remote_code(call)))
    assert calls, "no transformers loader found: the scan is broken"
    assert [where for where, ok in calls if not ok] == []
    from ropekit_lab.remote_code import NO_REMOTE_CODE

    assert NO_REMOTE_CODE == {"trust_remote_code": False}

