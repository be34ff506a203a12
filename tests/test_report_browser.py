"""The HTML report in a real browser: nothing overflows at 390 px (a phone) or 1280 px, every image loads.

The harness (headless Chromium, the measurement and what counts as a defect) is in
tests/browser_harness.py, shared with the probe's page. The reports come from
:func:`ropekit_lab.report.write_report` with ``quick=True`` (the default configuration and a scaled
preset, whose tables have more columns and rows) and one real quick benchmark, plus synthetic rows
of the widest kinds a GPU run adds (Liger, ``torch.compile``, peak memory, both flags), so the speed
table is measured at its widest.
"""

from pathlib import Path

import pytest
import torch

import browser_harness
from browser_harness import WIDTHS, assert_fits, measure
from ropekit.cli.common import load_config
from ropekit_lab import bench
from ropekit_lab import report as report_module

torch.set_num_threads(1)
browser = browser_harness.browser


def widest_bench_rows() -> list[dict]:
    """The real quick benchmark plus the widest rows a CUDA run adds (flags, Liger, compile, peak memory)."""
    rows = bench.run(quick=True)
    template = dict(rows[0], device="cuda", dtype="bfloat16", ms=123456.789, min_ms=0.00123, spread_pct=987.6,
                    gbps=1234.5, ratio_copy=7.0123, ratio_hf=1234.5, saved_mb=12345.6, peak_mb=12345.6,
                    flags=["noisy", "beats floor"], note="a made-up row as wide as any")
    return rows + [dict(template, impl=impl, mode=mode) for impl, mode in (
        ("liger-kernel", "in-place"), ("transformers + torch.compile", "out-of-place"), ("triton", "fwd+bwd"))]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    """``{name: index.html}`` of the default report and a scaled preset's, sharing one benchmark run."""
    rows = widest_bench_rows()
    root, out = tmp_path_factory.mktemp("browser"), {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report_module, "_bench_rows", lambda: (rows, None))
        for name in ("default", "llama-3.1"):
            config, label = load_config(None, name, None)
            report_module.write_report(root / name, config, label, quick=True)
            out[name] = root / name / "index.html"
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["default", "llama-3.1"])
def test_report_fits_the_screen_and_every_image_loads(browser, reports, name, width):
    assert_fits(measure(browser, reports[name], width), width, tables=6, images=8)


def test_the_measurement_sees_overflow_clipping_and_broken_images(browser, tmp_path):
    """The oracle itself: a page with each defect is reported, the same page without them is clean."""
    png = (Path(__file__).resolve().parent.parent / "docs" / "report-screenshot.png").read_bytes()
    (tmp_path / "ok.png").write_bytes(png)
    good = ('<!DOCTYPE html><html><head><meta name="viewport" content="width=device-width"><style>'
            "body{margin:0}img{max-width:100%}.scroll{overflow-x:auto}</style></head><body>"
            '<p>short text</p><img src="ok.png" alt="x"><div class="scroll wide"><table><tr>'
            + "<td>cell</td>" * 80 + "</tr></table></div></body></html>")
    (tmp_path / "good.html").write_text(good, encoding="utf-8")
    clean = measure(browser, tmp_path / "good.html", 390)
    assert not clean["overflow"] and clean["scroll_width"] == 390
    assert clean["images"][0]["natural_width"] == int.from_bytes(png[16:20], "big") > 390  # PNG header width
    assert [c["wide"] for c in clean["clipped"]] == [True]  # the wide table scrolls, nothing else

    defects = (f"<p>{'x' * 300}</p>"  # a word longer than the page
               + "<table><tr>" + "<td>nowrap-cell</td>" * 30 + "</tr></table>"  # a table wider than the page
               + '<div style="overflow:hidden;width:100px"><span style="white-space:nowrap">cut off text '
                 "that does not fit</span></div>")
    bad = good.replace("<p>short text</p>", defects).replace('src="ok.png"', 'src="missing.png"')
    (tmp_path / "bad.html").write_text(bad.replace("scroll wide", "scroll"), encoding="utf-8")
    broken = measure(browser, tmp_path / "bad.html", 390)
    assert {"#text" in o["path"] for o in broken["overflow"]} == {True, False}  # the word and the table
    assert broken["scroll_width"] > 390 and broken["images"][0]["natural_width"] == 0
    assert [(c["wide"], c["overflow_x"]) for c in broken["clipped"]] == [(False, "hidden"), (False, "auto")]
