"""The ``ropekit`` command line, run as a real subprocess and through ``main``: inspect, decay, help, errors.

Each subprocess that computes pays for ``import torch`` (~1.5 s), so independent invocations are
started together and awaited together. The command line's promises (one line and exit code 2 for
bad input, 130 on Ctrl-C, no torch before the arguments are parsed, output checks before the
work) are in tests/test_cli_promises.py.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ropekit import RopeConfig
from ropekit.cli.entry import main

torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
SCRIPT = Path(sys.executable).parent / "ropekit"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "ropekit"]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def ropekit(*argvs: list[str], cwd=None, command=None) -> list[subprocess.CompletedProcess]:
    """Run ``ropekit <argv>`` for each argv concurrently; return the completed processes in order."""
    command = command or COMMAND
    procs = [subprocess.Popen([*command, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                              env=ENV) for argv in argvs]
    results = []
    for argv, proc in zip(argvs, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess([*command, *argv], proc.returncode, out, err))
    return results


def numpy_decay(dim: int, base: float, distances) -> np.ndarray:
    """(1/(d/2)) sum_j |sum_{i<j} e^{i r theta_i}| with explicit numpy complex sums."""
    n = dim // 2
    theta = base ** (-2.0 * np.arange(n) / dim)
    return np.array([np.abs(np.cumsum(np.exp(1j * r * theta))).sum() / n for r in distances])


def test_help_for_every_verb(capsys):
    (top,) = ropekit(["--help"])
    assert top.returncode == 0 and all(verb in top.stdout for verb in ("inspect", "decay", "report", "bench"))
    helps = {}
    for verb in ("inspect", "decay", "report", "bench"):  # in-process: the parser is the same object
        with pytest.raises(SystemExit) as info:
            main([verb, "--help"])
        assert info.value.code == 0
        helps[verb] = capsys.readouterr().out
    assert all(word in helps["inspect"] for word in ("--config", "--preset", "--json", "--layer-type", "llama-3.1"))
    assert all(word in helps["decay"] for word in ("--dim", "--base", "--max-distance", "--png", "--json"))
    assert all(word in helps["report"] for word in ("--out", "--quick", "--preset", "--config", "--json"))
    assert "--json" in helps["bench"]


def test_inspect_json_matches_rope_config(tmp_path):
    path = FIXTURES / "llama-3.1-8b.json"
    llama, phi, neox = ropekit(["inspect", "--config", str(path), "--json"],
                               ["inspect", "--preset", "phi-3", "--json", "--no-bound"],
                               ["inspect", "--preset", "gpt-neox", "--context", "1000", "--json"])
    assert llama.returncode == 0, llama.stderr
    info = json.loads(llama.stdout)
    config = RopeConfig.from_hf(json.loads(path.read_text()))
    inv_freq, scale = config.inv_frequencies(131072)
    assert info["inv_freq"] == inv_freq.tolist() and info["attention_scale"] == scale
    assert (info["head_dim"], info["rotary_dim"], info["base"], info["layout"], info["rope_type"]) == (
        128, 128, 500000.0, "half", "llama3")
    assert info["max_positions"] == info["context"] == 131072 and info["source"] == "meta-llama/Llama-3.1-8B"
    assert info["rope_parameters"]["original_max_position_embeddings"] == 8192
    for f, w, r in zip(info["inv_freq"], info["wavelength"], info["rotations"], strict=True):
        assert w == pytest.approx(2 * math.pi / f) and r == pytest.approx(131072 * f / (2 * math.pi))
    assert info["regime"][0] == "extrapolated" and info["regime"][-1] == "interpolated" and "blended" in info["regime"]
    assert info["pairs_without_full_rotation"] == sum(w > 131072 for w in info["wavelength"])
    assert info["base_lower_bound"]["base"] > info["base"]  # 500000 is below what 128K tokens need
    assert info["pretraining"]["context"] == 8192 and info["pretraining"]["base_lower_bound"]["base"] < 500000

    assert phi.returncode == 0, phi.stderr
    info = json.loads(phi.stdout)
    config = RopeConfig.from_hf(json.loads((FIXTURES / "phi-3-mini-128k-instruct.json").read_text()))
    inv_freq, scale = config.inv_frequencies(131072)  # past original_max_position_embeddings: long_factor
    assert info["inv_freq"] == inv_freq.tolist() and info["attention_scale"] == pytest.approx(scale)
    assert info["rope_type"] == "longrope" and info["rotary_dim"] == 96 and info["base_lower_bound"] is None

    assert neox.returncode == 0, neox.stderr
    info = json.loads(neox.stdout)
    assert (info["head_dim"], info["rotary_dim"], info["context"], info["context_source"]) == (96, 24, 1000, "given")
    assert len(info["theta"]) == 12 and info["regime"] is None


def test_inspect_text_and_decay(tmp_path):
    png = tmp_path / "decay.png"
    inspect, decay_json, decay_text = ropekit(
        ["inspect", "--preset", "qwen2.5-yarn"],
        ["decay", "--dim", "16", "--base", "10000", "--max-distance", "300", "--json", "--png", str(png)],
        ["decay", "--dim", "128", "--max-distance", "256"],
    )
    assert inspect.returncode == 0, inspect.stderr
    out = inspect.stdout
    assert "layout half, head_dim 128, rotary_dim 128, base 1,000,000, rope type yarn" in out
    assert "attention scale" in out and "context 131,072 tokens" in out
    assert "extrapolated" in out and "interpolated" in out and "blended" in out
    assert "pairs never complete a rotation within 131,072 tokens" in out and "arXiv:2405.14591" in out
    rows = [line.split() for line in out.splitlines() if len(line.split()) == 7 and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(64))

    assert decay_json.returncode == 0, decay_json.stderr
    data = json.loads(decay_json.stdout)
    assert data["distance"] == list(range(301))
    np.testing.assert_allclose(data["bound"], numpy_decay(16, 10000.0, range(301)), rtol=1e-12)
    assert data["bound"][0] == pytest.approx(sum(range(1, 9)) / 8)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name != "decay.png"]  # no temporary file left

    assert decay_text.returncode == 0, decay_text.stderr
    assert "r =          0  bound   32.5000" in decay_text.stdout and "minimum" in decay_text.stdout


@pytest.fixture()
def bad_inputs(tmp_path):
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"hidden_size": 64,')
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2,
                                   "rope_scaling": {"rope_type": "spiral", "factor": 2.0}}))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {"dir": tmp_path, "malformed": malformed, "list": listing, "unknown": unknown, "file": a_file}


def test_errors_through_the_console_script(bad_inputs):
    tmp = bad_inputs["dir"]
    cases = {
        ("inspect", "--config", str(tmp / "missing.json")): "config file not found",
        ("report", "--config", str(bad_inputs["malformed"]), "--out", str(tmp / "r")): "is not valid JSON",
        ("inspect", "--config", str(bad_inputs["unknown"])): "unknown rope_type 'spiral'",
        ("report", "--preset", "gpt-5", "--out", str(tmp / "r")): "unknown preset 'gpt-5'",
        ("decay", "--dim", "7", "--max-distance", "10"): "--dim must be a positive even number",
    }
    results = ropekit(*[list(argv) for argv in cases])
    for (argv, words), result in zip(cases.items(), results, strict=True):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (argv, result.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"ropekit {argv[0]}: error: ") and words in lines[0], argv
        assert result.stdout == ""
    assert not (tmp / "r").exists()


def test_more_errors_in_process(bad_inputs, capsys):
    tmp = bad_inputs["dir"]
    cases = {
        ("inspect", "--config", str(bad_inputs["list"])): "must hold a JSON object",
        ("inspect", "--config", str(tmp)): "cannot read",
        ("inspect", "--config", str(FIXTURES / "gemma-3-4b-text.json")): "--layer-type",
        ("inspect", "--config", str(FIXTURES / "gemma-3-4b-text.json"), "--layer-type", "global"): "'global'",
        ("report", "--config", str(bad_inputs["unknown"]), "--out", str(tmp / "r")): "unknown rope_type",
        ("report", "--quick", "--out", str(bad_inputs["file"])): "must be a directory",
        ("decay", "--dim", "0", "--max-distance", "10"): "--dim",
        ("decay", "--dim", "8", "--max-distance", "-1"): "--max-distance",
        ("decay", "--dim", "8", "--max-distance", "10", "--png", str(tmp / "no" / "x.png")): "does not exist",
    }
    for argv, words in cases.items():
        assert main(list(argv)) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ropekit {argv[0]}: error: ") and words in lines[0], argv
        assert captured.out == ""
    assert not (tmp / "r").exists()


@pytest.mark.parametrize("argv", [[], ["inspect", "--config", "a.json", "--preset", "llama-2"], ["decay", "--dim", "8"],
                                  ["decay", "--dim", "8", "--max-distance", "4", "--base", "-3"], ["frobnicate"],
                                  ["inspect", "--context", "0"]])
def test_usage_errors_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith("ropekit")
    assert ": error: " in lines[0] and lines[0].endswith(" --help)"), lines


def test_every_verb_says_what_it_does_in_its_help():
    """``ropekit VERB --help`` opens with a description of the verb, not only its options."""
    from ropekit.cli.entry import build_parser

    parser = build_parser()
    verbs = next(action for action in parser._actions if action.dest == "verb").choices
    assert {"inspect", "decay", "convert", "report", "bench", "train", "extrapolate", "probe"} <= set(verbs)
    for name, sub in verbs.items():
        assert sub.description and len(sub.description) > 40, name
