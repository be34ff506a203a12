"""The report's multi-axis section: score maps against an independent float64 formula, and the section itself."""

import types

import pytest
import torch

from ropekit import RopeConfig
from ropekit.config.presets import get_preset
from ropekit.multiaxis import named_plan, patch_grid
from ropekit_lab import report_multiaxis


def test_score_map_is_the_mean_cosine_of_angle_differences():
    plan = named_plan("qwen3-vl", head_dim=32, base=100.0, section=(6, 5, 5))
    grid = (5, 7)
    positions = torch.cat([torch.zeros(35, 1, dtype=torch.int64), patch_grid(grid)], dim=1)
    for layout in ("half", "interleaved"):
        cos, sin = plan.cos_sin(positions)
        scores = report_multiaxis.score_map(cos, sin, grid, layout)
        angles = plan.angles(positions)
        expected = torch.cos(angles - angles[2 * 7 + 3]).mean(-1).reshape(grid)
        torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset, panels", [("llama-2", 4), ("flux", 5), ("qwen2-vl", 5)])
def test_section_has_a_panel_per_scheme_and_symmetric_maps(preset, panels):
    pytest.importorskip("matplotlib")
    report = types.SimpleNamespace(config=RopeConfig.from_hf(get_preset(preset)), sections=[], summary={}, files={})

    def figure(name, draw, caption, alt):
        pngs = draw()
        report.files.update({f"{name}-{k}.png": png for k, png in enumerate(pngs)})
        return f"<figure>{caption}</figure>"

    report.figure = figure
    report_multiaxis.add_section(report)
    (section_id, title, body), = report.sections
    assert section_id == "multiaxis" and "2-D grid" in title and "<table" in body
    assert len(report.files) == panels and all(png.startswith(b"\x89PNG") for png in report.files.values())
    summary = report.summary["multiaxis"]
    assert len(summary) == panels and all(row["asymmetry"] < 1e-6 for row in summary)
    by_name = {row["scheme"]: row["min"] for row in summary}
    assert by_name["M-RoPE, Qwen2-VL sections"] > 0.99 > by_name["M-RoPE, Qwen3-VL interleave"]


def test_a_report_on_an_axial_config_is_complete(monkeypatch):
    pytest.importorskip("matplotlib")
    from ropekit_lab import report as report_module

    monkeypatch.setattr(report_module, "_bench_rows", lambda: (None, "not timed here"))
    html, files, summary = report_module.build(RopeConfig.from_hf(get_preset("flux")), "flux", quick=True)
    assert summary["config"]["base_lower_bound"] is None  # not one ladder: Men et al.'s bound does not apply
    assert summary["multiaxis"][0]["scheme"] == "this config (index, h, w)"
    assert 'id="multiaxis"' in html and sum(name.startswith("multiaxis") for name in files) == 5
