"""The HTML report in a real browser at 390 px (a phone), 768 px and 1280 px: nothing overflows, no table
cuts or hides a cell, every image loads and none is stretched, no figure's text is too small to read.

The harness (headless Chromium, the measurement and what counts as a defect) is in
tests/browser_harness.py, shared with the probe's page. The reports come from
:func:`ropekit_lab.report.write_report` with ``quick=True`` (the default configuration and a scaled
preset, whose tables have more columns and rows) and one real quick benchmark, plus synthetic rows
of the widest kinds a GPU run adds (Liger, ``torch.compile``, peak memory, both flags), so the speed
table is measured at its widest. The size of each figure's smallest text is read off the matplotlib
figure as the report draws it (every PNG passes through ``png_bytes``).
"""

from pathlib import Path

import pytest
import torch

import browser_harness
from browser_harness import WIDTHS, assert_fits, measure, smallest_text_px
from ropekit.cli.common import load_config
from ropekit_lab import bench, figures, figures_2d
from ropekit_lab import report as report_module

torch.set_num_threads(1)
browser = browser_harness.browser


def widest_bench_rows() -> list[dict]:
    """The real quick benchmark plus the widest rows a CUDA run adds (flags, Liger, compile, peak memory).

    The real rows lose their ``noisy`` flags and their load average, so that the table shows every
    row's flags whatever the machine is doing now (a busy notice would take their place):
    :func:`busy` makes the same rows too busy to measure.
    """
    rows = [dict(row, flags=[f for f in row["flags"] if f != "noisy"], load_avg=0.0) for row in bench.run(quick=True)]
    template = dict(rows[0], device="cuda", dtype="bfloat16", ms=123456.789, min_ms=0.00123, spread_pct=987.6,
                    error_pct=98.7, gbps=1234.5, ratio_copy=7.0123, ratio_hf=1234.5, saved_mb=12345.6,
                    peak_mb=12345.6, flags=["noisy", "beats floor"], note="a made-up row as wide as any")
    return rows + [dict(template, impl=impl, mode=mode) for impl, mode in (
        ("liger-kernel", "in-place"), ("transformers + torch.compile", "out-of-place"), ("triton", "fwd+bwd"))]


def busy(rows: list[dict]) -> list[dict]:
    """The same rows measured with a load average far above the cores: the speed section opens with a notice."""
    return [dict(row, load_avg=99.0) for row in rows]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, tuple[Path, dict[str, float]]]:
    """``{name: (index.html, {png name: its smallest text in px})}`` of the default report and a scaled
    preset's, sharing one benchmark run (the second too busy to measure)."""
    rows = widest_bench_rows()
    root, out, text_px = tmp_path_factory.mktemp("browser"), {}, {}

    def recording(png_bytes):
        def save(fig) -> bytes:
            data = png_bytes(fig)
            text_px[data] = smallest_text_px(fig)
            return data
        return save

    with pytest.MonkeyPatch.context() as patch:
        for module in (figures, figures_2d):
            patch.setattr(module, "png_bytes", recording(module.png_bytes))
        for name, speed in (("default", rows), ("llama-3.1", busy(rows))):
            patch.setattr(report_module, "_bench_rows", lambda speed=speed: (speed, None))
            config, label = load_config(None, name, None)
            report_module.write_report(root / name, config, label, quick=True)
            out[name] = (root / name / "index.html",
                         {png.name: text_px[png.read_bytes()] for png in (root / name).glob("*.png")})
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["default", "llama-3.1"])
def test_report_fits_the_screen_and_every_image_loads(browser, reports, name, width):
    index, text_px = reports[name]
    assert_fits(measure(browser, index, width), width, tables=6, images=8, text_px=text_px)
    assert ('class="notice"' in index.read_text(encoding="utf-8")) == (name == "llama-3.1")


def small_figure(path: Path) -> float:
    """A 200 x 100 px PNG whose smallest text is 7 pt at 100 dpi (9.7 px); returns what the harness reads off it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1), dpi=100)
    FigureCanvasAgg(fig)
    fig.text(0.05, 0.6, "small", fontsize=7)
    fig.text(0.05, 0.1, "large", fontsize=20)
    fig.savefig(path, dpi=100)
    return smallest_text_px(fig)


GOOD = ('<!DOCTYPE html><html><head><meta name="viewport" content="width=device-width"><style>'
        "body{margin:0}img{max-width:100%;display:block}.scroll{overflow-x:auto}</style></head><body>"
        '<p>short text</p><img src="ok.png" alt="x"><img src="fig.png" alt="y">'
        '<div class="scroll"><table><tr><th>a</th><th>b</th></tr><tr><td>1.5</td><td>pass</td></tr></table></div>'
        "</body></html>")

#: ``{defect: (HTML added to the good page, what assert_fits says)}``
DEFECTS = {
    "a word longer than the page": (f"<p>{'x' * 300}</p>", "beyond the page"),
    "text cut off by its box": ('<div style="overflow:hidden;width:100px"><span style="white-space:nowrap">cut off '
                                "text that does not fit</span></div>", "cut off or behind a scrollbar"),
    "a missing image": ('<img src="missing.png" alt="z">', "did not load"),
    "a stretched image": ('<img src="fig.png" alt="z" style="width:300px">', "drawn over 1.25x"),
    "figure text too small": ('<img src="fig.png" alt="z" style="width:150px">', "figure text under 9 px"),
    "a table wider than the page outside a box": ("<table><tr>" + "<td>nowrap-cell</td>" * 30 + "</tr></table>",
                                                  "outside their own scroll box"),
    "columns behind a scroll box's edge": ('<div class="scroll"><table><tr>' + "<td>1234.5</td>" * 80
                                           + "</tr></table></div>", "table cells cut or hidden"),
    "a hidden column": ('<div class="scroll"><table><tr><td>1.5</td><td style="display:none">FAIL</td></tr>'
                        "</table></div>", "table cells cut or hidden"),
    "a number wider than its cell": ('<div class="scroll"><table style="table-layout:fixed;width:80px"><tr>'
                                     '<td style="width:40px;white-space:nowrap">123456789.0</td><td>x</td></tr>'
                                     "</table></div>", "table cells cut or hidden"),
}


def test_the_measurement_sees_each_defect(browser, tmp_path):
    """The oracle itself: the good page is clean, and each defect added to it is reported, for the right reason."""
    png = (Path(__file__).resolve().parent.parent / "docs" / "report-screenshot.png").read_bytes()
    (tmp_path / "ok.png").write_bytes(png)
    text_px = {"ok.png": 40.0, "fig.png": small_figure(tmp_path / "fig.png"), "missing.png": 20.0}
    assert text_px["fig.png"] == pytest.approx(7 * 100 / 72)  # 7 pt at 100 dpi
    (tmp_path / "good.html").write_text(GOOD, encoding="utf-8")
    clean = measure(browser, tmp_path / "good.html", 390)
    assert clean["images"][0]["natural_width"] == int.from_bytes(png[16:20], "big") > 390  # PNG header width
    assert [img["drawn_width"] for img in clean["images"]] == [390, 200]  # shrunk to the page; natural size
    assert_fits(clean, 390, tables=1, images=2, text_px=text_px)

    for name, (fragment, message) in DEFECTS.items():
        (tmp_path / "bad.html").write_text(GOOD.replace("<p>short text</p>", fragment), encoding="utf-8")
        found = measure(browser, tmp_path / "bad.html", 390)
        with pytest.raises(AssertionError, match=message):
            assert_fits(found, 390, tables=1, images=2, text_px=text_px)
        if "cells" in message:
            why = {cell["why"].split(" of ")[0] for cell in found["cells"]}
            assert why == {"columns behind a scroll box's edge": {"outside the visible part"},
                           "a hidden column": {"hidden"},
                           "a number wider than its cell": {"content wider than its cell"}}[name], (name, found)
