"""``python -m ropekit_lab.spread``: the extrapolation table over seeds, its arithmetic and its refusals."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ropekit_lab import extrapolate, spread
from ropekit_lab.verbs import extrapolate as cli_extrapolate

MAX_CHARS = 120_000  # as in test_train: Genesis 1-~30, chapter 20 in the validation part


def parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    cli_extrapolate.add_parser(parser.add_subparsers(dest="verb"))
    return parser.parse_args(list(argv))


def fake_run(folder: Path, seed: int, val_loss: dict, **settings) -> Path:
    """An extrapolate output folder: one model file (any bytes) and a summary that names it by sha256."""
    folder.mkdir(parents=True)
    model = folder / "model-rope-softmax-ctx8.pt"
    model.write_bytes(f"weights of seed {seed}".encode())
    summary = {"train_context": 8, "multiples": [1, 2], "lengths": [8, 16], "attention": "softmax",
               "sizes": {"dim": 32}, "finetune_steps": 0, "seed": seed, "val_loss": val_loss,
               "runs": [{"model_file": model.name, "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
                         "seed": seed}]}
    summary.update(settings)
    (folder / "extrapolation.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture()
def three_runs(tmp_path):
    losses = [{"rope": [1.0, 2.0], "learned": [1.5, None]}, {"rope": [2.0, 2.5], "learned": [1.5, None]},
              {"rope": [3.0, 4.5], "learned": [2.1, None]}]
    return [fake_run(tmp_path / f"s{seed}", seed, loss) for seed, loss in enumerate(losses)]


def test_mean_and_sample_standard_deviation(three_runs, tmp_path):
    table = spread.write(tmp_path / "out", three_runs)
    rope = table["rows"]["rope"]
    assert rope["values"] == [[1.0, 2.0, 3.0], [2.0, 2.5, 4.5]]
    assert rope["mean"] == pytest.approx([2.0, 3.0])
    assert rope["std"] == pytest.approx([1.0, ((1.0 + 0.25 + 2.25) / 2) ** 0.5])  # deviations -1, -0.5, 1.5
    learned = table["rows"]["learned"]
    assert learned["mean"][0] == pytest.approx(1.7) and learned["mean"][1] is None and learned["std"][1] is None
    assert table["seeds"] == [0, 1, 2]
    text = (tmp_path / "out" / "spread.md").read_text()
    assert "| rope | 2.000 ± 1.000 | 3.000 ± 1.323 |" in text and "| learned | 1.700 ± 0.346 | n/a |" in text
    assert json.loads((tmp_path / "out" / "spread.json").read_text()) == table
    assert (tmp_path / "out" / "spread.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("change, match", [
    ({"train_context": 16}, "differs from .* in train_context"),
    ({"sizes": {"dim": 64}}, "in sizes"),
    ({"seed": 0}, r"each seed once, got seeds \[0, 1, 0\]"),
    ({"val_loss": {"rope": [1.0, 2.0]}}, "has the rows"),
])
def test_runs_that_are_not_one_experiment_are_refused(tmp_path, change, match):
    runs = [fake_run(tmp_path / "a", 0, {"rope": [1.0, 2.0], "none": [2.0, 2.0]}),
            fake_run(tmp_path / "b", 1, {"rope": [1.0, 2.0], "none": [2.0, 2.0]})]
    settings = {"seed": 2, "val_loss": {"rope": [1.0, 2.0], "none": [2.0, 2.0]}} | change
    runs.append(fake_run(tmp_path / "c", **settings))
    with pytest.raises(ValueError, match=match):
        spread.write(tmp_path / "out", runs)
    assert not (tmp_path / "out").exists()


def test_a_summary_that_no_longer_describes_its_model_files_is_refused(three_runs, tmp_path):
    (three_runs[1] / "model-rope-softmax-ctx8.pt").write_bytes(b"another run's weights")
    with pytest.raises(ValueError, match="sha256 differs"):
        spread.write(tmp_path / "out", three_runs)


def test_command_line_errors_are_one_line_and_exit_2(three_runs, tmp_path, capsys):
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "extrapolation.json").write_text("{not json")
    cases = {
        (str(tmp_path / "o1"), str(three_runs[0]), str(tmp_path / "not-a-run")): "holds no extrapolation.json",
        (str(tmp_path / "o2"), str(three_runs[0]), str(tmp_path / "garbage")): "is not a summary",
        (str(three_runs[0] / "inside"), *map(str, three_runs)): "lies in the run",
        (str(three_runs[0] / "extrapolation.json"), *map(str, three_runs)): "lies in the run",
    }
    for argv, words in cases.items():
        assert spread.main(list(argv)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ropekit_lab.spread: error: ") and words in err, err
    assert spread.main([str(tmp_path / "o3"), str(three_runs[0])]) == 2 and "usage" in capsys.readouterr().err
    assert spread.main(["--rows", "rope,yarn", str(tmp_path / "o3"), *map(str, three_runs)]) == 2
    assert "--rows: yarn not among the runs' rows rope, learned" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3"))
    assert not (three_runs[0] / "inside").exists()
    file_out = tmp_path / "a-file"
    file_out.write_text("x")
    assert spread.main([str(file_out), *map(str, three_runs)]) == 2 and file_out.read_text() == "x"
    capsys.readouterr()


def test_real_runs_end_to_end(tmp_path, capsys):
    """Two seeds of a tiny ``extrapolate``, then ``python -m ropekit_lab.spread`` in a fresh process."""
    folders = []
    for seed in (0, 1):
        folders.append(tmp_path / f"seed{seed}")
        args = parse("extrapolate", "--quick", "--steps", "2", "--context", "8", "--out", str(folders[-1]),
                     "--seed", str(seed), "--max-chars", str(MAX_CHARS), "--threads", "1", "--no-progress",
                     "--finetune-steps", "0", "--encodings", "rope,alibi,learned")
        assert extrapolate.run(args) == 0
    capsys.readouterr()
    done = subprocess.run([sys.executable, "-m", "ropekit_lab.spread", "--rows", "rope,alibi", str(tmp_path / "table"),
                           *map(str, folders)],
                          capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    table = json.loads((tmp_path / "table" / "spread.json").read_text())
    runs = [json.loads((f / "extrapolation.json").read_text())["val_loss"] for f in folders]
    for name in ("rope", "rope+yarn", "alibi"):
        assert table["rows"][name]["mean"][2] == pytest.approx((runs[0][name][2] + runs[1][name][2]) / 2)
    assert table["rows"]["learned"]["mean"][1:] == [None, None, None]
    assert done.stdout.splitlines()[0].startswith("| model | 1× (8) | 2× (16)")
