"""``ropekit inspect`` on multi-axis configs: each pair's axis, wavelengths per axis, refusals in one line."""

import json
from pathlib import Path

import torch

from ropekit import RopeConfig
from ropekit.cli.entry import main

FIXTURES = Path(__file__).parent / "fixtures" / "multiaxis"


def run_json(argv, capsys):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_json_has_each_pairs_axis(capsys):
    info = run_json(["inspect", "--preset", "qwen3-vl", "--json", "--no-bound"], capsys)
    plan = RopeConfig.from_hf(json.loads((FIXTURES / "qwen3-vl-8b-instruct.json").read_text())).axis_plan()
    axes = info["axes"]
    assert axes["names"] == ["t", "h", "w"]
    assert axes["pair_axis"] == [("t", "h", "w")[a] for a in plan.axis.tolist()]
    assert [a["pairs"] for a in axes["per_axis"]] == [24, 20, 20]
    h = axes["per_axis"][1]
    assert h["pair_indices"] == list(range(1, 60, 3)) and not h["contiguous"]
    inv_freq = plan.inv_freq[plan.pairs_on("h")]
    assert h["wavelength_min"] == float(2 * torch.pi / inv_freq.max())
    assert h["wavelength_max"] == float(2 * torch.pi / inv_freq.min())
    one_d = run_json(["inspect", "--preset", "llama-2", "--json", "--no-bound"], capsys)
    assert one_d["axes"] is None


def test_inspect_text_of_an_axial_config(capsys):
    assert main(["inspect", "--config", str(FIXTURES / "flux.1-dev.json")]) == 0
    out = capsys.readouterr().out
    assert "layout interleaved" in out and "multi-axis: positions are (index, h, w) vectors" in out
    assert "axis index: 8 pairs, pairs 0..7" in out and "axis w: 28 pairs, pairs 36..63" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("pair"))
    assert header.split()[:2] == ["pair", "axis"]
    assert "     8      h" in out
    assert "base needed" not in out  # Men et al.'s bound is about one ladder, which an axial plan is not
    info = run_json(["inspect", "--preset", "qwen2-vl", "--json"], capsys)
    assert info["base_lower_bound"] is not None  # M-RoPE: one ladder, the bound applies


def test_inspect_refuses_unrepresentable_configs_in_one_line(tmp_path, capsys):
    cfg = {**json.loads((FIXTURES / "qwen2-vl-7b-instruct.json").read_text()), "model_type": "hunyuan_vl"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["inspect", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ropekit inspect: error: ") and "'hunyuan_vl'" in err[0]
